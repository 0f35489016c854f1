"""dLLM-Cache inside SGLang: response-side adaptive feature caching over the current block.

SGLang keeps the committed prefix in its paged KV cache exactly, so only the block's features are
cached. Every decision and the layer execution itself are dllm_core's: the policy is a
``CanvasCache`` (``full_layer``, ``n_update``, ``pick``), the storage a ``FeatureStore`` and the
layers run through ``CachedStep`` / ``cached_layer`` (V-verify, pick, partial recompute,
assemble). This file only binds SGLang's request slots to store rows.

The algorithm drives it: before each forward it puts the per-row denoise step into
``forward_batch.dllm_input_preparation_state`` (CPU int64 [B]; 0 = first forward of the block,
-1 = the final forward that persists the finished block: always exact). Data-dependent shapes:
incompatible with CUDA graphs (the algorithm disables them at launch).
"""
from __future__ import annotations

import torch

from dllm_core.cache.canvas import CanvasCache
from dllm_core.cache.executor import CachedStep, FeatureStore

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_req_to_token_pool


class FeatureCache:
    """Block features of the requests in flight; ``policy`` is set by the algorithm (None = off).

    The store holds one row per request whose block is in flight (not per request slot: SGLang's
    slot pool can be thousands deep). A row is bound to (slot, slot generation) at the block's
    first forward (a full refresh: nothing stale is read), released by its persisting forward,
    and reclaimed if the slot passes to another request (e.g. after an abort)."""

    def __init__(self, model):
        self.model = model
        self.policy: CanvasCache | None = None
        self.store: FeatureStore | None = None
        self.rows: dict[int, tuple[int, int]] = {}  # slot -> (store row, slot generation)
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
        """Store rows of the batch's requests: [B] (growing the store when needed)."""
        if self.gen is None:
            self.gen = torch.Generator(like.device).manual_seed(self.policy.seed)
        if self.store is not None and self.store.length != L:
            self.store, self.rows, self.free = None, {}, []
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
            old = self.store.slots if self.store else 0
            grow = max(old, 4)
            if self.store is None:
                kv = self.model.layers[0].self_attn.kv_size
                self.store = FeatureStore(len(self.model.layers), grow, L, kv, like.shape[-1], like)
            else:
                self.store.grow(grow)
            self.free = list(range(old + grow - 1, old - 1, -1))
        return self.free.pop()

    def run(self, h: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The cached forward of the block tokens: embeddings h [N, d] -> final hidden [N, d]."""
        B = fb.batch_size
        L = h.shape[0] // B
        slots = fb.req_pool_indices.tolist()
        steps = fb.dllm_input_preparation_state.tolist()  # CPU: no device sync
        rows = torch.arange(B * L, device=h.device).view(B, L)
        step = CachedStep.by_policy(rows, self._bind(slots, L, h), [max(c, 0) for c in steps], [self.policy] * B,
                                    self.store, self.gen)
        for i, layer in enumerate(self.model.layers):
            h = step.layer(layer.ops(fb), h, positions, i)
        for slot, c in zip(slots, steps):
            if c < 0 and slot in self.rows:  # the block is persisted: its features are dead
                self.free.append(self.rows.pop(slot)[0])
        return h
