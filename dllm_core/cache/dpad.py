"""DPad (Diffusion Scratchpad, arXiv 2508.14148): suffix dropout over Fast-dLLM's caches, policy ``dpad``.

The masked positions far right of the block being decoded act mostly as a length signal; DPad drops most of them
*before* the forward. For the block ending at position ``e`` the model sees

    everything left of ``e`` (prompt, committed tokens, the block)  +  the kept suffix positions in [e, e + window)

and nothing else: dropped positions are neither queries nor keys, and the kept ones keep their own RoPE positions
(the forward runs over a compact, gathered sequence). Which suffix positions are kept:

* ``decay=none``: every position of the sliding window;
* ``decay=gaussian`` (DPad's distance-decay dropout): the position at distance d in [0, window) is kept with
  probability ``min(1, scale * phi(k * d / (window - 1)))`` (phi: the standard normal density; DPad's defaults
  ``k=4`` standard deviations at the window's end, ``scale=2``, ``window=256``: 0.80 next to the block, 0.05 past
  0.65 of the window, about window / 4 kept). The draw is a fixed function of (``seed``, block index): the kept
  set is the same at every step of a block and for a row decoded alone or in a batch.
* ``tail`` (not DPad's; 0 = off): also keep the canvas's last ``tail`` positions, so the forward still sees where
  the canvas ends (a model trained on whole canvases reads the answer's length from it: on the shipped
  ``models/llada-long`` a window without it ends counting answers early).

The rest is the base cache ``cache`` over that compact sequence: ``dual`` (default; DPad + Fast-dLLM's dual cache:
between refreshes only the window is recomputed against the cached prefix and kept-suffix K/V), ``prefix`` (the
window and the kept suffix recomputed) or ``none`` (every step one forward over the compact sequence, DPad alone).
``every`` is the base cache's refresh period. Every new block is a refresh (the kept set moves with the block).

Exact mode: ``decay=none`` with a ``window`` reaching the canvas end keeps every position: the base policy itself
(``dpad:cache=dual,window=<gen_length>,decay=none`` equals ``dual``; ``cache=none`` equals ``none``), token for token.

On a host (``host_plan``): the plan's ``keep`` is the same compact sequence, its parts and columns count kept
positions (below the block's end they are the positions themselves), and the base cache's plan follows over it; the
host runs the kept positions alone, as a compact sequence (``cache.host``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from .base import Canvas, CacheState, kv_buffers, nbytes
from .fast_dllm import PrefixCache, PrefixState
from .host import HostPlan, HostRequest, HostStep
from .graphs import GraphRunner
from ..options import check_choice, check_min


class DPadState(PrefixState):
    """Fast-dLLM's prefix / dual state run over the compact sequence of each block: ``[0, e)`` + the kept suffix
    positions. Positions left of ``e`` keep their column; K/V buffers are used up to the compact length."""

    def __init__(self, policy, model, canvas):
        super().__init__(policy, model, canvas)
        self._window_run = GraphRunner(self._window, False)  # the compact length moves per block: eager
        self.full_canvas, self.kv = canvas, []  # K/V buffers are made per block, over its compact sequence
        self.counters.cache_bytes = 0
        self.layout: tuple[int, torch.Tensor, Canvas, list] | None = None  # block, columns, canvas, K/V

    def _compact(self) -> tuple[torch.Tensor, Canvas, list]:
        """The current block's kept columns [n], the compact canvas over them and its K/V buffers (made per block:
        a new block is a refresh of every row, from column 0)."""
        cv = self.full_canvas
        if self.layout is None or self.layout[0] != cv.block:
            e = cv.prompt_len + (cv.block + 1) * cv.block_len
            cols = torch.as_tensor(self.policy.kept(cv.block, e, cv.seq_len), device=cv.pos.device)
            mask = None if cv.mask is None else cv.mask[..., cols]
            self.layout = None  # the previous block's buffers go first
            kv = kv_buffers(self.model, cv.pos.shape[0], cols.shape[0], cv.pos.device)
            self.layout = (cv.block, cols, Canvas(cv.pos[:, cols], mask, cv.prompt_len, cv.block_len, cv.block), kv)
            self.counters.cache_bytes = max(self.counters.cache_bytes, nbytes(kv))
        return self.layout[1:]

    def hidden(self, x, need, fresh, active=None):
        cols, compact, kv = self._compact()
        self.canvas, self.kv = compact, kv
        try:
            return super().hidden(x[:, cols], need, fresh, active)
        finally:
            self.canvas = self.full_canvas

    def _count(self, positions: int) -> None:
        c, n = self.counters, self.model.args.n_layers
        c.forwards += 1
        c.token_layers += positions * n
        c.full_token_layers += self.full_canvas.seq_len * n  # work against `none` over the whole canvas


@dataclass(frozen=True)
class DPadCache(PrefixCache):
    """DPad suffix dropout (see the module docstring). ``cache``: none | prefix | dual (the base cache over the
    compact sequence); ``window``: suffix positions after the block that may be kept; ``decay``: none | gaussian;
    ``k``: standard deviations at the window's end; ``scale``: the keep probability's scale; ``seed``: the draw's;
    ``tail``: the canvas's last positions, always kept; ``every``: the base cache's extra refresh period (0 = per
    block)."""

    name: ClassVar[str] = "dpad"
    state_cls: ClassVar[type[CacheState]] = DPadState
    cache: str = "dual"
    window: int = 256
    decay: str = "gaussian"
    k: float = 4.0
    scale: float = 2.0
    seed: int = 0
    tail: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_choice(self.cache, ("none", "prefix", "dual"), "--cache dpad.cache")
        check_min(self.window, 0, "--cache dpad.window")
        check_choice(self.decay, ("none", "gaussian"), "--cache dpad.decay")
        check_min(self.k, 0.0, "--cache dpad.k", strict=True)
        check_min(self.scale, 0.0, "--cache dpad.scale", strict=True)
        check_min(self.tail, 0, "--cache dpad.tail")

    @property
    def dual(self) -> bool:  # PrefixCache.row_end: dual recomputes the window only
        return self.cache == "dual"

    def refresh(self, key, age, fresh, active):
        if self.cache == "none":  # DPad alone: every step one forward over the compact sequence
            return super(DPadCache, replace(self, every=1)).refresh(key, age, fresh, active)
        return super().refresh(key, age, fresh, active)

    def keep_probability(self) -> np.ndarray:
        """[window] the probability of keeping the suffix position at each distance from the block end."""
        if self.decay == "none" or self.window == 0:
            return np.ones(self.window)
        x = np.linspace(0.0, self.k, self.window)
        return np.minimum(1.0, self.scale * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))

    def kept(self, block: int, end: int, seq_len: int) -> np.ndarray:
        """The columns a forward of block ``block`` (ending at column ``end``) sees: [0, end) + the kept suffix."""
        d = np.arange(min(self.window, seq_len - end))
        if self.decay == "gaussian":
            draw = np.random.default_rng([self.seed, block]).random(self.window)[:len(d)]
            d = d[draw < self.keep_probability()[:len(d)]]
        d = end + d
        tail = np.arange(max(seq_len - self.tail, end), seq_len)
        return np.concatenate([np.arange(end), np.union1d(d, tail)])

    def host_plan(self, req: HostRequest, step: HostStep) -> HostPlan:
        """The embedded state's step on a host: the block's compact sequence (``kept``; the block counted in the
        generation, as streamed canvases continue it) as the plan's ``keep``, the base cache's rows over it (a new
        block is a refresh: its fresh range moved)."""
        if step.block < 1:
            raise ValueError(f"cache {self.name}: the host gave no block length")
        keep = self.kept((step.start - step.prompt) // step.block, step.start + step.block, step.end)  # its block
        plan = super().host_plan(req, replace(step, width=len(keep) - step.prefix))
        plan.keep = keep
        return plan
