"""Per-request diffusion state and vLLM's ModelState for LLaDA / Dream.

A request goes through vLLM's diffusion pathway as:

    prefill (prompt, bidirectional) -> denoise steps over the canvas -> commit step (emits the
    canvas, its K/V stay in the paged cache) -> denoise steps over the next canvas -> ...

The canvas rides vLLM's draft-token path (``req_states.draft_tokens``). ``phase`` says what the
next scheduled canvas step of a slot is (denoise or commit); the dllm sampler flips it.

Fast-dLLM's ``prefix`` / ``dual`` (dllm_core's ``PrefixCache``): at a refresh step (a new block or
SlowFast span, or every ``every`` steps) the request's whole paged prefix (prompt + committed
canvases) is run again *with the masked canvas present*: its rows are added to vLLM's scheduled
rows (an ``Extension`` of the batch with its own attention metadata), so vLLM's paged attention
writes the refreshed prefix K/V in place and the canvas rows see them. Between refreshes only the
policy's rows of the canvas are recomputed (the block or span: ``dual``; from it to the canvas end:
``prefix``), the other canvas rows reuse their K/V from the ``FeatureStore`` (dllm_core's executor).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dllm_core.cache import CachePolicy, CanvasCache, HostPlan, HostRequest, host_cache
from dllm_core.cache.executor import CachedStep, PartStores
from dllm_core.engine.generate import grid_canvas_width
from dllm_core.engine.request import DecodeOptions, ResponsePlan
from dllm_core.engine.step import BlockProgress, SlotStates, plan_step
from dllm_core.sampling import Sampler, TokenContext

from vllm.v1.worker.gpu.attn_utils import build_attn_metadata, build_slot_mappings_by_layer
from vllm.v1.worker.gpu.model_states.interface import ModelState

from .options import SERVED, request_options, request_plan, server_options, streams

logger = logging.getLogger(__name__)

PREFILL, DENOISE, COMMIT = 0, 1, 2
WORK_KEPT = 4096  # finished requests whose work counters stay readable (``work_counters``)


@dataclass(frozen=True)
class RequestPolicy:
    """What one request runs with: dllm_core sampler + cache policy + token context knobs."""

    sampler: Sampler
    cache: CachePolicy  # as host_cache gives it: a policy that refreshes the prefix, or the block canvas
    block_length: int  # semi-AR block inside the canvas
    steps: int  # per block (fixed-schedule samplers): the request's total split over its blocks
    temperature: float
    top_p: float | None
    top_k: int | None
    logits_eos_inf: bool
    confidence_eos_eot_inf: bool
    eot_id: int | None
    stream: bool  # emit each block when decoded; the next canvas is the rest of the response

    @classmethod
    def resolve(cls, opts: DecodeOptions, sampling_params, plan: ResponsePlan, cache: CachePolicy,
                canvas: int) -> "RequestPolicy":
        top_p = getattr(sampling_params, "top_p", 1.0)
        top_k = getattr(sampling_params, "top_k", 0)
        return cls(opts.sampler, cache, plan.block_length, plan.steps_per_block, opts.temperature,
                   top_p if top_p is not None and top_p < 1.0 else None,
                   top_k if top_k is not None and top_k > 0 else None,
                   opts.logits_eos_inf, opts.confidence_eos_eot_inf, opts.eot_id, streams(opts, cache, plan, canvas))

    @property
    def group(self) -> tuple:
        """Requests sharing this key run one batched sampler call."""
        return (self.sampler, self.block_length, self.steps, self.temperature, self.top_p, self.top_k,
                self.logits_eos_inf, self.confidence_eos_eot_inf, self.eot_id)


@dataclass
class Extension:
    """Prefix rows a step recomputes beside vLLM's scheduled rows (Fast-dLLM refreshes, Dream's
    shifted row): per request the rows [its extra prefix positions ; its scheduled tokens]."""

    n_tokens: int               # rows of the extended batch
    qsl: np.ndarray             # [n + 1] query start of each request in it
    orig: torch.Tensor          # [N] row of each scheduled token
    rows: torch.Tensor          # [E] rows of the extra prefix positions
    ids: torch.Tensor           # [E] their token ids
    pos: torch.Tensor           # [E] their positions
    extra: np.ndarray           # [n] extra rows per request (host)
    metadata: dict | None = None      # per-layer attention metadata of the extended batch
    slot_mapping: dict | None = None  # per-layer slot mapping of the extended batch


@dataclass
class StepPlan:
    """Set on the model right before each forward (rows in the extended batch when ``ext`` is set)."""

    capture_rows: torch.Tensor | None = None   # [k] rows whose final hidden state is kept (Dream)
    capture_slots: torch.Tensor | None = None  # [k]
    cached: CachedStep | None = None
    ext: Extension | None = None
    row_slots: torch.Tensor | None = None  # [N] request slot of each row of the forward (work accounting)
    prefill: list[tuple[int, int]] | None = None  # block-causal models: (first row, rows) of each prompt prefill


class DllmStates:
    """Per-slot diffusion state shared by the ModelState, the model and the sampler."""

    def __init__(self, vllm_config, args, max_reqs: int, device, block_causal: int = 0):
        self.canvas_len = vllm_config.diffusion_config.canvas_length
        self.block_causal = block_causal  # grid block of a block-causal model (LLaDA2), 0: bidirectional
        self.max_reqs, self.device, self.args = max_reqs, device, args
        self.mask_id = args.mask_token_id
        if self.mask_id is None:
            raise ValueError("config.json: mask_token_id is required to serve a masked diffusion model")
        self.pad_id = args.pad_token_id if args.pad_token_id is not None else args.eos_token_id or 0
        SERVED["canvas_length"], SERVED["block_causal"] = self.canvas_len, block_causal or None
        self.defaults = SERVED["defaults"] = server_options(vllm_config.additional_config)
        self.canvas = torch.full((max_reqs, self.canvas_len), self.mask_id, dtype=torch.long, device=device)
        self.phase = np.zeros(max_reqs, dtype=np.int8)
        self.offset = np.zeros(max_reqs, dtype=np.int64)  # canvas column of the first scheduled position
        self.progress = BlockProgress(max_reqs)  # block of the canvas, denoise steps in it
        self.policy: list[RequestPolicy | None] = [None] * max_reqs
        self.tokens: list[list[int]] = [[] for _ in range(max_reqs)]  # prompt + emitted tokens
        self.response_left = np.zeros(max_reqs, dtype=np.int64)  # max_tokens not emitted yet
        self.prompt_len = np.zeros(max_reqs, dtype=np.int64)
        self.host: list[HostRequest | None] = [None] * max_reqs  # the core's per-request state (policy counters)
        self.slot_states: dict[tuple, SlotStates] = {}
        self.last_hidden = torch.zeros(max_reqs, args.dim, dtype=vllm_config.model_config.dtype, device=device)
        self.stores: list[PartStores | None] = [None] * max_reqs  # a request's features, per part
        # work, per slot (the embedded engine's Counters units): rows x layers run through a full layer
        # (device, summed without sync), forwards and what the vanilla loop would run in the denoise ones
        self.token_layers = torch.zeros(max_reqs + 1, dtype=torch.long, device=device)  # + 1: padding rows
        self.forwards = np.zeros(max_reqs, dtype=np.int64)
        self.full_token_layers = np.zeros(max_reqs, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_reqs
        self.finished_work: OrderedDict[str, dict] = OrderedDict()  # the last WORK_KEPT finished requests
        self.feature_shape = None  # (n_layers, kv_size) set by the ModelState
        self.generator = torch.Generator(device).manual_seed(self.defaults.seed)
        self.plan: StepPlan | None = None
        self.tp = vllm_config.parallel_config.tensor_parallel_size

    def add(self, slot: int, sampling_params, prompt: list[int], req_id: str | None = None) -> None:
        opts = request_options(getattr(sampling_params, "extra_args", None), self.defaults)
        plan = request_plan(opts, getattr(sampling_params, "max_tokens", None), self.canvas_len)
        cache = CanvasCache() if self.block_causal else host_cache(opts.cache)  # block-causal: all exact, one path
        if cache.picks and self.tp > 1:  # V-verify picks per shard would differ
            logger.warning("dllm: cache %s picks rows per rank: it needs tensor_parallel_size 1; running exact",
                           cache.name)
            cache = CanvasCache()
        pol = RequestPolicy.resolve(opts, sampling_params, plan, cache, self.canvas_len)
        self.policy[slot] = pol
        self.phase[slot] = PREFILL
        self.tokens[slot] = list(prompt)
        self.req_ids[slot] = req_id
        self.token_layers[slot], self.forwards[slot], self.full_token_layers[slot] = 0, 0, 0
        self.response_left[slot] = plan.decoded  # positions to decode (whole blocks; vLLM emits max_tokens of them)
        self.prompt_len[slot] = len(prompt)
        self.host[slot] = HostRequest(pol.cache, len(prompt), pol.stream, self.device)
        self.stores[slot] = PartStores(*self.feature_shape, self.args.dim, self.last_hidden)
        self.sampler_states(pol).reset(torch.tensor([slot], device=self.device))

    def work(self, slot: int) -> dict:
        """A request's work so far, in the embedded engine's ``Counters`` units."""
        return {"forwards": int(self.forwards[slot]), "token_layers": int(self.token_layers[slot]),
                "full_token_layers": int(self.full_token_layers[slot])}

    def remove(self, slot: int) -> None:
        if self.req_ids[slot] is not None and self.policy[slot] is not None:
            self.finished_work[self.req_ids[slot]] = self.work(slot)
            while len(self.finished_work) > WORK_KEPT:
                self.finished_work.popitem(last=False)
        self.policy[slot] = self.host[slot] = self.stores[slot] = None
        self.phase[slot] = PREFILL

    def sampler_states(self, pol: RequestPolicy) -> SlotStates:
        key = (pol.sampler, pol.block_length, pol.steps)
        if key not in self.slot_states:
            self.slot_states[key] = SlotStates(pol.sampler, pol.block_length, pol.steps, self.device, self.max_reqs)
        return self.slot_states[key]

    def groups(self, rows, slots) -> list[np.ndarray]:
        """``rows`` of a batch grouped by their requests' sampler configuration (one batched step each)."""
        groups: dict[tuple, list[int]] = {}
        for r in rows:
            groups.setdefault(self.policy[slots[r]].group, []).append(r)
        return [np.array(g) for g in groups.values()]

    def token_context(self, pol: RequestPolicy) -> TokenContext:
        return TokenContext(self.mask_id, pol.temperature, pol.top_p, pol.top_k, self.args.eos_token_id, pol.eot_id,
                            pol.logits_eos_inf, pol.confidence_eos_eot_inf, self.generator)

    def canvas_width(self, slot: int) -> int:
        """Width of the slot's next canvas (``DllmScheduler``): the served length cut at max_tokens, or for a
        block-causal model the rest of the grid block (decoded whole, cut when emitted)."""
        if self.block_causal:
            return grid_canvas_width(len(self.tokens[slot]), self.block_causal)
        return int(min(self.canvas_len, max(self.response_left[slot], 1)))

    def scheduled(self, slots: np.ndarray) -> torch.Tensor:
        """The canvases of ``slots`` from their first scheduled position: [m, canvas_len] (a block-causal
        canvas holds its grid block's prompt tail in the columns before ``offset``; later columns repeat)."""
        off = torch.as_tensor(self.offset[slots], device=self.device)
        cols = (off[:, None] + torch.arange(self.canvas_len, device=self.device)).clamp(max=self.canvas_len - 1)
        return self.canvas[torch.as_tensor(slots, dtype=torch.long, device=self.device)].gather(1, cols)

    def emit_length(self, slot: int, valid: int) -> int:
        """Tokens a commit emits: the canvas, or its first block when streaming."""
        pol = self.policy[slot]
        return min(pol.block_length, valid) if pol.stream else valid

    def start_canvas(self, slots: np.ndarray) -> None:
        """A fresh all-mask canvas for ``slots`` (after their prefill or commit): its blocks (one when
        streaming; a canvas cut at max_tokens has fewer)."""
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        self.canvas[idx] = self.mask_id
        self.phase[slots] = DENOISE
        if self.block_causal:  # the grid block's prompt tail before the masks
            for s in slots:
                self.offset[s] = tail = self.canvas_len - self.canvas_width(s)
                if tail:
                    self.canvas[s, :tail] = torch.tensor(self.tokens[s][-tail:], device=self.device)
        blocks = [1 if self.policy[s].stream else -(-self.canvas_width(s) // self.policy[s].block_length)
                  for s in slots]
        self.progress.start(slots, blocks)
        for s in slots:
            self.host[s].begin_canvas(len(self.tokens[s]))



class DllmModelState(ModelState):
    """ModelState of LLaDA / Dream / LLaDA2: all attention non-causal (per-request causal flag 0; LLaDA2's
    prompt prefill block-causal in the model), the canvas plan for the response-side cache, and the dllm
    sampler."""

    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.states = DllmStates(vllm_config, model.args, self.max_num_reqs, device, model.block_causal)
        self.states.feature_shape = model.feature_shape
        model.dllm_state = self.states
        self._causal = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
        self._req_slot: dict[str, int] = {}

    def get_supported_generation_tasks(self):
        return ("generate",)

    def custom_sampler(self, sampler: Any):
        from .sampler import DllmSampler

        return DllmSampler(sampler, self.states, self.model), None

    def add_request(self, req_index: int, new_req_data) -> None:
        self._req_slot[new_req_data.req_id] = req_index
        self.states.add(req_index, new_req_data.sampling_params, new_req_data.prompt_token_ids or [],
                        new_req_data.req_id)

    def remove_request(self, req_id: str) -> None:
        slot = self._req_slot.pop(req_id, None)
        if slot is not None:
            self.states.remove(slot)

    def prepare_inputs_embeds(self, scheduled_encoder_inputs, input_batch, req_states):
        return None

    def prepare_inputs(self, input_batch, req_states) -> dict[str, Any]:
        return {}  # the step's plan was made in prepare_attn (it runs first)

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        self.states.plan = None
        return {}

    # ---- the step's plan ------------------------------------------------------------------------
    def _plan(self, ib) -> StepPlan:
        st, n = self.states, ib.num_reqs
        slots = ib.idx_mapping_np[:n]
        qlen = np.diff(ib.query_start_loc_np[:n + 1])
        known = np.array([st.policy[s] is not None for s in slots], dtype=bool)  # dummy runs have none
        ndraft = ib.num_draft_tokens_per_req if ib.num_draft_tokens_per_req is not None else np.zeros(n, np.int32)
        is_canvas = known & (ndraft[:n] > 0)
        done_prefill = known & ~is_canvas & (ib.num_computed_prefill_tokens_np[:n] + ib.num_scheduled_tokens[:n]
                                             >= ib.prefill_len_np[:n])
        denoise, commit = is_canvas & (st.phase[slots] == DENOISE), is_canvas & (st.phase[slots] == COMMIT)
        self._begin_blocks(slots[denoise], qlen[denoise])
        pol = [st.policy[s] if k else None for s, k in zip(slots, known)]
        refresh = np.array([p is not None and p.cache.refreshes_prefix for p in pol], dtype=bool)
        # canvases the policies run cached: whole blocks (a policy that refreshes the prefix: its canvases shrink
        # with max_tokens and streaming), the served width (block canvas); others (cut short) run exact
        lb = np.array([p.block_length if p is not None else 1 for p in pol])
        whole = np.where(refresh, qlen % lb == 0, qlen == st.canvas_len)
        prefix = ib.num_computed_tokens_np[:n]
        plans = self._host_plans(slots, np.flatnonzero(denoise & whole), prefix, qlen)
        for i in np.flatnonzero(commit & whole):  # emitted as is (a refreshing policy's next step refreshes it)
            if (hp := st.host[slots[i]].commit_plan(int(prefix[i]), int(qlen[i]))) is not None:
                plans[i] = hp
        extra = np.zeros(n, dtype=np.int64)
        for i, hp in plans.items():
            extra[i] = prefix[i] - hp.run_from
        if st.block_causal:  # the canvas's grid block begins with the prompt tail: recomputed beside it
            extra[is_canvas] = st.offset[slots[is_canvas]]
        ext = self._extension(ib, slots, qlen, extra) if extra.any() else None
        start = ext.qsl if ext is not None else ib.query_start_loc_np  # request starts in the forward's rows
        plan = StepPlan(ext=ext)
        if st.block_causal:
            plan.prefill = self._block_causal_prefill(ib, start, qlen, known & ~is_canvas)
        if self.model.shift_logits:  # Dream: the last prefix row predicts the first canvas position
            cap = np.flatnonzero(done_prefill | (commit & ~refresh) | (extra > 0))
            if len(cap):
                plan.capture_rows = self._rows(start[cap] + np.where(extra[cap] > 0, extra[cap], qlen[cap]) - 1)
                plan.capture_slots = self._rows(slots[cap])
        regions = [r for i, hp in plans.items()  # position p of request i at row start[i] + p - run_from
                   for r in hp.regions(int(start[i]) - hp.run_from, st.stores[slots[i]], self.device)]
        for i in np.flatnonzero(done_prefill & (qlen == ib.prefill_len_np[:n])):  # a whole prompt prefill
            if (hp := st.host[slots[i]].prefill_plan(int(qlen[i]))) is not None:
                regions += hp.regions(int(start[i]), st.stores[slots[i]], self.device)
        if regions:
            plan.cached = CachedStep(regions, st.generator)
        self._tally(plan, slots, known, qlen, extra, prefix, denoise)
        return plan

    def _host_plans(self, slots, rows: np.ndarray, prefix, qlen) -> dict[int, HostPlan]:
        """The core's plan of each denoise step in ``rows``, from its block's sampler focus (one sampler call
        and one read per sampler configuration)."""
        st, shift, plans = self.states, int(self.model.shift_logits), {}
        for members in st.groups(rows, slots):
            pol = st.policy[slots[members[0]]]
            sl, Lb = slots[members], pol.block_length
            idx = self._rows(sl)
            cols = self._rows(st.progress.block[sl] * Lb)[:, None] + torch.arange(Lb, device=self.device)
            blk = st.canvas[idx].gather(1, cols)
            flo, fhi = plan_step(pol.sampler, st.sampler_states(pol).gather(idx, tuple(sl.tolist())),
                                 blk == st.mask_id).focus
            for i, s, b, lo, hi in zip(members, sl, st.progress.block[sl], flo.tolist(), fhi.tolist()):
                p = int(prefix[i])
                plans[i] = st.host[s].plan(p + int(b) * Lb, (lo, hi), shift, p, int(qlen[i]))
        return plans

    def _tally(self, plan: StepPlan, slots, known, qlen, extra, prefix, denoise) -> None:
        """Work accounting: each row's slot (the forward sums its full-layer runs into the slot) and,
        for denoise steps, what the vanilla loop would run (the whole sequence in every layer)."""
        st, rows = self.states, qlen + extra
        plan.row_slots = self._rows(np.repeat(np.where(known, slots, st.max_reqs), rows))
        st.forwards[slots[known]] += 1
        st.full_token_layers[slots[denoise]] += (prefix[denoise] + qlen[denoise]) * st.feature_shape[0]

    @staticmethod
    def _block_causal_prefill(ib, start, qlen, prefill) -> list[tuple[int, int]]:
        """(first row, rows) of each prompt prefill of the step: the model attends them block-causally."""
        if (ib.num_computed_tokens_np[:len(qlen)][prefill] > 0).any():
            raise RuntimeError("dllm: a block-causal prompt must be prefilled in one chunk from position 0")
        return [(int(start[i]), int(qlen[i])) for i in np.flatnonzero(prefill)]

    def _rows(self, a) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a), dtype=torch.long, device=self.device)

    def _begin_blocks(self, slots: np.ndarray, widths: np.ndarray) -> None:
        """``Sampler.begin_block`` for the requests whose next step starts a block (positions past a
        canvas cut short are not to be decoded)."""
        st = self.states
        for s, w in zip(slots, widths):
            if not st.progress.new[s]:
                continue
            pol, b = st.policy[s], st.progress.block[s]
            idx, cols = self._rows([s]), torch.arange(b * pol.block_length, (b + 1) * pol.block_length, device=self.device)
            st.sampler_states(pol).begin_block(idx, (st.canvas[idx][:, cols] == st.mask_id) & (cols < st.offset[s] + w))
            st.host[s].begin_block()
        st.progress.new[slots] = False

    def _extension(self, ib, slots, qlen, extra) -> Extension:
        """The batch with each request's extra prefix rows placed before its scheduled rows."""
        st, n = self.states, len(slots)
        qsl = np.concatenate([[0], np.cumsum(extra + qlen)])
        orig = np.concatenate([np.arange(qsl[i] + extra[i], qsl[i + 1]) for i in range(n)])
        who = np.flatnonzero(extra)
        rows = np.concatenate([np.arange(qsl[i], qsl[i] + extra[i]) for i in who])
        pos = np.concatenate([np.arange(ib.num_computed_tokens_np[i] - extra[i], ib.num_computed_tokens_np[i])
                              for i in who])
        ids = np.concatenate([st.tokens[slots[i]][ib.num_computed_tokens_np[i] - extra[i]:ib.num_computed_tokens_np[i]]
                              for i in who])
        return Extension(int(qsl[-1]), qsl.astype(np.int32), self._rows(orig), self._rows(rows), self._rows(ids),
                         self._rows(pos), extra)

    # ---- attention metadata ---------------------------------------------------------------------
    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, kv_cache_config,
                     for_capture=False, ubatch_idx: int = 0) -> dict[str, Any]:
        ib, num_reqs = input_batch, input_batch.num_reqs
        self.states.plan = plan = None if for_capture else self._plan(ib)
        # Per-request causal flag (CPU_ATTN / FlashAttention): 0 for every LLaDA / Dream step.
        causal = self._causal[:num_reqs]
        common = dict(attn_groups=attn_groups, num_reqs=num_reqs, seq_lens=ib.seq_lens, max_seq_len=self.max_model_len,
                      block_tables=block_tables, kv_cache_config=kv_cache_config, causal=causal)
        if plan is not None and plan.ext is not None:
            ext = plan.ext
            ext_slots = self._ext_slots(ib, ext, block_tables, slot_mappings, kv_cache_config)
            ext.metadata = build_attn_metadata(
                num_tokens=ext.n_tokens, query_start_loc_gpu=torch.as_tensor(ext.qsl, device=self.device),
                query_start_loc_cpu=torch.from_numpy(ext.qsl), max_query_len=int(np.diff(ext.qsl).max()),
                slot_mappings=ext_slots, **common)
            ext.slot_mapping = build_slot_mappings_by_layer(ext_slots, kv_cache_config)
        return build_attn_metadata(
            num_tokens=ib.num_tokens, query_start_loc_gpu=ib.query_start_loc,
            query_start_loc_cpu=torch.from_numpy(ib.query_start_loc_np),
            max_query_len=int(ib.num_scheduled_tokens.max()), slot_mappings=slot_mappings, **common)

    def _ext_slots(self, ib, ext: Extension, block_tables, slot_mappings, kv_cache_config) -> torch.Tensor:
        """Paged slots [groups, n_tokens] of the extended batch: vLLM's for the scheduled rows, from
        the block table for the extra prefix rows (positions already held by the request)."""
        n = ib.num_reqs
        req = torch.as_tensor(np.repeat(np.arange(n), ext.extra), dtype=torch.long, device=self.device)
        out = slot_mappings.new_empty(slot_mappings.shape[0], ext.n_tokens)
        for g, (bt, group) in enumerate(zip(block_tables, kv_cache_config.kv_cache_groups)):
            bs = group.kv_cache_spec.block_size
            out[g, ext.orig] = slot_mappings[g, :ib.num_tokens]
            out[g, ext.rows] = (bt[req, ext.pos // bs] * bs + ext.pos % bs).to(out.dtype)
        return out

    num_new_sampled_tokens_per_step: int = 0



class DllmWorkerExtension:
    """Methods vLLM adds to its workers (``parallel_config.worker_extension_cls``, set by the config
    hook) for ``collective_rpc``."""

    def dllm_work_counters(self) -> dict[str, dict]:
        return dict(self.model_runner.model_state.states.finished_work)


def work_counters(llm) -> dict[str, dict]:
    """The work of the requests an offline ``vllm.LLM`` finished last (up to ``WORK_KEPT``), by request
    id: ``forwards``, ``token_layers`` (rows x layers run through a full layer) and
    ``full_token_layers`` (what the vanilla loop runs in the same denoise steps) - the units of the
    embedded engine's ``Counters`` and ``dllm bench``'s work column."""
    return llm.collective_rpc("dllm_work_counters")[0]
