"""Fast-dLLM block-wise approximate KV caches: ``prefix`` and ``dual`` (DualCache).

At a refresh step (a new block, a new SlowFast span, or every ``every`` steps) one full forward
fills static K/V buffers for every position. Other steps run only
``prefix``: [window start, T) - the block and the masked suffix - against the cached prefix K/V;
``dual``:   the window itself against cached prefix *and* suffix K/V.
``every=1`` refreshes at each step: the exact mode (identical to ``none``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import CachePolicy, kv_buffers, nbytes
from ..models.layers import Block


@dataclass(frozen=True)
class PrefixCache(CachePolicy):
    """Fast-dLLM prefix KV cache. ``every``: also refresh after this many steps (0 = never)."""

    name: ClassVar[str] = "prefix"
    every: int = 0

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"--cache {self.name}.every must be >= 0 (0 = refresh only per block), got {self.every}")

    def begin(self, model, canvas):
        super().begin(model, canvas)
        object.__setattr__(self, "_buf_kv", kv_buffers(model, canvas.pos.shape[0], canvas.seq_len, canvas.pos.device))
        object.__setattr__(self, "_key", None)
        object.__setattr__(self, "_age", 0)
        self.counters.cache_bytes = nbytes(self._buf_kv)

    def span(self, lo: int, fresh: tuple[int, int]) -> tuple[int, int]:
        return min(lo, fresh[0]), self.canvas.seq_len

    def hidden(self, model, x, need, fresh):
        refresh = self._key != fresh or (self.every and self._age >= self.every)
        object.__setattr__(self, "_key", fresh)
        object.__setattr__(self, "_age", 1 if refresh else self._age + 1)
        a, b = (0, self.canvas.seq_len) if refresh else self.span(need[0], fresh)
        b = max(b, need[1])
        cv = self.canvas
        h, rope = model.embed(x[:, a:b]), model.rope(cv.pos[:, a:b])
        layer: Block
        for layer, kv in zip(model.layers, self._buf_kv):
            h = layer(h, rope, cv.mask, kv=kv, at=a)
        self._count(model, b - a)
        return h[:, need[0] - a:need[1] - a]


@dataclass(frozen=True)
class DualCache(PrefixCache):
    """Fast-dLLM DualCache: only the window is recomputed; prefix and suffix K/V are cached."""

    name: ClassVar[str] = "dual"

    def span(self, lo, fresh):
        return min(lo, fresh[0]), fresh[1]
