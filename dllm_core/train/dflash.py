"""``dllm train-dflash``: train a DFlash drafter for a frozen causal target (the paper's recipe).

1. Regenerate: the target's own greedy responses to the training prompts (task-suite train split or a
   prompt file) - the drafter learns the target's distribution, not the dataset's.
2. Every step: a batch of (prompt + response) sequences; the frozen target gives the features of
   ``target_layer_ids``; random anchors in each response open blocks [anchor, MASK x (B-1)], packed
   per sequence under the sparse mask of ``drafters/blocks.py``; loss = position-weighted cross-entropy
   (w_k = exp(-(k-1)/gamma)) through the target's frozen LM head.
3. AdamW + warmup/cosine with the shared loop (``train/loop.py``): progress bar, resumable ``--resume``
   (model + optimizer + step; data draws depend only on (seed, step), so a resumed run equals an
   uninterrupted one). The drafter is written to ``--out`` in the vLLM/SGLang checkpoint format.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from .common import add_config_args, set_threads
from .config import TrainBase

INITS = ("random", "target")


@dataclass(frozen=True, kw_only=True)
class DFlashTrainConfig(TrainBase):
    """Every knob of one drafter training run (optimisation, seed, device, checkpoints: ``TrainBase``)."""

    RUNTIME: ClassVar[tuple[str, ...]] = TrainBase.RUNTIME + ("regen_batch", "keep_data")
    target: str
    tasks: str = "arithmetic;sort;retrieval:min_pairs=4"  # prompt source (train split) unless prompts_file
    prompts_file: str | None = None   # JSONL ({"prompt": ...} per line) or plain text, one prompt a line
    num_prompts: int = 2000
    chat: bool = True                 # wrap prompts with the tokenizer's chat template
    max_new_tokens: int = 256         # cap on regenerated responses
    layers: int = 2
    block_size: int = 16
    target_layer_ids: str = ""        # comma-separated 0-based target layers; "" = spread (reference rule)
    mask_token_id: int | None = None  # None: the tokenizer's mask token, else the first unused embedding row
    init: str = "random"              # random | target (copy evenly spaced target layers)
    blocks_per_seq: int = 16
    batch_size: int = 16
    lr: float = 6e-4
    weight_decay: float = 0.01
    gamma: float = 7.0
    regen_batch: int = 32
    keep_data: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.check_at_least(1, "num_prompts", "max_new_tokens", "layers", "blocks_per_seq", "batch_size",
                            "regen_batch")
        if self.block_size < 2:
            raise ValueError(f"--block-size must be >= 2, got {self.block_size}")
        if not self.gamma > 0:
            raise ValueError(f"--gamma must be > 0, got {self.gamma}")
        if self.init not in INITS:
            raise ValueError(f"--init must be one of {list(INITS)}, got {self.init!r}")
        self.layer_ids()

    def layer_ids(self) -> tuple[int, ...] | None:
        if not self.target_layer_ids.strip():
            return None
        try:
            return tuple(int(i) for i in self.target_layer_ids.split(","))
        except ValueError:
            raise ValueError(f"--target-layer-ids must be comma-separated ints, got {self.target_layer_ids!r}") \
                from None

    @property
    def data_path(self) -> Path:
        return Path(self.out) / "regenerated.pt"


# --- data ---------------------------------------------------------------------------------------------------
def read_prompts(cfg: DFlashTrainConfig) -> list[str]:
    """Training prompt texts: ``--prompts-file`` lines, else the train split of ``--tasks``."""
    if cfg.prompts_file:
        path = Path(cfg.prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompts-file: {path} does not exist")
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        if path.suffix == ".jsonl":
            lines = [json.loads(ln)["prompt"] for ln in lines]
        return lines[: cfg.num_prompts]
    from ..tasks import parse_tasks

    tasks = parse_tasks(cfg.tasks)
    per = -(-cfg.num_prompts // len(tasks))
    return [ex.prompt for t in tasks for ex in t.examples("train", per, seed=cfg.seed)][: cfg.num_prompts]


def stop_ids(tok, target_cfg) -> list[int]:
    """EOS of the target config plus the tokenizer's end-of-turn tokens."""
    from ..tokenizer import special_id

    eos = target_cfg.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    ids += [special_id(tok, "<|im_end|>"), special_id(tok, "<|eot_id|>"), tok.eos_token_id]
    return sorted({i for i in ids if i is not None})


def choose_mask_id(tok, target_cfg, requested: int | None) -> int:
    """``--mask-token-id``, else the tokenizer's mask token, else the first embedding row past the tokenizer."""
    if requested is not None:
        return requested
    for name in ("<|mask|>", "<|mdm_mask|>", "<|MASK|>"):
        from ..tokenizer import special_id

        i = special_id(tok, name)
        if i is not None:
            return i
    if len(tok) < target_cfg.vocab_size:
        return len(tok)
    raise ValueError("--mask-token-id: the tokenizer has no mask token and no unused embedding row; give one")


def build_data(cfg: DFlashTrainConfig, target, tok) -> dict:
    """Regenerated (prompt, response) id lists, cached in ``<out>/regenerated.pt`` for resumption."""
    from ..progress import progress

    from ..drafters.target import regenerate
    from ..tokenizer import encode_prompt

    key = {k: getattr(cfg, k) for k in ("target", "tasks", "prompts_file", "num_prompts", "chat",
                                        "max_new_tokens", "seed")}
    if cfg.data_path.is_file():
        data = torch.load(cfg.data_path, weights_only=True)
        if data["key"] == key:
            return data
    prompts = [encode_prompt(tok, p, cfg.chat) for p in read_prompts(cfg)]
    with progress(total=len(prompts), desc="regenerate") as bar:
        responses = regenerate(target, prompts, cfg.max_new_tokens, stop_ids(tok, target.config),
                               cfg.regen_batch, bar)
    data = {"key": key, "prompts": prompts, "responses": responses}
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    torch.save(data, cfg.data_path)
    return data


def batch_at(data: dict, step: int, cfg: DFlashTrainConfig, pad_id: int):
    """Deterministic batch of step ``step``: tokens [S, L] (right-padded), lengths [S], response starts [S]."""
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) % 2**63)
    idx = torch.randint(len(data["prompts"]), (cfg.batch_size,), generator=g).tolist()
    seqs = [data["prompts"][i] + data["responses"][i] for i in idx]
    L = max(map(len, seqs))
    tokens = torch.tensor([s + [pad_id] * (L - len(s)) for s in seqs])
    lengths = torch.tensor([len(s) for s in seqs])
    starts = torch.tensor([len(data["prompts"][i]) for i in idx])
    return tokens, lengths, starts, g


# --- model --------------------------------------------------------------------------------------------------
def build_drafter(cfg: DFlashTrainConfig, target, mask_id: int):
    from ..drafters.config import DFlashConfig
    from ..drafters.dflash import DFlashDrafter, init_weights

    dcfg = DFlashConfig.for_target(target.config, cfg.layers, cfg.block_size, mask_id, cfg.layer_ids())
    model = init_weights(DFlashDrafter(dcfg), std=target.config.initializer_range, seed=cfg.seed)
    if cfg.init == "target":
        copy_target_layers(model, target)
    return model.to(cfg.device).bind(target)


def copy_target_layers(model, target) -> None:
    """Start drafter layer i from an evenly spaced target layer (same shapes: q/k/v/o, norms, MLP)."""
    src = target.model.layers
    picks = [round(i * (len(src) - 1) / max(len(model.layers) - 1, 1)) for i in range(len(model.layers))]
    for layer, j in zip(model.layers, picks):
        missing = layer.load_state_dict(src[j].state_dict(), strict=False)
        if missing.missing_keys:
            raise ValueError(f"--init target: target layer {j} lacks {missing.missing_keys}")


def block_loss(drafter, target, tokens, lengths, starts, cfg: DFlashTrainConfig, g) -> tuple[torch.Tensor, dict]:
    """Position-weighted denoising loss of random-anchor blocks; also the greedy in-block acceptance."""
    from ..drafters.blocks import IGNORE, pack_blocks, sample_anchors

    dev = cfg.device
    tokens, lengths, starts = tokens.to(dev), lengths.to(dev), starts.to(dev)
    with torch.no_grad():
        feats = drafter.features(target(tokens, output_hidden_states=True).hidden_states)  # [S, L, k*H]
    anchors, valid = sample_anchors(lengths.cpu(), starts.cpu(), cfg.blocks_per_seq, tokens.shape[1], g)
    pb = pack_blocks(tokens, lengths, anchors.to(dev), valid.to(dev), cfg.block_size, drafter.cfg.mask_token_id,
                     cfg.gamma)
    h = drafter(drafter.embed(pb.ids), feats, pb.pos, mask=pb.mask)  # [S, N*B, H]
    logits = drafter.logits(h).float()  # [S, N*B, V]
    ce = F.cross_entropy(logits.flatten(0, 1), pb.labels.flatten(), ignore_index=IGNORE, reduction="none")
    loss = (ce * pb.weights.flatten()).sum() / pb.weights.sum().clamp_min(1e-9)
    with torch.no_grad():
        hit = (logits.argmax(-1) == pb.labels).view(*anchors.shape, cfg.block_size)[..., 1:]  # [S, N, B-1]
        full = (pb.labels.view(*anchors.shape, cfg.block_size)[..., 1:] != IGNORE).all(-1) & valid
        tau = (1 + hit.long().cumprod(-1).sum(-1).float())[full].mean() if full.any() else torch.tensor(math.nan)
    return loss, {"tau": float(tau), "acc1": float(hit[..., 0][valid].float().mean())}


def run(cfg: DFlashTrainConfig) -> dict:
    """Regenerate data (cached), train, write the drafter to ``cfg.out``; returns the loop summary."""
    from ..drafters.dflash import save_drafter
    from ..drafters.target import load_target
    from ..tokenizer import load_tokenizer
    from .loop import train

    torch.manual_seed(cfg.seed)
    target = load_target(cfg.target, cfg.device)
    tok = load_tokenizer(cfg.target)
    mask_id = choose_mask_id(tok, target.config, cfg.mask_token_id)
    data = build_data(cfg, target, tok)
    drafter = build_drafter(cfg, target, mask_id)
    pad = stop_ids(tok, target.config)[0]
    held = batch_at(data, -1, cfg, pad)  # fixed batch for progress reports

    def loss_fn(step: int):
        tokens, lengths, starts, g = batch_at(data, step, cfg, pad)
        loss, _ = block_loss(drafter, target, tokens, lengths, starts, cfg, g)
        return loss, int(lengths.sum())

    def eval_fn() -> dict:
        with torch.no_grad():
            g = torch.Generator().manual_seed(cfg.seed)
            loss, m = block_loss(drafter, target, *held[:3], cfg, g)
        return {"eval_loss": float(loss), **m}

    summary = train(cfg, drafter, loss_fn, eval_fn, desc="train-dflash")
    summary.update(eval_fn())
    save_drafter(drafter, cfg.out)
    if not cfg.keep_data and summary["steps"] == cfg.steps:  # an early stop keeps it for --resume
        cfg.data_path.unlink(missing_ok=True)
    return summary


# --- CLI ------------------------------------------------------------------------------------------------------
HELP = {
    "tasks": "';'-separated task specs whose train split gives the prompts", "prompts_file":
    "JSONL ({\"prompt\": ...} per line) or text file of prompts (instead of --tasks)", "num_prompts":
    "training prompts (responses regenerated by the target)", "chat": "do not wrap prompts in the chat template",
    "max_new_tokens": "cap on regenerated response length", "layers": "drafter layers",
    "block_size": "training block size (position 0 = anchor)", "target_layer_ids":
    "comma-separated 0-based target layers whose outputs feed the drafter (default: spread 1..N-3)",
    "mask_token_id": "mask token (default: the tokenizer's mask token, else the first unused embedding row)",
    "init": "random, or target (start from evenly spaced target layers)", "blocks_per_seq":
    "random anchors (blocks) per sequence", "batch_size": "sequences per step", "gamma":
    "loss decay: w_k = exp(-(k-1)/gamma)", "save_every": "steps between resumable checkpoints",
    "eval_every": "steps between loss/acceptance reports on a fixed batch (0: off)",
    "regen_batch": "prompts per target.generate call", "keep_data": "keep <out>/regenerated.pt after training",
    "resume": "continue from <out>/train_state.pt",
    "time_limit": "seconds; stop early with everything saved (continue with --resume), 0 = none",
}


def add_parser(sub) -> None:
    p = sub.add_parser("train-dflash", help="train a DFlash block-diffusion drafter for a causal target")
    p.add_argument("--target", required=True, help="local transformers causal LM directory (with tokenizer)")
    p.add_argument("--out", required=True, help="output drafter directory (config.json + model.safetensors)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)")
    add_config_args(p, DFlashTrainConfig(target="", out=""), skip=("target", "out"), help=HELP)
    p.set_defaults(func=cmd_train)


def cmd_train(a) -> int:
    set_threads(a.threads)
    cfg = DFlashTrainConfig(**{f.name: getattr(a, f.name) for f in fields(DFlashTrainConfig)})
    print(json.dumps(run(cfg)))
    return 0
