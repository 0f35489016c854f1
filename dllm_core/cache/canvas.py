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

On a block-causal model (LLaDA2) with one block per canvas this *is* the model's own semantics: the
prefix (whole grid blocks of the prompt, then committed blocks) is exact, and ``kr`` > 1 is dLLM-Cache
inside the block (the engine maps a ``dllm`` spec onto it for such a model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import CachePolicy, CacheState, kv_buffers, nbytes
from .host import HostPart, HostPlan, HostRequest, HostStep
from .executor import CachedRows, Features, FeatureReuse, cached_layer
from ..models.layers import BlockOps
from ..options import check_min


class CanvasState(CacheState):
    """Frozen prefix K/V [B, Hkv, T, D], the last committed row's hidden state, per-row denoise steps
    of the current canvas (host ints) and, for the approximate mode, the canvas features."""

    def __init__(self, policy, model, canvas):
        super().__init__(policy, model, canvas)
        B, T, dev = canvas.pos.shape[0], canvas.seq_len, canvas.pos.device
        self.L = L = policy.blocks * canvas.block_len  # canvas length
        if (T - canvas.prompt_len) % L:
            raise ValueError(f"--cache canvas.blocks={policy.blocks}: gen_length {T - canvas.prompt_len} is not a "
                             f"multiple of the canvas ({policy.blocks} x block_length {canvas.block_len})")
        a = model.args
        self.kv = kv_buffers(model, B, T, dev)
        self.last = torch.zeros(B, a.dim, dtype=model.dtype, device=dev)
        like = self.last[:0]
        self.feats = [] if policy.exact else [Features.zeros(B, L, a.n_kv_heads * a.head_dim, a.dim, like)
                                              for _ in model.layers]
        self.rows = torch.arange(B * L, device=dev).view(B, L)
        self.current = None  # canvas being denoised
        self.steps = np.zeros(B, dtype=np.int64)  # per row, in the canvas
        self.gen = torch.Generator(dev).manual_seed(policy.seed)
        self.counters.cache_bytes = nbytes(self.kv) + nbytes([f.tensors() for f in self.feats]) + self.last.nbytes

    def hidden(self, x, need, fresh, active=None):
        cv, L = self.canvas, self.L
        P, c = cv.prompt_len, cv.block // self.policy.blocks
        if self.current is None:
            if P > 0:  # block-causal: a short prompt has no whole grid block before the first decoded one
                self._freeze(x, 0, P)  # prompt prefill
        elif c != self.current:
            s0 = P + self.current * L
            self._freeze(x, s0, s0 + L)  # commit of the finished canvas
        if c != self.current:
            self.current = c
            self.steps[:] = 0
        s = P + c * L
        active = np.ones(len(self.steps), dtype=bool) if active is None else active.cpu().numpy()
        h = self._denoise(x, s, s + L, active)
        self.steps += active
        h = torch.cat([self.last[:, None], h], 1)  # positions [s - 1, s + L)
        return h[:, need[0] - s + 1:need[1] - s + 1]

    def _freeze(self, x, s: int, e: int) -> None:
        """Run [s, e) against the frozen prefix + itself, keep its K/V and its last hidden row."""
        m, cv = self.model, self.canvas
        h, rope, mask = m.embed(x[:, s:e]), m.rope(cv.pos[:, s:e]), self._mask(s, e)
        for layer, (k, v) in zip(m.layers, self.kv):
            h = layer(h, rope, mask, kv=(k[:, :, :e], v[:, :, :e]), at=s)
        self.last.copy_(h[:, -1])
        self._count(e - s)

    def _mask(self, s: int, e: int):
        """Queries [s, e) over keys [0, e)."""
        return None if self.canvas.mask is None else self.canvas.attn(s, e)[..., :e]

    def _denoise(self, x, s: int, e: int, active: np.ndarray) -> torch.Tensor:
        """One denoise forward of the canvas [s, e): [B, L, d] final-layer hidden states."""
        m, cv, pol = self.model, self.canvas, self.policy
        B, L = x.shape[0], e - s
        h, mask = m.embed(x[:, s:e]), self._mask(s, e)
        self.counters.forwards += 1
        self.counters.full_token_layers += cv.seq_len * m.args.n_layers
        if pol.exact:
            rope = m.rope(cv.pos[:, s:e])
            for layer, (k, v) in zip(m.layers, self.kv):
                h = layer(h, rope, mask, kv=(k[:, :, :e], v[:, :, :e]), at=s)
            self.counters.token_layers += L * m.args.n_layers
            return h
        h, pos, n = h.flatten(0, 1), cv.pos[:, s:e].flatten(), pol.n_update(L)
        for i, (layer, (k, v), feats) in enumerate(zip(m.layers, self.kv, self.feats)):
            full = np.array([pol.full_layer(int(c), i) for c in self.steps]) & active
            verify = ~full & active
            vmask = bool(verify.any()) if verify.all() or not verify.any() else torch.as_tensor(verify, device=x.device)
            g = CachedRows(self.rows, feats, torch.as_tensor(full, device=x.device)[:, None].expand(B, L), vmask, pol,
                           (0, L), dense=True)
            ops = BlockOps(layer, m.rotary, B, mask, prefix=(k[:, :, :s], v[:, :, :s]))
            h = cached_layer(ops, h, pos, [g], self.gen, bound=L * int(full.sum()) + n * int(verify.sum()))
            self.counters.token_layers += L if full.any() else n if active.any() else 0
            self.counters.v_only += L if n and verify.any() and pol.select != "random" else 0
        return h.view(B, L, -1)


@dataclass(frozen=True)
class CanvasCache(FeatureReuse, CachePolicy):
    """Block-canvas semantics (see the module docstring) + optional response-side dLLM-Cache.
    ``blocks``: engine blocks per canvas; ``kr``: full canvas refresh every kr steps (1 = exact);
    ``rho``: fraction of the canvas recomputed on the other steps; ``select``: value | key |
    random; ``metric``: cosine | l2; ``first_layer``: always recompute layer 0."""

    name: ClassVar[str] = "canvas"
    state_cls: ClassVar[type[CacheState]] = CanvasState
    blocks: int = 1
    kr: int = 1

    def __post_init__(self):
        check_min(self.blocks, 1, "--cache canvas.blocks")
        check_min(self.kr, 1, "--cache canvas.kr")
        self.check_reuse("--cache canvas")

    @classmethod
    def from_spec(cls, spec: "str | CachePolicy", option: str = "--cache") -> "CanvasCache":
        """Canvas policy for a host engine's cache option: ``none`` / ``canvas:..`` (exact unless
        kr > 1) or a ``dllm:..`` spec (its response-side knobs; ``kp`` is moot: the prefix is
        exact). ``prefix`` / ``dual`` are not canvas policies (``cache.host_cache`` serves them)."""
        from . import make_cache  # late: the registry imports this module

        pol = make_cache(spec, option)
        if isinstance(pol, CanvasCache):
            return pol
        if pol.name == "none":
            return cls()
        if pol.name == "dllm":
            return cls(kr=pol.kr, rho=pol.rho, select=pol.select, metric=pol.metric,
                       first_layer=pol.first_layer, seed=pol.seed)
        raise ValueError(f"{option}: {pol.name!r} is not a block-canvas policy; allowed: ['canvas', 'dllm', 'none']")

    @property
    def exact(self) -> bool:
        return self.kr == 1

    @property
    def stores_features(self) -> bool:
        return not self.exact

    def host_plan(self, req: HostRequest, step: HostStep) -> HostPlan:
        """A paged host's step: the prefix is frozen (not run); the canvas is recomputed whole (exact) or by
        the ``full_layer`` schedule at the request's step in the canvas, V-verify elsewhere."""
        if self.exact:
            return HostPlan(step.prefix)
        c = req.canvas_steps
        return HostPlan(step.prefix, [HostPart("response", step.prefix, step.end, reuse=req.reuse(self),
                                               schedule=lambda layer: (self.full_layer(c, layer), True))])

    def full_layer(self, step: int, layer: int) -> bool:
        """Whether denoise step ``step`` (0 = first of the canvas) fully recomputes ``layer``."""
        return step % self.kr == 0 or (self.first_layer and layer == 0)
