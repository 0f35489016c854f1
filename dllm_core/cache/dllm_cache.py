"""dLLM-Cache: adaptive per-layer feature caching (prompt every Kp steps, response every Kr steps,
V-verify partial response updates in between).

Per layer the cache holds K, V [B, Hkv, T, D] and the attention / FFN outputs [B, T, d]; a layer's
output is always assembled as ``x + attn + ffn`` from (partly fresh, partly cached) features.
Exact mode: ``kp=1,kr=1`` (every layer fully recomputed at every step).
On CUDA each distinct per-layer mode pattern (at most four) replays as a CUDA graph: shapes are
fixed (|prompt|, |response|, floor(rho * |response|)) and the selection is index tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import CachePolicy, kv_buffers, nbytes
from .graphs import GraphRunner
from ..models.layers import gather_rows, scatter_rows, write_kv
from ..options import check_choice, check_range


@dataclass(frozen=True)
class DLLMCache(CachePolicy):
    """``kp``/``kr``: prompt/response refresh intervals; ``rho``: fraction of response tokens
    recomputed by the adaptive update; ``select``: value (V-verify) | key | random;
    ``metric``: cosine | l2; ``first_layer``: always refresh layer 0 (reference behaviour);
    ``per_block``: restart the step counter at each block (the reference runs it across blocks)."""

    name: ClassVar[str] = "dllm"
    kp: int = 50
    kr: int = 7
    rho: float = 0.25
    select: str = "value"
    metric: str = "cosine"
    first_layer: bool = True
    per_block: bool = False
    seed: int = 0

    def __post_init__(self):
        for n in ("kp", "kr"):
            if getattr(self, n) < 1:
                raise ValueError(f"--cache dllm.{n} must be >= 1, got {getattr(self, n)}")
        check_range(self.rho, 0.0, 1.0, "--cache dllm.rho")
        check_choice(self.select, ("value", "key", "random"), "--cache dllm.select")
        check_choice(self.metric, ("cosine", "l2"), "--cache dllm.metric")

    def begin(self, model, canvas):
        super().begin(model, canvas)
        B, T, dev = canvas.pos.shape[0], canvas.seq_len, canvas.pos.device
        feats = [tuple(torch.zeros(B, T, model.args.dim, dtype=model.dtype, device=dev) for _ in "af")
                 for _ in model.layers]  # (attn_out, ffn_out) [B, T, d] per layer
        object.__setattr__(self, "_buf_kv", kv_buffers(model, B, T, dev))
        object.__setattr__(self, "_buf_feat", feats)
        object.__setattr__(self, "_step", 0)
        object.__setattr__(self, "_block", None)
        object.__setattr__(self, "_gen", torch.Generator(dev).manual_seed(self.seed))
        object.__setattr__(self, "_buf_runs", {})  # per-layer mode pattern -> GraphRunner
        self.counters.cache_bytes = nbytes(self._buf_kv) + nbytes(feats)

    def _mode(self, c: int, layer: int) -> str:
        if c == 0 or (self.first_layer and layer == 0) or (c % self.kp == 0 and c % self.kr == 0):
            return "full"
        return "prompt" if c % self.kp == 0 else "response" if c % self.kr == 0 else "adaptive"

    def hidden(self, model, x, need, fresh, active=None):
        cv = self.canvas
        block = cv.block if self.per_block else None
        c = 0 if block != self._block else self._step
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_step", c + 1)
        modes = tuple(self._mode(c, i) for i in range(model.args.n_layers))
        self._tally(modes)
        graphs = self.graphs and x.device.type == "cuda" and self.select != "random"
        run = self._buf_runs.get(modes) or self._buf_runs.setdefault(
            modes, GraphRunner(lambda ids: self._forward(model, ids, modes), graphs))
        return run(x)[:, need[0]:need[1]]

    def _tally(self, modes: tuple[str, ...]) -> None:
        P, T = self.canvas.prompt_len, self.canvas.seq_len
        n = int(self.rho * (T - P))
        c = self.counters
        c.forwards += 1
        c.full_token_layers += T * len(modes)
        c.token_layers += sum({"full": T, "prompt": P, "response": T - P, "adaptive": n}[m] for m in modes)
        c.v_only += sum(T - P for m in modes if m == "adaptive" and n and self.select != "random")

    def _forward(self, model, ids, modes):
        """ids [B, T] -> hidden [B, T, d], each layer run in its mode."""
        h, rope = model.embed(ids), model.rope(self.canvas.pos)
        for layer, kv, feat, mode in zip(model.layers, self._buf_kv, self._buf_feat, modes):
            h = self._layer(layer, h, rope, kv, feat, mode)
        return h

    def _run(self, layer, x, rope, kv, feat, at):
        """Recompute positions ``at`` (slice or index tensor [B, n]) and store their features."""
        cv = self.canvas
        if isinstance(at, slice):
            xs, rs, off = x[:, at], tuple(r[:, at] for r in rope), at.start
        else:
            xs, rs, off = gather_rows(x, at), tuple(gather_rows(r, at) for r in rope), at
        q, k, v = layer.qkv(xs, rs)
        write_kv(kv[0], off, k)
        write_kv(kv[1], off, v)
        a = layer.attend(q, kv[0], kv[1], cv.mask)
        f = layer.ffn(xs + a)
        for buf, new in zip(feat, (a, f)):
            if isinstance(at, slice):
                buf[:, at] = new
            else:
                scatter_rows(buf, at, new)

    def _layer(self, layer, x, rope, kv, feat, mode):
        P, T = self.canvas.prompt_len, self.canvas.seq_len
        if mode == "full":
            self._run(layer, x, rope, kv, feat, slice(0, T))
        elif mode == "prompt":
            self._run(layer, x, rope, kv, feat, slice(0, P))
        elif mode == "response":
            self._run(layer, x, rope, kv, feat, slice(P, T))
        else:
            idx = self._pick(layer, x, rope, kv)
            if idx is not None:
                self._run(layer, x, rope, kv, feat, idx)
        return x + feat[0] + feat[1]

    def _pick(self, layer, x, rope, kv):
        """Adaptive update: the floor(rho * R) response positions whose V (or K) moved most."""
        P, T = self.canvas.prompt_len, self.canvas.seq_len
        n = int(self.rho * (T - P))
        if n == 0:
            return None
        xr = x[:, P:]
        if self.select == "random":
            score = torch.rand(xr.shape[:2], device=x.device, generator=self._gen)
        else:
            if self.select == "value":
                new, old = layer.value(xr), kv[1][:, :, P:]
                kv[1][:, :, P:] = new  # V is refreshed for every response token
            else:
                _, new, _ = layer.qkv(xr, tuple(r[:, P:] for r in rope))
                old = kv[0][:, :, P:]
            new, old = new.transpose(1, 2).flatten(2).float(), old.transpose(1, 2).flatten(2).float()  # [B, R, Hkv*D]
            score = -F.cosine_similarity(new, old, dim=-1) if self.metric == "cosine" else (new - old).norm(dim=-1)
        return score.topk(n, -1).indices + P  # [B, n] least similar first
