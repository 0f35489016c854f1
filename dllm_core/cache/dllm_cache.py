"""dLLM-Cache: adaptive per-layer feature caching (prompt every Kp steps, response every Kr steps,
V-verify partial response updates in between), and its base ``LayerSchedule``: any policy that keeps every
layer's features of the prompt and the response and says, per step and layer, which part it recomputes.

Per layer the cache holds K, V [B, T, Hkv*D] and the attention / FFN outputs [B, T, d]; a layer's
output is always assembled as ``x + attn + ffn`` from (partly fresh, partly cached) features by the
shared executor (``executor.cached_layer``: the same code the vLLM and SGLang adapters run).
Exact mode: ``kp=1,kr=1`` (every layer fully recomputed at every step).
On CUDA each distinct per-layer mode pattern (at most four) replays as a CUDA graph: shapes are
fixed (|prompt|, |response|, floor(rho * |response|)) and the selection is index tensors
(``nonzero_static`` to the plan's count: no device sync).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import CachePolicy, CacheState, nbytes
from .executor import CachedRows, Features, FeatureReuse, cached_layer
from .host import HostPart, HostPlan, HostRequest, HostStep
from .graphs import GraphRunner
from ..models.layers import BlockOps
from ..options import check_choice, check_min


class ScheduleState(CacheState):
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
        self.runs: dict[tuple, GraphRunner] = {}  # (per-layer plan pattern, first column read) -> forward
        self.since = [[0, 0] for _ in range(B)]  # per row: tokens changed since the prompt's / response's refresh
        self.seen: torch.Tensor | None = None  # [B, T] the tokens of the previous step (policies counting tokens)
        self.counters.cache_bytes = nbytes([f.tensors() for f in self.feats])

    def hidden(self, x, need, fresh, active=None):
        pol = self.policy
        if self.canvas.block != self.block:
            self.block, self.block_step = self.canvas.block, 0
        c = pol.counter(self.step, self.block_step)
        self.step, self.block_step = self.step + 1, self.block_step + 1
        n, first = self.model.args.n_layers, min(need[0], self.canvas.prompt_len)  # the first column read
        if pol.counts_tokens:  # each row's own plan from the tokens its previous steps changed
            changed = [0] * x.shape[0] if self.seen is None else (x != self.seen).sum(-1).tolist()
            self.seen = x.clone()
            dues = [pol.tick(c, since, k) for since, k in zip(self.since, changed)]
            rows = [tuple(pol.layer_plan(c, i, due) for i in range(n)) for due in dues]
            if any(r != rows[0] for r in rows):
                self._tally(rows)
                return self._forward(x, rows, first)[:, need[0]:need[1]]
            plans = rows[0]
        else:
            plans = tuple(pol.layer_plan(c, i) for i in range(n))
        self._tally([plans])
        graphs = self.use_graphs and pol.select != "random"
        if (plans, first) not in self.runs:
            self.runs[plans, first] = GraphRunner(lambda ids: self._forward(ids, [plans], first), graphs)
        return self.runs[plans, first](x)[:, need[0]:need[1]]

    def _count(self, plan: tuple[bool, bool, bool]) -> int:
        """Positions per row a layer plan (prompt full, response full, verify) recomputes."""
        P, T = self.canvas.prompt_len, self.canvas.seq_len
        pf, rf, verify = plan
        return P * pf + (T - P) * rf + (self.policy.n_update(T - P) if verify else 0)

    def _tally(self, rows: list[tuple]) -> None:
        """Count one forward whose rows ran these plans (one per row, or one for the whole batch): per row."""
        P, T, L = self.canvas.prompt_len, self.canvas.seq_len, len(rows[0])
        verified = self.policy.n_update(T - P) and self.policy.select != "random"
        c = self.counters
        c.forwards += 1
        c.full_token_layers += T * L
        c.token_layers += round(sum(self._count(p) for plans in rows for p in plans) / len(rows))
        c.v_only += round(sum(T - P for plans in rows for p in plans if p[2] and verified) / len(rows))

    def _forward(self, ids, rows: list[tuple], first: int):
        """ids [B, T] -> hidden [B, T, d] (exact from position ``first`` on: no earlier position is read), each layer
        run through the executor by ``rows``: one plan for every row ([plans]: fixed shapes, graph-capturable) or a
        plan per row (``rows[b]``: per layer (prompt, response, verify))."""
        m, cv = self.model, self.canvas
        (B, T), P = ids.shape, cv.prompt_len
        h, pos = m.embed(ids).flatten(0, 1), cv.pos.flatten()  # [B*T, d], [B*T]
        rows = rows * B if len(rows) == 1 else rows
        shared = all(r is rows[0] for r in rows)
        prompt = [any(plan[i][0] for plan in rows) for i in range(len(m.layers))]  # a layer recomputes a prompt
        for i, (layer, feats) in enumerate(zip(m.layers, self.feats)):
            rec = torch.zeros(B, T, dtype=torch.bool, device=ids.device)
            for b, plan in ([(slice(None), rows[0])] if shared else enumerate(rows)):
                rec[b, :P], rec[b, P:] = plan[i][0], plan[i][1]
            verify = [plan[i][2] for plan in rows]
            verify = verify[0] if shared or len(set(verify)) == 1 else torch.tensor(verify, device=ids.device)
            g = CachedRows(self.rows, feats, rec, verify, self.policy, (P, T), dense=True)
            n = self._count(rows[0][i]) if shared else None  # positions each row recomputes, when all agree
            ops = BlockOps(layer, m.rotary, B, cv.mask, per_row=n)
            live = None if any(prompt[i + 1:]) else (first, T)  # no later layer reads the prompt's rows
            bound = sum(self._count(plan[i]) for plan in rows)  # exact (a shared plan: B * n)
            h = cached_layer(ops, h, pos, [g], self.gen, bound=bound, live=live)
        return h.view(B, T, -1)


@dataclass(frozen=True)
class LayerSchedule(FeatureReuse, CachePolicy):
    """A policy that keeps every layer's features (K, V, attention and FFN outputs) of the prompt and the
    response and recomputes, at step ``c`` of the generation (of the block with ``per_block``), what
    ``recomputes(c, layer, prompt)`` says: every position of the part, or (the response) the V-verify pick
    of ``FeatureReuse``. One rule runs in every engine: the embedded state (``ScheduleState``) and the hosts
    (``host_plan``). Subclasses define ``recomputes``."""

    state_cls: ClassVar[type[CacheState]] = ScheduleState
    refreshes_prefix: ClassVar[bool] = True
    spans_response: ClassVar[bool] = True  # the response part holds every emitted token of a streamed request
    per_block: bool = False

    def counter(self, steps: int, block_steps: int) -> int:
        """The step counter ``c`` from the steps taken so far in the generation and in its current block: the
        block's with ``per_block``, else the generation's (every engine asks here)."""
        return block_steps if self.per_block else steps

    def recomputes(self, c: int, layer: int, prompt: bool) -> tuple[bool, bool]:
        """For one part (the prompt, or the response) at step ``c`` (0 = the first: nothing is cached yet, so
        every layer must be recomputed): (every position of the part recomputed, the response's V-verify runs)."""
        raise NotImplementedError

    counts_tokens: ClassVar[bool] = False  # refreshes tied to the tokens a row's steps changed (``due``)

    def layer_plan(self, c: int, layer: int, due: tuple[bool, bool] | None = None) -> tuple[bool, bool, bool]:
        """(prompt recomputed, response recomputed, response V-verified) of ``layer`` at step ``c`` (``due``: the
        parts a schedule that counts tokens refreshes at this step)."""
        (pf, _), (rf, verify) = self._recomputes(c, layer, True, due), self._recomputes(c, layer, False, due)
        return pf, rf, verify and not rf

    def _recomputes(self, c: int, layer: int, prompt: bool, due) -> tuple[bool, bool]:
        return self.recomputes(c, layer, prompt) if due is None else self.recomputes(c, layer, prompt, due)

    def due(self, c: int, since: list[int]) -> tuple[bool, bool] | None:
        """A schedule that counts tokens: whether the prompt / the response are refreshed at step ``c``, from the
        tokens changed since each one's last refresh (``since``); None: the step counter alone decides."""
        return None

    def tick(self, c: int, since: list[int], changed: int) -> tuple[bool, bool] | None:
        """A row's step ``c`` after its previous step changed ``changed`` tokens: ``due`` of the step; ``since``
        (the row's counts, [prompt, response], updated in place) restarts from 0 for a refreshed part."""
        since[:] = [a + changed for a in since]
        due = self.due(c, since)
        if due is not None:
            since[:] = [0 if d else a for d, a in zip(due, since)]
        return due

    def host_plan(self, req: HostRequest, step: HostStep) -> HostPlan:
        """A host request's step: every position runs, in two parts - the generation's prompt and its response
        (emitted tokens and the canvas) - each recomputed per layer as ``recomputes`` says at the request's
        own step counter (and, for a schedule that counts tokens, the tokens its steps changed)."""
        c, P = self.counter(req.steps, req.block_steps), step.prompt
        due = self.tick(c, req.since, req.changed) if self.counts_tokens else None
        return HostPlan(0, [HostPart("prompt", 0, P, schedule=lambda layer: self._recomputes(c, layer, True, due)),
                            HostPart("response", P, step.end, reuse=req.reuse(self),
                                     schedule=lambda layer: self._recomputes(c, layer, False, due))])


@dataclass(frozen=True)
class DLLMCache(LayerSchedule):
    """``kp``/``kr``: prompt/response refresh intervals; ``rho``: fraction of response tokens
    recomputed by the adaptive update; ``select``: value (V-verify) | key | random;
    ``metric``: cosine | l2; ``first_layer``: always refresh layer 0 (reference behaviour);
    ``first_layer_prompt``: that refresh covers the prompt too (the reference; false: the response alone, the
    prompt at its own ``kp`` schedule - a few-shot prompt is most of the canvas);
    ``per_block``: restart the step counter at each block (the reference runs it across blocks)."""

    name: ClassVar[str] = "dllm"
    kp: int = 50
    kr: int = 7
    unit: str = "steps"
    first_layer_prompt: bool = True

    def __post_init__(self):
        for n in ("kp", "kr"):
            check_min(getattr(self, n), 1, f"--cache dllm.{n}")
        check_choice(self.unit, ("steps", "tokens"), "--cache dllm.unit")
        self.check_reuse("--cache dllm")

    @property
    def counts_tokens(self) -> bool:
        return self.unit == "tokens"

    def due(self, c: int, since: list[int]) -> tuple[bool, bool] | None:
        """``unit=tokens``: the prompt is refreshed once ``kp`` tokens changed since its last refresh, the response
        once ``kr`` did (a parallel sampler's step commits many: its features do not go stale over them)."""
        if not self.counts_tokens:
            return None
        return c == 0 or since[0] >= self.kp, c == 0 or since[1] >= self.kr

    def recomputes(self, c: int, layer: int, prompt: bool, due=None) -> tuple[bool, bool]:
        m = self.mode(c, layer, due)
        return (m in ("full", "prompt"), False) if prompt else (m in ("full", "response"), m == "adaptive")

    def mode(self, c: int, layer: int, due: tuple[bool, bool] | None = None) -> str:
        """What step ``c`` recomputes in ``layer``: full | prompt | response | adaptive (``due``: the parts
        refreshed at this step, by tokens; default: by steps, every ``kp`` / ``kr``)."""
        p, r = due if due is not None else (c % self.kp == 0, c % self.kr == 0)
        if c == 0 or (p and r):
            return "full"
        if self.first_layer and layer == 0:
            return "full" if p or self.first_layer_prompt else "response"
        return "prompt" if p else "response" if r else "adaptive"
