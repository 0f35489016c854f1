"""vLLM's ModelState for LLaDA / Dream / LLaDA2 and its side of the core's request lifecycle (``DllmStates``):
prefill -> denoise steps over the canvas (vLLM's draft-token path) -> commit step (emits it) -> the next canvas. A
policy that refreshes the prefix adds the request's prefix rows to vLLM's rows (``Extension``), so the paged
attention rewrites their K/V in place; the core's ``HostPlan`` says what runs (``docs/architecture.md``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dllm_core.cache import CanvasCache, HostRequest, host_cache
from dllm_core.cache.executor import CachedStep, PartStores
from dllm_core.engine.generate import grid_canvas_width
from dllm_core.engine.slots import ResponseSlots, SlotConfig

from vllm.v1.worker.gpu.attn_utils import build_attn_metadata, build_slot_mappings_by_layer
from vllm.v1.worker.gpu.model_states.interface import ModelState

from . import options
from .options import request_options

logger = logging.getLogger(__name__)

PREFILL, DENOISE, COMMIT = 0, 1, 2


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
    drop: np.ndarray            # [n] scheduled rows a plan leaves out (DPad; host)
    sched: torch.Tensor | None = None  # [N'] the scheduled tokens the rows ``orig`` carry (None: all, in order)
    at: torch.Tensor | None = None     # [N'] the scheduled tokens whose paged slots those rows take
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
    """vLLM's side of the core's per-slot lifecycle (``ResponseSlots``: canvas, blocks, sampler rows, policy
    state, work): the phase of each slot's next canvas step, what it has emitted, Dream's kept hidden row."""

    def __init__(self, vllm_config, args, max_reqs: int, device, block_causal: int = 0, feature_shape=(0, 0)):
        self.canvas_len = vllm_config.diffusion_config.canvas_length
        self.block_causal = block_causal  # grid block of a block-causal model (LLaDA2), 0: bidirectional
        self.max_reqs, self.device, self.args, self.feature_shape = max_reqs, device, args, feature_shape
        if args.mask_token_id is None:
            raise ValueError("config.json: mask_token_id is required to serve a masked diffusion model")
        pad = args.pad_token_id if args.pad_token_id is not None else args.eos_token_id or 0
        self.served = options.serve(self.canvas_len, block_causal or None, vllm_config.additional_config)
        self.defaults = self.served.defaults
        self.slots = ResponseSlots(max_reqs, self.canvas_len, args.mask_token_id, device, args.eos_token_id, pad,
                                   self.defaults.seed, feature_shape[0])
        self.phase = np.zeros(max_reqs, dtype=np.int8)
        self.offset = np.zeros(max_reqs, dtype=np.int64)  # canvas column of the first scheduled position
        self.held = np.zeros(max_reqs, dtype=np.int64)  # prompt + emitted tokens
        self.response_left = np.zeros(max_reqs, dtype=np.int64)  # positions to decode not emitted yet
        self.stream = np.zeros(max_reqs, dtype=bool)  # emit each block when decoded
        self.last_hidden = torch.zeros(max_reqs, args.dim, dtype=vllm_config.model_config.dtype, device=device)
        self.token_ids: torch.Tensor | None = None  # vLLM's [max_reqs, max_model_len] prompt + output ids
        self.plan: StepPlan | None = None
        self.tp = vllm_config.parallel_config.tensor_parallel_size

    @property
    def token_layers(self) -> torch.Tensor:
        return self.slots.token_layers

    def add(self, slot: int, sampling_params, prompt_len: int, req_id: str | None = None) -> None:
        opts = request_options(getattr(sampling_params, "extra_args", None), self.defaults,
                               getattr(sampling_params, "temperature", None))
        plan = self.served.plan(opts, getattr(sampling_params, "max_tokens", None))
        cache = CanvasCache() if self.block_causal else host_cache(opts.cache)  # block-causal: all exact, one path
        top_p, top_k = getattr(sampling_params, "top_p", 1.0), getattr(sampling_params, "top_k", 0)
        config = SlotConfig.of(opts, plan, top_p if top_p is not None and top_p < 1.0 else None,
                               top_k if top_k is not None and top_k > 0 else None)
        self.stream[slot] = stream = self.served.streams(opts, cache, plan)
        self.phase[slot], self.held[slot], self.response_left[slot] = PREFILL, prompt_len, plan.decoded
        self.slots.admit(slot, config, HostRequest(cache, prompt_len, stream, self.device), req_id,
                         PartStores(*self.feature_shape, self.args.dim, self.last_hidden),
                         getattr(sampling_params, "seed", None))

    def remove(self, slot: int) -> None:
        self.slots.release(slot)
        self.phase[slot] = PREFILL

    def known(self, slots: np.ndarray) -> np.ndarray:
        """[n] bool: the slots hold a request (dummy runs have none)."""
        return np.array([self.slots.config[s] is not None for s in slots.tolist()], dtype=bool)

    def canvas_width(self, slot: int) -> int:
        """Width of the slot's next canvas: the served length cut at the response, or for a block-causal model
        the rest of the grid block (decoded whole, cut when emitted)."""
        if self.block_causal:
            return grid_canvas_width(int(self.held[slot]), self.block_causal)
        return int(min(self.canvas_len, max(self.response_left[slot], 1)))

    def scheduled(self, slots: np.ndarray) -> torch.Tensor:
        """The canvases of ``slots`` from their first scheduled position: [m, canvas_len] (a block-causal
        canvas holds its grid block's prompt tail in the columns before ``offset``; later columns repeat)."""
        off = torch.as_tensor(self.offset[slots], device=self.device)
        cols = (off[:, None] + torch.arange(self.canvas_len, device=self.device)).clamp(max=self.canvas_len - 1)
        return self.slots.canvas[torch.as_tensor(slots, dtype=torch.long, device=self.device)].gather(1, cols)

    def emitted(self, slots: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Tokens each commit emits (the canvas, or its first block when streaming), counted as held."""
        Lb = self.slots.block_len[slots]
        n = np.where(self.stream[slots], np.minimum(Lb, valid), valid)
        self.held[slots] += n
        self.response_left[slots] -= n
        return n

    def start_canvas(self, slots: np.ndarray) -> None:
        """A fresh all-mask canvas for ``slots`` (after their prefill or commit): one block when streaming, else
        the blocks of its width (a block-causal canvas: its grid block's prompt tail first, from vLLM's ids)."""
        width = np.array([self.canvas_width(s) for s in slots.tolist()], dtype=np.int64)
        self.phase[slots] = DENOISE
        self.slots.start(slots, self.held[slots], width)
        if self.block_causal:
            self.offset[slots] = tail = self.canvas_len - width
            for s, t in zip(slots.tolist(), tail.tolist()):
                if t:
                    self.slots.canvas[s, :t] = self.token_ids[s, self.held[s] - t:self.held[s]]


class DllmModelState(ModelState):
    """ModelState of LLaDA / Dream / LLaDA2: all attention non-causal (per-request causal flag 0; LLaDA2's
    prompt prefill block-causal in the model), the canvas plan for the response-side cache, and the dllm
    sampler."""

    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.states = DllmStates(vllm_config, model.args, self.max_num_reqs, device, model.block_causal,
                                 model.feature_shape)
        model.dllm_state = self.states
        self._causal = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
        self._req_slot: dict[str, int] = {}

    def get_supported_generation_tasks(self):
        return ("generate",)

    def custom_sampler(self, sampler: Any):
        from .sampler import DllmSampler

        self.states.token_ids = sampler.req_states.all_token_ids.gpu
        return DllmSampler(sampler, self.states, self.model), None

    def add_request(self, req_index: int, new_req_data) -> None:
        self._req_slot[new_req_data.req_id] = req_index
        self.states.add(req_index, new_req_data.sampling_params, len(new_req_data.prompt_token_ids or []),
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
        core, slots = st.slots, ib.idx_mapping_np[:n]
        qlen = np.diff(ib.query_start_loc_np[:n + 1])
        known = st.known(slots)
        ndraft = ib.num_draft_tokens_per_req if ib.num_draft_tokens_per_req is not None else np.zeros(n, np.int32)
        is_canvas = known & (ndraft[:n] > 0)
        done_prefill = known & ~is_canvas & (ib.num_computed_prefill_tokens_np[:n] + ib.num_scheduled_tokens[:n]
                                             >= ib.prefill_len_np[:n])
        denoise, commit = is_canvas & (st.phase[slots] == DENOISE), is_canvas & (st.phase[slots] == COMMIT)
        core.begin(slots[denoise], st.offset[slots[denoise]] + qlen[denoise])
        hosts = [core.host[s] if k else None for s, k in zip(slots.tolist(), known)]
        refresh = np.array([h is not None and h.policy.refreshes_prefix for h in hosts], dtype=bool)
        # canvases the policies run cached: whole blocks (a policy that refreshes the prefix: its canvases shrink
        # with max_tokens and streaming), the served width (block canvas); others (cut short) run exact
        lb = np.array([core.config[s].block_length if k else 1 for s, k in zip(slots.tolist(), known)])
        whole = np.where(refresh, qlen % lb == 0, qlen == st.canvas_len)
        prefix = ib.num_computed_tokens_np[:n]
        rows = np.flatnonzero(denoise & whole)
        plans = dict(zip(rows.tolist(), core.plan(slots[rows], prefix[rows], qlen[rows], int(self.model.shift_logits))))
        for i in np.flatnonzero(commit & whole):  # emitted as is (a refreshing policy's next step refreshes it)
            if (hp := hosts[i].commit_plan(int(prefix[i]), int(qlen[i]))) is not None:
                plans[i] = hp
        extra, drop = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for i, hp in plans.items():
            extra[i] = prefix[i] - hp.run_from
            drop[i] = 0 if hp.keep is None else prefix[i] + qlen[i] - len(hp.keep)
        if st.block_causal:  # the canvas's grid block begins with the prompt tail: recomputed beside it
            extra[is_canvas] = st.offset[slots[is_canvas]]
        ext = self._extension(ib, slots, qlen, extra, drop, plans) if extra.any() or drop.any() else None
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
                   for r in hp.regions(int(start[i]) - hp.run_from, core.stores[slots[i]], self.device)]
        for i in np.flatnonzero(done_prefill & (qlen == ib.prefill_len_np[:n])):  # a whole prompt prefill
            if (hp := hosts[i].prefill_plan(int(qlen[i]))) is not None:
                regions += hp.regions(int(start[i]), core.stores[slots[i]], self.device)
        if regions:
            plan.cached = CachedStep(regions, core.generator)
        # work: each row's slot (the forward sums its full-layer runs into it) and, for denoise steps, what the
        # vanilla loop would run (the whole sequence in every layer)
        plan.row_slots = self._rows(np.repeat(np.where(known, slots, st.max_reqs), qlen + extra - drop))
        core.count(slots[known], np.where(denoise, (prefix + qlen) * core.layers, 0)[known])
        return plan

    @staticmethod
    def _block_causal_prefill(ib, start, qlen, prefill) -> list[tuple[int, int]]:
        """(first row, rows) of each prompt prefill of the step: the model attends them block-causally."""
        if (ib.num_computed_tokens_np[:len(qlen)][prefill] > 0).any():
            raise RuntimeError("dllm: a block-causal prompt must be prefilled in one chunk from position 0")
        return [(int(start[i]), int(qlen[i])) for i in np.flatnonzero(prefill)]

    def _rows(self, a) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a), dtype=torch.long, device=self.device)

    def _extension(self, ib, slots, qlen, extra, drop, plans) -> Extension:
        """The batch with each request's extra prefix rows placed before its scheduled rows (their ids from
        vLLM's token ids of the request) and without the scheduled rows its plan leaves out: the kept ones, in
        order, take the paged slots of its first scheduled tokens (the attention reads a compact sequence)."""
        n, done = len(slots), ib.num_computed_tokens_np[:len(slots)]
        qsl = np.concatenate([[0], np.cumsum(extra + qlen - drop)])
        orig = np.concatenate([np.arange(qsl[i] + extra[i], qsl[i + 1]) for i in range(n)])
        who, none = np.flatnonzero(extra), [np.zeros(0, dtype=np.int64)]  # (a DPad step may add no prefix row)
        rows = np.concatenate(none + [np.arange(qsl[i], qsl[i] + extra[i]) for i in who])
        pos = self._rows(np.concatenate(none + [np.arange(done[i] - extra[i], done[i]) for i in who]))
        ids = self.states.token_ids[self._rows(np.repeat(slots[who], extra[who])), pos].long()
        ext = Extension(int(qsl[-1]), qsl.astype(np.int32), self._rows(orig), self._rows(rows), ids, pos, extra, drop)
        if drop.any():
            q0, kept = ib.query_start_loc_np[:n], qlen - drop
            cols = [plans[i].keep[done[i]:] - done[i] if drop[i] else np.arange(qlen[i]) for i in range(n)]
            ext.sched = self._rows(np.concatenate([q0[i] + c for i, c in enumerate(cols)]))
            ext.at = self._rows(np.concatenate([q0[i] + np.arange(kept[i]) for i in range(n)]))
        return ext

    # ---- attention metadata ---------------------------------------------------------------------
    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, kv_cache_config,
                     for_capture=False, ubatch_idx: int = 0) -> dict[str, Any]:
        ib, num_reqs = input_batch, input_batch.num_reqs
        self.states.plan = plan = None if for_capture else self._plan(ib)
        # Per-request causal flag (CPU_ATTN / FlashAttention): 0 for every LLaDA / Dream step.
        causal = self._causal[:num_reqs]
        common = dict(attn_groups=attn_groups, num_reqs=num_reqs, max_seq_len=self.max_model_len,
                      block_tables=block_tables, kv_cache_config=kv_cache_config, causal=causal)
        if plan is not None and plan.ext is not None:
            ext = plan.ext
            ext_slots = self._ext_slots(ib, ext, block_tables, slot_mappings, kv_cache_config)
            seq_lens = ib.seq_lens if not ext.drop.any() else \
                ib.seq_lens[:num_reqs] - torch.as_tensor(ext.drop, dtype=ib.seq_lens.dtype, device=self.device)
            ext.metadata = build_attn_metadata(
                num_tokens=ext.n_tokens, query_start_loc_gpu=torch.as_tensor(ext.qsl, device=self.device),
                query_start_loc_cpu=torch.from_numpy(ext.qsl), max_query_len=int(np.diff(ext.qsl).max()),
                seq_lens=seq_lens, slot_mappings=ext_slots, **common)
            ext.slot_mapping = build_slot_mappings_by_layer(ext_slots, kv_cache_config)
        return build_attn_metadata(
            num_tokens=ib.num_tokens, query_start_loc_gpu=ib.query_start_loc,
            query_start_loc_cpu=torch.from_numpy(ib.query_start_loc_np),
            max_query_len=int(ib.num_scheduled_tokens.max()), seq_lens=ib.seq_lens, slot_mappings=slot_mappings,
            **common)

    def _ext_slots(self, ib, ext: Extension, block_tables, slot_mappings, kv_cache_config) -> torch.Tensor:
        """Paged slots [groups, n_tokens] of the extended batch: vLLM's for the scheduled rows, from
        the block table for the extra prefix rows (positions already held by the request)."""
        n = ib.num_reqs
        req = torch.as_tensor(np.repeat(np.arange(n), ext.extra), dtype=torch.long, device=self.device)
        out = slot_mappings.new_empty(slot_mappings.shape[0], ext.n_tokens)
        for g, (bt, group) in enumerate(zip(block_tables, kv_cache_config.kv_cache_groups)):
            bs = group.kv_cache_spec.block_size
            out[g, ext.orig] = slot_mappings[g, :ib.num_tokens] if ext.at is None else slot_mappings[g, ext.at]
            out[g, ext.rows] = (bt[req, ext.pos // bs] * bs + ext.pos % bs).to(out.dtype)
        return out

    num_new_sampled_tokens_per_step: int = 0



class DllmWorkerExtension:
    """Methods vLLM adds to its workers (``parallel_config.worker_extension_cls``, set by the config
    hook) for ``collective_rpc``."""

    def dllm_work_counters(self) -> dict[str, dict]:
        return self.model_runner.model_state.states.slots.all_work()


def work_counters(llm) -> dict[str, dict]:
    """The work of the requests an offline ``vllm.LLM`` finished last (or still holds in a slot), by request id, in
    the embedded engine's ``Counters`` units (``forwards``, ``token_layers``, ``full_token_layers``; ``dllm bench``'s
    work column)."""
    return llm.collective_rpc("dllm_work_counters")[0]
