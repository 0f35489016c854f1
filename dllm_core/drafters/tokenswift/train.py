"""``dllm train-tokenswift``: train the gamma residual heads on a frozen causal target.

1. Data: the target's own free-running greedy continuations (``--gen-tokens`` each, stop tokens banned, as
   in a long generation) of training prompts (task-suite train split or a prompt file) - the heads learn
   what the target will write, not a dataset. Cached in ``<out>/tokenswift_data.pt`` for resumption.
2. The frozen target's final hidden states of every sequence are computed once (in memory).
3. Every step: ``--batch`` random positions p of the generated parts; head i (1..gamma) predicts token
   p+1+i through the target's frozen LM head; loss = sum_i w^(i-1) CE_i / sum_i w^(i-1) (``--decay``).
4. AdamW + warmup/cosine in the shared loop (``train/loop.py``): progress bar, ``--resume`` continues exactly
   (positions depend only on (seed, step)). The heads land in ``--out`` (``heads.save_heads`` format).

Under ``torchrun`` (``train/distributed.py``) continuations and hidden states are computed in per-rank shards
and gathered, each rank trains on its share of every step's ``--batch`` positions (``--grad-accum``
micro-batches) with the heads under DDP, and the loss is normalised by the global batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from ...train.common import add_config_args, set_threads
from ...train.config import TrainBase
from ...train.dflash import DFlashTrainConfig, cached
from ...train.distributed import World, finish, init_world, wrap


@dataclass(frozen=True, kw_only=True)
class TokenSwiftTrainConfig(TrainBase):
    """Every knob of one heads training run (optimisation, seed, device, checkpoints: ``TrainBase``)."""

    RUNTIME: ClassVar[tuple[str, ...]] = DFlashTrainConfig.RUNTIME  # not part of a resumable run's identity
    target: str
    tasks: str = "count:span=2000"   # prompt source (train split) unless prompts_file
    prompts_file: str | None = None  # JSONL ({"prompt": ...} per line) or plain text, one prompt a line
    num_prompts: int = 32
    chat: bool = True
    gen_tokens: int = 2048           # free-running continuation per prompt
    num_heads: int = 3               # gamma
    batch: int = 512                 # positions per step
    decay: float = 0.8               # weight of head i is decay^(i-1)
    steps: int = 1500
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    save_every: int = 250
    eval_every: int = 250
    regen_batch: int = 16
    keep_data: bool = False
    grad_accum: int = 1              # micro-batches per step on each rank (the global batch stays ``batch``)
    feature_chunk: int = 0           # target tokens per hidden-state forward (0: whole sequences)
    regen_engine: str = "auto"       # auto | vllm | transformers (drafters/target.py: regen_engine)

    def __post_init__(self):
        super().__post_init__()
        from ..target import regen_engine

        regen_engine(self.regen_engine, self.device)
        self.check_at_least(1, "num_prompts", "gen_tokens", "num_heads", "batch", "regen_batch", "grad_accum")
        self.check_at_least(0, "feature_chunk")
        if self.gen_tokens <= self.num_heads + 1:
            raise ValueError(f"--gen-tokens must exceed --num-heads + 1, got {self.gen_tokens}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"--decay must be in (0, 1], got {self.decay}")

    @property
    def data_path(self) -> Path:
        return Path(self.out) / "tokenswift_data.pt"


# --- data ---------------------------------------------------------------------------------------------------
def read_prompts(cfg: TokenSwiftTrainConfig) -> list[str]:
    from ...train.dflash import read_prompts as dflash_prompts

    return dflash_prompts(cfg)  # same sources and formats as train-dflash (fields: prompts_file, tasks, ...)


def build_data(cfg: TokenSwiftTrainConfig, target, tok, world: World = World()) -> dict:
    """(prompt, continuation) id lists, cached in ``<out>/tokenswift_data.pt``; each rank its shard."""
    from ...progress import progress
    from ...tokenizer import encode_prompt
    from ...train.dflash import regenerate_in, stop_ids, target_config

    key = {k: getattr(cfg, k) for k in ("target", "tasks", "prompts_file", "num_prompts", "chat", "gen_tokens",
                                        "seed")}

    def make() -> dict:
        prompts = [encode_prompt(tok, p, cfg.chat) for p in read_prompts(cfg)]
        mine = prompts[world.shard(len(prompts))]
        with progress(total=len(mine), desc="free-run", disable=not world.main) as bar:
            gens = regenerate_in(cfg, world, target, mine, cfg.gen_tokens, stop_ids(tok, target_config(cfg.target)),
                                 bar, free_run=True)
        return {"prompts": prompts, "generations": world.gather(gens)}
    return cached(cfg.data_path, key, world, make)


@torch.inference_mode()
def hidden_states(target, data: dict, world: World = World(), chunk: int = 0) -> tuple[torch.Tensor, ...]:
    """-> hidden [S, L, H] (final norm, float32), tokens [S, L], start [S] (first generated position),
    end [S] (sequence lengths). Each rank computes its shard of the sequences; all get every row."""
    from ...progress import progress
    from ..target import target_features

    seqs = [p + g for p, g in zip(data["prompts"], data["generations"])]
    width, last = max(map(len, seqs)), target.config.num_hidden_layers - 1
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    hidden = torch.zeros(len(seqs), width, target.config.hidden_size)
    rows = range(len(seqs))[world.shard(len(seqs))]
    mine = [target_features(target, torch.tensor([seqs[i]], device=target.device), (last,), chunk)[0].float().cpu()
            for i in progress(rows, desc="hidden states", disable=not world.main)]
    for i, h in zip(range(len(seqs)), world.gather(mine)):
        tokens[i, : len(seqs[i])] = torch.tensor(seqs[i])
        hidden[i, : len(seqs[i])] = h
    start = torch.tensor([len(p) for p in data["prompts"]])
    return hidden, tokens, start, torch.tensor([len(s) for s in seqs])


def positions_at(step: int, cfg: TokenSwiftTrainConfig, start: torch.Tensor, end: torch.Tensor):
    """Deterministic (sequence, position) pairs of one step: p in [start-1, end-gamma-2] (h at p predicts
    p+1; head i needs p+1+i)."""
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) % 2**63)
    seq = torch.randint(len(start), (cfg.batch,), generator=g)
    lo = start[seq] - 1
    hi = end[seq] - cfg.num_heads - 1  # exclusive
    pos = lo + (torch.rand(cfg.batch, generator=g) * (hi - lo)).long()
    return seq, pos


def heads_loss(heads, lm_head, hidden, tokens, seq, pos, cfg: TokenSwiftTrainConfig,
               total: int | None = None) -> tuple[torch.Tensor, list]:
    """Weighted CE of heads 1..gamma at the given positions, averaged over ``total`` positions (default: these;
    the step's global batch when these are one rank's share); also each head's top-1 accuracy. ``heads``: the
    heads, or the heads under DDP."""
    dev = cfg.device
    h0 = hidden[seq, pos].to(dev)  # [B, H]
    logits = lm_head(heads(h0))[:, 1:].float()  # [B, gamma, V]
    offs = torch.arange(2, cfg.num_heads + 2)  # head i predicts p + 1 + i
    labels = tokens[seq[:, None], pos[:, None] + offs].to(dev)  # [B, gamma]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    w = cfg.decay ** torch.arange(cfg.num_heads, device=dev, dtype=torch.float32)
    loss = (ce.sum(0) / (total or len(seq)) * w).sum() / w.sum()
    acc = (logits.argmax(-1) == labels).float().mean(0).tolist()
    return loss, acc


def run(cfg: TokenSwiftTrainConfig) -> dict:
    """Free-run data (cached), hidden states, train, write the heads to ``cfg.out``."""
    from ...tokenizer import load_tokenizer
    from ...train.loop import train
    from ..target import load_target
    from .heads import HeadsConfig, TokenSwiftHeads, save_heads

    from ...train.loop import check_resume

    world, device = init_world(cfg.device)
    cfg = replace(cfg, device=device)
    check_resume(cfg)
    world.rows(cfg.batch, 0, cfg.grad_accum)  # the batch splits evenly, or a clear error now
    torch.manual_seed(cfg.seed)
    from ...train.dflash import uses_vllm

    tok = load_tokenizer(cfg.target)
    target = None if uses_vllm(cfg) else load_target(cfg.target, cfg.device)
    data = build_data(cfg, target, tok, world)
    target = target or load_target(cfg.target, cfg.device)  # after vLLM gave the device back
    hidden, tokens, start, end = hidden_states(target, data, world, cfg.feature_chunk)
    lm_head = target.get_output_embeddings()
    heads = TokenSwiftHeads(HeadsConfig.for_target(target.config, cfg.num_heads)).to(cfg.device)
    step_module = wrap(heads, world)
    held = positions_at(-1, cfg, start, end)

    def loss_fn(step: int, micro: int = 0):
        seq, pos = positions_at(step, cfg, start, end)
        rows = world.rows(cfg.batch, micro, cfg.grad_accum)
        loss, _ = heads_loss(step_module, lm_head, hidden, tokens, seq[rows], pos[rows], cfg, cfg.batch)
        return loss, rows.stop - rows.start

    def eval_fn() -> dict:
        with torch.no_grad():
            loss, acc = heads_loss(heads, lm_head, hidden, tokens, *held, cfg)
        return {"eval_loss": float(loss), **{f"acc_head{i + 1}": a for i, a in enumerate(acc)}}

    summary = train(cfg, heads, loss_fn, eval_fn, desc="train-tokenswift", world=world, step_module=step_module)
    if world.main:
        summary.update(eval_fn())
        save_heads(heads, cfg.out)
        if not cfg.keep_data and summary["steps"] == cfg.steps:  # stopped early (--time-limit): keep for --resume
            cfg.data_path.unlink(missing_ok=True)
    del step_module  # the DDP wrapper goes before its process group
    finish(world)
    return summary


# --- CLI ------------------------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("train-tokenswift", help="train TokenSwift's gamma residual heads on a frozen causal target")
    p.add_argument("--target", required=True, help="local transformers causal LM directory (with tokenizer)")
    p.add_argument("--out", required=True, help="output heads directory (config.json + model.safetensors)")
    add_config_args(p, TokenSwiftTrainConfig(target="", out=""), skip=("target", "out"))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=cmd_train)


def cmd_train(a) -> int:
    set_threads(a.threads)
    cfg = TokenSwiftTrainConfig(**{f.name: getattr(a, f.name) for f in fields(TokenSwiftTrainConfig)})
    print(json.dumps(run(cfg)))
    return 0
