"""vLLM's diffusion scheduler with the canvas cut at ``max_tokens``.

vLLM schedules every canvas at the served ``canvas_length`` (only ``max_model_len`` cuts it), so a
request's last canvas runs positions past its ``max_tokens`` and a finished block cannot leave the
canvas. Selected by the config hook (``scheduler_cls``, a vLLM option; no patch): a canvas never
extends past the request's ``max_tokens``, i.e. the request's response region is exactly
``max_tokens`` positions, as ``gen_length`` is in the embedded engine. With ``stream`` requests a
commit emits one block and the next canvas is the rest of the response (the masked suffix of
Fast-dLLM's DualCache stays in the canvas).
"""
from __future__ import annotations

from vllm.v1.core.sched.diffusion_scheduler import DiffusionScheduler


class DllmScheduler(DiffusionScheduler):
    def update_draft_token_ids(self, draft_token_ids) -> None:
        for i, (req_id, ids) in enumerate(zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)):
            request = self.requests.get(req_id)
            if request is None:
                continue
            left = request.num_prompt_tokens + request.max_tokens - request.num_tokens
            if 0 < left < len(ids):
                draft_token_ids.draft_token_ids[i] = ids[:left]
        super().update_draft_token_ids(draft_token_ids)
