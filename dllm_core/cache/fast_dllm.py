"""Fast-dLLM block-wise approximate KV caches: ``prefix`` and ``dual`` (DualCache).

At a refresh step (a new block, a new SlowFast span, or every ``every`` steps) one full forward
fills static K/V buffers for every position. Other steps recompute only
``prefix``: [window start, T) - the block and the masked suffix - against the cached prefix K/V;
``dual``:   the window itself against cached prefix *and* suffix K/V.
``every=1`` refreshes at each step: the exact mode (identical to ``none``).
On a block-causal model (LLaDA2) both are exact: no position sees a later block, so the K/V of finished
blocks are final; a refresh then recomputes only from the start of the block of each row's previous range
(the block just finished), the rest of its prefix K/V staying as written (a paged prefix cache); a SlowFast
span recomputes its whole block (its positions see each other), and nothing after a row's window is
computed (no position reads it): ``prefix`` and ``dual`` are then the same policy. The block-causal
canvas puts block starts at multiples of the block length.
On CUDA each (batch, window) shape runs as a replayed CUDA graph (``graphs=false`` for eager); K/V
are written through position indices, so one graph serves every block offset.

Rows of a batch keep their own windows and refresh times: the step computes the union of the
rows' ranges, but each row writes fresh K/V only inside its own range, so a row's output never
depends on its neighbours.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import CachePolicy, CacheState, kv_buffers, nbytes
from .host import HostPart, HostPlan, HostRequest, HostStep
from .graphs import GraphRunner
from ..options import check_min


class PrefixState(CacheState):
    """Static K/V buffers for every position + per-row refresh keys (the range each row's K/V are
    fresh for) and ages."""

    def __init__(self, policy, model, canvas):
        super().__init__(policy, model, canvas)
        B, dev = canvas.pos.shape[0], canvas.pos.device
        self.kv = kv_buffers(model, B, canvas.seq_len, dev)
        self.key = torch.full((B, 2), -1, dtype=torch.long, device=dev)
        self.age = torch.zeros(B, dtype=torch.long, device=dev)
        self._window_run = GraphRunner(self._window, self.use_graphs)
        self.counters.cache_bytes = nbytes(self.kv)

    def hidden(self, x, need, fresh, active=None):
        T = self.canvas.seq_len
        active = torch.ones_like(self.age, dtype=torch.bool) if active is None else active
        bc, bl = self.canvas.block_causal, self.canvas.block_len
        if bc:  # a block's positions see each other: a SlowFast span recomputes its whole block
            fresh = torch.stack([fresh[:, 0].div(bl, rounding_mode="floor") * bl, fresh[:, 1]], -1)
        final = self.key[:, 0].clamp_min(0).div(bl, rounding_mode="floor") * bl  # bc: K/V before it are final
        refresh = self.policy.refresh(self.key, self.age, fresh, active)
        lo, hi = fresh[:, 0], fresh[:, 1] if bc else self.policy.row_end(fresh, T)
        a_t = lo.masked_fill(~active, T).min().clamp(max=need[0])  # union of the rows' ranges and `need`
        b_t = hi.masked_fill(~active, 0).max().clamp(min=need[1])
        covered = (active & (lo <= a_t) & (hi >= b_t)).all()  # all rows write all of [a, b)
        paged = final.masked_fill(~(active & refresh), T).min() if bc else a_t * 0
        any_refresh, a, b, all_refresh, all_cover, a_ref = torch.stack(
            [refresh.any(), a_t, b_t, (active & refresh).all(), covered, paged]).tolist()  # the step's one device sync
        if any_refresh:  # block-causal: nothing after the window is ever read
            a, b = min(a_ref, a), b if bc else T
        p = torch.arange(a, b, device=x.device).expand(x.shape[0], -1)  # [B, n] absolute positions
        keep = active[:, None] & (refresh[:, None] | ((p >= lo[:, None]) & (p < hi[:, None])))  # [B, n]
        whole = all_refresh if any_refresh else all_cover  # every row writes all of [a, b)
        if whole and not self.use_graphs:
            at, keep = a, None  # eager: a slice write, no scatter
        else:
            at, keep = p, torch.ones_like(keep) if whole else keep
        h = self._window_run(x[:, a:b], self.canvas.pos[:, a:b], at, keep, self.canvas.attn(a, b))
        self._count(b - a)
        return h[:, need[0] - a:need[1] - a]

    def _window(self, ids, pos, at, keep, mask):
        """ids/pos/keep [B, n], ``at`` [B, n] or the window's start, mask [B, 1, 1|n, T] -> hidden [B, n, d]; K/V
        written at ``at`` where ``keep`` (None: everywhere)."""
        m = self.model
        h, rope = m.embed(ids), m.rope(pos)
        for layer, kv in zip(m.layers, self.kv):
            h = layer(h, rope, mask, kv=kv, at=at, keep=keep)
        return h


@dataclass(frozen=True)
class PrefixCache(CachePolicy):
    """Fast-dLLM prefix KV cache. ``every``: also refresh after this many steps (0 = never)."""

    name: ClassVar[str] = "prefix"
    state_cls: ClassVar[type[CacheState]] = PrefixState
    dual: ClassVar[bool] = False
    refreshes_prefix: ClassVar[bool] = True
    every: int = 0

    def __post_init__(self):
        check_min(self.every, 0, f"--cache {self.name}.every", note=" (0 = refresh only per block)")

    def refresh(self, key: torch.Tensor, age: torch.Tensor, fresh: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """The refresh rule, per row: a new fresh range or ``every`` steps since the last refresh.
        key [B, 2] (last fresh range) and age [B] are updated in place; fresh [B, 2]; -> [B] bool."""
        refresh = active & ((fresh != key).any(-1) | ((self.every > 0) & (age >= self.every)))
        key.copy_(torch.where(active[:, None], fresh, key))
        age.copy_(torch.where(refresh, 1, age + 1))
        return refresh

    def row_end(self, fresh: torch.Tensor, seq_len: int) -> torch.Tensor:
        """End of each row's recomputed range between refreshes: the window end (dual) or the
        sequence end (prefix). fresh [B, 2] -> [B]."""
        return fresh[:, 1] if self.dual else torch.full_like(fresh[:, 1], seq_len)

    def host_plan(self, req: HostRequest, step: HostStep) -> HostPlan:
        """One request's step on a paged host: the embedded loop's fresh range -> ``refresh`` (the request's
        key / age updated in place) -> ``host_rows``: prefix positions from ``a`` and the canvas window
        recomputed in every layer, the rest of the canvas from its stored features."""
        lo, hi = step.fresh
        refresh = bool(self.refresh(req.key, req.age, torch.tensor([[lo, hi]]), torch.ones(1, dtype=torch.bool)))
        a, c0, c1 = self.host_rows(refresh, lo, hi, step.prefix, step.width)
        return HostPlan(a, [HostPart("response", step.prefix, step.end, always=(c0, c1))])

    def host_rows(self, refresh: bool, lo: int, hi: int, prefix: int, canvas: int) -> tuple[int, int, int]:
        """A paged host's share of one row's step, its canvas being positions [prefix, prefix + canvas)
        of the sequence and [lo, hi) its fresh range: -> (first prefix position recomputed - prefix when
        none, canvas columns [c0, c1) recomputed). A refresh recomputes everything from position 0."""
        if refresh:
            return 0, 0, canvas
        end = hi if self.dual else prefix + canvas
        return min(lo, prefix), max(lo - prefix, 0), end - prefix


@dataclass(frozen=True)
class DualCache(PrefixCache):
    """Fast-dLLM DualCache: only the window is recomputed; prefix and suffix K/V are cached."""

    name: ClassVar[str] = "dual"
    dual: ClassVar[bool] = True
