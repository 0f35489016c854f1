"""Fast-dLLM's ``prefix`` / ``dual`` caches (dllm_core ``PrefixCache`` / ``DualCache``) in SGLang's block scheduler.

The semantics are the embedded engine's (``dllm_core.generate`` with ``cache="prefix"`` / ``"dual"``): the
response is one canvas of ``max_new_tokens`` positions right after the prompt, decoded in blocks of
``block_size`` that start at the prompt end, with the masked rest of the response present in every step.
At a refresh (a new block or SlowFast span, or ``every`` steps: ``PrefixCache.refresh``) one forward runs
the whole sequence [0, P + G) bidirectionally; between refreshes only ``PrefixCache.host_rows`` are
recomputed (``dual``: the step's window, and the row left of it for Dream; ``prefix``: from the window to
the response end) against the K/V cached for every other position.

SGLang's scheduler knows nothing of this: it decodes blocks aligned to multiples of ``block_size`` from
position 0 (the first one holding the prompt tail) and nothing right of its block exists. Here its
block is only a window onto the request's canvas:

* the algorithm's ``FastDllmHost`` keeps each request's canvas (a ``Response``, bound to the request
  slot and its generation) and runs the embedded loop over it: every SGLang forward of a request being
  decoded is one step of that loop (``plan_step`` -> forward -> ``denoise_step``); SGLang's block ids
  mirror the canvas, and SGLang's block is done once its positions are decoded (a block of the loop may
  straddle two SGLang blocks). Prompt-prefill forwards and forwards after the response is decoded compute
  nothing (the first refresh recomputes the whole prompt anyway);
* the model's ``FastDllmForward`` runs the rows the host planned: the prompt's K/V are written in place
  into SGLang's KV pool (``set_kv_buffer`` at the ``req_to_token`` slots), the response's K/V into a
  per-request ``ResponseKV`` row beside the pool, and the queries attend (torch SDPA) to [the prompt's
  K/V from the pool ; the response's K/V from the store]. Its logits rows are the canvas block's
  (``full_logits`` row ``b * L + j`` = position ``start + j`` of request b; zeros where not computed).

dLLM-Cache with prompt refresh (``cache: dllm``, dllm_core ``DLLMCache``) runs on the same canvas and host
loop: every step plans the whole sequence [0, P + G) of each request at its own step counter c (its steps
so far, or the block's with ``per_block``), and ``FastDllmForward.cached_hidden`` runs each layer through
dllm_core's executor (``CachedStep``) with two ``Region``s per request - its prompt and its response, each
recomputed as ``DLLMCache.recomputes(c, layer, part)`` says, the response's adaptive rows picked by V-verify
over the response positions - with the features (K, V, attention and FFN outputs) kept per request
(``RequestFeatures``); a layer that recomputed the prompt writes its K/V into SGLang's pool.

Work accounting (the embedded engine's ``Counters`` units, ``dllm bench``'s work column): each ``Response``
counts the forwards of the embedded loop it took part in (one per step of its canvas), the token-layer
evaluations run for it (rows x layers: Fast-dLLM the rows its step recomputed, in every layer; dLLM-Cache
per layer the rows the executor ran through the full layer, its ``tally``) and ``full_token_layers``, what
the uncached loop runs for the same forwards ((P + G) x n_layers per step). ``FastDllmHost.work(rid)`` reads
a request's work (in flight, or one of the last ``WORK_KEPT`` finished: ``finished_work`` by request id);
a finished response logs it at debug level.

The prompt token ids and ``max_new_tokens`` are not in the ForwardBatch: the plugin's hook on
``ForwardBatch.init_new`` hands the batch's requests to the model (``FastDllmForward.expect``). The
in-place prefix refresh needs request-private KV slots: the radix cache is turned off at launch.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from types import SimpleNamespace

from dllm_core.cache import DLLMCache, PrefixCache
from dllm_core.cache.executor import CachedStep, FeatureStore
from dllm_core.engine.step import SlotGroups, denoise_step, plan_step
from dllm_core.sampling import TokenContext

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

logger = logging.getLogger(__name__)

WORK_KEPT = 4096  # finished requests whose work stays readable (``FastDllmHost.finished_work``)


class BatchRequests:
    """The SGLang ``Req``s of the next forward batch (prompt ids, output ids, sampling params, block offset),
    from the plugin's ``ForwardBatch.init_new`` hook: SGLang passes none of it to the algorithm or the model."""

    def __init__(self, what: str = "dllm-serve"):
        self.what, self.pending = what, None  # (request slots [B], the batch's Reqs)

    def expect(self, slots: torch.Tensor, reqs: list) -> None:
        self.pending = (slots, list(reqs))

    def requests(self, slots: list[int]) -> list:
        if self.pending is None or self.pending[0].tolist() != slots:
            raise RuntimeError(f"{self.what}: no request info for this batch; the dllm-serve SGLang plugin's "
                               "ForwardBatch.init_new hook must be live (SGLANG_PLUGINS must allow 'dllm')")
        return self.pending[1]


BATCH = BatchRequests()  # the algorithms' view (any model class)


class Response:
    """One request's canvas: prompt + response token ids [P + G], the block of the embedded loop in
    flight (``block``; G // L once decoded), its Fast-dLLM refresh key / age (host tensors) and its work
    (the embedded ``Counters`` units: ``forwards``, ``token_layers`` - an int, or a device scalar once
    the executor tallied dLLM-Cache rows: no sync per step - and ``full_token_layers``)."""

    def __init__(self, slot: int, gen: int, prompt, output, G: int, L: int, mask_id: int, device,
                 rid: str | None = None, block_steps: int = 0):
        out = list(output)[:G]  # committed before (a request SGLang retracted and re-admitted)
        self.slot, self.gen, self.P, self.G, self.L = slot, gen, len(prompt), G, L
        self.steps_per_block = block_steps or L  # the sampler's steps per block (fixed schedules)
        self.rid = rid if rid is not None else f"slot{slot}.gen{gen}"  # SGLang's request id
        self.forwards, self.full_token_layers = 0, 0
        self.token_layers: int | torch.Tensor = 0
        self.ids = torch.tensor([*prompt, *out, *[mask_id] * (G - len(out))], dtype=torch.long, device=device)
        self.block = len(out) // L
        self.new = True  # the sampler rows begin the block at the next step
        self.key = torch.full((1, 2), -1, dtype=torch.long)  # PrefixCache.refresh state
        self.age = torch.zeros(1, dtype=torch.long)
        self.row: int | None = None  # ResponseKV row while decoding
        self.feats: RequestFeatures | None = None  # dLLM-Cache features while decoding
        self.steps = self.block_steps = 0  # dLLM-Cache step counters: this generation's steps, this block's

    @property
    def end(self) -> int:
        return self.P + self.G

    @property
    def start(self) -> int:
        """First position of the block in flight."""
        return self.P + self.block * self.L

    @property
    def decoded(self) -> bool:
        return self.block * self.L >= self.G

    def block_ids(self) -> torch.Tensor:
        return self.ids[self.start:self.start + self.L]

    def work(self) -> dict[str, int]:
        """The request's work so far, in the embedded engine's ``Counters`` units."""
        return {"forwards": self.forwards, "token_layers": int(self.token_layers),
                "full_token_layers": self.full_token_layers}

    def count(self, token_layers, n_layers: int) -> None:
        """One forward of the embedded loop: ``token_layers`` run (rows x layers) against the uncached
        loop's whole sequence in every layer."""
        self.forwards += 1
        self.token_layers = self.token_layers + token_layers
        self.full_token_layers += self.end * n_layers


@dataclass
class RowPlan:
    """One request's share of a forward: positions [lo, hi) recomputed, logits for [start, start + L)."""

    resp: Response
    lo: int
    hi: int
    start: int
    step: int = 0  # dLLM-Cache: the request's step counter c (0 = first step: every layer recomputed)


@dataclass
class ForwardPlan:
    """Set on the model by the host right before a forward (rows: per batch row, None = nothing to run)."""

    slots: list[int]
    rows: list[RowPlan | None]
    shift: int  # Dream: the logit row of position i is the hidden state of i - 1
    cache: DLLMCache | None = None  # dLLM-Cache: every row [0, P + G) runs, per layer as ``recomputes`` says


class FastDllmHost:
    """The embedded engine's loop over the canvases of the requests in flight (algorithm side): sampler
    rows per request slot (dllm_core ``SlotStates``), refresh decisions (``PrefixCache.refresh`` /
    ``host_rows``) and commits (``denoise_step``). ``prepare`` plans a forward, ``step`` takes it."""

    def __init__(self, policy: PrefixCache | DLLMCache, opts, L: int, mask_id: int):
        self.policy, self.opts, self.sampler, self.L, self.mask_id = policy, opts, opts.sampler, L, mask_id
        self.responses: dict[int, Response] = {}  # by request slot (replaced when the slot's generation moves)
        self.rows: SlotGroups | None = None
        self.fwd: FastDllmForward | None = None
        self.batch: tuple[list[Response], list[int], list[int]] | None = None  # (responses, offsets, live rows)
        self.finished_work: OrderedDict[str, dict] = OrderedDict()  # the last WORK_KEPT finished, by request id

    def work(self, rid: str) -> dict[str, int] | None:
        """A request's work in the embedded engine's ``Counters`` units (``forwards``, ``token_layers``,
        ``full_token_layers``): in flight, or one of the last ``WORK_KEPT`` finished; None if unknown."""
        for r in self.responses.values():
            if r.rid == rid and not r.decoded:
                return r.work()
        return self.finished_work.get(rid)

    def finish(self, r: Response) -> None:
        """A response decoded: its work kept (by request id) and logged; its K/V row / features freed."""
        w = self.finished_work[r.rid] = r.work()
        self.finished_work.move_to_end(r.rid)
        while len(self.finished_work) > WORK_KEPT:
            self.finished_work.popitem(last=False)
        logger.debug("dllm-serve %s: request %s decoded: %d forwards, %d token-layers of %d uncached (%.3f)",
                     self.policy.name, r.rid, w["forwards"], w["token_layers"], w["full_token_layers"],
                     w["token_layers"] / max(w["full_token_layers"], 1))
        self.fwd.release(r)

    def prepare(self, model_runner, fb: ForwardBatch) -> None:
        """Before a forward: bind the batch's requests, begin new blocks and plan each row's rows."""
        model = model_runner.model
        self.fwd = fwd = getattr(model, "fast_dllm", None)
        if fwd is None:
            raise ValueError(f"cache {self.policy.name} needs a dllm-serve model class (LLaDAModelLM, DreamModel), "
                             f"got {type(model).__name__}")
        slots = fb.req_pool_indices.tolist()
        reqs = fwd.requests(slots)
        resps = self._bind(model_runner, slots, reqs, fb.input_ids.device)
        offsets = [int(r.dllm_block_offset) for r in reqs]  # SGLang's block: [offset, offset + L)
        # SGLang prefills blocks of committed tokens (the prompt; all it committed, after a retraction): no step
        live = [b for b, (r, q, o) in enumerate(zip(resps, reqs, offsets))
                if not r.decoded and o + self.L > len(q.origin_input_ids) + len(q.output_ids)]
        shift = int(model.core_cls.shift_logits)
        dllm = self.policy if isinstance(self.policy, DLLMCache) else None
        fwd.plan = ForwardPlan(slots, self._plan(resps, live, shift), shift, dllm)
        self.batch = (resps, offsets, live)

    def _plan(self, resps: list[Response], live: list[int], shift: int) -> list[RowPlan | None]:
        """Begin the live rows' new blocks; -> each batch row's rows of this step (None: not live)."""
        rows: list[RowPlan | None] = [None] * len(resps)
        if not live:
            return rows
        new = [b for b in live if resps[b].new]
        if new:
            for bs, idx, ss in self._groups(resps, new):
                ss.begin_block(idx, torch.stack([resps[b].block_ids() for b in bs]) == self.mask_id)
            for b in new:
                resps[b].new = False
                resps[b].block_steps = 0
        if isinstance(self.policy, DLLMCache):  # no focus: every step runs the whole sequence
            for b in live:
                rows[b] = self._plan_dllm(resps[b])
                self.fwd.bind(resps[b], self.policy)
            return rows
        for bs, idx, ss in self._groups(resps, live):
            x = torch.stack([resps[b].block_ids() for b in bs])
            flo, fhi = plan_step(self.sampler, ss.gather(idx), x == self.mask_id).focus
            for b, lo, hi in zip(bs, flo.tolist(), fhi.tolist()):
                rows[b] = self._plan_row(resps[b], lo, hi, shift)
                self.fwd.bind(resps[b])
        return rows

    def step(self, fb: ForwardBatch, logits: torch.Tensor, tc: TokenContext) -> list[bool]:
        """After the forward: one step of the loop for the live rows (logits [B * L, V] of their canvas
        blocks), the canvas mirrored into SGLang's block ids; -> per row whether SGLang's block is decoded."""
        resps, offsets, live = self.batch
        B, L = fb.batch_size, self.L
        for bs, idx, ss in self._groups(resps, live):
            st = ss.gather(idx)
            x = torch.stack([resps[b].block_ids() for b in bs])
            rows = torch.tensor(bs, device=logits.device)
            x, after = denoise_step(self.sampler, st, logits.view(B, L, -1)[rows], x, tc)
            ss.scatter(idx, st)
            for j, (b, fin) in enumerate(zip(bs, after.tolist())):
                r = resps[b]
                r.ids[r.start:r.start + L] = x[j]
                if fin:  # the loop's next block (its first step refreshes)
                    r.block, r.new = r.block + 1, True
                    if r.decoded:
                        self.finish(r)
        return self.mirror(fb, resps, offsets)

    def mirror(self, fb: ForwardBatch, resps: list[Response], offsets: list[int]) -> list[bool]:
        """SGLang's block ids [B, L] <- the canvas (mask ids past the response end: never emitted, SGLang
        stops at max_new_tokens); -> per row whether the block's response positions are decoded."""
        ids = fb.input_ids.view(fb.batch_size, self.L)
        span = []
        for b, (r, o) in enumerate(zip(resps, offsets)):
            n = max(0, min(self.L, r.end - o))
            ids[b, :n] = r.ids[o:o + n]
            ids[b, n:] = self.mask_id
            span.append(n)
        inside = torch.arange(self.L, device=ids.device) < torch.tensor(span, device=ids.device)[:, None]
        return (~((ids == self.mask_id) & inside).any(-1)).tolist()

    def _bind(self, model_runner, slots: list[int], reqs: list, device) -> list[Response]:
        """The batch's responses; a slot whose generation moved (a new request) gets a fresh one."""
        if self.rows is None:
            self.rows = SlotGroups(self.sampler, self.L, device)
        gens = model_runner.req_to_token_pool.req_generation[slots].tolist()
        out = []
        for slot, gen, req in zip(slots, gens, reqs):
            r = self.responses.get(slot)
            if r is None or r.gen != gen:
                if r is not None:
                    self.fwd.release(r)
                plan = self.opts.response(max(req.sampling_params.max_new_tokens or 0, 1), self.L)
                r = self.responses[slot] = Response(slot, gen, req.origin_input_ids, req.output_ids, plan.decoded,
                                                    self.L, self.mask_id, device, getattr(req, "rid", None),
                                                    plan.steps_per_block)
                self.rows.states(r.steps_per_block, slot + 1).reset(torch.tensor([slot], device=device))
            out.append(r)
        return out

    def _groups(self, resps: list[Response], rows: list[int]):
        """Batch rows grouped by their steps per block: [(rows, request slots [m], SlotStates)]."""
        return [([rows[i] for i in g], idx, ss) for g, idx, ss in
                self.rows.split([resps[b].slot for b in rows], [resps[b].steps_per_block for b in rows])]

    def _plan_dllm(self, r: Response) -> RowPlan:
        """dLLM-Cache: the whole sequence, at the request's step counter (``DLLMCache.counter``)."""
        c = self.policy.counter(r.steps, r.block_steps)
        r.steps, r.block_steps = r.steps + 1, r.block_steps + 1
        return RowPlan(r, 0, r.end, r.start, c)

    def _plan_row(self, r: Response, lo: int, hi: int, shift: int) -> RowPlan:
        """The embedded loop's ``fresh`` range (shifted one left for Dream) -> refresh -> rows recomputed."""
        a, c0, c1 = self.policy.host_step(r.key, r.age, r.start, (lo, hi), shift, r.P, r.G)
        return RowPlan(r, a if a < r.P else r.P + c0, r.P + c1, r.start)


class ResponseKV:
    """Per-layer K/V of the response positions of the requests being decoded: k / v [n_layers, R, G, Hkv, D]
    (a request holds one row from its first step to its last; rows and length grow on demand)."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, like: torch.Tensor):
        self.k = like.new_zeros(n_layers, 0, 0, n_kv, head_dim)
        self.v = self.k.clone()
        self.free: list[int] = []

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def take(self, G: int) -> int:
        if G > self.length:
            self.k, self.v = (F.pad(t, (0, 0, 0, 0, 0, G - self.length)) for t in (self.k, self.v))
        if not self.free:
            old = self.rows
            grow = max(old, 4)
            self.k, self.v = (F.pad(t, (0, 0, 0, 0, 0, 0, 0, grow)) for t in (self.k, self.v))
            self.free = list(range(old + grow - 1, old - 1, -1))
        return self.free.pop()

    def release(self, row: int) -> None:
        self.free.append(row)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's k / v as flat rows [R * G, Hkv, D] (row r, position g at r * G + g)."""
        return self.k[i].flatten(0, 1), self.v[i].flatten(0, 1)


@dataclass
class KeyLayout:
    """Index tensors of one forward over m requests (N computed rows, T = the longest sequence):
    where each request's keys come from and where each computed row's K/V go."""

    qidx: torch.Tensor   # [m, n] flat computed row of each query (padded with 0)
    qmask: torch.Tensor  # [m, n] real queries
    kmask: torch.Tensor  # [m, T] positions < the request's end
    kside: torch.Tensor  # [m, T] response positions (from the store; others from the pool)
    kpool: torch.Tensor  # [m, T] pool slot of each prompt position (0 elsewhere)
    kstore: torch.Tensor  # [m, T] store row of each response position (0 elsewhere)
    prow: torch.Tensor   # [n_p] computed rows at prompt positions ...
    ploc: torch.Tensor   # [n_p] ... and their pool slots
    srow: torch.Tensor   # [n_s] computed rows at response positions ...
    sidx: torch.Tensor   # [n_s] ... and their store rows

    @classmethod
    def build(cls, rows: list[RowPlan], pos: torch.Tensor, r2t: torch.Tensor, G: int) -> "KeyLayout":
        dev = pos.device
        P, E, lo, slot, srow = (torch.tensor(v, device=dev) for v in zip(*[
            (r.resp.P, r.resp.end, r.lo, r.resp.slot, r.resp.row) for r in rows]))
        n = torch.tensor([r.hi - r.lo for r in rows], device=dev)
        T, Pm = int(max(r.resp.end for r in rows)), int(max(r.resp.P for r in rows))
        t = torch.arange(T, device=dev)
        kmask, kside = t < E[:, None], t >= P[:, None]
        kpool = F.pad(r2t[slot, :Pm].long(), (0, T - Pm)).masked_fill(kside | ~kmask, 0)
        kstore = torch.where(kside & kmask, srow[:, None] * G + t - P[:, None], 0)
        rid = torch.repeat_interleave(torch.arange(len(rows), device=dev), n)  # [N] request of each row
        prompt = pos < P[rid]
        loc = r2t[slot[rid], pos.clamp(max=Pm - 1)].long()
        j = torch.arange(int(n.max()), device=dev)
        qmask = j < n[:, None]
        qidx = torch.where(qmask, (n.cumsum(0) - n)[:, None] + j, 0)
        return cls(qidx, qmask, kmask, kside, kpool, kstore, prompt.nonzero()[:, 0], loc[prompt],
                   (~prompt).nonzero()[:, 0], (srow[rid] * G + pos - P[rid])[~prompt])


class FastDllmForward:
    """The model side: request info from the ForwardBatch hook, the response K/V store and the forward of
    the rows a ``ForwardPlan`` names (SGLang's layers; attention over the pool + the store)."""

    def __init__(self, model):
        self.model = model
        self.reqs = BatchRequests("Fast-dLLM cache")
        self.plan: ForwardPlan | None = None
        self.kv: ResponseKV | None = None
        self.tallies: torch.Tensor | None = None  # dLLM-Cache: [m] token-layers of the last forward's requests

    def expect(self, slots: torch.Tensor, reqs: list) -> None:
        """The next batch's request slots and SGLang ``Req``s, from the plugin's ``ForwardBatch.init_new`` hook."""
        self.reqs.expect(slots, reqs)

    def requests(self, slots: list[int]) -> list:
        return self.reqs.requests(slots)

    def bind(self, r: Response, cache: DLLMCache | None = None) -> None:
        """A response K/V row for a request being decoded (dLLM-Cache: its prompt / response features)."""
        if cache is not None:
            if r.feats is None:
                att = self.model.layers[0].self_attn
                r.feats = RequestFeatures.new(cache, len(self.model.layers), r.P, r.G, att.n_kv * att.head_dim,
                                              self.model.args.dim, self.model.embed.weight)
            return
        if r.row is None:
            if self.kv is None:
                att = self.model.layers[0].self_attn
                self.kv = ResponseKV(len(self.model.layers), att.n_kv, att.head_dim, self.model.embed.weight)
            r.row = self.kv.take(r.G)

    def release(self, r: Response) -> None:
        r.feats = None
        if r.row is not None:
            self.kv.release(r.row)
            r.row = None

    def active(self, fb: ForwardBatch) -> bool:
        return self.plan is not None and fb.forward_mode.is_dllm_extend()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch):
        """The planned rows -> SGLang's logits output, ``full_logits`` [B * L, V] over the canvas blocks."""
        plan, self.plan = self.plan, None
        if plan.slots != fb.req_pool_indices.tolist():
            raise RuntimeError("Fast-dLLM cache: the forward's batch is not the one the algorithm planned")
        m, B = self.model, fb.batch_size
        L = input_ids.shape[0] // B
        h = m.embed.weight.new_zeros(B * L, m.args.dim)
        live = [(b, r) for b, r in enumerate(plan.rows) if r is not None]
        if live:
            rows = [r for _, r in live]
            hid = self.hidden(rows) if plan.cache is None else self.cached_hidden(rows, plan.cache)
            n_layers = len(m.layers)
            for r, t in zip(rows, self.tallies if plan.cache is not None else [None] * len(rows)):
                r.resp.count((r.hi - r.lo) * n_layers if t is None else t, n_layers)
            src, dst, off = [], [], 0
            for b, r in live:  # logit row of canvas position start + j: hidden state of start + j - shift
                for j in range(L):
                    p = r.start + j - plan.shift
                    if r.lo <= p < r.hi:
                        src.append(off + p - r.lo)
                        dst.append(b * L + j)
                off += r.hi - r.lo
            h[torch.tensor(dst, device=h.device)] = m.norm(hid[torch.tensor(src, device=h.device)])
        return m.logits_processor(input_ids, h, m.lm_head, fb)

    @staticmethod
    def pool(name: str = "Fast-dLLM cache: the prefix refresh"):
        pool = get_token_to_kv_pool()
        if pool.dtype not in (torch.float16, torch.bfloat16, torch.float32) or getattr(pool, "use_hnd", False):
            raise ValueError(f"{name} needs an unquantized KV cache in SGLang's slot-row "
                             f"layout (--kv-cache-dtype auto, no SGLANG_USE_HND_KVCACHE), got {pool.dtype}")
        return pool

    def hidden(self, rows: list[RowPlan]) -> torch.Tensor:
        """Pre-norm final hidden states [N, d] of the rows [lo, hi) of each request, concatenated."""
        m = self.model
        dev = m.embed.weight.device
        pool = self.pool()
        pos = torch.cat([torch.arange(r.lo, r.hi, device=dev) for r in rows])  # [N]
        lay = KeyLayout.build(rows, pos, get_req_to_token_pool().req_to_token, self.kv.length)
        x = m.embed(torch.cat([r.resp.ids[r.lo:r.hi] for r in rows]))
        for i, layer in enumerate(m.layers):
            x = self.layer(layer, i, x, pos, lay, pool)
        return x

    def layer(self, layer, i: int, x: torch.Tensor, pos: torch.Tensor, lay: KeyLayout, pool) -> torch.Tensor:
        """One layer over the computed rows x [N, d]: their K/V written (pool / store), queries attending
        to every position of their request."""
        att = layer.self_attn
        N, Hq, Hkv, D = x.shape[0], att.n_heads, att.n_kv, att.head_dim
        q, k, v = att.qkv(pos, layer.attn_norm(x))
        k, v = k.view(N, Hkv, D), v.view(N, Hkv, D)
        if lay.prow.numel():
            pool.set_kv_buffer(att.attn, lay.ploc, k[lay.prow], v[lay.prow])
        sk, sv = self.kv.layer(i)
        sk[lay.sidx], sv[lay.sidx] = k[lay.srow], v[lay.srow]
        side = lay.kside[..., None, None]
        lid = att.attn.layer_id
        K = torch.where(side, sk[lay.kstore], pool.get_key_buffer(lid)[lay.kpool].to(q.dtype))  # [m, T, Hkv, D]
        V = torch.where(side, sv[lay.kstore], pool.get_value_buffer(lid)[lay.kpool].to(q.dtype))
        Q = q.view(N, Hq, D)[lay.qidx]  # [m, n, Hq, D]
        o = F.scaled_dot_product_attention(Q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2),
                                           attn_mask=lay.kmask[:, None, None, :], scale=att.attn.scaling,
                                           enable_gqa=Hq != Hkv)
        a, _ = att.o_proj(o.transpose(1, 2)[lay.qmask].reshape(N, Hq * D))
        h = x + a
        return h + layer.ffn(h)

    def cached_hidden(self, rows: list[RowPlan], cache: DLLMCache) -> torch.Tensor:
        """dLLM-Cache: pre-norm final hidden states [N, d] of every position [0, P + G) of each request,
        concatenated. Each layer runs through dllm_core's executor (``CachedStep``) with two regions per
        request - its prompt (features per request, no adaptive pick) and its response (V-verify over the
        response positions) - each recomputed as ``DLLMCache.recomputes(c, layer, part)`` says at the
        request's step c; the prompt's K/V of the layers that recomputed it are written into SGLang's pool."""
        m = self.model
        dev = m.embed.weight.device
        pool = self.pool("dLLM-Cache: the prompt refresh")
        ends = [r.resp.end for r in rows]
        off = [0, *torch.tensor(ends).cumsum(0).tolist()]
        pos = torch.cat([torch.arange(e, device=dev) for e in ends])  # [N]
        x = m.embed(torch.cat([r.resp.ids for r in rows]))
        regions, zero = [], torch.zeros(1, dtype=torch.long, device=dev)
        for r, o in zip(rows, off):
            P, G, f = r.resp.P, r.resp.G, r.resp.feats
            regions += cache.host_regions(r.step, torch.arange(o, o + P, device=dev)[None], f.prompt,
                                          torch.arange(o + P, o + P + G, device=dev)[None], zero, f.response, f.reuse)
        step = CachedStep(regions)
        attend = SdpaAttend(off, dev)
        r2t = get_req_to_token_pool().req_to_token
        ploc = torch.cat([r2t[r.resp.slot, :r.resp.P].long() for r in rows])  # pool slots of the prompts
        tally = torch.zeros(pos.shape[0], dtype=torch.long, device=dev)  # full-layer runs per row (work)
        for i, layer in enumerate(m.layers):
            att = layer.self_attn
            ops = SimpleNamespace(qkv=lambda h, p, layer=layer: layer.self_attn.qkv(p, layer.attn_norm(h)),
                                  value=lambda h, layer=layer: layer.self_attn.value(layer.attn_norm(h)),
                                  attend=lambda q, k, v, ridx, att=att: attend(att, q, k, v, ridx), ffn=layer.ffn)
            x = step.layer(ops, x, pos, i, tally=tally)
            if any(cache.recomputes(r.step, i, True)[0] for r in rows):  # the prompts' K/V moved: into the pool
                k, v = (torch.cat([b[i, 0] for b in bufs]) for bufs in zip(*[
                    (r.resp.feats.prompt.bufs[0], r.resp.feats.prompt.bufs[1]) for r in rows]))
                pool.set_kv_buffer(att.attn, ploc, k.view(-1, att.n_kv, att.head_dim),
                                   v.view(-1, att.n_kv, att.head_dim))
        rid = torch.repeat_interleave(torch.arange(len(rows), device=dev), torch.tensor(ends, device=dev))
        self.tallies = torch.zeros(len(rows), dtype=torch.long, device=dev).index_add_(0, rid, tally)  # no sync
        return x


class SeededReuse:
    """A request's ``DLLMCache`` with its own generator for ``select=random`` (the embedded state seeds one
    per generation with ``seed``), so the picks do not depend on the other requests of the batch."""

    def __init__(self, policy: DLLMCache, device):
        self.policy, self.gen = policy, torch.Generator(device).manual_seed(policy.seed)

    @property
    def select(self) -> str:
        return self.policy.select

    def n_update(self, candidates: int) -> int:
        return self.policy.n_update(candidates)

    def pick(self, new, old, n, generator=None):
        return self.policy.pick(new, old, n, self.gen)


@dataclass
class RequestFeatures:
    """One request's dLLM-Cache features for every layer: its prompt's [n_layers, 1, P, *] and its
    response's [n_layers, 1, G, *] (dllm_core ``FeatureStore``s), and its V-verify policy."""

    prompt: FeatureStore
    response: FeatureStore
    reuse: SeededReuse

    @classmethod
    def new(cls, cache: DLLMCache, n_layers: int, P: int, G: int, kv: int, d: int, like: torch.Tensor):
        return cls(FeatureStore(n_layers, 1, P, kv, d, like), FeatureStore(n_layers, 1, G, kv, d, like),
                   SeededReuse(cache, like.device))


class SdpaAttend:
    """dllm_core ``LayerOps.attend`` over m requests laid out back to back in the forward's rows
    (request i: rows [off[i], off[i + 1]), its whole sequence): each recomputed query attends
    bidirectionally to every position of its own request (torch SDPA)."""

    def __init__(self, off: list[int], device):
        self.off = torch.tensor(off, device=device)
        n = self.off.diff()
        t = torch.arange(int(n.max()), device=device)
        self.kmask = t < n[:, None]                                    # [m, T]
        self.kidx = torch.where(self.kmask, self.off[:-1, None] + t, 0)  # [m, T] row of each key

    def __call__(self, att, q, k, v, ridx):
        D, Hq, Hkv = att.head_dim, att.n_heads, att.n_kv
        rid = torch.searchsorted(self.off[1:], ridx, right=True)  # request of each query row (ridx ascending)
        n = torch.bincount(rid, minlength=self.kmask.shape[0])
        j = torch.arange(int(n.max()), device=q.device)
        qmask = j < n[:, None]
        qidx = torch.where(qmask, (n.cumsum(0) - n)[:, None] + j, 0)
        Q = q.view(-1, Hq, D)[qidx].transpose(1, 2)            # [m, Hq, nq, D]
        K = k.view(-1, Hkv, D)[self.kidx].transpose(1, 2)      # [m, Hkv, T, D]
        V = v.view(-1, Hkv, D)[self.kidx].transpose(1, 2)
        o = F.scaled_dot_product_attention(Q, K, V, attn_mask=self.kmask[:, None, None, :], scale=att.attn.scaling,
                                           enable_gqa=Hq != Hkv)
        out, _ = att.o_proj(o.transpose(1, 2)[qmask].reshape(q.shape[0], Hq * D))
        return out
