"""The dllm sampler: vLLM's custom sampler for LLaDA / Dream / LLaDA2, delegating every decision to
dllm_core's samplers (``Sampler.begin_block`` / ``step``).

Per step, for each request in the batch:

* prefill that completes its prompt -> a fresh all-mask canvas becomes its draft tokens;
* denoise  -> the logits of the request's current block of the canvas (Dream: shifted, the first
  canvas row from the last committed position's kept hidden state) go to its dllm_core sampler,
  which commits tokens; nothing is emitted (every canvas position is "rejected", so vLLM rolls the
  canvas back); a finished block moves to the next block of the canvas, a finished last block
  makes the next step the commit;
* commit   -> the finished canvas is emitted (its K/V were just written into the paged cache);
  a new all-mask canvas follows.

Requests sharing a sampler configuration run one batched dllm_core call; per-request sampler
state lives in slot-indexed rows (dllm_core's ``SlotStates``).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm.v1.worker.gpu.sample.output import SamplerOutput

from dllm_core.engine.step import denoise_step
from dllm_core.models import shift_right

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
        known = np.array([st.policy[s] is not None for s in slots], dtype=bool)  # dummy runs have none
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
            self._denoise(np.flatnonzero(denoise), slots, nlog, ib.cu_num_logits_np, logits)
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
        n_emit = np.array([st.emit_length(s, v) for s, v in zip(slots[rows], nlog[rows])], dtype=np.int64)
        valid = torch.as_tensor(n_emit, dtype=torch.long, device=st.device)
        keep = torch.arange(st.canvas_len, device=st.device) < valid[:, None]
        r = torch.as_tensor(rows, dtype=torch.long, device=st.device)
        canvas = st.scheduled(slots[rows])  # [m, L]
        sampled[r] = torch.where(keep, canvas, 0).to(sampled.dtype)
        num_sampled[r] = valid.to(num_sampled.dtype)
        for s, v, toks in zip(slots[rows], n_emit, canvas.tolist()):
            st.tokens[s].extend(toks[:v])  # the prefix a later refresh re-runs
            st.response_left[s] -= v
        return n_emit

    def _denoise(self, rows: np.ndarray, slots, nlog, cu, logits) -> None:
        """One dllm_core sampler step per group of requests sharing a configuration."""
        st = self.states
        finished = [m[self._step_group(m, slots, nlog, cu, logits)] for m in st.groups(rows, slots)]
        done = np.concatenate(finished)
        st.phase[slots[done]] = COMMIT

    def _step_group(self, rows: np.ndarray, slots, nlog, cu, logits) -> np.ndarray:
        """One dllm_core step on each request's current block; returns the rows whose canvas is done."""
        st, L, dev = self.states, self.states.canvas_len, self.states.device
        pol = st.policy[slots[rows[0]]]
        Lb, sl = pol.block_length, slots[rows]
        idx = torch.as_tensor(sl, dtype=torch.long, device=dev)
        valid = torch.as_tensor(nlog[rows], dtype=torch.long, device=dev)
        pos = torch.arange(L, device=dev)
        off = torch.as_tensor(st.offset[sl], device=dev)[:, None]  # [m, 1] canvas column of the first logit row
        src = torch.as_tensor(cu[rows], dtype=torch.long, device=dev)[:, None] + torch.clamp(
            torch.minimum(pos - off, valid[:, None] - 1), min=0)  # a block-causal prompt tail: never decoded
        lg = logits[src].float()  # [m, L, V]
        if self.model.shift_logits:  # Dream: position i is predicted by row i - 1
            lg = shift_right(self.model.compute_logits(st.last_hidden[idx]).float(), lg)
        x = st.canvas[idx]  # [m, L]
        x = torch.where(pos < off + valid[:, None], x, st.pad_id)  # a canvas cut at max_model_len
        win = torch.as_tensor(st.progress.block[sl] * Lb, device=dev)[:, None] + torch.arange(Lb, device=dev)  # [m, Lb]
        xw, lgw = x.gather(1, win), lg[torch.arange(len(rows), device=dev)[:, None], win]  # [m, Lb], [m, Lb, V]
        ss = st.sampler_states(pol)  # rows starting a block had begin_block before the forward
        key = tuple(sl.tolist())  # the batch's rows stay gathered while it is unchanged
        state = ss.gather(idx, key)
        xw, done = denoise_step(pol.sampler, state, lgw, xw, st.token_context(pol))
        ss.scatter(idx, state, key)
        st.canvas[idx] = x.scatter(1, win, xw)
        return st.progress.advance(sl, done.cpu().numpy())  # the one host sync of a step
