"""The cache-policy interface: how the decoding loop gets hidden states for one step.

A policy is an immutable description (a frozen dataclass, shareable by any number of threads and
requests). ``begin`` returns the per-request-batch state that owns the buffers::

    cache = policy.begin(model, canvas)          # CacheState: static buffers, counters
    h = cache.hidden(x, need, fresh, active)     # every step -> [B, need_hi - need_lo, d]
    cache.end()                                  # release (counters stay readable)

``need``   = (lo, hi) ints: positions whose final hidden states the sampler's logits come from
             (already shifted one left for Dream); the union over the batch rows.
``fresh``  = [B, 2] per-row [lo, hi): the positions each row's step is about (its block or
             SlowFast span, shifted like ``need``); approximate policies keep these exact and may
             reuse cached K/V / features elsewhere. A change of a row's range is a refresh point.
``active`` = [B] bool: rows still decoding this block (others are carried along idle).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class Canvas:
    """Per-request-batch constants: positions, key mask and the prompt/response split."""

    pos: torch.Tensor           # [B, T] RoPE positions (left padding aware)
    mask: torch.Tensor | None   # [B, 1, 1, T] bool key mask (None: no padding); [B, 1, T, T] block-causal
    prompt_len: int             # response (generation region) starts here
    block_len: int
    block: int = 0              # index of the block being decoded (set by the engine)

    @property
    def seq_len(self) -> int:
        return self.pos.shape[1]

    @property
    def block_causal(self) -> bool:
        """The mask differs per query (a block-causal model): a window's queries need their own rows."""
        return self.mask is not None and self.mask.shape[2] > 1

    def attn(self, a: int, b: int) -> torch.Tensor | None:
        """The attention mask of queries at positions [a, b): [B, 1, 1|b - a, T]."""
        return self.mask[:, :, a:b] if self.block_causal else self.mask


@dataclass
class Counters:
    """Work accounting: layer evaluations of single positions, per request row."""

    forwards: int = 0
    token_layers: int = 0       # positions x layers actually run through the full layer
    v_only: int = 0             # positions x layers that only ran the V projection (dLLM-Cache)
    full_token_layers: int = 0  # what `none` would have run for the same forwards
    cache_bytes: int = 0        # peak bytes held by the policy's buffers

    def ratio(self) -> float:
        """Work relative to recomputing every position at every step (1.0 = `none`)."""
        return self.token_layers / max(self.full_token_layers, 1)


class CacheState:
    """One request batch's run of a policy: buffers, counters, step bookkeeping (policy ``none``:
    the exact, uncached forward over the whole sequence)."""

    def __init__(self, policy: "CachePolicy", model, canvas: Canvas):
        from .graphs import GraphRunner

        self.policy, self.model, self.canvas, self.counters = policy, model, canvas, Counters()
        self.use_graphs = policy.graphs and canvas.pos.device.type == "cuda"
        self._full_run = GraphRunner(self._full, self.use_graphs)

    def end(self) -> None:
        """Drop every buffer; counters stay readable."""
        keep = {"policy", "canvas", "counters"}
        for k in [k for k in vars(self) if k not in keep]:
            delattr(self, k)

    def _count(self, positions: int) -> None:
        c, n = self.counters, self.model.args.n_layers
        c.forwards += 1
        c.token_layers += positions * n
        c.full_token_layers += self.canvas.seq_len * n

    def hidden(self, x: torch.Tensor, need: tuple[int, int], fresh: torch.Tensor | None,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T] -> final hidden states [B, need_hi - need_lo, d] of the ``need`` positions."""
        self._count(self.canvas.seq_len)
        return self._full_run(x)[:, need[0]:need[1]]

    def _full(self, ids: torch.Tensor) -> torch.Tensor:
        """Uncached full-sequence pass: ids [B, T] -> hidden [B, T, d]."""
        m = self.model
        h, rope = m.embed(ids), m.rope(self.canvas.pos)
        for layer in m.layers:
            h = layer(h, rope, self.canvas.mask)
        return h


@dataclass(frozen=True)
class CachePolicy:
    """Base: the exact, uncached forward over the whole sequence (policy ``none``)."""

    name: ClassVar[str] = "none"
    state_cls: ClassVar[type[CacheState]] = CacheState
    # a paged host recomputes the prefix it holds (prompt + emitted tokens) with the masked response present, so
    # the response must be decoded as one canvas (Fast-dLLM, dLLM-Cache); False: the prefix's K/V stay frozen
    refreshes_prefix: ClassVar[bool] = False
    spans_response: ClassVar[bool] = False  # a host's features span the whole response (not only the canvas)

    @property
    def stores_features(self) -> bool:
        """Whether a host keeps the features of this policy's parts between steps."""
        return self.refreshes_prefix
    graphs: bool = True  # replay fixed-shape forwards as CUDA graphs (CUDA only)

    def begin(self, model, canvas: Canvas) -> CacheState:
        """A fresh per-request-batch state (buffers for ``canvas``'s batch and length)."""
        return self.state_cls(self, model, canvas)


def kv_buffers(model, batch: int, seq_len: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Static per-layer K/V buffers [B, Hkv, T, D]."""
    a = model.args
    shape = (batch, a.n_kv_heads, seq_len, a.head_dim)
    return [(torch.zeros(shape, dtype=model.dtype, device=device), torch.zeros(shape, dtype=model.dtype, device=device))
            for _ in range(a.n_layers)]


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    return sum(nbytes(o) for o in obj) if isinstance(obj, (list, tuple)) else 0
