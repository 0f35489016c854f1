"""Per-request diffusion state and vLLM's ModelState for LLaDA / Dream.

A request goes through vLLM's diffusion pathway as:

    prefill (prompt, bidirectional) -> denoise steps over the canvas -> commit step (emits the
    canvas, its K/V stay in the paged cache) -> denoise steps over the next canvas -> ...

The canvas rides vLLM's draft-token path (``req_states.draft_tokens``). ``phase`` says what the
next scheduled canvas step of a slot is (denoise or commit); the dllm sampler flips it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dllm_core.cache.canvas import CanvasCache
from dllm_core.cache.executor import CachedStep, FeatureStore
from dllm_core.engine.step import BlockProgress, SlotStates
from dllm_core.sampling import Sampler, TokenContext

from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
from vllm.v1.worker.gpu.model_states.interface import ModelState

from .options import SERVED, DllmOptions

logger = logging.getLogger(__name__)

PREFILL, DENOISE, COMMIT = 0, 1, 2


@dataclass(frozen=True)
class RequestPolicy:
    """What one request runs with: dllm_core sampler + canvas cache policy + token context knobs."""

    sampler: Sampler
    cache: CanvasCache
    block_length: int  # semi-AR block inside the canvas
    steps: int  # per block (fixed-schedule samplers)
    temperature: float
    top_p: float | None
    top_k: int | None
    logits_eos_inf: bool
    confidence_eos_eot_inf: bool
    eot_id: int | None

    @classmethod
    def resolve(cls, opts: DllmOptions, sampling_params, canvas_len: int) -> "RequestPolicy":
        top_p = getattr(sampling_params, "top_p", 1.0)
        top_k = getattr(sampling_params, "top_k", 0)
        block = opts.block_length or canvas_len
        if canvas_len % block:
            raise ValueError(f"block_length {block} must divide the served canvas_length {canvas_len}")
        return cls(opts.sampler_obj(), opts.cache_obj(), block, opts.steps or block, opts.temperature,
                   top_p if top_p is not None and top_p < 1.0 else None,
                   top_k if top_k is not None and top_k > 0 else None,
                   opts.logits_eos_inf, opts.confidence_eos_eot_inf, opts.eot_id)

    @property
    def group(self) -> tuple:
        """Requests sharing this key run one batched sampler call."""
        return (self.sampler, self.block_length, self.steps, self.temperature, self.top_p, self.top_k,
                self.logits_eos_inf, self.confidence_eos_eot_inf, self.eot_id)


@dataclass
class StepPlan:
    """Set on the model right before each forward."""

    capture_rows: torch.Tensor | None = None   # [k] rows whose final hidden state is kept (Dream)
    capture_slots: torch.Tensor | None = None  # [k]
    cached: CachedStep | None = None


class DllmStates:
    """Per-slot diffusion state shared by the ModelState, the model and the sampler."""

    def __init__(self, vllm_config, args, max_reqs: int, device):
        self.canvas_len = vllm_config.diffusion_config.canvas_length
        self.max_reqs, self.device, self.args = max_reqs, device, args
        self.mask_id = args.mask_token_id
        if self.mask_id is None:
            raise ValueError("config.json: mask_token_id is required to serve a masked diffusion model")
        self.pad_id = args.pad_token_id if args.pad_token_id is not None else args.eos_token_id or 0
        SERVED["canvas_length"] = self.canvas_len
        self.defaults = DllmOptions.from_additional_config(vllm_config.additional_config)
        self.canvas = torch.full((max_reqs, self.canvas_len), self.mask_id, dtype=torch.long, device=device)
        self.phase = np.zeros(max_reqs, dtype=np.int8)
        self.progress = BlockProgress(max_reqs)  # block of the canvas, denoise steps in it
        self.policy: list[RequestPolicy | None] = [None] * max_reqs
        self.slot_states: dict[tuple, SlotStates] = {}
        self.last_hidden = torch.zeros(max_reqs, args.dim, dtype=vllm_config.model_config.dtype, device=device)
        self.features: FeatureStore | None = None
        self.feature_shape = None  # (n_layers, kv_size) set by the ModelState
        self.generator = torch.Generator(device).manual_seed(self.defaults.seed)
        self.plan: StepPlan | None = None
        self.tp = vllm_config.parallel_config.tensor_parallel_size

    def add(self, slot: int, sampling_params) -> None:
        opts = self.defaults.with_request(getattr(sampling_params, "extra_args", None))
        pol = RequestPolicy.resolve(opts, sampling_params, self.canvas_len)
        if not pol.cache.exact and self.tp > 1:
            logger.warning("dllm: the response-side canvas cache needs tensor_parallel_size 1; running exact")
            pol = RequestPolicy(**{**pol.__dict__, "cache": CanvasCache()})
        self.policy[slot] = pol
        self.phase[slot] = PREFILL
        self.sampler_states(pol).reset(torch.tensor([slot], device=self.device))
        if not pol.cache.exact and self.features is None:
            n_layers, kv_size = self.feature_shape
            self.features = FeatureStore(n_layers, self.max_reqs, self.canvas_len, kv_size, self.args.dim,
                                         self.last_hidden)

    def remove(self, slot: int) -> None:
        self.policy[slot] = None
        self.phase[slot] = PREFILL

    def sampler_states(self, pol: RequestPolicy) -> SlotStates:
        key = (pol.sampler, pol.block_length, pol.steps)
        if key not in self.slot_states:
            self.slot_states[key] = SlotStates(pol.sampler, pol.block_length, pol.steps, self.device, self.max_reqs)
        return self.slot_states[key]

    def token_context(self, pol: RequestPolicy) -> TokenContext:
        return TokenContext(self.mask_id, pol.temperature, pol.top_p, pol.top_k, self.args.eos_token_id, pol.eot_id,
                            pol.logits_eos_inf, pol.confidence_eos_eot_inf, self.generator)

    def start_canvas(self, slots: np.ndarray) -> None:
        """A fresh all-mask canvas for ``slots`` (after their prefill or commit)."""
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        self.canvas[idx] = self.mask_id
        self.phase[slots] = DENOISE
        self.progress.start(slots, [self.canvas_len // self.policy[s].block_length for s in slots])


class DllmModelState(ModelState):
    """ModelState of LLaDA / Dream: all attention bidirectional (per-request causal flag 0), the
    canvas plan for the response-side cache, and the dllm sampler."""

    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.states = DllmStates(vllm_config, model.args, self.max_num_reqs, device)
        layer = model.layers[0]
        self.states.feature_shape = (len(model.layers), layer.kv_size)
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
        self.states.add(req_index, new_req_data.sampling_params)

    def remove_request(self, req_id: str) -> None:
        slot = self._req_slot.pop(req_id, None)
        if slot is not None:
            self.states.remove(slot)

    def prepare_inputs_embeds(self, scheduled_encoder_inputs, input_batch, req_states):
        return None

    def prepare_inputs(self, input_batch, req_states) -> dict[str, Any]:
        self.states.plan = self._plan(input_batch)
        return {}

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        self.states.plan = None
        return {}

    def _plan(self, ib) -> StepPlan:
        st, n = self.states, ib.num_reqs
        slots = ib.idx_mapping_np[:n]
        qsl = ib.query_start_loc_np
        ndraft = ib.num_draft_tokens_per_req if ib.num_draft_tokens_per_req is not None else np.zeros(n, np.int32)
        is_canvas = ndraft[:n] > 0
        done_prefill = ~is_canvas & (ib.num_computed_prefill_tokens_np[:n] + ib.num_scheduled_tokens[:n]
                                     >= ib.prefill_len_np[:n])
        plan = StepPlan()
        if self.model.shift_logits:
            cap = np.flatnonzero(done_prefill | (is_canvas & (st.phase[slots] == COMMIT)))
            if len(cap):
                plan.capture_rows = torch.as_tensor(qsl[cap + 1] - 1, dtype=torch.long, device=self.device)
                plan.capture_slots = torch.as_tensor(slots[cap], dtype=torch.long, device=self.device)
        cached = [i for i in np.flatnonzero(is_canvas & (st.phase[slots] == DENOISE))
                  if st.policy[slots[i]] is not None and not st.policy[slots[i]].cache.exact
                  and qsl[i + 1] - qsl[i] == st.canvas_len]  # a canvas cut at max_model_len runs exact
        if cached:
            cached = np.array(cached)
            rows = torch.as_tensor(qsl[cached][:, None] + np.arange(st.canvas_len), dtype=torch.long,
                                   device=self.device)
            plan.cached = CachedStep(rows, torch.as_tensor(slots[cached], dtype=torch.long, device=self.device),
                                     st.progress.steps[slots[cached]].tolist(), [st.policy[s].cache for s in slots[cached]],
                                     st.features, st.generator)
        return plan

    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, kv_cache_config,
                     for_capture=False, ubatch_idx: int = 0) -> dict[str, Any]:
        num_reqs, num_tokens = input_batch.num_reqs, input_batch.num_tokens
        # Per-request causal flag (CPU_ATTN / FlashAttention): 0 for every LLaDA / Dream step.
        causal = self._causal[:num_reqs]
        return build_attn_metadata(
            attn_groups=attn_groups, num_reqs=num_reqs, num_tokens=num_tokens,
            query_start_loc_gpu=input_batch.query_start_loc,
            query_start_loc_cpu=torch.from_numpy(input_batch.query_start_loc_np),
            max_query_len=int(input_batch.num_scheduled_tokens.max()), seq_lens=input_batch.seq_lens,
            max_seq_len=self.max_model_len, block_tables=block_tables, slot_mappings=slot_mappings,
            kv_cache_config=kv_cache_config, causal=causal)

    num_new_sampled_tokens_per_step: int = 0
