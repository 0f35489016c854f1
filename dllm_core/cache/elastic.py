"""Elastic-Cache-style adaptive refresh (arXiv 2510.14973), policy ``elastic``: WHEN to refresh decided by an
attention-aware drift test on the most-attended token, WHERE by depth (recompute from the failing layer onward).

Per request row the state keeps, for every layer, the K/V of every position and the layer's input hidden states.
A step runs its *query rows* through every layer against those caches (Fast-dLLM's dual cache without the refresh
at each block): the row's fresh range (its block, or SlowFast span), the positions whose token changed since the
cache last saw them (the previous step's commits: their K/V are then computed from the committed token, once), and
``window`` more masked positions after the range. Every other position - the prompt, committed tokens, the masked
suffix outside the window - is read from the cache.

The drift test, per layer l < L - 1 and row, against the layer's state when it was last fresh. At a refresh of
layer l the *anchor* becomes the key left of the row's fresh range (the prompt or a committed token) that the
*probe rows* (response columns that are multiples of ``probe``) attend to most, over heads and rows, and their
weights to it are kept as the reference. At a later step the probe rows among the query rows whose token has not
changed since (still masked) attend to the anchor again; the cosine similarity of those weights (over heads and
rows) with the reference falls as the context moved on since the layer was fresh - the most-attended token moves
least, so a similarity below ``gamma`` says the cache has drifted. From the first failing layer l on the row
refreshes: layer l runs every position against its cached K/V (the shallow cache is reused; this state becomes
the layer's reference) to give layer l + 1 fresh inputs, and layers l + 1 .. L - 1 recompute every position's K/V,
attention and FFN. Layers before the first failing test are not refreshed (their drift is smallest; layer 0's K/V
depend on each position's token alone, so they are always exact). Rows decide alone: a batched row equals its run
alone.

Differences from the paper's procedure (not public code): the test compares with the layer's last refresh, not
the previous step (slow drift adds up; a consecutive-step test let the counting answers go stale on the shipped
model), the anchor is looked for among the prompt and committed tokens, and only every ``probe``-th response row
takes part (the weights are computed explicitly; the step's attention itself is SDPA).

``every``: also refresh every layer of every position after this many steps (0 = only by the drift test).
Exact modes: ``gamma=1`` (the test always fails: every step a full refresh) or ``every=1``; both equal ``none``
token for token (a full refresh is the uncached forward).

Served by the embedded engine. Not by the paged hosts (``HOST_GAP``): the test reads each layer's attention
weights of the step's query rows mid-forward and changes what the next layers recompute, while the host contract
fixes a step's ``HostPlan`` before the forward and ``LayerOps.attend`` returns only the attention output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import CachePolicy, CacheState, kv_buffers, nbytes
from ..options import check_min, check_range

HOST_GAP = ("its drift test reads each layer's attention weights over the request's keys during the forward and "
            "switches the following layers to recompute every position; a HostPlan is fixed before the forward and "
            "LayerOps.attend returns the attention output only")


class ElasticState(CacheState):
    """K/V [B, Hkv, T, D] and layer inputs [B, T, d] of every layer, the tokens the cache saw, and per layer the
    drift test's anchor and reference: the probe rows' attention weights to the anchor when the layer was fresh."""

    def __init__(self, policy, model, canvas):
        super().__init__(policy, model, canvas)
        a, (B, T), dev = model.args, canvas.pos.shape, canvas.pos.device
        n = a.n_layers
        self.kv = kv_buffers(model, B, T, dev)
        self.hs = [torch.zeros(B, T, a.dim, dtype=model.dtype, device=dev) for _ in range(n)]
        self.ids = torch.full((B, T), -1, dtype=torch.long, device=dev)   # tokens the cache was computed from
        self.ready = torch.zeros(B, dtype=torch.bool, device=dev)
        self.age = torch.zeros(B, dtype=torch.long, device=dev)
        self.anchor = torch.zeros(n, B, dtype=torch.long, device=dev)
        self.ref = torch.zeros(n, B, a.n_heads, T, dtype=torch.float32, device=dev)  # weights to the anchor
        self.has_ref = torch.zeros(n, B, T, dtype=torch.bool, device=dev)  # ... taken with the row's token now
        cols = torch.arange(canvas.prompt_len, T, device=dev)
        self.probes = cols[cols % policy.probe == 0]  # the response rows the test reads (absolute columns)
        self.refreshes = torch.zeros(n + 1, dtype=torch.long)  # row refreshes by first layer (n: none)
        self.rope_all = model.rope(canvas.pos)  # cos, sin [B, T, D]: every step slices its query rows
        self.bias = None if canvas.mask is None else \
            torch.zeros(canvas.mask.shape, dtype=model.dtype, device=dev).masked_fill(~canvas.mask, float("-inf"))
        self.counters.cache_bytes = nbytes(self.kv) + nbytes(self.hs) + self.ref.nbytes

    def end(self) -> None:
        refreshes = self.refreshes
        super().end()
        self.refreshes = refreshes  # readable after the generation, like the counters

    def hidden(self, x, need, fresh, active=None):
        pol = self.policy
        (B, T), dev = x.shape, x.device
        active = torch.ones(B, dtype=torch.bool, device=dev) if active is None else active
        col = torch.arange(T, device=dev)
        changed = (x != self.ids) & active[:, None]
        self.has_ref &= ~changed  # a row whose token changed queries differently: no reference
        lo = torch.minimum(fresh[:, 0], torch.where(changed, col, T).min(-1).values)
        hi = torch.maximum((fresh[:, 1] + pol.window).clamp(max=T), torch.where(changed, col + 1, 0).max(-1).values)
        full = active & (~self.ready | ((pol.every > 0) & (self.age + 1 >= pol.every)) | (pol.gamma >= 1))
        a_t = lo.masked_fill(~active, T).min().clamp(max=need[0])
        b_t = hi.masked_fill(~active, 0).max().clamp(min=need[1])
        a, b, *flags = torch.cat([torch.stack([a_t, b_t]), full, active]).tolist()  # the step's one sync
        self.age = torch.where(full, 0, self.age + active.long())
        full, act = flags[:B], flags[B:]
        p = torch.arange(a, b, device=dev)
        keep = active[:, None] & (p >= lo[:, None]) & (p < hi[:, None])  # [B, n] each row's own query rows
        R = [r for r in range(B) if act[r] and full[r]]  # rows refreshing every position from layer 0
        C = [r for r in range(B) if act[r] and not full[r]]
        self.refreshes[0] += len(R)
        out = self._layers(x, a, b, keep, fresh[:, 0], R, C)
        self.ids[:, a:b] = torch.where(keep, x[:, a:b], self.ids[:, a:b])
        if R:
            self.ids[R] = x[R]
        self.ready |= active
        return out[:, need[0] - a:need[1] - a]

    def _layers(self, x, a: int, b: int, keep, start, R: list[int], C: list[int]) -> torch.Tensor:
        """Every layer over the query rows [a, b) (rows ``C``) or every position (rows ``R``, and the rows whose
        drift test fails on the way) -> final hidden states [B, b - a, d] of the query rows. ``start`` [B]: each
        row's fresh range start (the anchor is a key left of it: the prompt or a committed token)."""
        m, pol = self.model, self.policy
        (B, T), n, dev = x.shape, b - a, x.device
        L = len(m.layers)
        qp = self.probes[(self.probes >= a) & (self.probes < b)]  # this step's probe rows (absolute columns)
        rope = self.rope_all
        rope_q = tuple(t[:, a:b] for t in rope)
        h = m.embed(x[:, a:b])                        # [B, n, d] query rows
        HR = m.embed(x[R]) if R else None             # [r, T, d] refreshing rows, every position
        work = len(R) * T + len(C) * n
        for i, layer in enumerate(m.layers):
            K, V = self.kv[i]
            tested = pol.gamma > 0 and i < L - 1  # the last layer has no later layer to refresh
            if R:
                idx = _index(R, B, dev)
                self.hs[i][idx] = HR
                q, k, v = layer.qkv(HR, tuple(t[idx] for t in rope))
                K[idx], V[idx] = k, v
                if tested:
                    self._reference(i, R, idx, q, k, start)
                HR = HR + layer.attend(q, k, v, self._mask(idx))
                HR = HR + layer.ffn(HR)
                h[idx] = HR[:, a:b]
            if C:
                idx = _index(C, B, dev)
                hq, kp = h[idx], keep[idx]
                q, k, v = layer.qkv(hq, tuple(t[idx] for t in rope_q))
                wk = kp[:, None, :, None]
                K[idx, :, a:b] = torch.where(wk, k, K[idx, :, a:b])
                V[idx, :, a:b] = torch.where(wk, v, V[idx, :, a:b])
                self.hs[i][idx, a:b] = torch.where(kp[..., None], hq, self.hs[i][idx, a:b])
                Kc, Vc = (K, V) if isinstance(idx, slice) else (K[idx], V[idx])
                hq = hq + layer.attend(q, Kc, Vc, self._mask(idx))
                h[idx] = hq + layer.ffn(hq)
                fail = self._drift(i, idx, q[:, :, qp - a], Kc, qp, kp[:, qp - a]) if tested and qp.numel() else None
                F = [r for r, f in zip(C, fail.tolist()) if f] if fail is not None else []
                if F:  # layer i over every position of the failing rows: the next layers' fresh inputs
                    fdx = torch.tensor(F, device=dev)
                    hin = self.hs[i][fdx]
                    qf = layer.qkv(hin, tuple(t[fdx] for t in rope))[0]
                    self._reference(i, F, fdx, qf, K[fdx], start)  # this layer's cache is accepted as it is
                    hf = hin + layer.attend(qf, K[fdx], V[fdx], self._mask(fdx))
                    hf = hf + layer.ffn(hf)
                    merged = R + F
                    R, C = sorted(merged), [r for r in C if r not in F]  # rows stay in batch order
                    HR = hf if HR is None else torch.cat([HR, hf])[[merged.index(r) for r in R]]
                    work += (T - n) * len(F)
                    self.refreshes[i + 1] += len(F)
            if i < L - 1:
                work += len(R) * T + len(C) * n
        c = self.counters
        c.forwards += 1
        c.token_layers += round(work / B)
        c.full_token_layers += T * L
        self.refreshes[L] += len(C)
        return h

    def _mask(self, idx):
        return None if self.canvas.mask is None else self.canvas.mask[idx]

    def _bias(self, idx):
        return None if self.bias is None else self.bias[idx]

    def _reference(self, i: int, rows: list[int], idx, q: torch.Tensor, k: torch.Tensor, start) -> None:
        """Layer ``i`` of ``rows`` is fresh: its anchor (the key left of the row's fresh range that the probe rows
        attend to most, over heads and rows) and the probe rows' weights to it become the reference.
        q [r, H, T, D] of every position, k [r, Hkv, T, D]."""
        w = _weights(q[:, :, self.probes], k, self._bias(idx)).float()   # [r, H, np, T]
        mass = w.sum((1, 2))                                              # [r, T]
        left = torch.arange(mass.shape[-1], device=mass.device) < start[idx][:, None]
        anchor = mass.masked_fill(~left, -1).argmax(-1)                   # [r]
        ridx = torch.tensor(rows, device=mass.device)
        self.anchor[i, ridx] = anchor
        got = w.gather(-1, anchor[:, None, None, None].expand(*w.shape[:3], 1))[..., 0]  # [r, H, np]
        ref = self.ref[i, ridx]
        ref[:, :, self.probes] = got
        self.ref[i, ridx] = ref
        has = self.has_ref[i, ridx]
        has[:, self.probes] = True
        self.has_ref[i, ridx] = has

    def _drift(self, i: int, idx, q: torch.Tensor, k: torch.Tensor, cols: torch.Tensor, kp: torch.Tensor):
        """[c] bool: rows ``idx`` whose probe rows (q [c, H, np, D] at columns ``cols``; ``kp`` their own) attend to
        the anchor unlike when the layer was fresh (cosine over heads and rows < gamma)."""
        anchor = self.anchor[i, idx]                                      # [c]
        w = _weights(q, k, self._bias(idx)).float()                       # [c, H, np, T]
        cur = w.gather(-1, anchor[:, None, None, None].expand(*w.shape[:3], 1))[..., 0]  # [c, H, np]
        ok = (self.has_ref[i, idx][:, cols] & kp)[:, None, :]
        cur, old = cur * ok, self.ref[i, idx][:, :, cols] * ok
        sim = (cur * old).sum((1, 2)) / (cur.norm(dim=(1, 2)) * old.norm(dim=(1, 2))).clamp_min(1e-12)
        return ok.any(-1)[:, 0] & (sim < self.policy.gamma)


def _index(rows: list[int], B: int, dev):
    """Rows of the batch (ascending) as an index: all of them as a slice (views, no copies)."""
    return slice(None) if rows == list(range(B)) else torch.tensor(rows, device=dev)


def _weights(q: torch.Tensor, k: torch.Tensor, bias) -> torch.Tensor:
    """Attention probabilities q [r, H, n, D] over k [r, Hkv, T, D] (SDPA's scale, GQA; ``bias`` [r, 1, 1, T]:
    0 or -inf per key) -> [r, H, n, T]."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    return (s if bias is None else s + bias).softmax(-1)


@dataclass(frozen=True)
class ElasticCache(CachePolicy):
    """Elastic-Cache-style adaptive refresh (see the module docstring). ``gamma``: the drift test's cosine
    similarity threshold (a layer whose test gives less refreshes from there; 1 = every step, every layer: exact;
    0 = never); ``window``: masked positions after the fresh range recomputed with it (Elastic-Cache's sliding
    window: MASK positions outside it are cached); ``every``: a full refresh after this many steps (0 = only by the
    test; 1 = exact); ``probe``: every probe-th response column takes part in the test."""

    name: ClassVar[str] = "elastic"
    state_cls: ClassVar[type[CacheState]] = ElasticState
    refreshes_prefix: ClassVar[bool] = True
    host_gap: ClassVar[str] = HOST_GAP
    gamma: float = 0.9
    window: int = 32
    every: int = 0
    probe: int = 4

    def __post_init__(self):
        check_range(self.gamma, 0.0, 1.0, "--cache elastic.gamma")
        check_min(self.window, 0, "--cache elastic.window")
        check_min(self.every, 0, "--cache elastic.every", note=" (0 = refresh only by the drift test)")
        check_min(self.probe, 1, "--cache elastic.probe")
