"""vLLM's diffusion scheduler with each canvas cut at the whole blocks holding ``max_tokens`` (the core's response
rule; selected by the config hook as ``scheduler_cls``, no patch). ``docs/vllm.md`` has the canvas rules.
"""
from __future__ import annotations

from dllm_core.engine.generate import grid_canvas_width, prefix_pages_error

from vllm.v1.core.sched.diffusion_scheduler import DiffusionScheduler

from .configs import block_causal_size
from . import options


def check_prefix_pages(vllm_config) -> int | None:
    """The resolved config's page against a block-causal model's grid when prefix caching is on (a page of whole
    blocks, ``prefix_pages_error``); -> the model's block (None: bidirectional)."""
    block, cc = block_causal_size(vllm_config.model_config.hf_config), vllm_config.cache_config
    if block and cc.enable_prefix_caching and (err := prefix_pages_error(cc.block_size, block)):
        raise ValueError(f"--block-size {cc.block_size}: {err}, or --no-enable-prefix-caching")
    return block


class DllmScheduler(DiffusionScheduler):
    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.block_causal = check_prefix_pages(vllm_config)
        self.served = options.serve(vllm_config.diffusion_config.canvas_length, self.block_causal,
                                    vllm_config.additional_config)

    def decoded(self, request) -> int:
        """Positions the request decodes: ``max_tokens`` in whole blocks (dllm_core's response rule)."""
        sp = request.sampling_params
        opts = options.request_options(sp.extra_args, self.served.defaults, sp.temperature)
        return self.served.plan(opts, sp.max_tokens).decoded

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
