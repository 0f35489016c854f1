"""The dllm sampler (vLLM's custom sampler for LLaDA / Dream / LLaDA2): the core's ``CanvasLifecycle.sample`` in
vLLM's terms - what a commit step emits, the logits a step rolls back, the canvases its draft tokens take next.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from dllm_core.engine.lifecycle import CanvasLifecycle

from vllm.v1.outputs import LogprobsTensors
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from .options import validate_request

_NO_PENALTIES = SimpleNamespace(output_bin_counts=None)


class DllmSampler:
    """Replaces vLLM's sampler for the diffusion models served by this adapter."""

    compute_nans = False

    def __init__(self, sampler, states: CanvasLifecycle, model):
        self.sampling_states = sampler.sampling_states
        self.logprob_token_ids_state = sampler.logprob_token_ids_state
        self.req_states = sampler.req_states
        self.states, self.model = states, model
        n, L, dev = states.n_slots, states.canvas_len, states.device
        self._sampled = torch.zeros(n, L, dtype=torch.int32, device=dev)
        self._num_sampled = torch.zeros(n, dtype=torch.int32, device=dev)
        self._num_rejected = torch.zeros(n, dtype=torch.int32, device=dev)

    @property
    def penalties_state(self):
        return _NO_PENALTIES  # diffusion requests take no penalties

    def add_request(self, req_idx: int, sampling_params) -> None:
        self.sampling_states.add_request(req_idx, sampling_params)
        self.logprob_token_ids_state.add_request(req_idx, sampling_params)

    def apply_staged_writes(self) -> None:
        self.sampling_states.apply_staged_writes()
        self.logprob_token_ids_state.apply_staged_writes()

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None) -> SamplerOutput:
        st, ib, n = self.states, input_batch, input_batch.num_reqs
        nlog = np.diff(ib.cu_num_logits_np[:n + 1])
        width = st.canvas_len if ib.num_draft_tokens > 0 else 1
        sampled, num_sampled = self._sampled[:n, :width], self._num_sampled[:n]
        num_rejected = self._num_rejected[:n]
        sampled.zero_(), num_sampled.zero_(), num_rejected.zero_()
        prefilled = ib.num_computed_prefill_tokens_np[:n] + ib.num_scheduled_tokens[:n] >= ib.prefill_len_np[:n]
        out = st.sample(ib.idx_mapping_np[:n], nlog, ib.cu_num_logits_np[:n], prefilled, logits,
                        self.model.compute_logits)
        logprobs = None
        if len(out.emit):
            r = torch.as_tensor(out.emit, dtype=torch.long, device=st.device)
            sampled[r] = out.tokens[:, :width].to(sampled.dtype)
            num_sampled[r] = torch.as_tensor(out.n, dtype=num_sampled.dtype, device=st.device)
            if out.logprobs is not None:
                logprobs = self._logprobs(out, n)
        if out.rejected.any():
            num_rejected.copy_(torch.as_tensor(out.rejected, dtype=torch.int32))
        if len(out.touched):
            idx = torch.as_tensor(out.touched, dtype=torch.long, device=st.device)
            self.req_states.draft_tokens[idx, :st.canvas_len] = st.scheduled(out.touched)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs, num_nans=None,
                             num_sampled=num_sampled, num_rejected=num_rejected)

    @staticmethod
    def _logprobs(out, n: int) -> LogprobsTensors:
        """The emitted tokens' log-probabilities in vLLM's layout (``Logprobs.flat``: a row per emitted token, request
        by request, ``cu_num_generated_tokens``; columns [the token, its step's top k]; no row: nothing emitted)."""
        counts = np.zeros(n, dtype=np.int64)
        counts[out.emit] = out.n
        ids, vals, rank = out.logprobs.flat(out.tokens, out.n)
        return LogprobsTensors(ids.to(torch.int32), vals, rank.to(torch.int32), [0, *np.cumsum(counts).tolist()])


class DllmRequestValidator(LogitsProcessor):
    """Admission-time validation of ``dllm_*`` extra_args (vLLM calls ``validate_params`` in the frontend). It never
    edits logits: the dllm sampler replaces vLLM's sampler."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        validate_request(sampling_params)

    def add_request(self, req_idx, sampling_params) -> bool:
        return False

    def apply(self, logits, ctx):
        return logits
