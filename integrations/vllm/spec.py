"""DFlash and TokenSwift at the core's adaptive draft length in vLLM: ``--scheduler-cls
integrations.vllm.spec.AdaptiveDraftScheduler`` (``AsyncAdaptiveDraftScheduler`` with async scheduling): vLLM's
dynamic speculative decoding asks the policy each step's draft count; a DFlash step that drafts nothing skips the
drafter's query forward (``patch_dflash``), a ``custom_class`` proposer (TokenSwift) is told the count
(``patch_custom_proposer``), a step without drafts samples as plain decoding (``patch_draftless_sampling``).
"""
from __future__ import annotations

from dllm_core.drafters.adaptive import AdaptiveDraft, DraftLengths

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

KEY = "adaptive_draft"  # additional_config's key of the policy's options


class AdaptiveDrafts:
    """The scheduler side (a mixin over vLLM's schedulers); the policy's options from ``--additional-config
    '{"adaptive_draft": {...}}'`` (``AdaptiveDraft``'s, as SGLang's ``--speculative-adaptive-config``)."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        if self.num_spec_tokens:
            cpu, opts = vllm_config.device_config.device_type == "cpu", (vllm_config.additional_config or {}).get(KEY)
            policy = AdaptiveDraft.of(self.num_spec_tokens, opts, f"--additional-config {KEY}")
            self.dynamic_sd_lookup = DraftLengths(policy.new(per_request=cpu),
                                                  lag=2 if isinstance(self, AsyncScheduler) else 1)
            patch_runner()  # the worker of a single-process executor lives here (a worker process: ``register``)

    def update_from_output(self, scheduler_output, model_runner_output):
        out = super().update_from_output(scheduler_output, model_runner_output)
        if isinstance(table := self.dynamic_sd_lookup, DraftLengths):
            out_ids, index = model_runner_output.sampled_token_ids, model_runner_output.req_id_to_index
            table.done(scheduler_output.num_scheduled_tokens,
                       {r: len(t) for r, t in scheduler_output.scheduled_spec_decode_tokens.items()},
                       {r: len(out_ids[i]) for r, i in index.items()}, table.verified(), table.steady())
        return out


class AdaptiveDraftScheduler(AdaptiveDrafts, Scheduler):
    pass


class AsyncAdaptiveDraftScheduler(AdaptiveDrafts, AsyncScheduler):
    pass


def _patched(cls, name: str, wrap) -> None:
    """Replace ``cls.name`` by ``wrap(original)`` once per process."""
    if not getattr(cls, "_dllm_patched_" + name, False):
        setattr(cls, name, wrap(getattr(cls, name)))
        setattr(cls, "_dllm_patched_" + name, True)


def patch_runner() -> None:
    """The runner patches below, where a runner runs (``register`` in a worker process, the scheduler in-process).
    None changes a step whose draft count is the configured one."""
    patch_dflash()
    patch_custom_proposer()
    patch_draftless_sampling()


def patch_dflash() -> None:
    """vLLM's DFlash drafter skips its query forward for a step that drafts nothing (both runners; eager steps; the
    context K/V of the step's tokens are still stored). ``patches/vllm/README.md``."""
    import torch
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    def v2_propose(propose):  # Model Runner V2: the draft count gates _generate_draft
        def _propose(self, *args, num_speculative_tokens=None, **kwargs):
            self._dllm_skip = num_speculative_tokens == 0
            return propose(self, *args, num_speculative_tokens=num_speculative_tokens, **kwargs)
        return _propose

    _patched(DFlashSpeculator, "propose", v2_propose)
    _patched(DFlashSpeculator, "_generate_draft", lambda generate: lambda self, *a, **kw: (
        None if getattr(self, "_dllm_skip", False) else generate(self, *a, **kw)))

    def v1_propose(propose):  # the default runner, called with keywords: the context K/V stored, no forward
        def _propose(self, num_speculative_tokens, **kw):
            if num_speculative_tokens:
                return propose(self, num_speculative_tokens=num_speculative_tokens, **kw)
            self.num_speculative_tokens, self._last_draft_probs, cad = 0, None, kw["common_attn_metadata"]
            n, _, _ = self.set_inputs_first_pass(
                target_hidden_states=self.model.combine_hidden_states(kw["target_hidden_states"]), cad=cad,
                **{k: kw.get(k) for k in ("target_token_ids", "next_token_ids", "target_positions",
                                          "token_indices_to_sample", "num_rejected_tokens_gpu")})
            self.build_model_inputs_first_pass(n, n, kw.get("mm_embed_inputs"))
            return torch.empty(cad.batch_size(), 0, dtype=torch.int64, device=self.device)
        return _propose

    _patched(DFlashProposer, "propose", v1_propose)


def patch_custom_proposer() -> None:
    """vLLM 0.32's runner calls a ``custom_class`` proposer without the step's draft count (every other proposer gets
    ``num_spec_tokens_to_schedule``): set it as the proposer's ``num_speculative_tokens`` before each call.
    ``patches/vllm/README.md``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrap(propose):
        def _propose(self, scheduler_output, *args, **kwargs):
            if self.speculative_config is not None and self.speculative_config.method == "custom_class":
                self.drafter.num_speculative_tokens = scheduler_output.num_spec_tokens_to_schedule
            return propose(self, scheduler_output, *args, **kwargs)
        return _propose

    _patched(GPUModelRunner, "propose_draft_token_ids", wrap)


def patch_draftless_sampling() -> None:
    """vLLM 0.32's runner samples every step of a speculative engine through its rejection sampler, a step without
    drafts too; such a step samples as plain decoding does (its logits are the same rows).
    ``patches/vllm/README.md``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrap(sample):
        def _sample(self, logits, spec_decode_metadata):
            if spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens):
                spec_decode_metadata = None
            return sample(self, logits, spec_decode_metadata)
        return _sample

    _patched(GPUModelRunner, "_sample", wrap)
