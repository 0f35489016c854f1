"""dLLM-Cache inside SGLang: response-side adaptive feature caching over the current block.

SGLang keeps the committed prefix in its paged KV cache exactly, so only the block's features are
cached (the decisions - which layers are full, how many positions, which ones - are dllm_core's
``CanvasCache``: ``full_layer``, ``n_update``, ``pick``). Per layer and request in flight the
cache holds the block's K, V, attention output and FFN output. A layer that is not fully recomputed
runs V-verify: the V projection of every block position, the ``int(rho * block)`` positions
whose V moved most (cosine) get fresh Q/K, attention and FFN; the others reuse their cached
attention / FFN outputs, and their cached K (fresh V) go back into the paged cache.

The algorithm drives it: before each forward it puts the per-row denoise step into
``forward_batch.dllm_input_preparation_state`` (CPU int64 [B]; 0 = first forward of the block,
-1 = the final forward that persists the finished block: always exact). Data-dependent shapes:
incompatible with CUDA graphs (the algorithm disables them at launch).
"""
from __future__ import annotations

import torch

from dllm_core.cache.canvas import CanvasCache

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_req_to_token_pool


class FeatureCache:
    """Block features of the requests in flight; ``policy`` is set by the algorithm (None = off).

    Buffers hold one row per request whose block is in flight (not per request slot: SGLang's
    slot pool can be thousands deep). A row is bound to (slot, slot generation) at the block's
    first forward (a full refresh: nothing stale is read), released by its persisting forward,
    and reclaimed if the slot passes to another request (e.g. after an abort)."""

    def __init__(self, model):
        self.model = model
        self.policy: CanvasCache | None = None
        self.bufs: list[dict[str, torch.Tensor]] = []  # per layer: k, v [C, L, Hkv*D], a, f [C, L, d]
        self.rows: dict[int, tuple[int, int]] = {}  # slot -> (buffer row, slot generation)
        self.free: list[int] = []
        self.gen: torch.Generator | None = None

    def configure(self, policy: CanvasCache) -> None:
        """Enable with a dllm_core canvas policy (a server sets it once; a new one restarts the
        selection generator)."""
        if self.model.quant_config is not None:
            raise ValueError("dllm_cache: the V-verify projection needs unquantized weights (drop --quantization)")
        if policy != self.policy:
            self.policy, self.gen = policy, None

    def active(self, fb: ForwardBatch) -> bool:
        return (self.policy is not None and not self.policy.exact and fb.forward_mode.is_dllm_extend()
                and fb.dllm_input_preparation_state is not None)

    def _bind(self, slots: list[int], L: int, like: torch.Tensor) -> torch.Tensor:
        """Buffer rows of the batch's requests: [B] (growing the buffers when needed)."""
        if self.gen is None:
            self.gen = torch.Generator(like.device).manual_seed(self.policy.seed)
        if self.bufs and self.bufs[0]["a"].shape[1] != L:
            self.bufs, self.rows, self.free = [], {}, []
        gens = get_req_to_token_pool().req_generation[slots].tolist()
        rows = []
        for slot, g in zip(slots, gens):
            row, bound = self.rows.get(slot, (None, None))
            if row is None or bound != g:
                row = row if row is not None else self._take(L, like)
                self.rows[slot] = (row, g)
            rows.append(row)
        return torch.tensor(rows, device=like.device)

    def _take(self, L: int, like: torch.Tensor) -> int:
        if not self.free:
            old = self.bufs[0]["a"].shape[0] if self.bufs else 0
            kv = self.model.layers[0].self_attn.kv_size
            widths = {"k": kv, "v": kv, "a": like.shape[-1], "f": like.shape[-1]}
            grow = max(old, 4)
            self.bufs = [{n: torch.cat([b.get(n, like.new_zeros(0, L, w)), like.new_zeros(grow, L, w)])
                          for n, w in widths.items()} for b in (self.bufs or [{}] * len(self.model.layers))]
            self.free = list(range(old + grow - 1, old - 1, -1))
        return self.free.pop()

    def run(self, h: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The cached forward of the block tokens: embeddings h [N, d] -> final hidden [N, d]."""
        B = fb.batch_size
        L = h.shape[0] // B
        slots = fb.req_pool_indices.tolist()
        rows = self._bind(slots, L, h)
        steps = fb.dllm_input_preparation_state.tolist()  # CPU: no device sync
        for i, layer in enumerate(self.model.layers):
            full = [c < 0 or self.policy.full_layer(c, i) for c in steps]
            h = self._layer(layer, self.bufs[i], h.view(B, L, -1), positions.view(B, L), fb, rows, full).flatten(0, 1)
        for slot, c in zip(slots, steps):
            if c < 0 and slot in self.rows:  # the block is persisted: its features are dead
                self.free.append(self.rows.pop(slot)[0])
        return h

    def _layer(self, layer, buf, x, pos, fb, rows, full: list[bool]) -> torch.Tensor:
        """x, pos [B, L(, d)] -> layer output [B, L, d]; updates the batch's buffer rows [B]."""
        B, L, _ = x.shape
        att = layer.self_attn
        hn = layer.attn_norm(x.flatten(0, 1)).view(B, L, -1)
        cached = {n: b[rows] for n, b in buf.items()}  # [B, L, *] copies
        sel = torch.tensor(full, device=x.device)[:, None].expand(B, L).clone()  # recompute mask [B, L]
        if not all(full):
            new, old = self._verify(att, hn, pos, cached)
            idx = self.policy.pick(new, old, self.policy.n_update(L), self.gen)  # [B, n]
            sel |= torch.zeros_like(sel).scatter_(1, idx, True)
        flat = sel.flatten().nonzero()[:, 0]  # recomputed token rows of the batch
        if flat.numel():  # (rho = 0 on every row: all cached features are reused)
            self._recompute(layer, x, pos, hn, fb, cached, flat)
        for name, t in cached.items():
            buf[name][rows] = t
        return x + cached["a"] + cached["f"]

    @staticmethod
    def _recompute(layer, x, pos, hn, fb, cached, flat) -> None:
        """Fresh Q/K/V, attention and FFN for the token rows ``flat``; their K/V and the cached
        K/V of the other rows go into the paged cache (all block queries run: SGLang's kernels
        take the block whole; the others' outputs are dropped)."""
        att, n = layer.self_attn, x.shape[0] * x.shape[1]
        q, k, v = att.qkv(pos.flatten()[flat], hn.flatten(0, 1)[flat])
        for name, new in (("k", k), ("v", v)):
            cached[name].view(n, -1)[flat] = new
        q_all = q.new_zeros(n, q.shape[-1]).index_copy_(0, flat, q)
        o = att.attn(q_all, cached["k"].flatten(0, 1), cached["v"].flatten(0, 1), fb)
        a, _ = att.o_proj(o.view(n, -1)[flat])
        f = layer.ffn(x.flatten(0, 1)[flat] + a)
        for name, new in (("a", a), ("f", f)):
            cached[name].view(n, -1)[flat] = new

    def _verify(self, att, hn, pos, cached):
        """(new, old) features the pick compares, [B, L, F]; V-verify refreshes every V."""
        sel = self.policy.select
        if sel == "value":
            new = att.value(hn.flatten(0, 1)).view_as(cached["v"])
            old, cached["v"] = cached["v"], new.clone()
            return new, old
        if sel == "key":
            _, k, _ = att.qkv(pos.flatten(), hn.flatten(0, 1))
            return k.view_as(cached["k"]), cached["k"]
        return hn, hn  # random: only the shape is read
