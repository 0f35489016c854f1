"""vLLM's diffusion scheduler with the canvas cut at ``max_tokens``.

vLLM schedules every canvas at the served ``canvas_length`` (only ``max_model_len`` cuts it), so a
request's last canvas runs positions past its ``max_tokens`` and a finished block cannot leave the
canvas. Selected by the config hook (``scheduler_cls``, a vLLM option; no patch): a canvas never
extends past the whole blocks that hold the request's ``max_tokens`` (dllm_core's response rule, as
``gen_length`` in the embedded engine; vLLM's stop check emits ``max_tokens`` of them). With ``stream`` requests a
commit emits one block and the next canvas is the rest of the response (the masked suffix of
Fast-dLLM's DualCache stays in the canvas). A block-causal model (LLaDA2) decodes one grid block per canvas,
the last one whole (as the embedded engine does): its canvas runs to the end of its grid block and the commit's
tokens past ``max_tokens`` are cut by vLLM's stop check.
"""
from __future__ import annotations

from dllm_core.engine.generate import grid_canvas_width

from vllm.v1.core.sched.diffusion_scheduler import DiffusionScheduler

from .configs import block_causal_size
from . import options


class DllmScheduler(DiffusionScheduler):
    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.block_causal = block_causal_size(vllm_config.model_config.hf_config)
        self.served = options.serve(vllm_config.diffusion_config.canvas_length, self.block_causal,
                                    vllm_config.additional_config)

    def decoded(self, request) -> int:
        """Positions the request decodes: ``max_tokens`` in whole blocks (dllm_core's response rule)."""
        sp = request.sampling_params
        return self.served.plan(options.request_options(sp.extra_args, self.served.defaults), sp.max_tokens).decoded

    def update_draft_token_ids(self, draft_token_ids) -> None:
        for i, (req_id, ids) in enumerate(zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)):
            request = self.requests.get(req_id)
            if request is None:
                continue
            left = (grid_canvas_width(request.num_tokens, self.block_causal) if self.block_causal else
                    request.num_prompt_tokens + self.decoded(request) - request.num_tokens)
            if 0 < left < len(ids):
                draft_token_ids.draft_token_ids[i] = ids[:left]
        super().update_draft_token_ids(draft_token_ids)
