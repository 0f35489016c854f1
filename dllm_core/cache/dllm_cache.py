"""dLLM-Cache: adaptive per-layer feature caching (prompt every Kp steps, response every Kr steps,
V-verify partial response updates in between).

Per layer the cache holds K, V [B, T, Hkv*D] and the attention / FFN outputs [B, T, d]; a layer's
output is always assembled as ``x + attn + ffn`` from (partly fresh, partly cached) features by the
shared executor (``executor.cached_layer``: the same code the vLLM and SGLang adapters run).
Exact mode: ``kp=1,kr=1`` (every layer fully recomputed at every step).
On CUDA each distinct per-layer mode pattern (at most four) replays as a CUDA graph: shapes are
fixed (|prompt|, |response|, floor(rho * |response|)) and the selection is index tensors
(``nonzero_static`` with the known count: no device sync).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import CachePolicy, CacheState, nbytes
from .executor import CachedRows, Features, FeatureReuse, Region, cached_layer
from .graphs import GraphRunner
from ..models.layers import BlockOps
from ..options import check_min


class DLLMCacheState(CacheState):
    """Per-layer features of every position ([B, T, *]) + the step counter (shared by the batch)."""

    def __init__(self, policy, model, canvas):
        super().__init__(policy, model, canvas)
        B, T, dev = canvas.pos.shape[0], canvas.seq_len, canvas.pos.device
        kv = model.args.n_kv_heads * model.args.head_dim
        like = torch.zeros(0, dtype=model.dtype, device=dev)
        self.feats = [Features.zeros(B, T, kv, model.args.dim, like) for _ in model.layers]
        self.rows = torch.arange(B * T, device=dev).view(B, T)  # [B, T] flat row of each position
        self.step, self.block_step, self.block = 0, 0, None  # the generation's steps, the block's, its index
        self.gen = torch.Generator(dev).manual_seed(policy.seed)
        self.runs: dict[tuple[str, ...], GraphRunner] = {}  # per-layer mode pattern -> forward
        self.counters.cache_bytes = nbytes([f.tensors() for f in self.feats])

    def hidden(self, x, need, fresh, active=None):
        pol = self.policy
        if self.canvas.block != self.block:
            self.block, self.block_step = self.canvas.block, 0
        c = pol.counter(self.step, self.block_step)
        self.step, self.block_step = self.step + 1, self.block_step + 1
        modes = tuple(pol.mode(c, i) for i in range(self.model.args.n_layers))
        self._tally(modes)
        graphs = self.use_graphs and pol.select != "random"
        if modes not in self.runs:
            self.runs[modes] = GraphRunner(lambda ids: self._forward(ids, modes), graphs)
        return self.runs[modes](x)[:, need[0]:need[1]]

    def _counts(self) -> dict[str, int]:
        """Positions per row each mode recomputes."""
        P, T = self.canvas.prompt_len, self.canvas.seq_len
        return {"full": T, "prompt": P, "response": T - P, "adaptive": self.policy.n_update(T - P)}

    def _tally(self, modes: tuple[str, ...]) -> None:
        P, T = self.canvas.prompt_len, self.canvas.seq_len
        n, c = self._counts(), self.counters
        c.forwards += 1
        c.full_token_layers += T * len(modes)
        c.token_layers += sum(n[m] for m in modes)
        c.v_only += sum(T - P for m in modes if m == "adaptive" and n[m] and self.policy.select != "random")

    def _forward(self, ids, modes):
        """ids [B, T] -> hidden [B, T, d], each layer run in its mode through the executor."""
        m, cv = self.model, self.canvas
        (B, T), P, counts = ids.shape, cv.prompt_len, self._counts()
        h, pos = m.embed(ids).flatten(0, 1), cv.pos.flatten()  # [B*T, d], [B*T]
        for layer, feats, mode in zip(m.layers, self.feats, modes):
            rec = torch.zeros(B, T, dtype=torch.bool, device=ids.device)
            rec[:, {"full": slice(0, T), "prompt": slice(0, P), "response": slice(P, T)}.get(mode, slice(0, 0))] = True
            g = CachedRows(self.rows, feats, rec, [mode == "adaptive"] * B, self.policy, (P, T), dense=True)
            ops = BlockOps(layer, m.rotary, B, cv.mask, per_row=counts[mode])
            h = cached_layer(ops, h, pos, [g], self.gen, count=B * counts[mode])
        return h.view(B, T, -1)


@dataclass(frozen=True)
class DLLMCache(FeatureReuse, CachePolicy):
    """``kp``/``kr``: prompt/response refresh intervals; ``rho``: fraction of response tokens
    recomputed by the adaptive update; ``select``: value (V-verify) | key | random;
    ``metric``: cosine | l2; ``first_layer``: always refresh layer 0 (reference behaviour);
    ``per_block``: restart the step counter at each block (the reference runs it across blocks)."""

    name: ClassVar[str] = "dllm"
    state_cls: ClassVar[type[CacheState]] = DLLMCacheState
    refreshes_prefix: ClassVar[bool] = True
    kp: int = 50
    kr: int = 7
    per_block: bool = False

    def __post_init__(self):
        for n in ("kp", "kr"):
            check_min(getattr(self, n), 1, f"--cache dllm.{n}")
        self.check_reuse("--cache dllm")

    def counter(self, steps: int, block_steps: int) -> int:
        """The step counter ``c`` that ``mode`` reads, from the steps taken so far in the generation and in
        its current block: the block's with ``per_block``, else the generation's (every engine asks here)."""
        return block_steps if self.per_block else steps

    def recomputes(self, c: int, layer: int, prompt: bool) -> tuple[bool, bool]:
        """A host's view of ``mode`` for one part of the sequence (the prompt, or the response):
        (every row of the part recomputed, the response's adaptive V-verify runs)."""
        m = self.mode(c, layer)
        return (m in ("full", "prompt"), False) if prompt else (m in ("full", "response"), m == "adaptive")

    def host_regions(self, c: int, prompt_rows: torch.Tensor, prompt_store, response_rows: torch.Tensor,
                     response_slot: torch.Tensor, response_store, reuse: FeatureReuse | None = None) -> list[Region]:
        """A host request's two cached regions at its step ``c``: the prompt part (rows [1, P] of the
        forward, features in row 0 of ``prompt_store``, no adaptive pick) and the response part (rows
        [1, G], features at ``response_slot`` [1] of ``response_store``, V-verify by ``reuse`` or this
        policy), each recomputed per layer as ``recomputes`` says."""
        def plan(layer, prompt, n, dev=prompt_rows.device):
            full, verify = self.recomputes(c, layer, prompt)
            return torch.full((1, n), full, dtype=torch.bool, device=dev), [verify]

        zero = torch.zeros(1, dtype=torch.long, device=prompt_rows.device)
        P, G = prompt_rows.shape[1], response_rows.shape[1]
        return [Region(prompt_rows, zero, prompt_store, None, lambda layer: plan(layer, True, P)),
                Region(response_rows, response_slot, response_store, reuse or self, lambda layer: plan(layer, False, G))]

    def mode(self, c: int, layer: int) -> str:
        """What step ``c`` recomputes in ``layer``: full | prompt | response | adaptive."""
        if c == 0 or (self.first_layer and layer == 0) or (c % self.kp == 0 and c % self.kr == 0):
            return "full"
        return "prompt" if c % self.kp == 0 else "response" if c % self.kr == 0 else "adaptive"
