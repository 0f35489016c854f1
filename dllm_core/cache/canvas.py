"""``canvas``: the block-canvas semantics of a paged host engine (vLLM's diffusion pathway).

This is the reference policy whose output the vLLM adapter (``integrations/vllm``) reproduces
token for token. A request is decoded one canvas at a time; a canvas is ``blocks`` consecutive
engine blocks (default 1: the canvas is the block), decoded semi-autoregressively inside it:

* **prompt prefill** - one forward over the prompt alone, bidirectional among the prompt tokens;
  its K/V are frozen (the host keeps them in its paged KV cache). The prompt never sees masks.
* **denoise step** inside canvas c - only the canvas positions are run; their queries attend to
  the frozen K/V of everything left of the canvas (prompt + committed canvases) and to the whole
  canvas, bidirectionally (its later, still masked blocks included), and to **nothing right of
  the canvas** (no masked suffix beyond it).
* **commit** of canvas c - once the sampler has filled every block of the canvas, one more
  forward runs the finished canvas (same attention: frozen prefix + the canvas itself) and its
  K/V are frozen from then on. It happens right before the first denoise step of canvas c + 1,
  i.e. exactly where vLLM runs its commit step (which also emits the canvas). The last canvas's
  commit only emits tokens, so the reference skips it.

Dream predicts position i from the logit row at i - 1: the first canvas position's row is the
last committed position's final hidden state, taken from the forward that committed it (the
prompt prefill or the previous block's commit) and frozen like its K/V.

Differences from vanilla LLaDA / Dream (one full bidirectional forward over prompt + every
response position per step): the prompt and committed canvases do not attend to later positions,
masked positions right of the current canvas are absent, and committed K/V are never refreshed.
Like Fast-dLLM's prefix cache, but exact for the host engine: nothing is recomputed later. With
``blocks = gen_length / block_length`` (one canvas holds the whole response) only the first
difference remains: the prompt does not see the response.

Response-side dLLM-Cache inside the canvas (``kr``, ``rho``, ``select``, ``metric``,
``first_layer``): the prefix needs no prompt cache (it is frozen and exact), so only the canvas
features are cached. Denoise step c of a canvas (c = 0 at its first step) fully recomputes layer l
when ``c % kr == 0`` (always at c = 0: the canvas is new) or ``first_layer and l == 0``; otherwise
the ``int(rho * canvas_len)`` canvas positions whose V (or K) moved most are recomputed (V of every
canvas position is refreshed in V-verify) and the rest reuse their cached attention / FFN
outputs. ``kr=1`` (the default) is exact. ``CanvasCache.from_spec("dllm:kp=..,kr=..")`` maps a
``dllm`` spec onto this policy (``kp`` has nothing to refresh here and is ignored).
The step counter restarts at every canvas (dLLM-Cache's ``per_block``): a new canvas has no
cached features.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import CachePolicy, kv_buffers, nbytes
from ..options import check_choice, check_range, parse_spec


@dataclass(frozen=True)
class CanvasCache(CachePolicy):
    """Block-canvas semantics (see the module docstring) + optional response-side dLLM-Cache.
    ``blocks``: engine blocks per canvas; ``kr``: full canvas refresh every kr steps (1 = exact);
    ``rho``: fraction of the canvas recomputed on the other steps; ``select``: value | key |
    random; ``metric``: cosine | l2; ``first_layer``: always recompute layer 0."""

    name: ClassVar[str] = "canvas"
    blocks: int = 1
    kr: int = 1
    rho: float = 0.25
    select: str = "value"
    metric: str = "cosine"
    first_layer: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.blocks < 1:
            raise ValueError(f"--cache canvas.blocks must be >= 1, got {self.blocks}")
        if self.kr < 1:
            raise ValueError(f"--cache canvas.kr must be >= 1, got {self.kr}")
        check_range(self.rho, 0.0, 1.0, "--cache canvas.rho")
        check_choice(self.select, ("value", "key", "random"), "--cache canvas.select")
        check_choice(self.metric, ("cosine", "l2"), "--cache canvas.metric")

    # ---- decisions shared with host adapters -----------------------------------------------
    @classmethod
    def from_spec(cls, spec: "str | CachePolicy", option: str = "--cache") -> "CanvasCache":
        """Canvas policy for a host engine's cache option: ``none`` / ``canvas:..`` (exact unless
        kr > 1) or a ``dllm:..`` spec (its response-side knobs; ``kp`` is moot: the prefix is
        exact). ``prefix`` / ``dual`` are rejected: the committed prefix is always cached exactly."""
        from . import CACHES  # late: the registry imports this module

        pol = spec if isinstance(spec, CachePolicy) else parse_spec(spec, CACHES, option)
        if isinstance(pol, CanvasCache):
            return pol
        if pol.name == "none":
            return cls()
        if pol.name == "dllm":
            return cls(kr=pol.kr, rho=pol.rho, select=pol.select, metric=pol.metric,
                       first_layer=pol.first_layer, seed=pol.seed)
        raise ValueError(f"{option}: {pol.name!r} is not available in the block-canvas semantics (the committed "
                         f"prefix is already cached exactly); allowed: ['canvas', 'dllm', 'none']")

    @property
    def exact(self) -> bool:
        return self.kr == 1

    def full_layer(self, step: int, layer: int) -> bool:
        """Whether denoise step ``step`` (0 = first of the block) fully recomputes ``layer``."""
        return step % self.kr == 0 or (self.first_layer and layer == 0)

    def n_update(self, canvas_len: int) -> int:
        """Canvas positions recomputed by an adaptive layer."""
        return int(self.rho * canvas_len)

    def pick(self, new: torch.Tensor, old: torch.Tensor, n: int,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """Positions to recompute: the n whose feature moved most. new/old [B, L, F] -> [B, n]."""
        if self.select == "random":
            score = torch.rand(new.shape[:2], device=new.device, generator=generator)
        else:
            new, old = new.float(), old.float()
            score = -F.cosine_similarity(new, old, dim=-1) if self.metric == "cosine" else (new - old).norm(dim=-1)
        return score.topk(n, -1).indices

    # ---- the reference implementation ------------------------------------------------------
    def begin(self, model, canvas):
        super().begin(model, canvas)
        B, T, dev = canvas.pos.shape[0], canvas.seq_len, canvas.pos.device
        L = self.blocks * canvas.block_len  # canvas length
        if (T - canvas.prompt_len) % L:
            raise ValueError(f"--cache canvas.blocks={self.blocks}: gen_length {T - canvas.prompt_len} is not a "
                             f"multiple of the canvas ({self.blocks} x block_length {canvas.block_len})")
        object.__setattr__(self, "_buf_kv", kv_buffers(model, B, T, dev))
        object.__setattr__(self, "_buf_last", torch.zeros(B, model.args.dim, dtype=model.dtype, device=dev))
        feats = [] if self.exact else [tuple(torch.zeros(B, L, model.args.dim, dtype=model.dtype, device=dev)
                                              for _ in "af") for _ in model.layers]
        object.__setattr__(self, "_buf_feat", feats)  # (attn_out, ffn_out) [B, L, d] per layer
        object.__setattr__(self, "_canvas", None)
        object.__setattr__(self, "_steps", torch.zeros(B, dtype=torch.long, device=dev))  # per row, in the canvas
        object.__setattr__(self, "_gen", torch.Generator(dev).manual_seed(self.seed))
        self.counters.cache_bytes = nbytes(self._buf_kv) + nbytes(feats) + self._buf_last.nbytes

    def hidden(self, model, x, need, fresh, active=None):
        cv = self.canvas
        P, L, c = cv.prompt_len, self.blocks * cv.block_len, cv.block // self.blocks
        if self._canvas is None:
            self._freeze(model, x, 0, P)  # prompt prefill
        elif c != self._canvas:
            s0 = P + self._canvas * L
            self._freeze(model, x, s0, s0 + L)  # commit of the finished canvas
        if c != self._canvas:
            object.__setattr__(self, "_canvas", c)
            self._steps.zero_()
        s = P + c * L
        active = torch.ones_like(self._steps, dtype=torch.bool) if active is None else active
        h = self._denoise(model, x, s, s + L, active)
        self._steps.add_(active.long())
        h = torch.cat([self._buf_last[:, None], h], 1)  # positions [s - 1, s + L)
        return h[:, need[0] - s + 1:need[1] - s + 1]

    def _freeze(self, model, x, s: int, e: int) -> None:
        """Run [s, e) against the frozen prefix + itself, keep its K/V and its last hidden row."""
        cv = self.canvas
        h, rope, mask = model.embed(x[:, s:e]), model.rope(cv.pos[:, s:e]), self._mask(e)
        for layer, (k, v) in zip(model.layers, self._buf_kv):
            h = layer(h, rope, mask, kv=(k[:, :, :e], v[:, :, :e]), at=s)
        self._buf_last.copy_(h[:, -1])
        self._count(model, e - s)

    def _mask(self, e: int):
        return None if self.canvas.mask is None else self.canvas.mask[..., :e]

    def _denoise(self, model, x, s: int, e: int, active) -> torch.Tensor:
        """One denoise forward of the canvas [s, e): [B, L, d] final-layer hidden states."""
        cv = self.canvas
        h, rope, mask = model.embed(x[:, s:e]), model.rope(cv.pos[:, s:e]), self._mask(e)
        self.counters.forwards += 1
        self.counters.full_token_layers += cv.seq_len * model.args.n_layers
        for i, (layer, (k, v)) in enumerate(zip(model.layers, self._buf_kv)):
            kv = (k[:, :, :e], v[:, :, :e])
            if self.exact:
                h = layer(h, rope, mask, kv=kv, at=s)
                self.counters.token_layers += e - s
            else:
                full = (self._steps % self.kr == 0) | (self.first_layer and i == 0)  # [B]
                h = self._cached_layer(layer, h, rope, mask, kv, s, self._buf_feat[i], full, active)
        return h

    def _cached_layer(self, layer, x, rope, mask, kv, s, feat, full, active):
        """Rows with ``full`` recompute every canvas position; the others only the positions
        ``pick`` chooses (V-verify refreshes all their V). Only ``active`` rows update their cache,
        so a row idling in a batch evolves exactly as it would alone."""
        B, L = x.shape[:2]
        e = s + L
        n, adaptive = self.n_update(L), ~full & active
        rec = full[:, None].expand(B, L).clone()  # [B, L] positions recomputed
        if bool(adaptive.any()):
            if self.select == "value":
                new, old = layer.value(x), kv[1][:, :, s:e].clone()
                kv[1][:, :, s:e] = torch.where(adaptive[:, None, None, None], new, old)
            elif self.select == "key":
                _, new, _ = layer.qkv(x, rope)
                old = kv[0][:, :, s:e]
            if self.select != "random":
                self.counters.v_only += L
                new, old = (t.transpose(1, 2).flatten(2) for t in (new, old))  # [B, L, Hkv*D]
            else:
                new = old = x  # only the shape is read
            if n:
                picked = torch.zeros_like(rec).scatter_(1, self.pick(new, old, n, self._gen), True)
                rec |= picked & adaptive[:, None]
        write = rec & active[:, None]  # [B, L]
        q, k, v = layer.qkv(x, rope)
        for buf, fresh in zip(kv, (k, v)):
            buf[:, :, s:e] = torch.where(write[:, None, :, None], fresh, buf[:, :, s:e])
        a = layer.attend(q, kv[0], kv[1], mask)
        f = layer.ffn(x + a)
        for buf, fresh in zip(feat, (a, f)):
            buf.copy_(torch.where(write[..., None], fresh, buf))
        self.counters.token_layers += int(write.sum(-1).max())
        return x + feat[0] + feat[1]
