"""The dllm sampler (vLLM's custom sampler for LLaDA / Dream / LLaDA2): a finished prefill gets an all-mask canvas as
its draft tokens; a denoise step runs the core's step on its block (``ResponseSlots.take``) and emits nothing (vLLM
rolls the canvas back); a commit step emits the canvas (or its first block when streaming).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm.v1.worker.gpu.sample.output import SamplerOutput

from .state import COMMIT, DENOISE, DllmStates

_NO_PENALTIES = SimpleNamespace(output_bin_counts=None)


class DllmSampler:
    """Replaces vLLM's sampler for the diffusion models served by this adapter."""

    compute_nans = False

    def __init__(self, sampler, states: DllmStates, model):
        self.sampling_states = sampler.sampling_states
        self.logprob_token_ids_state = sampler.logprob_token_ids_state
        self.req_states = sampler.req_states
        self.states, self.model = states, model
        n, L, dev = states.max_reqs, states.canvas_len, states.device
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
        slots = ib.idx_mapping_np[:n]
        known = st.known(slots)
        nlog = np.diff(ib.cu_num_logits_np[:n + 1])
        width = st.canvas_len if ib.num_draft_tokens > 0 else 1
        sampled, num_sampled = self._sampled[:n, :width], self._num_sampled[:n]
        num_rejected = self._num_rejected[:n]
        sampled.zero_(), num_sampled.zero_(), num_rejected.zero_()

        prefilled = known & (nlog == 0) & (ib.num_computed_prefill_tokens_np[:n] + ib.num_scheduled_tokens[:n]
                                           >= ib.prefill_len_np[:n])
        commit = known & (nlog > 0) & (st.phase[slots] == COMMIT)
        denoise = known & (nlog > 0) & (st.phase[slots] == DENOISE)
        rejected = np.where(denoise, nlog, 0)  # a denoise step keeps nothing; a commit keeps what it emits
        if commit.any():
            rows = np.flatnonzero(commit)
            rejected[rows] = nlog[rows] - self._emit(rows, slots, nlog, sampled, num_sampled)
        if denoise.any():
            rows = np.flatnonzero(denoise)
            st.phase[slots[rows]] = np.where(self._denoise(rows, slots, nlog, ib.cu_num_logits_np, logits), COMMIT,
                                             DENOISE)
        if rejected.any():
            num_rejected.copy_(torch.as_tensor(rejected, dtype=torch.int32))
        fresh = slots[prefilled | commit]
        if len(fresh):
            st.start_canvas(fresh)
        touched = slots[prefilled | commit | denoise]
        if len(touched):
            idx = torch.as_tensor(touched, dtype=torch.long, device=st.device)
            self.req_states.draft_tokens[idx, :st.canvas_len] = st.scheduled(touched)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None, num_nans=None,
                             num_sampled=num_sampled, num_rejected=num_rejected)

    def _emit(self, rows: np.ndarray, slots, nlog, sampled, num_sampled) -> np.ndarray:
        """Commit step: emit each finished canvas (its first ``nlog`` positions; streaming: its block)."""
        st = self.states
        n_emit = st.emitted(slots[rows], nlog[rows])
        valid = torch.as_tensor(n_emit, dtype=torch.long, device=st.device)
        keep = torch.arange(st.canvas_len, device=st.device) < valid[:, None]
        r = torch.as_tensor(rows, dtype=torch.long, device=st.device)
        sampled[r] = torch.where(keep, st.scheduled(slots[rows]), 0).to(sampled.dtype)
        num_sampled[r] = valid.to(num_sampled.dtype)
        return n_emit

    def _denoise(self, rows: np.ndarray, slots, nlog, cu, logits) -> np.ndarray:
        """The core's step of each request's block (one batched sampler call per configuration, one device
        read) from its logits rows -> [len(rows)] the canvas is done."""
        st, core, dev = self.states, self.states.slots, self.states.device
        sl, valid = slots[rows], nlog[rows]
        Lb = core.block_len[sl]
        if (Lb != Lb[0]).any():  # blocks of different lengths: one take each
            done = np.zeros(len(rows), dtype=bool)
            for b in np.unique(Lb):
                done[Lb == b] = self._denoise(rows[Lb == b], slots, nlog, cu, logits)
            return done
        shift, off = int(self.model.shift_logits), st.offset[sl]
        cols = core.block_columns(sl)[:, None] + np.arange(Lb[0]) - shift  # [m, Lb] the column each logit row is of
        src = torch.as_tensor(cu[rows][:, None] + np.clip(np.minimum(cols - off[:, None], valid[:, None] - 1), 0, None),
                              dtype=torch.long, device=dev)  # a block-causal prompt tail: never decoded
        lg = logits[src].float()  # [m, Lb, V]
        if shift and (cols[:, 0] < 0).any():  # Dream: the first canvas position from the last held row
            first = np.flatnonzero(cols[:, 0] < 0)
            lg[first, 0] = self.model.compute_logits(st.last_hidden[self._idx(sl[first])]).float()
        return core.take(sl, lg, off + valid)

    def _idx(self, a) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.long, device=self.states.device)
