"""Fixed-schedule transfer rules: LLaDA's low_confidence / random and Dream's diffusion_generate
algorithms (origin, maskgit_plus, topk_margin, entropy).

Schedules (``schedule=``): ``llada`` (LLaDA's generate: the block's masks at its first step split over the steps,
every step run), ``dream`` (Dream's timesteps) and ``llada2`` (LLaDA2's official ``generate``: the block *length*
split over the steps, the block ending when it has no mask left - ``docs/llada2.md``). ``llada`` and ``llada2``
differ only on a block that begins with fewer masks than its length (a block-causal model's prompt tail) or that
has fewer positions than steps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Sampler, top_n
from ..options import check_choice, check_min

SCHEDULES = ("llada", "dream", "llada2")


def llada_counts(m: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to transfer at each step: m // s each, the first m % s steps one more. [B] -> [B, s]."""
    i = torch.arange(steps, device=m.device)
    return m[:, None] // steps + (i < (m[:, None] % steps)).long()


def llada2_count(i: torch.Tensor, L: int, steps: int) -> torch.Tensor:
    """LLaDA2's official schedule at step i: the block length L split evenly over the steps, the first L % s
    steps one more (its ``_get_num_transfer_tokens``; 0 past the L-th step when s > L). [B] -> [B]."""
    return L // steps + (i < L % steps).long()


def dream_count(n_mask: torch.Tensor, i: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """Dream: int(n_mask * (1 - s/t)) over timesteps linspace(1, eps, steps+1); all at the last."""
    t = torch.linspace(1, eps, steps + 1, device=n_mask.device)
    ratio = 1 - t[(i + 1).clamp_max(steps)] / t[i.clamp_max(steps - 1)]
    n = (n_mask.double() * ratio.double()).long()
    return torch.where(i >= steps - 1, n_mask, n)


@dataclass(frozen=True)
class FixedSchedule(Sampler):
    """Commit a scheduled number of masked positions per step, the most confident first."""

    fixed_steps: ClassVar[bool] = True  # steps per block fixed (llada2: at most that many; a block may end sooner)
    schedule: str = "llada"
    eps: float = 1e-3
    alg_temp: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_choice(self.schedule, SCHEDULES, f"--sampler {self.name}.schedule")
        check_min(self.alg_temp, 0, f"--sampler {self.name}.alg_temp")

    def begin_block(self, st, masked):
        super().begin_block(st, masked)
        st["counts"] = llada_counts(st["m0"], st["steps"])

    def rows_done(self, st, masked):
        """The schedule's steps are run (a block that began without masks has nothing to run); llada2: also
        once the block has no mask left."""
        done = (st["i"] >= st["steps"]) | (st["m0"] == 0)
        return (done | ~masked.any(-1)) if self.schedule == "llada2" else done

    def max_steps(self, block_len, steps):
        return max(block_len, steps)

    def block_done(self, st, masked):
        if self.schedule == "llada2":  # ends on the masks: one device read, as a variable-step rule
            return super().block_done(st, masked)
        return st["n"] >= st["steps"]  # rows_done from the host counter (lock step): no device sync

    def active(self, st, masked):
        if self.schedule == "llada2":
            return ~self.rows_done(st, masked)
        return st["m0"] > 0  # a block that began without masks (a block-causal row's padding) has no steps

    def n_transfer(self, st, masked) -> torch.Tensor:
        """Positions to commit at this step: [B]."""
        if self.schedule == "llada":
            return st["counts"].gather(1, st["i"][:, None].clamp_max(st["steps"] - 1))[:, 0]
        if self.schedule == "llada2":
            return llada2_count(st["i"], st["L"], st["steps"])
        return dream_count(masked.sum(-1), st["i"], st["steps"], self.eps)

    def select(self, conf, masked, st, lo):
        n = self.n_transfer(st, masked)
        if self.alg_temp > 0:  # Dream: sample positions ~ softmax(conf / alg_temp) without replacement
            g = -torch.empty_like(conf).exponential_().log()
            conf = conf / self.alg_temp + g
        return top_n(conf, masked, n)


@dataclass(frozen=True)
class LowConfidence(FixedSchedule):
    """LLaDA baseline: commit the most probable proposals (``remasking=low_confidence``)."""

    name: ClassVar[str] = "low_confidence"


@dataclass(frozen=True)
class RandomRemasking(FixedSchedule):
    """LLaDA baseline with ``remasking=random``: positions chosen uniformly at random."""

    name: ClassVar[str] = "random"
    confidence: str = "random"


@dataclass(frozen=True)
class MaskGitPlus(FixedSchedule):
    """Dream ``alg=maskgit_plus``: top-1 probability, Dream's timestep schedule."""

    name: ClassVar[str] = "maskgit_plus"
    confidence: str = "maskgit_plus"
    schedule: str = "dream"


@dataclass(frozen=True)
class TopKMargin(FixedSchedule):
    """Dream ``alg=topk_margin``: top-1 minus top-2 probability."""

    name: ClassVar[str] = "topk_margin"
    confidence: str = "topk_margin"
    schedule: str = "dream"


@dataclass(frozen=True)
class Entropy(FixedSchedule):
    """Dream ``alg=entropy``: negative entropy of the predictive distribution."""

    name: ClassVar[str] = "entropy"
    confidence: str = "entropy"
    schedule: str = "dream"


@dataclass(frozen=True)
class Origin(FixedSchedule):
    """Dream ``alg=origin``: each mask is revealed with probability 1 - s/t (all at the last step)."""

    name: ClassVar[str] = "origin"
    confidence: str = "random"
    schedule: str = "dream"

    def select(self, conf, masked, st, lo):
        t = torch.linspace(1, self.eps, st["steps"] + 1, device=conf.device)
        i = st["i"]
        p = 1 - t[(i + 1).clamp_max(st["steps"])] / t[i.clamp_max(st["steps"] - 1)]
        last = (i >= st["steps"] - 1)[:, None]
        return masked & ((conf < p[:, None]) | last)
