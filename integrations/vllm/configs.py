"""HF config classes for LLaDA / Dream (no remote code) and the vLLM config hook that makes them diffusion models:
``canvas_length`` (default ``max_model_len`` in whole blocks of 32, every response one canvas; ``--diffusion-config``).
"""
from __future__ import annotations

import logging

from dllm_core.models import hf_config

logger = logging.getLogger(__name__)

BLOCK = 32  # a canvas spans whole blocks of the default block length
VALIDATOR = "integrations.vllm.sampler:DllmRequestValidator"


class LLaDAConfig(hf_config.LLaDAConfig):
    """LLaDA's config under the names vLLM reads, + ``canvas_length``; mask id defaults to LLaDA-8B's."""

    def __init__(self, mask_token_id=126336, canvas_length=0, **kw):
        self.canvas_length = canvas_length
        super().__init__(mask_token_id=mask_token_id, **kw)


class DreamConfig(hf_config.DreamConfig):
    """Dream-v0 + ``canvas_length``; mask id defaults to Dream-v0's."""

    def __init__(self, mask_token_id=151666, canvas_length=0, **kw):
        self.canvas_length = canvas_length
        super().__init__(mask_token_id=mask_token_id, **kw)


class LLaDA2Config(hf_config.LLaDA2MoeConfig):
    """LLaDA2.0 / 2.1 + ``canvas_length`` (the checkpoint's ``block_size``: one grid block per canvas), under the
    names vLLM's Bailing-MoE layers read (RMS q/k norms, ``rope_parameters``); mask id defaults to the published
    one."""

    def __init__(self, mask_token_id=156895, block_size=32, canvas_length=None, use_rmsnorm=True, **kw):
        self.canvas_length = canvas_length or block_size
        self.block_size, self.use_rmsnorm = block_size, use_rmsnorm
        super().__init__(mask_token_id=mask_token_id, **kw)
        if not isinstance(getattr(self, "rope_parameters", None), dict):
            self.rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}


def block_causal_size(hf) -> int | None:
    """The block a served model attends block-causally over (LLaDA2's ``block_size``), else None."""
    return hf.block_size if isinstance(hf, LLaDA2Config) else None


def register_configs() -> None:
    """Make ``AutoConfig`` resolve the model types locally (no trust_remote_code), with vLLM's fields."""
    hf_config.register_configs((LLaDAConfig, DreamConfig, LLaDA2Config), replace=True)


def config_hook():
    """The ``VerifyAndUpdateConfig`` subclass vLLM runs for our architectures (built lazily so
    importing this module does not import vLLM)."""
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    class DllmDiffusionConfig(VerifyAndUpdateConfig):
        """Diffusion config + the engine settings the block-canvas semantics need."""

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            from vllm.config.diffusion import DiffusionConfig

            from . import options

            mc, sc, cc = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
            if vllm_config.diffusion_config is None:
                vllm_config.diffusion_config = DiffusionConfig(  # default: every response is one canvas
                    canvas_length=getattr(mc.hf_config, "canvas_length", None) or -(-mc.max_model_len // BLOCK) * BLOCK)
            canvas, block = vllm_config.diffusion_config.canvas_length, block_causal_size(mc.hf_config)
            if block is not None and canvas != block:
                raise ValueError(f"--diffusion-config canvas_length {canvas} must equal the checkpoint's block_size "
                                 f"{block} ({type(mc.hf_config).__name__} attends block-causally: one grid block per "
                                 f"canvas)")
            options.serve(canvas, block, vllm_config.additional_config)  # fail fast
            # A prompt is prefilled in one chunk. A bidirectional one's K/V depend on the whole prompt: never shared
            # through prefix caching; a block-causal one's are its grid blocks' (pages of whole blocks: scheduler.py)
            if block is None:
                cc.enable_prefix_caching = False
            sc.enable_chunked_prefill = False
            sc.long_prefill_token_threshold = 0
            if sc.max_num_batched_tokens < mc.max_model_len:
                logger.info("dllm: max_num_batched_tokens %d -> %d (prompts are prefilled in one chunk)",
                            sc.max_num_batched_tokens, mc.max_model_len)
                sc.max_num_batched_tokens = mc.max_model_len
            mc.enforce_eager = True  # the per-step canvas plan is data dependent: no CUDA graphs
            if sc.scheduler_cls is None:  # canvases cut at max_tokens (scheduler.py); the worker's canvas
                sc.scheduler_cls = "integrations.vllm.scheduler.DllmScheduler"  # width must be known when
                sc.async_scheduling = False  # the step is scheduled, so scheduling stays synchronous
            if mc.tokenizer_mode in ("auto", "hf"):  # HF tokenizer + the renderer that refuses [MASK] in prompts
                mc.tokenizer_mode = "dllm"
            ac = vllm_config.attention_config
            if ac.backend is None and not ac.use_non_causal:
                ac.use_non_causal = True
            pc = vllm_config.parallel_config
            if not pc.worker_extension_cls:  # work counters over collective_rpc (state.work_counters)
                pc.worker_extension_cls = "integrations.vllm.state.DllmWorkerExtension"
            procs = list(mc.logits_processors or [])
            if VALIDATOR not in procs:
                mc.logits_processors = [*procs, VALIDATOR]

    return DllmDiffusionConfig
