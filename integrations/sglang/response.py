"""The embedded engine's semantics in SGLang's block scheduler for a cache policy over the whole response
(``cache: prefix`` / ``dual`` / ``dllm``, or any dllm_core policy that refreshes the prefix).

The response is one canvas of ``max_new_tokens`` positions (whole blocks) right after the prompt, decoded in
blocks of ``block_size`` that start at the prompt end, with the masked rest of the response present in every
step. SGLang's scheduler knows nothing of this: it decodes blocks aligned to multiples of ``block_size`` from
position 0 and nothing right of its block exists. Here its block is only a window onto the request's canvas:

* the algorithm's ``ResponseHost`` keeps each request's canvas (a ``Response``, bound to the request slot and
  its generation, with the core's ``HostRequest``) and runs the embedded loop over it: every SGLang forward of
  a request being decoded is one step (``plan_step`` -> the policy's ``HostPlan`` -> forward ->
  ``denoise_step``); SGLang's block ids mirror the canvas, and SGLang's block is done once its positions are
  decoded. Prompt-prefill forwards and forwards after the response is decoded compute nothing;
* the model's ``ResponseForward`` runs every position [0, P + G) of each live request through dllm_core's
  executor (``CachedStep``): two regions per request, its prompt and its response (``HostPlan.cover``), each
  with its features (K, V, attention and FFN outputs) kept per request (``PartStores``) and recomputed per
  layer as the plan says; queries attend (torch SDPA) to every position of their request. A layer that
  recomputed prompt positions writes the prompt's K/V into SGLang's pool. Its logits rows are the canvas
  block's (``full_logits`` row ``b * L + j`` = position ``start + j`` of request b).

Work accounting (the embedded engine's ``Counters`` units): each request's ``HostRequest`` counts the forwards
it took part in, the rows x layers the executor ran through the full layer (its ``tally``) and what the
uncached loop runs for the same forwards. ``ResponseHost.work(rid)`` reads it (in flight, or one of the last
``WORK_KEPT`` finished).

The prompt token ids and ``max_new_tokens`` are not in the ForwardBatch: the plugin's hook on
``ForwardBatch.init_new`` hands the batch's requests over (``BatchRequests``).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from dllm_core.cache import CachePolicy, HostPlan, HostRequest
from dllm_core.cache.executor import CachedStep, PartStores
from dllm_core.engine.step import SlotGroups, denoise_step, plan_step
from dllm_core.sampling import TokenContext

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

logger = logging.getLogger(__name__)

WORK_KEPT = 4096  # finished requests whose work stays readable (``ResponseHost.finished_work``)


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
    """One request's canvas: prompt + response token ids [P + G], the block of the loop in flight (``block``;
    G // L once decoded), the core's per-request state (``host``: policy counters, work) and, while decoding,
    its features (``feats``)."""

    def __init__(self, slot: int, gen: int, prompt, output, G: int, L: int, mask_id: int, device,
                 host: HostRequest, rid: str | None = None, block_steps: int = 0):
        out = list(output)[:G]  # committed before (a request SGLang retracted and re-admitted)
        self.slot, self.gen, self.P, self.G, self.L, self.host = slot, gen, len(prompt), G, L, host
        self.steps_per_block = block_steps or L  # the sampler's steps per block (fixed schedules)
        self.rid = rid if rid is not None else f"slot{slot}.gen{gen}"  # SGLang's request id
        self.ids = torch.tensor([*prompt, *out, *[mask_id] * (G - len(out))], dtype=torch.long, device=device)
        self.block = len(out) // L
        self.new = True  # the sampler rows begin the block at the next step
        self.feats: PartStores | None = None  # its features while decoding, per part (prompt, response)
        host.begin_canvas(self.P)

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


@dataclass
class RowPlan:
    """One request's share of a forward: the core's plan of its step, logits for [start, start + L)."""

    resp: Response
    plan: HostPlan
    start: int


@dataclass
class ForwardPlan:
    """Set on the model by the host right before a forward (rows: per batch row, None = nothing to run)."""

    slots: list[int]
    rows: list[RowPlan | None]
    shift: int  # Dream: the logit row of position i is the hidden state of i - 1


class ResponseHost:
    """The embedded engine's loop over the canvases of the requests in flight (algorithm side): sampler rows per
    request slot (dllm_core ``SlotGroups``), the policy's plan of each step (``HostRequest.plan``) and commits
    (``denoise_step``). ``prepare`` plans a forward, ``step`` takes it."""

    def __init__(self, policy: CachePolicy, opts, L: int, mask_id: int):
        self.policy, self.opts, self.sampler, self.L, self.mask_id = policy, opts, opts.sampler, L, mask_id
        self.responses: dict[int, Response] = {}  # by request slot (replaced when the slot's generation moves)
        self.rows: SlotGroups | None = None
        self.fwd: ResponseForward | None = None
        self.batch: tuple[list[Response], list[int], list[int]] | None = None  # (responses, offsets, live rows)
        self.finished_work: OrderedDict[str, dict] = OrderedDict()  # the last WORK_KEPT finished, by request id

    def work(self, rid: str) -> dict[str, int] | None:
        """A request's work in the embedded engine's ``Counters`` units (``forwards``, ``token_layers``,
        ``full_token_layers``): in flight, or one of the last ``WORK_KEPT`` finished; None if unknown."""
        for r in self.responses.values():
            if r.rid == rid and not r.decoded:
                return r.host.work()
        return self.finished_work.get(rid)

    def finish(self, r: Response) -> None:
        """A response decoded: its work kept (by request id) and logged; its features freed."""
        w = self.finished_work[r.rid] = r.host.work()
        self.finished_work.move_to_end(r.rid)
        while len(self.finished_work) > WORK_KEPT:
            self.finished_work.popitem(last=False)
        logger.debug("dllm-serve %s: request %s decoded: %d forwards, %d token-layers of %d uncached (%.3f)",
                     self.policy.name, r.rid, w["forwards"], w["token_layers"], w["full_token_layers"],
                     w["token_layers"] / max(w["full_token_layers"], 1))
        self.fwd.release(r)

    def prepare(self, model_runner, fb: ForwardBatch) -> None:
        """Before a forward: bind the batch's requests, begin new blocks and plan each live row's step."""
        model = model_runner.model
        self.fwd = fwd = getattr(model, "response_forward", None)
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
        fwd.plan = ForwardPlan(slots, self._plan(resps, live, shift), shift)
        self.batch = (resps, offsets, live)

    def _plan(self, resps: list[Response], live: list[int], shift: int) -> list[RowPlan | None]:
        """Begin the live rows' new blocks; -> each batch row's plan of this step (None: not live)."""
        rows: list[RowPlan | None] = [None] * len(resps)
        for bs, idx, ss, key in self._groups(resps, live):
            x = torch.stack([resps[b].block_ids() for b in bs])
            new = [j for j, b in enumerate(bs) if resps[b].new]
            if new:
                ss.begin_block(idx[new], x[new] == self.mask_id)
                for j in new:
                    resps[bs[j]].new = False
                    resps[bs[j]].host.begin_block()
            flo, fhi = plan_step(self.sampler, ss.gather(idx, key), x == self.mask_id).focus
            for b, lo, hi in zip(bs, flo.tolist(), fhi.tolist()):
                r = resps[b]
                rows[b] = RowPlan(r, r.host.plan(r.start, (lo, hi), shift, r.P, r.G), r.start)
                self.fwd.bind(r)
        return rows

    def step(self, fb: ForwardBatch, logits: torch.Tensor, tc: TokenContext) -> list[bool]:
        """After the forward: one step of the loop for the live rows (logits [B * L, V] of their canvas
        blocks), the canvas mirrored into SGLang's block ids; -> per row whether SGLang's block is decoded."""
        resps, offsets, live = self.batch
        B, L = fb.batch_size, self.L
        for bs, idx, ss, key in self._groups(resps, live):
            st = ss.gather(idx, key)
            x = torch.stack([resps[b].block_ids() for b in bs])
            x, after = denoise_step(self.sampler, st, logits.view(B, L, -1)[torch.tensor(bs, device=logits.device)],
                                    x, tc)
            ss.scatter(idx, st, key)
            for j, (b, fin) in enumerate(zip(bs, after.tolist())):
                r = resps[b]
                r.ids[r.start:r.start + L] = x[j]
                if fin:  # the loop's next block
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
                                                    self.L, self.mask_id, device, HostRequest(self.policy, 0),
                                                    getattr(req, "rid", None), plan.steps_per_block)
                self.rows.states(r.steps_per_block, slot + 1).reset(torch.tensor([slot], device=device))
            out.append(r)
        return out

    def _groups(self, resps: list[Response], rows: list[int]):
        """Batch rows grouped by their steps per block: [(rows, request slots [m], SlotStates, key)]."""
        return [([rows[i] for i in g], idx, ss, key) for g, idx, ss, key in
                self.rows.split([resps[b].slot for b in rows], [resps[b].steps_per_block for b in rows])]


class ResponseForward:
    """The model side: request info from the ForwardBatch hook, the requests' features and the forward of the
    planned rows (SGLang's layers through dllm_core's executor; attention over each request's positions)."""

    def __init__(self, model):
        self.model = model
        self.reqs = BatchRequests("whole-response cache")
        self.plan: ForwardPlan | None = None

    def expect(self, slots: torch.Tensor, reqs: list) -> None:
        """The next batch's request slots and SGLang ``Req``s, from the plugin's ``ForwardBatch.init_new`` hook."""
        self.reqs.expect(slots, reqs)

    def requests(self, slots: list[int]) -> list:
        return self.reqs.requests(slots)

    def bind(self, r: Response) -> None:
        """Features for a request being decoded: its prompt's and its response's, in every layer."""
        if r.feats is None:
            att = self.model.layers[0].self_attn
            r.feats = PartStores(len(self.model.layers), att.n_kv * att.head_dim, self.model.args.dim,
                                 self.model.embed.weight)

    def release(self, r: Response) -> None:
        r.feats = None

    def active(self, fb: ForwardBatch) -> bool:
        return self.plan is not None and fb.forward_mode.is_dllm_extend()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch):
        """The planned rows -> SGLang's logits output, ``full_logits`` [B * L, V] over the canvas blocks."""
        plan, self.plan = self.plan, None
        if plan.slots != fb.req_pool_indices.tolist():
            raise RuntimeError("whole-response cache: the forward's batch is not the one the algorithm planned")
        m, B = self.model, fb.batch_size
        L = input_ids.shape[0] // B
        h = m.embed.weight.new_zeros(B * L, m.args.dim)
        live = [(b, r) for b, r in enumerate(plan.rows) if r is not None]
        if live:
            rows = [r for _, r in live]
            hid, off = self.hidden(rows), [0]
            for r in rows:
                off.append(off[-1] + r.resp.end)
            b_idx = torch.tensor([b for b, _ in live], device=h.device)[:, None] * L + torch.arange(L, device=h.device)
            src = torch.tensor([[o + r.start + j - plan.shift for j in range(L)] for o, r in zip(off, rows)],
                               device=h.device)  # [m, L] the hidden row of each canvas block position
            h[b_idx.flatten()] = m.norm(hid[src.flatten()])
        return m.logits_processor(input_ids, h, m.lm_head, fb)

    def hidden(self, rows: list[RowPlan]) -> torch.Tensor:
        """Pre-norm final hidden states [N, d] of every position [0, P + G) of each request, concatenated. Each
        layer runs through dllm_core's executor (``CachedStep``) with two regions per request - its prompt and
        its response - recomputed as the request's plan says (``HostPlan.cover``); the prompt's K/V of a layer
        that recomputed some of it are written into SGLang's pool."""
        m = self.model
        dev = m.embed.weight.device
        pool = get_token_to_kv_pool()
        ends = [r.resp.end for r in rows]
        off = [0, *torch.tensor(ends).cumsum(0).tolist()]
        pos = torch.cat([torch.arange(e, device=dev) for e in ends])  # [N]
        x = m.embed(torch.cat([r.resp.ids for r in rows]))
        regions = [r.plan.regions(o, r.resp.feats, dev, [r.plan.cover("prompt", 0, r.resp.P),
                                                         r.plan.cover("response", r.resp.P, r.resp.end)])
                   for r, o in zip(rows, off)]
        prompts = [g[0] for g in regions]
        step = CachedStep([g for pair in regions for g in pair])
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
            if any(bool(g.plan(i)[0].any()) for g in prompts):  # the prompts' K/V moved: into the pool
                k, v = (torch.cat([g.store.bufs[j][i, 0] for g in prompts]) for j in (0, 1))
                pool.set_kv_buffer(att.attn, ploc, k.view(-1, att.n_kv, att.head_dim), v.view(-1, att.n_kv, att.head_dim))
        rid = torch.repeat_interleave(torch.arange(len(rows), device=dev), torch.tensor(ends, device=dev))
        work = torch.zeros(len(rows), dtype=torch.long, device=dev).index_add_(0, rid, tally)  # no sync
        for r, w in zip(rows, work):
            r.resp.host.count(w, r.resp.end * len(m.layers))
        return x


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
