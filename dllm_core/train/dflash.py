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

Under ``torchrun`` (``train/distributed.py``) the prompts are regenerated in per-rank shards, each rank trains
on its rows of every step's global batch (``--batch-size`` sequences, split again into ``--grad-accum``
micro-batches) with the drafter under DDP and the frozen target replicated, and the loss is normalised by the
global batch, so any number of processes follows the one-process loss curve. Target features are taken from
the chosen layers only, ``--feature-chunk`` tokens at a time (bounded memory on long sequences).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from .common import add_config_args, set_threads
from .config import TrainBase
from .distributed import World, finish, init_world, wrap

INITS = ("random", "target")


@dataclass(frozen=True, kw_only=True)
class DFlashTrainConfig(TrainBase):
    """Every knob of one drafter training run (optimisation, seed, device, checkpoints: ``TrainBase``)."""

    RUNTIME: ClassVar[tuple[str, ...]] = TrainBase.RUNTIME + ("regen_batch", "keep_data", "grad_accum",
                                                              "feature_chunk", "regen_engine")
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
    grad_accum: int = 1               # micro-batches per step on each rank (the global batch stays batch_size)
    feature_chunk: int = 0            # target tokens per feature forward (0: whole sequences at once)
    regen_engine: str = "auto"        # auto | vllm | transformers (drafters/target.py: regen_engine)

    def __post_init__(self):
        super().__post_init__()
        from ..drafters.target import regen_engine

        regen_engine(self.regen_engine, self.device)
        self.check_at_least(1, "num_prompts", "max_new_tokens", "layers", "blocks_per_seq", "batch_size",
                            "regen_batch", "grad_accum")
        self.check_at_least(0, "feature_chunk")
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


def target_config(target_dir):
    """The target's transformers config (no weights loaded)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(target_dir), local_files_only=True)


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


def cached(path: Path, key: dict, world: World, make) -> dict:
    """``path``'s data when it was made with ``key``, else ``make()`` (every rank calls it: per-rank shards),
    saved by rank 0; every rank returns the same data."""
    if path.is_file():
        data = torch.load(path, weights_only=True)
        if data["key"] == key:
            return data
    data = {"key": key, **make()}
    if world.main:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, path)
    world.barrier()
    return data


def regenerate_in(cfg, world: World, target, prompts: list[list[int]], max_new_tokens: int, stops: list[int], bar,
                  free_run: bool = False) -> list[list[int]]:
    """The target's responses through ``cfg.regen_engine`` (vLLM runs its own workers: one process only;
    ``target`` may then be None: the trainer loads it after vLLM has given the device back)."""
    from ..drafters.target import regen_engine, regenerate_with

    engine = regen_engine(cfg.regen_engine, cfg.device)
    if engine == "vllm" and world.size > 1:
        raise ValueError("--regen-engine vllm: regenerate in one process (the same command without torchrun, "
                         "--steps 1 --keep-data), then train under torchrun from the cached data; or use "
                         "--regen-engine transformers for per-rank shards")
    return regenerate_with(engine, target, cfg.target, prompts, max_new_tokens, stops, cfg.regen_batch, bar,
                           free_run)


def uses_vllm(cfg) -> bool:
    """Whether the data still has to be regenerated, through vLLM."""
    from ..drafters.target import regen_engine

    return regen_engine(cfg.regen_engine, cfg.device) == "vllm" and not cfg.data_path.is_file()


def build_data(cfg: DFlashTrainConfig, target, tok, world: World = World()) -> dict:
    """Regenerated (prompt, response) id lists, cached in ``<out>/regenerated.pt`` for resumption; under
    ``torchrun`` each rank regenerates its shard of the prompts."""
    from ..progress import progress
    from ..tokenizer import encode_prompt

    key = {k: getattr(cfg, k) for k in ("target", "tasks", "prompts_file", "num_prompts", "chat",
                                        "max_new_tokens", "seed")}

    def make() -> dict:
        prompts = [encode_prompt(tok, p, cfg.chat) for p in read_prompts(cfg)]
        mine = prompts[world.shard(len(prompts))]
        with progress(total=len(mine), desc="regenerate", disable=not world.main) as bar:
            responses = regenerate_in(cfg, world, target, mine, cfg.max_new_tokens,
                                      stop_ids(tok, target_config(cfg.target)), bar)
        return {"prompts": prompts, "responses": world.gather(responses)}
    return cached(cfg.data_path, key, world, make)


@dataclass(frozen=True)
class StepBatch:
    """One step's global batch, the same on every rank: sequences, their anchors and packed blocks."""

    tokens: torch.Tensor    # [S, L] right-padded
    lengths: torch.Tensor   # [S]
    packed: "PackedBlocks"  # [S, ...] (drafters/blocks.py)
    anchors: torch.Tensor   # [S, N]
    valid: torch.Tensor     # [S, N]
    total: float            # sum of the loss weights of the whole batch (the loss's denominator)

    def rows(self, rows: slice, device) -> tuple:
        """tokens, packed blocks, anchors, valid of ``rows`` on ``device``."""
        from ..drafters.blocks import PackedBlocks

        pb = PackedBlocks(*(getattr(self.packed, f.name)[rows].to(device) for f in fields(self.packed)))
        return self.tokens[rows].to(device), pb, self.anchors[rows], self.valid[rows]


def step_batch(data: dict, step: int, cfg: DFlashTrainConfig, pad_id: int, mask_id: int,
               anchor_gen: torch.Generator | None = None) -> StepBatch:
    """Sequences, anchors and packed blocks of step ``step`` (a function of seed and step only; anchors drawn
    with ``anchor_gen`` when given, else with the batch's generator)."""
    from ..drafters.blocks import pack_blocks, sample_anchors

    tokens, lengths, starts, g = batch_at(data, step, cfg, pad_id)
    g = anchor_gen or g
    anchors, valid = sample_anchors(lengths, starts, cfg.blocks_per_seq, tokens.shape[1], g)
    pb = pack_blocks(tokens, lengths, anchors, valid, cfg.block_size, mask_id, cfg.gamma)
    return StepBatch(tokens, lengths, pb, anchors, valid, float(pb.weights.sum()))


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


def block_loss(step_module, drafter, target, batch: StepBatch, rows: slice, cfg: DFlashTrainConfig
               ) -> tuple[torch.Tensor, dict]:
    """Position-weighted denoising loss of the random-anchor blocks of ``rows`` of the step's batch, normalised
    by the whole batch's weight (the parts of all ranks and micro-batches sum to the batch's loss); also the
    greedy in-block acceptance of these rows. ``step_module``: the drafter, or the drafter under DDP."""
    from ..drafters.blocks import IGNORE
    from ..drafters.target import target_features

    tokens, pb, anchors, valid = batch.rows(rows, cfg.device)
    feats = target_features(target, tokens, drafter.cfg.target_layer_ids, cfg.feature_chunk)  # [s, L, k*H]
    h = step_module(drafter.embed(pb.ids), feats, pb.pos, mask=pb.mask)  # [s, N*B, H]
    logits = drafter.logits(h).float()  # [s, N*B, V]
    ce = F.cross_entropy(logits.flatten(0, 1), pb.labels.flatten(), ignore_index=IGNORE, reduction="none")
    loss = (ce * pb.weights.flatten()).sum() / max(batch.total, 1e-9)
    valid = valid.to(cfg.device)
    with torch.no_grad():
        hit = (logits.argmax(-1) == pb.labels).view(*anchors.shape, cfg.block_size)[..., 1:]  # [S, N, B-1]
        full = (pb.labels.view(*anchors.shape, cfg.block_size)[..., 1:] != IGNORE).all(-1) & valid
        tau = (1 + hit.long().cumprod(-1).sum(-1).float())[full].mean() if full.any() else torch.tensor(math.nan)
    return loss, {"tau": float(tau), "acc1": float(hit[..., 0][valid].float().mean())}


def run(cfg: DFlashTrainConfig) -> dict:
    """Regenerate data (cached), train, write the drafter to ``cfg.out``; returns the loop summary. Under
    ``torchrun`` every rank runs this (rank 0 writes)."""
    from ..drafters.dflash import save_drafter
    from ..drafters.target import load_target
    from ..tokenizer import load_tokenizer
    from .loop import check_resume, train

    world, device = init_world(cfg.device)
    cfg = replace(cfg, device=device)
    check_resume(cfg)
    world.rows(cfg.batch_size, 0, cfg.grad_accum)  # the batch splits evenly, or a clear error now
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(cfg.target)
    target = None if uses_vllm(cfg) else load_target(cfg.target, cfg.device)
    data = build_data(cfg, target, tok, world)
    target = target or load_target(cfg.target, cfg.device)  # after vLLM gave the device back
    mask_id = choose_mask_id(tok, target.config, cfg.mask_token_id)
    drafter = build_drafter(cfg, target, mask_id)
    step_module = wrap(drafter, world)
    pad = stop_ids(tok, target.config)[0]
    held = step_batch(data, -1, cfg, pad, mask_id, torch.Generator().manual_seed(cfg.seed))  # progress reports

    @functools.lru_cache(maxsize=1)  # one draw and packing per step, shared by its micro-batches
    def batch_of(step: int) -> StepBatch:
        return step_batch(data, step, cfg, pad, mask_id)

    def loss_fn(step: int, micro: int = 0):
        batch = batch_of(step)
        rows = world.rows(cfg.batch_size, micro, cfg.grad_accum)
        loss, _ = block_loss(step_module, drafter, target, batch, rows, cfg)
        return loss, int(batch.lengths[rows].sum())

    def eval_fn() -> dict:
        with torch.no_grad():
            loss, m = block_loss(drafter, drafter, target, held, slice(None), cfg)
        return {"eval_loss": float(loss), **m}

    summary = train(cfg, drafter, loss_fn, eval_fn, desc="train-dflash", world=world, step_module=step_module)
    if world.main:
        summary.update(eval_fn())
        save_drafter(drafter, cfg.out)
        if not cfg.keep_data and summary["steps"] == cfg.steps:  # an early stop keeps it for --resume
            cfg.data_path.unlink(missing_ok=True)
    del step_module  # the DDP wrapper goes before its process group
    finish(world)
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
    "resume": "continue from <out>/train_state.pt (written at any number of processes)",
    "grad_accum": "micro-batches per step on each process (--batch-size stays the global batch)",
    "feature_chunk": "target tokens per feature forward (0 = whole sequences; bounds memory on long ones)",
    "regen_engine": "auto (vLLM on a GPU when installed, else transformers), vllm (offline LLM.generate) or "
                    "transformers (batched generate)",
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
