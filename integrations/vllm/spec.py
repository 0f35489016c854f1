"""DFlash and TokenSwift at the core's adaptive draft length in vLLM: ``--scheduler-cls
integrations.vllm.spec.AdaptiveDraftScheduler`` (``AsyncAdaptiveDraftScheduler`` with async scheduling): vLLM's
dynamic speculative decoding asks the policy each step's draft count; a DFlash step that drafts nothing skips the
drafter's query forward (``patch_dflash``), a ``custom_class`` proposer (TokenSwift) is told the count
(``patch_custom_proposer``).
"""
from __future__ import annotations

from dllm_core.drafters.adaptive import AdaptiveDraft, StepClock

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler


class DraftLengths(StepClock):
    """vLLM's batch size -> draft count table (``Scheduler.dynamic_sd_lookup``), answered by the policy."""

    def __getitem__(self, batch: int) -> int:
        return self.lengths.choose(batch)


class AdaptiveDrafts:
    """The scheduler side (a mixin over vLLM's schedulers)."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        if self.num_spec_tokens:
            self.dynamic_sd_lookup = DraftLengths(AdaptiveDraft(self.num_spec_tokens).new())
            patch_dflash()  # the worker of a single-process executor lives here
            patch_custom_proposer()

    def update_from_output(self, scheduler_output, model_runner_output):
        out = super().update_from_output(scheduler_output, model_runner_output)
        if isinstance(self.dynamic_sd_lookup, DraftLengths):
            out_ids, index = model_runner_output.sampled_token_ids, model_runner_output.req_id_to_index
            self.dynamic_sd_lookup.done(scheduler_output.num_scheduled_tokens,
                                        {r: len(t) for r, t in scheduler_output.scheduled_spec_decode_tokens.items()},
                                        {r: len(out_ids[i]) for r, i in index.items()})
        return out


class AdaptiveDraftScheduler(AdaptiveDrafts, Scheduler):
    pass


class AsyncAdaptiveDraftScheduler(AdaptiveDrafts, AsyncScheduler):
    pass


def patch_dflash() -> None:
    """vLLM's DFlash drafter skips its query forward for a step that drafts nothing (eager steps; the context K/V
    of the step's tokens are still stored). ``patches/vllm/README.md``."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    if getattr(DFlashSpeculator, "_dllm_patched", False):
        return
    propose, generate = DFlashSpeculator.propose, DFlashSpeculator._generate_draft

    def _propose(self, *args, num_speculative_tokens=None, **kwargs):
        self._dllm_skip = num_speculative_tokens == 0
        return propose(self, *args, num_speculative_tokens=num_speculative_tokens, **kwargs)

    def _generate_draft(self, *args, **kwargs):
        if not getattr(self, "_dllm_skip", False):
            generate(self, *args, **kwargs)

    DFlashSpeculator.propose, DFlashSpeculator._generate_draft = _propose, _generate_draft
    DFlashSpeculator._dllm_patched = True


def patch_custom_proposer() -> None:
    """vLLM 0.32's runner calls a ``custom_class`` proposer without the step's draft count (every other proposer gets
    ``num_spec_tokens_to_schedule``): set it as the proposer's ``num_speculative_tokens`` before each call.
    ``patches/vllm/README.md``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_dllm_patched", False):
        return
    propose = GPUModelRunner.propose_draft_token_ids

    def _propose(self, scheduler_output, *args, **kwargs):
        if self.speculative_config is not None and self.speculative_config.method == "custom_class":
            self.drafter.num_speculative_tokens = scheduler_output.num_spec_tokens_to_schedule
        return propose(self, scheduler_output, *args, **kwargs)

    GPUModelRunner.propose_draft_token_ids = _propose
    GPUModelRunner._dllm_patched = True
