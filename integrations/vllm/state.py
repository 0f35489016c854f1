"""vLLM's ModelState for LLaDA / Dream / LLaDA2 on the core's ``CanvasLifecycle`` (prefill -> denoise steps over the
canvas, vLLM's draft-token path -> commit step, emitting it -> the next canvas): vLLM's batch classified into the
core's terms, the core's ``StepContext`` handed to the model, and the paged attention metadata of its ``RowLayout``
(a policy that refreshes the prefix adds the request's prefix rows, whose K/V the paged attention rewrites in place).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dllm_core.engine.context import RowLayout, StepContext
from dllm_core.engine.lifecycle import CanvasLifecycle

from vllm.v1.worker.gpu.attn_utils import build_attn_metadata, build_slot_mappings_by_layer
from vllm.v1.worker.gpu.model_states.interface import ModelState

from . import options
from .options import request_options


def lifecycle(vllm_config, model, max_reqs: int, device) -> CanvasLifecycle:
    """The core's lifecycle of this worker's request slots, with what vLLM serves (``options.serve``)."""
    a = model.args
    served = options.serve(vllm_config.diffusion_config.canvas_length, model.block_causal or None,
                           vllm_config.additional_config)
    return CanvasLifecycle(served, max_reqs, a.mask_token_id, device, a.eos_token_id, a.pad_token_id,
                           model.block_causal, int(model.shift_logits), model.feature_shape, a.dim,
                           vllm_config.model_config.dtype)


class DllmModelState(ModelState):
    """ModelState of LLaDA / Dream / LLaDA2: all attention non-causal (per-request causal flag 0; LLaDA2's
    prompt prefill block-causal in the model), the core's plan of each step, and the dllm sampler."""

    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.states = lifecycle(vllm_config, model, self.max_num_reqs, device)
        model.dllm = self.states
        self._causal = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
        self._req_slot: dict[str, int] = {}

    def get_supported_generation_tasks(self):
        return ("generate",)

    def custom_sampler(self, sampler: Any):
        from .sampler import DllmSampler

        self.states.bind_tokens(sampler.req_states.all_token_ids.gpu)
        return DllmSampler(sampler, self.states, self.model), None

    def add_request(self, req_index: int, new_req_data) -> None:
        self._req_slot[new_req_data.req_id] = req_index
        sp = new_req_data.sampling_params
        opts = request_options(getattr(sp, "extra_args", None), self.states.served.defaults,
                               getattr(sp, "temperature", None))
        top_p, top_k = getattr(sp, "top_p", 1.0), getattr(sp, "top_k", 0)
        self.states.add(req_index, opts, getattr(sp, "max_tokens", None), len(new_req_data.prompt_token_ids or []),
                        new_req_data.req_id, getattr(sp, "seed", None),
                        top_p if top_p is not None and top_p < 1.0 else None,
                        top_k if top_k is not None and top_k > 0 else None, getattr(sp, "logprobs", None))

    def remove_request(self, req_id: str) -> None:
        slot = self._req_slot.pop(req_id, None)
        if slot is not None:
            self.states.remove(slot)

    def prepare_inputs_embeds(self, scheduled_encoder_inputs, input_batch, req_states):
        return None

    def prepare_inputs(self, input_batch, req_states) -> dict[str, Any]:
        return {}  # the step's plan was made in prepare_attn (it runs first)

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        self.states.no_plan()
        return {}

    def _plan(self, ib) -> StepContext:
        """vLLM's batch in the core's terms: canvases are the rows with draft tokens, the others prompt chunks."""
        n = ib.num_reqs
        ndraft = ib.num_draft_tokens_per_req if ib.num_draft_tokens_per_req is not None else np.zeros(n, np.int32)
        qlen = np.diff(ib.query_start_loc_np[:n + 1])
        canvas = ndraft[:n] > 0
        prefilled = ~canvas & (ib.num_computed_prefill_tokens_np[:n] + ib.num_scheduled_tokens[:n]
                               >= ib.prefill_len_np[:n])
        return self.states.plan(ib.idx_mapping_np[:n], ib.query_start_loc_np[:n], qlen,
                                   ib.num_computed_tokens_np[:n], canvas, prefilled, qlen == ib.prefill_len_np[:n])

    # ---- attention metadata ---------------------------------------------------------------------
    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, kv_cache_config,
                     for_capture=False, ubatch_idx: int = 0) -> dict[str, Any]:
        ib, num_reqs = input_batch, input_batch.num_reqs
        ctx = self.states.no_plan() if for_capture else self._plan(ib)
        common = dict(attn_groups=attn_groups, max_seq_len=self.max_model_len, kv_cache_config=kv_cache_config)
        if ctx is not None and (ctx.layout is not None or ctx.grid is not None):  # the model's own rows / requests
            lay, grid, slots, seq_lens = ctx.layout, ctx.grid, slot_mappings, ib.seq_lens[:num_reqs]
            if lay is not None:
                slots = self._layout_slots(ib, lay, block_tables, slot_mappings, kv_cache_config)
                seq_lens = seq_lens - torch.as_tensor(lay.drop, dtype=seq_lens.dtype, device=self.device)
            qsl, tables = ib.query_start_loc_np[:num_reqs + 1] if lay is None else lay.qsl, block_tables
            if grid is not None:
                req = torch.as_tensor(grid.req, device=self.device)
                qsl, tables = grid.qsl, [bt[req] for bt in block_tables]
                seq_lens = seq_lens[req] - torch.as_tensor(grid.back, dtype=seq_lens.dtype, device=self.device)
            ctx.attention = (self._metadata(ib.num_tokens if lay is None else lay.n_tokens, qsl, seq_lens, slots,
                                            tables, **common), build_slot_mappings_by_layer(slots, kv_cache_config))
        return self._metadata(ib.num_tokens, ib.query_start_loc_np[:num_reqs + 1], ib.seq_lens, slot_mappings,
                              block_tables, ib.query_start_loc, **common)

    def _metadata(self, num_tokens: int, qsl: np.ndarray, seq_lens, slots, block_tables, qsl_gpu=None, **common):
        """vLLM's attention metadata of requests with query starts ``qsl`` [n + 1] (on the device: ``qsl_gpu``), all
        non-causal (the per-request causal flag of CPU_ATTN / FlashAttention: 0)."""
        n = len(qsl) - 1
        causal = self._causal[:n] if n <= len(self._causal) else torch.zeros(n, dtype=torch.int32, device=self.device)
        return build_attn_metadata(
            num_tokens=num_tokens, num_reqs=n, query_start_loc_cpu=torch.from_numpy(qsl),
            query_start_loc_gpu=torch.as_tensor(qsl, device=self.device) if qsl_gpu is None else qsl_gpu,
            max_query_len=int(np.diff(qsl).max()), seq_lens=seq_lens, slot_mappings=slots, block_tables=block_tables,
            causal=causal, **common)

    def _layout_slots(self, ib, lay: RowLayout, block_tables, slot_mappings, kv_cache_config) -> torch.Tensor:
        """Paged slots [groups, n_tokens] of the layout's rows: vLLM's for the scheduled rows, from the block table
        for the extra prefix rows (positions already held by the request)."""
        req = torch.as_tensor(np.repeat(np.arange(ib.num_reqs), lay.extra), dtype=torch.long, device=self.device)
        out = slot_mappings.new_empty(slot_mappings.shape[0], lay.n_tokens)
        for g, (bt, group) in enumerate(zip(block_tables, kv_cache_config.kv_cache_groups)):
            bs = group.kv_cache_spec.block_size
            out[g, lay.orig] = slot_mappings[g, :ib.num_tokens] if lay.at is None else slot_mappings[g, lay.at]
            out[g, lay.rows] = (bt[req, lay.pos // bs] * bs + lay.pos % bs).to(out.dtype)
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
