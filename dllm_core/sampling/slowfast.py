"""SlowFast sampling: alternate an exploratory slow stage and an accelerated fast stage per block."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import NEG, Sampler, masked_score, rank_desc
from ..options import check_choice, check_min, check_range


@dataclass(frozen=True)
class SlowFast(Sampler):
    """Paper defaults: min_conf 0.1, high 0.85, K 8, W_hist 2, var 1.0 (the public code uses 0.3,
    0.9, 6 and a standard-deviation test: ``stat=std``). ``fallback=mean`` uses the history's mean
    as span end after K slow steps; ``fallback=extreme`` keeps decoding slowly."""

    name: ClassVar[str] = "slowfast"
    moves_focus: ClassVar[bool] = True
    min_conf: float = 0.1
    high: float = 0.85
    k: int = 8
    w_hist: int = 2
    var: float = 1.0
    k_fast: int = 1
    stat: str = "var"
    fallback: str = "mean"
    slow_commit_high: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_range(self.min_conf, 0.0, 1.0, "--sampler slowfast.min_conf")
        check_range(self.high, 0.0, 1.0, "--sampler slowfast.high")
        for n in ("k", "w_hist", "k_fast"):
            check_min(getattr(self, n), 1, f"--sampler slowfast.{n}")
        check_min(self.var, 0, "--sampler slowfast.var")
        check_choice(self.stat, ("var", "std"), "--sampler slowfast.stat")
        check_choice(self.fallback, ("mean", "extreme"), "--sampler slowfast.fallback")

    def new_state(self, batch, block_len, steps, device):
        st = super().new_state(batch, block_len, steps, device)
        z = torch.zeros(batch, dtype=torch.long, device=device)
        st.update(fast=torch.zeros(batch, dtype=torch.bool, device=device), n_slow=z.clone(), n_hist=z.clone(),
                  hist=torch.zeros(batch, self.w_hist, device=device), start=z.clone(), end=z.clone())
        return st

    def begin_block(self, st, masked):
        super().begin_block(st, masked)
        self._to_slow(st, torch.ones_like(st["fast"]))

    @staticmethod
    def _to_slow(st, rows):
        st["fast"] &= ~rows
        st["n_slow"].masked_fill_(rows, 0)
        st["n_hist"].masked_fill_(rows, 0)

    def focus(self, st):
        """Fast rows look at their span only; slow rows at the whole block."""
        fast = st["fast"]
        return torch.where(fast, st["start"], 0), torch.where(fast, st["end"], st["L"])

    def window(self, st, active):
        lo, hi = self.focus(st)
        big = st["L"] + 1
        lo, hi = torch.stack([lo.masked_fill(~active, big).min(), -hi.masked_fill(~active, -1).max()]).tolist()
        return (0, st["L"]) if lo == big else (lo, -hi)

    def select(self, conf, masked, st, lo):
        pos = lo + torch.arange(conf.shape[-1], device=conf.device)  # [W] block-relative
        c = masked_score(conf, masked)
        fast = st["fast"][:, None]
        # slow: the top-1 (and optionally everything >= high)
        slow_commit = masked & ((rank_desc(c) == 0) | (self.slow_commit_high & (c >= self.high)))
        # fast: inside [start, end) everything >= high, else the top-k_fast of the span
        span = masked & (pos >= st["start"][:, None]) & (pos < st["end"][:, None])
        cs = c.masked_fill(~span, NEG)
        hi = span & (cs >= self.high)
        fast_commit = torch.where(hi.any(-1, keepdim=True), hi, span & (rank_desc(cs) < self.k_fast))
        commit = torch.where(fast, fast_commit, slow_commit)
        self._advance(st, c, masked, commit, pos)
        return commit

    def _advance(self, st, c, masked, commit, pos):
        left = masked & ~commit
        # slow rows: span-end estimate = 1 + farthest masked position with conf >= min_conf
        cand = torch.where(masked & (c >= self.min_conf), pos + 1, 0).amax(-1)
        cursor = torch.where(left, pos, st["L"]).amin(-1)  # first still-masked position
        slow = ~st["fast"]
        est = torch.where(cand > 0, cand, cursor + 1).float()
        st["hist"] = torch.where(slow[:, None], torch.cat([st["hist"][:, 1:], est[:, None]], 1), st["hist"])
        st["n_hist"] += slow.long()
        st["n_slow"] += slow.long()
        spread = st["hist"].var(-1, unbiased=False)
        spread = spread.sqrt() if self.stat == "std" else spread
        stable = (st["n_hist"] >= self.w_hist) & (spread < self.var)
        fallback = (st["n_slow"] >= self.k) & (self.fallback == "mean")
        go = slow & (stable | fallback) & left.any(-1)
        end = st["hist"].mean(-1).round().long().clamp(max=st["L"])
        st["start"] = torch.where(go, cursor, st["start"])
        st["end"] = torch.where(go, torch.maximum(end, cursor + 1), st["end"])
        # fast rows whose span has no masks left return to the slow stage
        span_left = (left & (pos >= st["start"][:, None]) & (pos < st["end"][:, None])).any(-1)
        done = st["fast"] & ~span_left
        st["fast"] |= go
        self._to_slow(st, done)
