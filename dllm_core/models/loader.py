"""Load / save LLaDA, Dream and LLaDA2 checkpoints in their HF directory layout (no remote code)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import transformer
from .device import check_device
from .llada2 import LLaDA2MoeModelLM
from .transformer import DiffusionLM

ARCHITECTURES: dict[str, type[DiffusionLM]] = {**transformer.ARCHITECTURES, "LLaDA2MoeModelLM": LLaDA2MoeModelLM}

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--model: {model_dir} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--model: {path} is not valid JSON: {e}") from None


def model_class(cfg: dict, path: str = "config.json") -> type[DiffusionLM]:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    raise ValueError(f"{path}: architectures {archs} not supported; allowed: {sorted(ARCHITECTURES)}")


def _weight_files(d: Path) -> list[Path]:
    if (d / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"--model: {d / INDEX} is corrupt ({e})") from None
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise FileNotFoundError(f"--model: shards listed in {INDEX} are missing: {missing}")
        return [d / s for s in shards]
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    raise FileNotFoundError(f"--model: {d} has no weights ({SINGLE} or {INDEX})")


def load_state(d: Path, device) -> dict[str, torch.Tensor]:
    sd = {}
    for f in _weight_files(d):
        try:
            sd.update(load_file(f, device=str(device)))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"--model: weight file {f} is corrupt or unreadable: {e}") from None
    return sd


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> DiffusionLM:
    """Build the native model for ``model_dir`` (config.json + safetensors) on ``device``/``dtype`` (a device
    this machine lacks is an error naming it and the available ones, before any file is read)."""
    device = check_device(device)
    d = Path(model_dir)
    cfg = read_config(d)
    cls = model_class(cfg, str(d / "config.json"))
    args = cls.parse_config(cfg, str(d / "config.json"))
    names = cls.from_hf_map(args)
    sd = cls.fold_hf(load_state(d, device), args)
    missing, unexpected = sorted(set(names) - set(sd)), sorted(set(sd) - set(names))
    if missing or unexpected:
        raise ValueError(f"--model: {d} does not match {cls.__name__}: missing keys {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}")
    with torch.device("meta"):
        model = cls(args)
    state = {names[k]: v.to(dtype) for k, v in sd.items()}
    if args.tied_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=False, assign=True)
    model.rotary = cls.rotary_for(args).to(device)
    return model.eval().requires_grad_(False)


def save_model(model: DiffusionLM, model_dir: str | Path, config: dict, shard_size: int | None = None) -> None:
    """Write config.json + safetensors with the real HF key names (sharded with an index when
    the state exceeds ``shard_size`` bytes)."""
    d = Path(model_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    sd = {model.to_hf(n): p.detach().contiguous().cpu() for n, p in model.named_parameters()
          if not (model.args.tied_embeddings and n == "lm_head.weight")}
    sd = type(model).unfold_hf(sd, model.args)
    if shard_size is None:
        save_file(sd, d / SINGLE, metadata={"format": "pt"})
        return
    shards, cur, size = [], {}, 0
    for k, v in sd.items():
        if cur and size + v.nbytes > shard_size:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + v.nbytes
    shards.append(cur)
    wmap = {}
    for i, s in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(s, d / name, metadata={"format": "pt"})
        wmap.update({k: name for k in s})
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": sum(v.nbytes for v in sd.values())},
                                       "weight_map": wmap}, indent=2))
