"""DFLASH and TOKENSWIFT at the core's adaptive draft length: ``--speculative-adaptive [--speculative-adaptive-config
options.yaml]`` (``docs/dflash.md``; SGLang's own adaptive speculation is EAGLE's)."""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from dllm_core.drafters.adaptive import AdaptiveDraft, StepClock
from dllm_core.engine.host_options import read_mapping

OPTION = "--speculative-adaptive-config"
# DFlashWorkerV2's attributes sized by its verify width (block_size), one set per width; fresh buffers: None, 0
WIDTH = ("block_size", "_block_pos_offsets", "_draft_block_spec_info", "_draft_block_ids_buf",
         "_draft_block_positions_buf", "_draft_block_tokens_buf", "_draft_verify_out_cache_loc_buf",
         "_draft_block_end_buf", "_draft_seq_lens_cpu_buf", "_accept_len_buf", "_commit_lens_bufs", "_bonus_id_bufs",
         "_out_tokens_bufs", "_new_seq_lens_bufs", "_accept_bonus_buffer_cap", "_accept_bonus_buffer_slot")


def step_clock(server_args, max_draft: int, device) -> StepClock:
    """The core's draft length for one worker, its options from ``--speculative-adaptive-config``."""
    opts = read_mapping(server_args.speculative_adaptive_config, OPTION)
    cpu = torch.device(device).type == "cpu"
    return StepClock(AdaptiveDraft.of(max_draft, opts, OPTION).new(per_request=cpu), synchronous=cpu)


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
        ``DraftLength`` (measured by a ``StepClock``); at k = 0 the drafter's forward is skipped, so the step is the
        target's plain decode, whose hidden states still enter the drafter's KV cache."""

        def __init__(self, server_args, *args, **kwargs):
            super().__init__(server_args, *args, **kwargs)
            if get_parallel().tp_group.world_size > 1 or self._is_domino or {self.selector, self.lilicorr} - {None}:
                raise ValueError("--speculative-adaptive with DFLASH: one rank (its own measured times decide) and a "
                                 "plain DFlash drafter (no selector, LiLiCorr or Domino head)")
            self.dllm_clock, self.dllm_widths = step_clock(server_args, self.block_size - 1, self.device), {}

        def forward_batch_generation(self, batch, *args, **kwargs):
            prefill = batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle()
            k = self.dllm_clock.dispatched(0 if prefill else len(batch.seq_lens))
            full, runner = self.block_size, self.draft_model_runner
            if prefill or k + 1 == full:
                return super().forward_batch_generation(batch, *args, **kwargs)
            fresh = lambda: {  # noqa: E731
                **dict.fromkeys(WIDTH), "_accept_bonus_buffer_cap": 0, "_accept_bonus_buffer_slot": 0,
                "block_size": k + 1, "_block_pos_offsets": build_block_pos_offsets(length=k + 1, device=self.device),
                "_draft_block_spec_info": make_draft_block_spec_info(draft_token_num=k + 1, device=self.device)}
            if k == 0:  # no drafts: the drafter's query forward is skipped (its context is appended after verify)
                runner.forward = lambda fb, *a, **kw: SimpleNamespace(can_run_graph=False, logits_output=(
                    SimpleNamespace(hidden_states=torch.empty(fb.batch_size, 1, device=self.device))))
            self.draft_model.set_block_size(k + 1)
            try:
                with at_width(self, WIDTH, self.dllm_widths, k + 1, fresh):
                    return super().forward_batch_generation(batch, *args, **kwargs)
            finally:
                vars(runner).pop("forward", None)
                self.draft_model.set_block_size(full)

        def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
            self.dllm_clock.result(num_correct_drafts_per_req)  # a decode step's result, in step order

    return AdaptiveDFlashWorker
