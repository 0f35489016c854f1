"""Fast-dLLM confidence-aware parallel decoding: the threshold and factor rules (variable steps), and LLaDA2's
official threshold rule (``threshold:schedule=llada2``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import masked_score, rank_desc
from .editing import Editable
from .fixed import llada2_count
from ..options import check_choice, check_min, check_range

THRESHOLD_SCHEDULES = ("fast_dllm", "llada2")


def threshold_commit(conf: torch.Tensor, masked: torch.Tensor, tau: float) -> torch.Tensor:
    """Every masked position with conf >= tau, and always the most confident one. [B, W] -> [B, W]."""
    c = masked_score(conf, masked)
    return (c >= tau).scatter_(-1, c.argmax(-1, keepdim=True), True) & masked  # + the first maximum: rank 0


def llada2_commit(conf: torch.Tensor, masked: torch.Tensor, tau: float, n: torch.Tensor) -> torch.Tensor:
    """LLaDA2's official rule: the masked positions with conf > tau when at least n[b] pass, else the n[b] most
    confident (every passing one among them). [B, W], n [B] -> [B, W]."""
    c = masked_score(conf, masked)
    return masked & ((c > tau) | (rank_desc(c) < n[:, None]))


def factor_commit(conf: torch.Tensor, masked: torch.Tensor, f: float) -> torch.Tensor:
    """Largest n with (n + 1)(1 - c_(n)) < f over the sorted confidences; at least one."""
    c = masked_score(conf, masked)
    srt = c.sort(-1, descending=True).values  # [B, W]
    n = torch.arange(1, c.shape[-1] + 1, device=c.device)
    ok = (n + 1) * (1 - srt) < f
    ok[:, 0] = True
    count = ok.long().cumprod(-1).sum(-1)  # [B]
    return masked & (rank_desc(c) < count[:, None])


@dataclass(frozen=True)
class Threshold(Editable):
    """Commit masked tokens whose confidence >= tau (at least the top-1); block ends with no masks
    (with ``edit``: LLaDA2.1's joint threshold decoding, ``editing.py``).

    ``schedule``: ``fast_dllm`` (the above; with ``edit``, SGLang's ``JointThreshold`` loop) or ``llada2`` (LLaDA2's
    official ``generate``): confidence > tau, and when fewer than n pass the n most confident, n being the block
    length split over the block's steps (LLaDA2.0; with ``edit``: 1, LLaDA2.1's ``num_to_transfer``); with ``edit``
    a block also ends without a further forward once its post-edit budget is spent (``docs/llada2.md``)."""

    name: ClassVar[str] = "threshold"
    tau: float = 0.9
    schedule: str = "fast_dllm"

    def __post_init__(self):
        super().__post_init__()
        check_range(self.tau, 0.0, 1.0, "--sampler threshold.tau")
        check_choice(self.schedule, THRESHOLD_SCHEDULES, "--sampler threshold.schedule")

    def ends_at_budget(self) -> bool:
        return self.schedule == "llada2"

    def n_transfer(self, st: dict) -> torch.Tensor:
        """llada2's fallback count at this step: [B]."""
        if self.edit is not None:
            return torch.ones_like(st["i"])
        return llada2_count(st["i"], st["L"], st["steps"])

    def select(self, conf, masked, st, lo):
        if self.schedule == "llada2":
            return llada2_commit(conf, masked, self.tau, self.n_transfer(st))
        return threshold_commit(conf, masked, self.tau)


@dataclass(frozen=True)
class Factor(Editable):
    """Fast-dLLM factor rule with factor f (default 1.0)."""

    name: ClassVar[str] = "factor"
    f: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        check_min(self.f, 0, "--sampler factor.f", strict=True)

    def select(self, conf, masked, st, lo):
        return factor_commit(conf, masked, self.f)
