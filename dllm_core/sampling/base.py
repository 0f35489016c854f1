"""The sampler (transfer-rule) interface shared by the embedded engine and the host adapters.

A sampler sees one block's window of logits and decides which masked positions to commit::

    st = sampler.new_state(batch, block_len, steps_per_block, device)    # per request rows
    sampler.begin_block(st, masked)
    while not sampler.block_done(st, masked):          # all rows done; per row: rows_done -> [B]
        lo, hi = sampler.focus(st)                     # [B] per-row windows inside the block
        LO, HI = sampler.window(st, active)            # their union over active rows (host ints)
        x0, commit = sampler.step(logits, x[:, LO:HI], st, tc, LO)       # logits [B, W, V]

Engines drive this through ``dllm_core.engine.step`` (``plan_step`` / ``take_step``), never directly.

All state lives in ``st`` (a dict of tensors, one row per request) so a host engine can keep it
between scheduler rounds; the sampler object itself is immutable configuration.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..options import OptionError, check_min

NEG = -math.inf
LOWEST = -3e38  # a confidence below every other, above NEG
CONFIDENCES = ("low_confidence", "random", "maskgit_plus", "topk_margin", "entropy")


@dataclass(frozen=True)
class TokenContext:
    """Per-generation constants a sampler needs besides the logits."""

    mask_id: int
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    generator: "torch.Generator | tuple[torch.Generator, ...] | None" = None  # one per row: each row's own stream


def uniform(shape, dtype, device, generator) -> torch.Tensor:
    """U[0, 1) of ``shape`` [B, ...]: from one generator, or row b from ``generator[b]`` (a request's own seed: its
    draws do not depend on the rest of its batch; row b draws what a batch of one draws from that generator)."""
    if not isinstance(generator, tuple):
        return torch.rand(shape, dtype=dtype, device=device, generator=generator)
    return torch.stack([torch.rand(shape[1:], dtype=dtype, device=device, generator=g) for g in generator])


def check_proposal(temperature: float, top_p: float | None, top_k: int | None, flag=str) -> None:
    """Validate the proposal-sampling knobs; ``flag`` names an option in the caller's vocabulary."""
    check_min(temperature, 0, flag("temperature"))
    if top_p is not None and not 0 < top_p <= 1:
        raise OptionError(flag("top_p"), f"must be in (0, 1], got {top_p}")
    if top_k is not None:
        check_min(top_k, 1, flag("top_k"))


def filter_logits(logits: torch.Tensor, tc: TokenContext) -> torch.Tensor:
    """Temperature, top-k and top-p (nucleus) filtering: [B, W, V] -> [B, W, V]."""
    if tc.temperature > 0:
        logits = logits / tc.temperature
    if tc.top_k:
        kth = logits.topk(min(tc.top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, NEG)
    if tc.top_p is not None and tc.top_p < 1:
        srt, idx = logits.sort(-1, descending=True)
        drop = srt.softmax(-1).cumsum(-1) - srt.softmax(-1) > tc.top_p  # keep the first token always
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), NEG)
    return logits


@functools.lru_cache(maxsize=64)
def never_proposed(mask_id: int, eos_id: int | None, device: torch.device) -> torch.Tensor:
    """The token ids ``propose`` never picks ([MASK]: committing it would not unmask; EOS where ``logits_eos_inf``):
    [1 or 2]. Built once per device, never written (shared by every request)."""
    return torch.tensor([mask_id] if eos_id is None else [mask_id, eos_id], device=device)


def propose(logits: torch.Tensor, tc: TokenContext) -> torch.Tensor:
    """Candidate token per position: argmax (greedy) or Gumbel-max in float64 (LLaDA's sampler,
    an exact sample of softmax(logits / T)). [B, W, V] -> [B, W]."""
    eos = tc.eos_id if tc.logits_eos_inf else None
    logits = logits.index_fill(-1, never_proposed(tc.mask_id, eos, logits.device), NEG)
    if tc.temperature <= 0:
        return logits.argmax(-1)
    f = filter_logits(logits, tc).double()
    u = uniform(f.shape, torch.float64, f.device, tc.generator)
    return (f.exp() / (-u.log())).argmax(-1)  # = argmax(f + Gumbel) since f already / T


def confidence(kind: str, logits: torch.Tensor, x0: torch.Tensor, tc: TokenContext) -> torch.Tensor:
    """Per-position score used to rank masked positions: [B, W, V], [B, W] -> [B, W] (float32)."""
    if kind == "random":
        c = uniform(x0.shape, torch.float32, x0.device, tc.generator)
    elif kind == "low_confidence":  # LLaDA: untempered probability of the proposal
        c = logits.softmax(-1).gather(-1, x0[..., None])[..., 0]
    else:  # Dream: probabilities after temperature / top-p / top-k
        p = filter_logits(logits, tc).softmax(-1)
        if kind == "maskgit_plus":
            c = p.gather(-1, x0[..., None])[..., 0]
        elif kind == "topk_margin":
            top2 = p.topk(2, -1).values
            c = top2[..., 0] - top2[..., 1]
        elif kind == "entropy":
            c = (p * p.clamp_min(1e-30).log()).sum(-1)
        else:
            raise ValueError(f"confidence must be one of {list(CONFIDENCES)}, got {kind!r}")
    c = c if c.dtype == torch.float32 else c.float()
    if tc.confidence_eos_eot_inf:  # lowest, yet finite: still above every unmasked position (``masked_score``)
        for t in (tc.eos_id, tc.eot_id):
            if t is not None:
                c = c.masked_fill(x0 == t, LOWEST)
    return c


def rank_desc(score: torch.Tensor) -> torch.Tensor:
    """Rank of each entry in descending order along the last dim (0 = best; stable)."""
    return score.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)


def masked_score(conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Scores where every masked position ranks above every unmasked one (``confidence`` is never -inf)."""
    return torch.where(masked, conf, NEG)


def top_n(score: torch.Tensor, masked: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Commit mask of the n[b] highest-scoring masked positions of each row. n [B] -> [B, W]."""
    return masked & (rank_desc(masked_score(score, masked)) < n[:, None])


@dataclass(frozen=True)
class Sampler:
    """Base transfer rule. Subclasses implement ``select``; stateless ones keep ``new_state``."""

    name: ClassVar[str] = "base"
    fixed_steps: ClassVar[bool] = False  # True: every block runs exactly steps_per_block steps
    moves_focus: ClassVar[bool] = False  # True: ``focus`` is not always the whole block (it is after begin_block)
    confidence: str = "low_confidence"

    def __post_init__(self):
        if self.confidence not in CONFIDENCES:
            raise OptionError(f"--sampler {self.name}.confidence",
                              f"must be one of {list(CONFIDENCES)}, got {self.confidence!r}")

    def new_state(self, batch: int, block_len: int, steps: int, device) -> dict:
        return {"i": torch.zeros(batch, dtype=torch.long, device=device), "steps": steps, "L": block_len}

    def begin_block(self, st: dict, masked: torch.Tensor) -> None:
        """masked [B, L]: the block's mask positions at its first step."""
        st["i"].zero_()
        st["n"] = 0  # host-side step counter of the block (no sync to read)
        st["m0"] = masked.sum(-1)

    def rows_done(self, st: dict, masked: torch.Tensor) -> torch.Tensor:
        """[B] bool: rows whose block is finished (variable-step rules: no mask left)."""
        return ~masked.any(-1)

    def max_steps(self, block_len: int, steps: int) -> int:
        """The most steps a block can take: variable rules commit >= 1 token per step."""
        return block_len

    def block_done(self, st: dict, masked: torch.Tensor) -> bool:
        """Host-side loop condition of a lock-step batch: every row done (one device sync)."""
        return bool(self.rows_done(st, masked).all())

    def active(self, st: dict, masked: torch.Tensor) -> torch.Tensor:
        """Rows that still take part in this block: [B] bool."""
        return masked.any(-1)

    def focus(self, st: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row window [lo, hi) of the block the next step is about: ([B], [B])."""
        z = torch.zeros_like(st["i"])
        return z, z + st["L"]

    def window(self, st: dict, active: torch.Tensor) -> tuple[int, int]:
        """Union of the active rows' focus windows as host ints (the whole block by default)."""
        return 0, st["L"]

    def step(self, logits: torch.Tensor, x: torch.Tensor, st: dict, tc: TokenContext, lo: int = 0):
        """logits [B, W, V], x [B, W] window tokens -> (x0 [B, W], commit [B, W] bool). Commits fall in ``active``
        rows only (a rule commits masked positions; an inactive row has none, or - editing - is finished).
        ``device_step``, then the block's host step counter ``st["n"]`` moves on: no host value is read or written
        inside ``device_step``, so one traced graph (``torch.compile``, a CUDA graph) serves every step."""
        out = self.device_step(logits, x, st, tc, lo)
        st["n"] += 1
        return out

    def device_step(self, logits: torch.Tensor, x: torch.Tensor, st: dict, tc: TokenContext, lo: int = 0):
        """``step`` on the device alone: the sampler rows' tensors in ``st`` are updated, nothing host-side."""
        return self.scored_step(logits, x, st, tc, lo)[:2]

    def scored_step(self, logits, x, st, tc, lo: int = 0, masked: torch.Tensor | None = None):
        """``step`` that also returns the confidences it ranked: (x0, commit, conf [B, W] float32); ``masked``:
        ``x == mask_id`` when the caller has it."""
        x0 = propose(logits, tc)
        conf = confidence(self.confidence, logits, x0, tc)
        commit = self.select(conf, x == tc.mask_id if masked is None else masked, st, lo)
        st["i"] += 1
        return x0, commit, conf

    def select(self, conf: torch.Tensor, masked: torch.Tensor, st: dict, lo: int) -> torch.Tensor:
        raise NotImplementedError
