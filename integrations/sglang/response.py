"""A policy that refreshes the prefix (``cache: prefix`` / ``dual`` / ``dllm``) in SGLang's block scheduler, with the
embedded engine's semantics: each response one canvas after its prompt, SGLang's block a window onto it; the
lifecycle is the core's ``ResponseLifecycle``. ``ResponseHost`` (algorithm side) hands it SGLang's requests and
blocks; ``ResponseForward`` (model side) runs the planned packed rows through SGLang's layers
(``integrations/sglang/README.md``).
"""
from __future__ import annotations

import logging
import numpy as np
import torch

from dllm_core.cache import CachePolicy
from dllm_core.engine.responses import ResponseLifecycle
from dllm_core.engine.slots import ResponseSlots

from .options import logprobs, request

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

logger = logging.getLogger(__name__)


class BatchRequests:
    """The SGLang ``Req``s of the next forward batch (prompt ids, output ids, sampling params, block offset),
    from the plugin's ``ForwardBatch.init_new`` hook: SGLang passes none of it to the algorithm or the model."""

    def __init__(self):
        self.pending = None  # (request slots [B], the batch's Reqs)
        self.runner = None  # SGLang's model runner (its pools, outside a forward's context)

    def expect(self, slots: torch.Tensor, reqs: list, runner=None) -> None:
        self.pending, self.runner = (slots, list(reqs)), runner

    def requests(self, slots: list[int]) -> list:
        if self.pending is None or self.pending[0].tolist() != slots or self.runner is None:
            raise RuntimeError("dllm-serve: no request info for this batch; the dllm-serve SGLang plugin's "
                               "ForwardBatch.init_new hook must be live (SGLANG_PLUGINS must allow 'dllm')")
        return self.pending[1]


BATCH = BatchRequests()  # the algorithms' view (any model class)


class SlotsHost:
    """SGLang's request slots on a core lifecycle (``lc``, made by a subclass's ``new_lifecycle``; its
    ``ResponseSlots``: ``core``): a slot whose generation moved holds a new request (``admit``);
    ``prepare(model_runner, fb, states)`` plans a forward, ``step(fb, logits, states)`` takes it."""

    active: "SlotsHost | None" = None  # this process's (one algorithm per scheduler): its logprobs are reported
    lc = None

    def __init__(self, policy: CachePolicy, opts, L: int, mask_id: int):
        SlotsHost.active = self
        self.policy, self.opts, self.L, self.mask_id = policy, opts, L, mask_id
        self.gens: dict[int, int] = {}  # the request generation each slot was admitted with

    @property
    def core(self) -> ResponseSlots | None:
        return None if self.lc is None else self.lc.slots

    def bind(self, model_runner, fb: ForwardBatch) -> list | None:
        """Admit the batch's new requests; -> the batch's ``Req``s (None when not needed)."""
        slots, model = fb.req_pool_indices.tolist(), model_runner.model
        if self.lc is None:
            self.lc = self.new_lifecycle(model, fb.input_ids.device)
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

    def release(self, slot: int) -> None:
        self.core.release(slot)


class ResponseHost(SlotsHost):
    """A policy over the whole response: SGLang's requests and blocks handed to the core's ``ResponseLifecycle``
    (``lc``), which plans each forward for the model's ``ResponseForward`` and mirrors the canvas into SGLang's block
    ids."""

    def new_lifecycle(self, model, device) -> ResponseLifecycle:
        if getattr(model, "response_forward", None) is None:
            raise ValueError(f"cache {self.policy.name} needs a dllm-serve model class (LLaDAModelLM, DreamModel), "
                             f"got {type(model).__name__}")
        return ResponseLifecycle(self.L, self.mask_id, device, self.opts.decode.seed,
                                 (len(model.layers), model.layers[0].kv_size, model.args.dim, model.embed.weight))

    def release(self, slot: int) -> None:
        self.lc.release(slot)

    def prepare(self, model_runner, fb: ForwardBatch, states=None) -> None:
        """Before a forward: bind the batch's requests; the core plans it (``StepContext.packed``) from SGLang's
        blocks (a block of committed tokens - the prompt, or all a retracted request committed - runs nothing)."""
        self.bind(model_runner, fb)
        slots = fb.req_pool_indices.tolist()
        reqs, model = BATCH.requests(slots), model_runner.model
        model.context = self.lc.plan(slots, [int(r.dllm_block_offset) for r in reqs],
                                     [len(q.origin_input_ids) + len(q.output_ids) for q in reqs],
                                     int(model.core_cls.shift_logits))

    def step(self, fb: ForwardBatch, logits: torch.Tensor, states=None) -> list[bool]:
        """After the forward: the core's step; SGLang's block ids rewritten from the canvas -> per row whether
        SGLang's block is decoded."""
        return self.lc.take(logits, fb.input_ids.view(fb.batch_size, self.L))

    def admit(self, slot: int, gen: int, req, model, device) -> None:
        """A new request in ``slot`` with its own options (what SGLang committed before kept)."""
        opts = request(self.opts, req, self.L)
        plan = opts.response(max(req.sampling_params.max_new_tokens or 0, 1), self.L)
        self.lc.admit(slot, getattr(req, "rid", None) or f"slot{slot}.gen{gen}", req.origin_input_ids, req.output_ids,
                      opts.decode, plan, opts.policy, req.sampling_params.sampling_seed, logprobs(req))

class ResponseForward:
    """The model side: the core's planned packed rows (``ForwardPlan.hidden``) through SGLang's layers, attention
    over each request's positions; the prompts' recomputed K/V written into SGLang's pool."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch, ctx):
        """The context's rows -> SGLang's logits output, ``full_logits`` [B * L, V] over the canvas blocks."""
        plan, m, B = ctx.packed, self.model, fb.batch_size
        if plan.slots != fb.req_pool_indices.tolist():
            raise RuntimeError("whole-response cache: the forward's batch is not the one the algorithm planned")
        L = input_ids.shape[0] // B
        h = m.embed.weight.new_zeros(B * L, m.args.dim)
        if any(r is not None for r in plan.rows):
            x = plan.hidden(m.embed, len(m.layers), self.ops, self.prompt_kv(plan))
            out, src = plan.logit_rows(L)
            h[out] = m.norm(x[src])
        return m.logits_processor(input_ids, h, m.lm_head, fb)

    def ops(self, i: int, step):
        """Layer i as the core's ``LayerOps`` over the packed rows (attention: the core's, per request)."""
        layer = self.model.layers[i]
        Hq, Hkv, _ = layer.heads
        return layer.ops(attend=lambda q, k, v, rows: layer.o_proj(step.attention(q, k, v, rows, Hq, Hkv,
                                                                                 layer.attn.scaling))[0])

    def prompt_kv(self, plan):
        """-> ``prompt_kv(i, k, v)``: the prompts' K / V of layer i into SGLang's pool, at their slots."""
        r2t, pool = get_req_to_token_pool().req_to_token, get_token_to_kv_pool()
        loc = torch.cat([r2t[r.resp.slot, :r.resp.P].long() for r in plan.rows if r is not None])

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            layer = self.model.layers[i]
            _, Hkv, D = layer.heads
            pool.set_kv_buffer(layer.attn, loc, k.view(-1, Hkv, D), v.view(-1, Hkv, D))
        return write


def report_logprobs(streamer, reqs, return_logprob: bool, *args, **kwargs) -> None:
    """BEFORE SGLang's ``SchedulerOutputStreamer.stream_output``: for each request that asks, the logprobs of the
    output ids it holds that it has none for yet (SGLang's ``ReqLogprob`` lists), the core's (``lc.logprobs``) from the
    host of this process, before SGLang streams them (SGLang computes none for a dLLM batch)."""
    host = SlotsHost.active
    if not return_logprob or host is None or host.lc is None:
        return
    for req in (r for r in reqs if r.return_logprob):
        lp = req.logprob
        have = len(lp.output_token_logprobs_val)
        # SGLang's streamer moves its logprob offset to 1 at a request's first stream (its prefill samples the first
        # token); a diffusion request had no output then: the offset goes back to what was sent
        req.send_output_token_logprobs_offset = min(req.send_output_token_logprobs_offset, have)
        got = host.lc.logprobs(req.rid, have, len(req.output_ids))
        if got is None:
            continue
        lp.output_token_logprobs_val += got.token.tolist()
        lp.output_token_logprobs_idx += list(req.output_ids[have:have + len(got.token)])
        if lp.top_logprobs_num > 0:
            lp.output_top_logprobs_val += got.top.tolist()
            lp.output_top_logprobs_idx += got.top_ids.tolist()
