"""Transformer pieces shared by LLaDA and Dream, split so a cache policy can drive one layer.

A layer is exposed as four steps a cache policy composes::

    q, k, v = layer.qkv(x, rope)          # x [B, n, d] -> q [B, H, n, D], k/v [B, Hkv, n, D]
    attn    = layer.attend(q, K, V, mask) # K/V [B, Hkv, T, D] (fresh or cached) -> [B, n, d]
    ffn     = layer.ffn(x + attn)         # -> [B, n, d]
    out     = x + attn + ffn

``layer.value(x)`` is the cheap V-only projection used by dLLM-Cache's V-verify.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [B, n, D]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """Non-interleaved (half-split) RoPE; cos/sin are built per call from position ids."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> Rope:
        ang = pos.float()[..., None] * self.inv_freq  # [B, n, D/2]
        ang = torch.cat([ang, ang], -1)  # [B, n, D]
        return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    cos, sin = (t[:, None] for t in rope)  # [B, 1, n, D]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Block(nn.Module):
    """Pre-norm block: bidirectional SDPA attention + SwiGLU MLP."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.q_proj = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.gate_proj = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.up_proj = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.down_proj = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        return t.unflatten(-1, (n, self.head_dim)).transpose(1, 2)  # [B, h, n, D]

    def qkv(self, x: torch.Tensor, rope: Rope):
        """x [B, n, d] -> q [B, H, n, D], k [B, Hkv, n, D], v [B, Hkv, n, D] (RoPE applied)."""
        h = self.attn_norm(x)
        q = apply_rope(self._heads(self.q_proj(h), self.n_heads), rope)
        k = apply_rope(self._heads(self.k_proj(h), self.n_kv), rope)
        return q, k, self._heads(self.v_proj(h), self.n_kv)

    def value(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, n, d] -> v [B, Hkv, n, D]."""
        return self._heads(self.v_proj(self.attn_norm(x)), self.n_kv)

    def attend(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """Non-causal SDPA; mask [B, 1, 1|n, T] bool (True = may attend) -> [B, n, d]."""
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(o.transpose(1, 2).flatten(2))

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU on RMSNorm(h): [B, n, d] -> [B, n, d]."""
        h = self.ffn_norm(h)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x, rope: Rope, mask, kv=None, at=None, keep=None) -> torch.Tensor:
        """Run the layer on x [B, n, d]. With ``kv=(K, V)`` buffers [B, Hkv, T, D], the fresh
        k/v are written at ``at`` (int offset or index tensor [B, n]) - only where ``keep``
        [B, n] is True, if given - and q attends to the whole buffers (cached entries elsewhere)."""
        q, k, v = self.qkv(x, rope)
        if kv is not None:
            k, v = write_kv(kv[0], at, k, keep), write_kv(kv[1], at, v, keep)
        a = self.attend(q, k, v, mask)
        h = x + a
        return h + self.ffn(h)


def write_kv(buf: torch.Tensor, at, new: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Write new [B, h, n, D] into buf [B, h, T, D] at offset ``at`` or per-row indices [B, n];
    with ``keep`` [B, n] only the True entries are written (others keep the cached value)."""
    if isinstance(at, int):
        old = buf[:, :, at:at + new.shape[2]]
        old.copy_(new if keep is None else torch.where(keep[:, None, :, None], new, old))
        return buf
    idx = at[:, None, :, None].expand_as(new)
    if keep is not None:
        new = torch.where(keep[:, None, :, None], new, buf.gather(2, idx))
    return buf.scatter_(2, idx, new)


class BlockOps:
    """The embedded ``Block`` as the cache executor's ``LayerOps`` over flat rows of a batch of B
    rows x S positions (row r = b * S + s). ``attend`` prepends the cached prefix K/V ``prefix``
    ([B, Hkv, P, D] each, optional: the canvas policy's frozen prefix) to every row's keys and
    applies ``mask`` [B, 1, 1, P + S]. ``per_row``: each row recomputes exactly this many positions
    (queries then run as [B, per_row]); None: any subset (all S queries run, the asked ones kept; ``ragged``: each
    row's own queries, padded per group of rows (``_ragged``) - a key mask [B, 1, 1, P + S] only)."""

    def __init__(self, layer: Block, rope: RotaryEmbedding, B: int, mask, prefix=None, per_row: int | None = None,
                 ragged: bool = False):
        self.layer, self.rope, self.B, self.mask, self.prefix, self.per_row = layer, rope, B, mask, prefix, per_row
        self.ragged = ragged and (mask is None or mask.shape[2] == 1)
        self.heads = (layer.n_heads, layer.n_kv, layer.head_dim)  # (Hq, Hkv, D)

    def qkv(self, x, pos):
        q, k, v = self.layer.qkv(x[None], self.rope(pos[None], x.dtype))  # [1, h, n, D]
        return tuple(t[0].transpose(0, 1).flatten(1) for t in (q, k, v))  # [n, h*D]

    def value(self, x):
        return self.layer.value(x[None])[0].transpose(0, 1).flatten(1)

    def ffn(self, h):
        return self.layer.ffn(h)

    def attend(self, q, k, v, rows):
        B, D = self.B, self.layer.head_dim
        k, v = (t.view(B, -1, self.layer.n_kv, D).transpose(1, 2) for t in (k, v))  # [B, Hkv, S, D]
        S = k.shape[2]
        if self.prefix is not None:
            k, v = torch.cat([self.prefix[0], k], 2), torch.cat([self.prefix[1], v], 2)
        if self.per_row is not None:  # rows are b-major with per_row each
            qh = q.view(B, self.per_row, -1, D).transpose(1, 2)
            return self.layer.attend(qh, k, v, self.mask).flatten(0, 1)
        if self.ragged:
            return self._ragged(q, k, v, torch.div(rows, S, rounding_mode="floor"))
        full = q.new_zeros(B * S, q.shape[-1]).index_copy_(0, rows, q)
        return self.layer.attend(full.view(B, S, -1, D).transpose(1, 2), k, v, self.mask).flatten(0, 1)[rows]

    def _ragged(self, q, k, v, b):
        """Each row's own queries (q [n, Hq*D] of rows ascending, b-major; ``b`` [n] their batch row), padded per
        group: rows asking more than half the positions (a full refresh) apart from the others -> [n, d]."""
        cnt = torch.bincount(b, minlength=self.B)  # [B]
        first = cnt.cumsum(0) - cnt
        n, half = cnt.tolist(), k.shape[2] // 2
        out = q.new_empty(q.shape[0], self.layer.o_proj.out_features)
        for rows in ([r for r, c in enumerate(n) if c > half], [r for r, c in enumerate(n) if 0 < c <= half]):
            if not rows:
                continue
            r = torch.tensor(rows, device=q.device)
            j = torch.arange(max(n[i] for i in rows), device=q.device)
            qmask = j < cnt[r, None]  # [m, n]
            qidx = torch.where(qmask, first[r, None] + j, 0)
            qh = q.view(-1, self.layer.n_heads, self.layer.head_dim)[qidx].transpose(1, 2)  # [m, Hq, n, D]
            mask = None if self.mask is None else self.mask[r]
            out[qidx[qmask]] = self.layer.attend(qh, k[r], v[r], mask)[qmask]
        return out


class PackedAttention:
    """Bidirectional attention over m requests laid out back to back in a forward's rows (request i: rows
    [off[i], off[i + 1]), its whole sequence): each query attends to every position of its own request (torch
    SDPA, one padded batch). A host's ``LayerOps.attend`` when it runs whole sequences outside its own kernels.
    Eager, the queries are padded to the most any request asks (one read); traced or captured (``torch.compile``,
    a CUDA graph), to the shapes alone (min(longest request, query rows)): no read. ``buckets``: the requests and
    the keys each padded to a power of two (empty requests; keys masked) and the queries to the shapes alone, so the
    shapes come from a finite set."""

    def __init__(self, off: list[int], device, buckets: bool = False):
        longest = max(b - a for a, b in zip(off, off[1:]))
        if buckets:
            off = off + off[-1:] * ((1 << (len(off) - 2).bit_length()) - len(off) + 1)
            longest = 1 << (longest - 1).bit_length()
        self.off, self.longest, self.buckets = torch.tensor(off, device=device), longest, buckets
        t = torch.arange(self.longest, device=device)
        n = self.off.diff()
        self.kmask = t < n[:, None]                                      # [m, T]
        self.kidx = torch.where(self.kmask, self.off[:-1, None] + t, 0)  # [m, T] row of each key

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, n_heads: int,
                 n_kv: int, scale: float) -> torch.Tensor:
        """q [n, Hq * D] of rows ``rows`` (ascending; a row given more than once, an executor's padding, has the
        same query each time), k / v [N, Hkv * D] of every row -> [n, Hq * D]."""
        D = q.shape[-1] // n_heads
        rid = torch.searchsorted(self.off[1:], rows, right=True)  # [n] request of each query row
        new = torch.ones_like(rows, dtype=torch.bool)
        new[1:] = rows[1:] != rows[:-1]  # [n] the first of a row's copies
        uid = new.long().cumsum(0) - 1  # [n] the distinct query each row is
        at = torch.zeros_like(rows).scatter_(0, uid, torch.arange(rows.shape[0], device=q.device))  # a copy of each
        cnt = torch.zeros_like(self.off[1:]).index_add_(0, rid, new.long())  # [m] distinct queries per request
        first = cnt.cumsum(0) - cnt
        nq = min(self.longest, q.shape[0]) if _static() or self.buckets else int(cnt.max())
        from ..cache.graphs import note  # (the cache package imports this module)

        note("attention", self.kmask.shape[0], nq, self.longest)
        j = torch.arange(nq, device=q.device)
        qidx = at[torch.where(j < cnt[:, None], first[:, None] + j, 0)]  # [m, nq]
        Q = q.view(-1, n_heads, D)[qidx].transpose(1, 2)    # [m, Hq, nq, D]
        K = k.view(-1, n_kv, D)[self.kidx].transpose(1, 2)  # [m, Hkv, T, D]
        V = v.view(-1, n_kv, D)[self.kidx].transpose(1, 2)
        o = F.scaled_dot_product_attention(Q, K, V, attn_mask=self.kmask[:, None, None, :], scale=scale,
                                           enable_gqa=n_heads != n_kv)
        col = uid - first[rid]  # [n] each query's place in its request
        return o.transpose(1, 2)[rid, col].reshape(q.shape[0], n_heads * D)


def _static() -> bool:
    """Whether shapes must not depend on data: torch.compile is tracing, or a CUDA graph is being captured."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())