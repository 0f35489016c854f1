"""Fast-dLLM confidence-aware parallel decoding: the threshold and factor rules (variable steps)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import masked_score, rank_desc
from .editing import Editable
from ..options import check_min, check_range


def threshold_commit(conf: torch.Tensor, masked: torch.Tensor, tau: float) -> torch.Tensor:
    """Every masked position with conf >= tau, and always the most confident one. [B, W] -> [B, W]."""
    c = masked_score(conf, masked)
    top = torch.zeros_like(masked).scatter_(-1, c.argmax(-1, keepdim=True), True)  # the first maximum: rank 0
    return masked & ((c >= tau) | top)


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
    (with ``edit``: LLaDA2.1's joint threshold decoding, ``editing.py``)."""

    name: ClassVar[str] = "threshold"
    tau: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        check_range(self.tau, 0.0, 1.0, "--sampler threshold.tau")

    def select(self, conf, masked, st, lo):
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
