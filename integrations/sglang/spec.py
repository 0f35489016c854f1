"""DFLASH and TOKENSWIFT at the core's adaptive draft length: ``--speculative-adaptive [--speculative-adaptive-config
options.yaml]`` (``docs/dflash.md``; SGLang's own adaptive speculation is EAGLE's)."""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from dllm_core.drafters.adaptive import AdaptiveDraft, StepClock
from dllm_core.drafters.deferred import DeferredContext
from dllm_core.engine.host_options import read_mapping

OPTION = "--speculative-adaptive-config"
# DFlashWorkerV2's attributes sized by its verify width (block_size), one set per width; fresh buffers: None, 0
WIDTH = ("block_size", "_block_pos_offsets", "_draft_block_spec_info", "_draft_block_ids_buf",
         "_draft_block_positions_buf", "_draft_block_tokens_buf", "_draft_verify_out_cache_loc_buf",
         "_draft_block_end_buf", "_draft_seq_lens_cpu_buf", "_accept_len_buf", "_commit_lens_bufs", "_bonus_id_bufs",
         "_out_tokens_bufs", "_new_seq_lens_bufs", "_accept_bonus_buffer_cap", "_accept_bonus_buffer_slot")


def step_clock(server_args, max_draft: int, device) -> StepClock:
    """The core's draft length for one worker, its options from ``--speculative-adaptive-config``."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    opts = read_mapping(server_args.speculative_adaptive_config, OPTION)
    cpu = torch.device(device).type == "cpu"
    kept = SchedulerBatchResultProcessor._visible_output_len  # (the result comes before the cut)
    return StepClock(AdaptiveDraft.of(max_draft, opts, OPTION).new(per_request=cpu), synchronous=cpu, kept=kept,
                     left=lambda r: (r.sampling_params.max_new_tokens or 1 << 30) - kept(r))


@contextmanager
def at_width(worker, attrs, widths: dict, width: int, fresh):
    """One step with the worker's attributes sized by its verify width (``attrs``) at ``width``: a set per width,
    made once by ``fresh()`` (which returns attributes to set, or sets them itself); restored after the step."""
    kept = {a: getattr(worker, a) for a in attrs}
    vars(worker).update(widths.get(width) or fresh())
    try:
        yield
    finally:
        widths[width] = {a: getattr(worker, a) for a in attrs}
        vars(worker).update(kept)


PREPARE_HOOK = "sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2.prepare_for_decode"
# SGLang's functions an adaptive DFLASH worker overrides or wraps (their signatures: test_sglang_server_spec.py)
OVERRIDES = (PREPARE_HOOK, "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation",
             "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.on_verify_complete_cpu")
ADAPTIVE: list = []  # the adaptive DFLASH worker of this scheduler process (one at most), deciding its decode steps


def prepare_decode(original, draft_input, batch):
    """AROUND ``DFlashDraftInputV2.prepare_for_decode`` (which reserves 2 verify blocks of KV per request at every
    step: a result may still be in flight): an adaptive worker's draft length is chosen here, before the forward
    (``draft_input.dllm_k``), and a step without drafts reserves what a plain step needs: the in-flight step's
    width and its own token."""
    worker = ADAPTIVE[0] if ADAPTIVE else None
    if worker is None or not batch.reqs:
        return original(draft_input, batch)
    draft_input.dllm_k = k = worker.dllm_clock.dispatched(len(batch.reqs), batch.reqs)
    if k:
        return original(draft_input, batch)
    from sglang.srt.mem_cache.allocation import alloc_for_spec_decode

    batch.maybe_evict_swa()
    reqs, page = batch.reqs, batch.token_to_kv_pool_allocator.page_size
    lens = [(r.kv.kv_committed_len, r.kv.kv_allocated_len) for r in reqs]
    ends = [max(a, -(-(c + worker.dllm_width + 1) // page) * page) for c, a in lens]
    committed, cur = torch.tensor([c for c, _ in lens]), torch.tensor([a for _, a in lens], dtype=torch.int32)
    nxt = torch.tensor(ends, dtype=torch.int32)
    alloc_for_spec_decode(batch.tree_cache, batch.req_to_token_pool, reqs=reqs, req_pool_indices=batch.req_pool_indices,
                          cur_kv_lens=cur.to(batch.device), cur_kv_lens_cpu=cur, nxt_kv_lens=nxt.to(batch.device),
                          nxt_kv_lens_cpu=nxt, num_needed_tokens=sum(ends) - sum(a for _, a in lens), batch=batch)
    tops = [r.sampling_params.top_k for r in reqs]
    for r in reqs:
        r.decode_batch_idx += 1
    draft_input.max_top_k = max(*tops, 1)
    draft_input.uniform_top_k_value = tops[0] if min(tops) == max(tops) else None
    batch.seq_lens_cpu, batch.seq_lens_sum = committed, sum(c for c, _ in lens)
    draft_input.nxt_kv_lens_cpu, draft_input.nxt_kv_lens_sum = nxt, sum(ends)


STEP = ("input_ids", "out_cache_loc", "seq_lens", "seq_lens_cpu", "orig_seq_lens", "seq_lens_sum", "spec_info")


def decodes_plainly(batch) -> bool:
    """A step without drafts may run as ``decode_forward``: its batch asks for no logprobs and no grammar (those keep
    the speculative verify of one token, which computes them)."""
    return not (batch.return_logprob or batch.has_grammar)


def next_slots(batch):
    """[bs]: each request's next KV slot (allocated by the speculative scheduler)."""
    return batch.req_to_token_pool.req_to_token[batch.req_pool_indices, batch.seq_lens]


def decode_forward(target_worker, batch, input_ids, slots=None, **kwargs):
    """A speculative decode step without drafts as SGLang's plain decode forward: ``ForwardMode.DECODE``, one token per
    request (``input_ids`` [bs]) at its next KV slot (``slots``, default ``next_slots``), the target worker's own
    sampling; the batch is left as it came (the scheduler advances it from the result)."""
    kept = {a: getattr(batch, a) for a in STEP}
    lens_cpu = kept["seq_lens_cpu"] if kept["seq_lens_cpu"] is not None else kept["seq_lens"].cpu()
    batch.input_ids = input_ids
    batch.out_cache_loc = (next_slots(batch) if slots is None else slots).long()
    batch.seq_lens, batch.seq_lens_cpu = kept["seq_lens"] + 1, lens_cpu + 1  # as prepare_for_decode
    batch.orig_seq_lens, batch.seq_lens_sum, batch.spec_info = kept["orig_seq_lens"] + 1, None, None
    try:
        return target_worker.forward_batch_generation(batch, **kwargs)
    finally:
        for a, v in kept.items():
            setattr(batch, a, v)


def adaptive_worker(result, algorithm, server_args, *args, **kwargs):
    """AFTER ``SpeculativeAlgorithm.create_worker``: DFLASH's worker at the adaptive length (the flag as given)."""
    if not (server_args.speculative_adaptive and algorithm.is_dflash()):
        return result
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.draft_worker_common import build_block_pos_offsets, make_draft_block_spec_info

    if result is not DFlashWorkerV2:  # an out-of-tree platform's worker
        return result

    class AdaptiveDFlashWorker(result):
        """Each decode step runs SGLang's own decode path at a verify width of k + 1, k from the core's
        ``DraftLength`` (measured by a ``StepClock``); k = 0 is SGLang's plain decode forward (``plain_step``), whose
        hidden states still enter the drafter's KV cache."""

        def __init__(self, server_args, *args, **kwargs):
            super().__init__(server_args, *args, **kwargs)
            if get_parallel().tp_group.world_size > 1 or self._is_domino or {self.selector, self.lilicorr} - {None}:
                raise ValueError("--speculative-adaptive with DFLASH: one rank (its own measured times decide) and a "
                                 "plain DFlash drafter (no selector, LiLiCorr or Domino head)")
            self.dllm_clock, self.dllm_widths = step_clock(server_args, self.block_size - 1, self.device), {}
            self.dllm_width = self.block_size  # the last decode step's verify width (KV a plain step reserves)
            ADAPTIVE[:] = [self]
            self.dllm_deferred = DeferredContext()  # the plain steps' drafter context

        def forward_batch_generation(self, batch, *args, **kwargs):
            prefill = batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle()
            k = None if prefill else vars(batch.spec_info).pop("dllm_k", None)  # chosen as its KV was reserved
            if k is None:
                k = self.dllm_clock.dispatched(0 if prefill else len(batch.seq_lens), batch.reqs)
            full, runner = self.block_size, self.draft_model_runner
            if not prefill:
                self.dllm_width = k + 1
            if k == 0 and not prefill and decodes_plainly(batch) and not self._need_mamba_verify_commit:
                return self.plain_step(batch, kwargs.get("on_publish"))
            if not prefill:
                self.catch_up(batch)
            if prefill or k + 1 == full:
                return super().forward_batch_generation(batch, *args, **kwargs)
            fresh = lambda: {  # noqa: E731
                **dict.fromkeys(WIDTH), "_accept_bonus_buffer_cap": 0, "_accept_bonus_buffer_slot": 0,
                "block_size": k + 1, "_block_pos_offsets": build_block_pos_offsets(length=k + 1, device=self.device),
                "_draft_block_spec_info": make_draft_block_spec_info(draft_token_num=k + 1, device=self.device)}
            if k == 0:  # (logprobs, a grammar) the drafter's query forward skipped, its context appended after verify
                runner.forward = lambda fb, *a, **kw: SimpleNamespace(can_run_graph=False, logits_output=(
                    SimpleNamespace(hidden_states=torch.empty(fb.batch_size, 1, device=self.device))))
            self.draft_model.set_block_size(k + 1)
            try:
                with at_width(self, WIDTH, self.dllm_widths, k + 1, fresh):
                    return super().forward_batch_generation(batch, *args, **kwargs)
            finally:
                vars(runner).pop("forward", None)
                self.draft_model.set_block_size(full)

        def plain_step(self, batch, on_publish=None):
            """k = 0 as SGLang's plain decode forward (``decode_forward``) with the target's hidden states captured for
            the drafter's KV cache at the token's slot (deferred to the next draft, the core's ``DeferredContext``:
            ``catch_up``); handed back as a verify of the bonus token alone."""
            from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
            from sglang.srt.speculative.dflash_worker_v2 import GenerationBatchResult

            positions = batch.seq_lens.long()  # [bs]: the bonus token's position
            slots = next_slots(batch)  # [bs]
            out = decode_forward(self.target_worker, batch, batch.spec_info.bonus_tokens.view(-1), slots,
                                 capture_hidden_mode=CaptureHiddenMode.FULL, return_kv_loc_plan=True)
            plan, out.kv_loc_plan = out.kv_loc_plan, None
            hidden, out.logits_output.hidden_states = out.logits_output.hidden_states, None
            rids = [r.rid for r in batch.reqs]  # (at the limit, the rows of requests no longer in the batch dropped)
            if self.dllm_deferred.add(hidden.clone(), slots, self._draft_write_ids(plan), positions, rids, set(rids)):
                self.catch_up(batch)
            tokens, new_lens = out.next_token_ids, batch.seq_lens + 1
            if on_publish is not None:
                on_publish(new_lens)
            return GenerationBatchResult(
                logits_output=out.logits_output, next_token_ids=tokens, can_run_cuda_graph=out.can_run_cuda_graph,
                accept_lens=torch.ones_like(batch.seq_lens, dtype=torch.int32), speculative_num_draft_tokens=1,
                new_seq_lens=new_lens, next_draft_input=self._make_next_draft_input_decode(bonus_tokens=tokens,
                                                                                          new_seq_lens=new_lens))

        def catch_up(self, batch):
            """Append the plain steps' deferred context to the drafter's KV cache in one write, for the rows whose
            request is in ``batch`` and still holds that KV slot at that position (not retracted since)."""
            got = self.dllm_deferred.take({r.rid: i for i, r in enumerate(batch.reqs)})
            if got is not None:
                hidden, slots, locs, pos, i = got
                held = batch.req_to_token_pool.req_to_token[batch.req_pool_indices[i].long(), pos] == slots
                self._append_target_hidden_to_draft_kv_by_loc(target_hidden=hidden[held], cache_loc=locs[held],
                                                              positions=pos[held])

        def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
            self.dllm_clock.result(num_correct_drafts_per_req)  # a decode step's result, in step order

    return AdaptiveDFlashWorker
