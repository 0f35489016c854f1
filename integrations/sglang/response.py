"""A policy that refreshes the prefix (``cache: prefix`` / ``dual`` / ``dllm``) in SGLang's block scheduler, with the
embedded engine's semantics: each response one canvas after its prompt, SGLang's block a window onto it.
``ResponseHost`` (algorithm side) steps each request on the core's ``ResponseSlots``; ``ResponseForward`` (model
side) runs each live request's positions [0, P + G) as the core's ``PackedStep``, planned in the core's ``StepContext``
(``integrations/sglang/README.md``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from dllm_core.cache import CachePolicy, HostPlan, HostRequest
from dllm_core.cache.host import PackedStep
from dllm_core.cache.executor import PartStores
from dllm_core.engine.context import StepContext
from dllm_core.engine.slots import ResponseSlots, SlotConfig

from .options import logprobs, request

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

logger = logging.getLogger(__name__)


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


@dataclass
class Response:
    """One request on the core's slots: prompt ids [P], ``G`` response positions (``ResponseSlots.canvas[slot, :G]``),
    its slot and generation; while decoding, its features (``feats``)."""

    slot: int
    gen: int
    rid: str
    prompt: torch.Tensor  # [P]
    G: int
    feats: PartStores | None = None

    def __post_init__(self):
        self.P, self.end = self.prompt.shape[0], self.prompt.shape[0] + self.G


@dataclass
class RowPlan:
    """One request's share of a forward: the core's plan of its step, logits for [start, start + L)."""

    resp: Response
    plan: HostPlan
    start: int
    ids: torch.Tensor  # [P + G] its sequence


@dataclass
class ForwardPlan:
    """The host's rows of a forward (``StepContext.packed``; rows: per batch row, None = nothing to run)."""

    slots: list[int]
    rows: list[RowPlan | None]
    shift: int  # Dream: the logit row of position i is the hidden state of i - 1


class SlotsHost:
    """SGLang's request slots on the core's ``ResponseSlots``: a slot whose generation moved holds a new request
    (``admit``); ``prepare(model_runner, fb, states)`` plans a forward, ``step(fb, logits, states)`` takes it."""

    def __init__(self, policy: CachePolicy, opts, L: int, mask_id: int):
        self.policy, self.opts, self.L, self.mask_id = policy, opts, L, mask_id
        self.core: ResponseSlots | None = None
        self.gens: dict[int, int] = {}  # the request generation each slot was admitted with

    @property
    def finished_work(self) -> dict[str, dict]:
        return {} if self.core is None else self.core.finished_work

    def work(self, rid: str) -> dict[str, int] | None:
        """A request's work in the embedded engine's ``Counters`` units (``forwards``, ``token_layers``,
        ``full_token_layers``): in flight, or one of the last finished; None if unknown."""
        return None if self.core is None else self.core.work(rid)

    def bind(self, model_runner, fb: ForwardBatch) -> list | None:
        """Admit the batch's new requests; -> the batch's ``Req``s (None when not needed)."""
        slots, model = fb.req_pool_indices.tolist(), model_runner.model
        if self.core is None:
            self.core = ResponseSlots(0, self.L, self.mask_id, fb.input_ids.device, seed=self.opts.decode.seed,
                                      layers=len(getattr(model, "layers", ())))
        gens = model_runner.req_to_token_pool.req_generation[slots].tolist()
        new = [(i, s, g) for i, (s, g) in enumerate(zip(slots, gens)) if self.gens.get(s) != g]
        reqs = BATCH.requests(slots) if new else None
        for i, s, g in new:
            self.core.fit(s + 1, self.L)
            if self.core.config[s] is not None:
                self.release(s)
            self.admit(s, g, None if reqs is None else reqs[i], model, fb.input_ids.device)
            self.gens[s] = g
        return reqs

    def admit(self, slot: int, gen: int, req, model, device) -> None:
        raise NotImplementedError

    def release(self, slot: int) -> None:
        self.core.release(slot)


class ResponseHost(SlotsHost):
    """A policy over the whole response: each request's canvas on the core's slots, planned for the model's
    ``ResponseForward`` (``begin`` / ``plan``), taken (``take``) and mirrored into SGLang's block ids."""

    active: "ResponseHost | None" = None  # this process's (one algorithm per scheduler): its logprobs are reported

    def __init__(self, policy: CachePolicy, opts, L: int, mask_id: int):
        super().__init__(policy, opts, L, mask_id)
        ResponseHost.active = self
        self.responses: dict[int, Response] = {}  # by request slot (replaced when the slot's generation moves)
        self.fwd: ResponseForward | None = None
        self.batch: tuple[list[Response], list[int], np.ndarray] | None = None  # (responses, offsets, live rows)

    def finish(self, r: Response) -> None:
        """A response decoded: its work kept (by request id) and logged; its features freed."""
        self.core.release(r.slot)
        w = self.core.finished_work[r.rid]
        logger.debug("dllm-serve %s: request %s decoded: %d forwards, %d token-layers of %d uncached (%.3f)",
                     self.policy.name, r.rid, w["forwards"], w["token_layers"], w["full_token_layers"],
                     w["token_layers"] / max(w["full_token_layers"], 1))
        self.fwd.release(r)

    def release(self, slot: int) -> None:
        self.core.release(slot)
        self.fwd.release(self.responses[slot])

    def prepare(self, model_runner, fb: ForwardBatch, states=None) -> None:
        """Before a forward: bind the batch's requests, begin new blocks and plan each live row's step."""
        model = model_runner.model
        self.fwd = fwd = getattr(model, "response_forward", None)
        if fwd is None:
            raise ValueError(f"cache {self.policy.name} needs a dllm-serve model class (LLaDAModelLM, DreamModel), "
                             f"got {type(model).__name__}")
        self.bind(model_runner, fb)
        slots = fb.req_pool_indices.tolist()
        reqs, resps, core = BATCH.requests(slots), [self.responses[s] for s in slots], self.core
        offsets = [int(r.dllm_block_offset) for r in reqs]  # SGLang's block: [offset, offset + L)
        # SGLang prefills blocks of committed tokens (the prompt; all it committed, after a retraction): no step
        live = np.array([b for b, (r, q, o) in enumerate(zip(resps, reqs, offsets)) if core.config[r.slot] is not None
                         and o + self.L > len(q.origin_input_ids) + len(q.output_ids)], dtype=np.int64)
        shift = int(model.core_cls.shift_logits)
        rows: list[RowPlan | None] = [None] * len(resps)
        if len(live):
            ls = np.array([resps[b].slot for b in live.tolist()])
            P, G = (np.array([getattr(resps[b], k) for b in live.tolist()]) for k in ("P", "G"))
            core.begin(ls)
            starts = P + core.block_columns(ls)
            for b, hp, a in zip(live.tolist(), core.plan(ls, P, G, shift), starts.tolist()):
                r = resps[b]
                rows[b] = RowPlan(r, hp, a, self.ids(r))
                fwd.bind(r)
            core.count(ls, (P + G) * core.layers)  # what the uncached loop runs
        model.context = StepContext(packed=ForwardPlan(slots, rows, shift), work=core.token_layers)
        self.batch = (resps, offsets, live)

    def report_logprobs(self, req) -> None:
        """The logprobs of the output ids ``req`` holds that it has none for yet (SGLang's ``ReqLogprob`` lists): the
        core's, of the response positions those ids are (before SGLang streams them)."""
        # by request id: a finished request may have given its pool slot back
        r, lp = next((x for x in self.responses.values() if x.rid == req.rid), None), req.logprob
        have, n = len(lp.output_token_logprobs_val), min(len(req.output_ids), 0 if r is None else r.G)
        # SGLang's streamer moves its logprob offset to 1 at a request's first stream (its prefill samples the first
        # token); a diffusion request had no output then: the offset goes back to what was sent
        req.send_output_token_logprobs_offset = min(req.send_output_token_logprobs_offset, have)
        if n <= have:
            return
        got = self.core.logprobs_of(r.slot, slice(have, n))
        lp.output_token_logprobs_val += got.token.tolist()
        lp.output_token_logprobs_idx += list(req.output_ids[have:n])
        if lp.top_logprobs_num > 0:
            lp.output_top_logprobs_val += got.top.tolist()
            lp.output_top_logprobs_idx += got.top_ids.tolist()

    def ids(self, r: Response) -> torch.Tensor:
        """The request's sequence [P + G]: prompt and canvas."""
        return torch.cat([r.prompt, self.core.canvas[r.slot, :r.G]])

    def step(self, fb: ForwardBatch, logits: torch.Tensor, states=None) -> list[bool]:
        """After the forward: one step of the loop for the live rows (logits [B * L, V] of their canvas
        blocks), the canvas mirrored into SGLang's block ids; -> per row whether SGLang's block is decoded."""
        resps, offsets, live = self.batch
        if len(live):
            lg = logits.view(fb.batch_size, self.L, -1)
            lg = lg if len(live) == fb.batch_size else lg[torch.as_tensor(live, device=lg.device)]
            done = self.core.take(np.array([resps[b].slot for b in live.tolist()]), lg)
            for b in live[done].tolist():
                self.finish(resps[b])
        return self.mirror(fb, resps, offsets)

    def mirror(self, fb: ForwardBatch, resps: list[Response], offsets: list[int]) -> list[bool]:
        """SGLang's block ids [B, L] <- the canvas (mask ids past the response end: never emitted, SGLang
        stops at max_new_tokens); -> per row whether the block's response positions are decoded."""
        ids = fb.input_ids.view(fb.batch_size, self.L)
        span = []
        for b, (r, o) in enumerate(zip(resps, offsets)):
            n = max(0, min(self.L, r.end - o))
            ids[b, :n] = self.ids(r)[o:o + n]
            ids[b, n:] = self.mask_id
            span.append(n)
        inside = torch.arange(self.L, device=ids.device) < torch.tensor(span, device=ids.device)[:, None]
        return (~((ids == self.mask_id) & inside).any(-1)).tolist()

    def admit(self, slot: int, gen: int, req, model, device) -> None:
        """A new request in ``slot``: its canvas (tokens SGLang committed before - a retracted and re-admitted
        request - kept, the loop resuming at their block)."""
        opts = request(self.opts, req, self.L)
        plan = opts.response(max(req.sampling_params.max_new_tokens or 0, 1), self.L)
        G, core = plan.decoded, self.core
        r = self.responses[slot] = Response(slot, gen, getattr(req, "rid", None) or f"slot{slot}.gen{gen}",
                                            torch.tensor(req.origin_input_ids, dtype=torch.long, device=device), G)
        core.fit(slot + 1, G)
        core.admit(slot, SlotConfig.of(opts.decode, plan), HostRequest(opts.policy, 0), r.rid,
                   seed=req.sampling_params.sampling_seed, logprobs=logprobs(req))
        out = list(req.output_ids)[:G]
        core.start(np.array([slot]), r.P, G, torch.tensor([out], dtype=torch.long, device=device) if out else None,
                   len(out) // self.L)


class ResponseForward:
    """The model side: the requests' features and the forward of the planned rows (SGLang's layers through
    dllm_core's executor; attention over each request's positions)."""

    def __init__(self, model):
        self.model = model
        self.step: PackedStep | None = None  # the last forward's rows

    def bind(self, r: Response) -> None:
        """Features for a request being decoded: its prompt's and its response's, in every layer."""
        if r.feats is None:
            att = self.model.layers[0].self_attn
            r.feats = PartStores(len(self.model.layers), att.n_kv * att.head_dim, self.model.args.dim,
                                 self.model.embed.weight)

    def release(self, r: Response) -> None:
        r.feats = None

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch, ctx):
        """The context's rows -> SGLang's logits output, ``full_logits`` [B * L, V] over the canvas blocks."""
        plan = ctx.packed
        if plan.slots != fb.req_pool_indices.tolist():
            raise RuntimeError("whole-response cache: the forward's batch is not the one the algorithm planned")
        m, B = self.model, fb.batch_size
        L = input_ids.shape[0] // B
        h = m.embed.weight.new_zeros(B * L, m.args.dim)
        live = [(b, r) for b, r in enumerate(plan.rows) if r is not None]
        if live:
            rows = [r for _, r in live]
            hid = self.hidden(rows, ctx.work)
            b_idx = torch.tensor([b for b, _ in live], device=h.device)[:, None] * L + torch.arange(L, device=h.device)
            h[b_idx.flatten()] = m.norm(hid[self.step.rows([r.start for r in rows], L, plan.shift).flatten()])
        return m.logits_processor(input_ids, h, m.lm_head, fb)

    def hidden(self, rows: list[RowPlan], work: torch.Tensor) -> torch.Tensor:
        """Pre-norm final hidden states [N, d] of each request's positions [0, P + G) that its plan keeps, concatenated
        (the core's ``PackedStep``: two parts per request, its prompt and its response); the prompt's K/V of a layer
        that recomputed some of it are written into SGLang's pool; each request's full-layer rows added to ``work``."""
        m, pool, ids = self.model, get_token_to_kv_pool(), torch.cat([r.ids for r in rows])
        self.step = step = PackedStep([r.plan for r in rows], [r.resp.end for r in rows],
                                      [[("prompt", 0, r.resp.P), ("response", r.resp.P, r.resp.end)] for r in rows],
                                      [r.resp.feats for r in rows], ids.device)
        x = m.embed(ids if step.kept is None else ids[step.kept])  # [N, d] (a plan may leave positions out)
        r2t = get_req_to_token_pool().req_to_token
        ploc = torch.cat([r2t[r.resp.slot, :r.resp.P].long() for r in rows])  # pool slots of the prompts
        for i, layer in enumerate(m.layers):
            att = layer.self_attn
            ops = SimpleNamespace(qkv=lambda h, p, layer=layer: layer.self_attn.qkv(p, layer.attn_norm(h)),
                                  heads=att.heads, reduce=att.reduce,
                                  value=lambda h, layer=layer: layer.self_attn.value(layer.attn_norm(h)),
                                  attend=lambda q, k, v, ridx, att=att: att.o_proj(step.attention(
                                      q, k, v, ridx, att.n_heads, att.n_kv, att.attn.scaling))[0], ffn=layer.ffn)
            x = step.layer(ops, x, i)
            if step.recomputed(0, i):  # the prompts' K/V moved: into the pool
                k, v = (torch.cat([g[0].store.bufs[j][i, 0] for g in step.regions]) for j in (0, 1))
                pool.set_kv_buffer(att.attn, ploc, k.view(-1, att.n_kv, att.head_dim), v.view(-1, att.n_kv, att.head_dim))
        work[torch.tensor([r.resp.slot for r in rows], device=x.device)] += step.work()  # no sync
        return x


def report_logprobs(streamer, reqs, return_logprob: bool, *args, **kwargs) -> None:
    """BEFORE SGLang's ``SchedulerOutputStreamer.stream_output``: the logprobs of a batch's new output ids, for the requests
    that ask, from the whole-response host of this process (SGLang computes none for a dLLM batch)."""
    host = ResponseHost.active
    if return_logprob and host is not None and host.core is not None:
        for req in reqs:
            if req.return_logprob:
                host.report_logprobs(req)
