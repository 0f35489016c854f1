"""DFlash and TokenSwift at the core's adaptive draft length in vLLM: ``--scheduler-cls
integrations.vllm.spec.AdaptiveDraftScheduler`` (``AsyncAdaptiveDraftScheduler`` with async scheduling): vLLM's
dynamic speculative decoding asks the policy each step's draft count; a DFlash step that drafts nothing runs no
proposer, its drafter context deferred to the next draft, a ``custom_class`` proposer (TokenSwift) is told the
count (``patch_proposers``), a step without drafts prepares and samples as plain decoding (``patch_draftless``).
"""
from __future__ import annotations

from dllm_core.drafters.adaptive import AdaptiveDraft, DraftLengths
from dllm_core.drafters.deferred import DeferredContext

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
            self.dynamic_sd_lookup = DraftLengths(  # (a step drafts for the next: a switch from plain costs one)
                policy.new(per_request=cpu, switch=1), lag=2 if isinstance(self, AsyncScheduler) else 1,
                left=lambda: {r.request_id: r.max_tokens - r.num_output_tokens - 1 for r in self.running})
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
    patch_proposers()
    patch_draftless()


def patch_proposers() -> None:
    """The step's draft count where vLLM 0.32's runners do not act on it (``patches/vllm/README.md``):
    - a ``custom_class`` proposer (TokenSwift) is called without it (every other proposer gets
      ``num_spec_tokens_to_schedule``): it is set as the proposer's ``num_speculative_tokens`` before each call;
    - DFlash at a step that drafts nothing (eager steps): the default runner calls no proposer; the step's target rows
      (the drafter's context) are held by the core's ``DeferredContext`` and written in one append before the next
      draft, or once the rows held reach its limit. Model Runner V2 skips the drafter's query forward."""
    import torch
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def v2_propose(propose):  # Model Runner V2: the draft count gates _generate_draft
        def _propose(self, *args, num_speculative_tokens=None, **kwargs):
            self._dllm_skip = num_speculative_tokens == 0
            return propose(self, *args, num_speculative_tokens=num_speculative_tokens, **kwargs)
        return _propose

    _patched(DFlashSpeculator, "propose", v2_propose)
    _patched(DFlashSpeculator, "_generate_draft", lambda generate: lambda self, *a, **kw: (
        None if getattr(self, "_dllm_skip", False) else generate(self, *a, **kw)))

    def v1_runner(propose):  # the default runner: (scheduler_output, sampled, sampling metadata, hidden, sample
        def _propose(self, out, sampled, *args):  # hidden, aux hidden, spec metadata, attention metadata, slots)
            drafter, k = self.drafter, out.num_spec_tokens_to_schedule
            if self.speculative_config is not None and self.speculative_config.method == "custom_class":
                drafter.num_speculative_tokens = k
            if not isinstance(drafter, DFlashProposer):
                return propose(self, out, sampled, *args)
            held, m = vars(drafter).setdefault("_dllm_held", DeferredContext()), drafter.model
            append = lambda h, slots, pos: m.precompute_and_store_context_kv(m.combine_hidden_states(h), pos, slots)
            alive = None if self.cache_config.enable_prefix_caching else self.requests  # (else a finished
            if k:  # request's rows are dropped: no later request reads them)
                held.write(append, alive)
                return propose(self, out, sampled, *args)
            if self.valid_sampled_token_count_event is not None:  # async scheduling reads the step's counts
                self._copy_valid_sampled_token_count(*drafter.prepare_next_token_ids_padded(
                    sampled, self.requests, self.input_batch, self.discard_request_mask.gpu))
            hidden, aux, n, sm = args[1], args[3], out.total_num_scheduled_tokens, args[6]
            ids, name = self.input_batch.req_ids, next(iter(drafter._draft_attn_layer_names))
            pos = self._get_positions(n).clone()
            rows = torch.cat([h[:n] for h in aux], -1) if self.use_aux_hidden_state_outputs else hidden[:n].clone()
            slots = (sm[name] if isinstance(sm, dict) else torch.cat([u[name] for u in sm]))[:n].clone()  # [n]
            if held.add(rows, slots, slots, pos, [r for r in ids for _ in range(out.num_scheduled_tokens[r])], alive):
                held.write(append, alive)
            return [[] for _ in ids]  # (a list: no device copy of an empty draft)
        return _propose

    _patched(GPUModelRunner, "propose_draft_token_ids", v1_runner)


def patch_draftless() -> None:
    """vLLM 0.32's runner prepares and samples every step of a speculative engine as a verify, a step without drafts
    too; such a step samples as plain decoding does (its logits are the same rows), and its verify metadata is
    written directly (``patches/vllm/README.md``)."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def metadata(calc):
        def _calc(self, num_draft_tokens, cu_num_scheduled_tokens):
            if num_draft_tokens.any():
                return calc(self, num_draft_tokens, cu_num_scheduled_tokens)
            rows = torch.arange(len(num_draft_tokens), dtype=torch.int32, device=self.device)  # [B]
            return SpecDecodeMetadata(rows[:0], num_draft_tokens.tolist(), torch.zeros_like(rows), rows + 1, rows[:0],
                                      rows, torch.from_numpy(cu_num_scheduled_tokens - 1).to(self.device))
        return _calc

    def sampling(sample):
        def _sample(self, logits, spec_decode_metadata):
            if spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens):
                spec_decode_metadata = None
            return sample(self, logits, spec_decode_metadata)
        return _sample

    _patched(GPUModelRunner, "_calc_spec_decode_metadata", metadata)
    _patched(GPUModelRunner, "_sample", sampling)
