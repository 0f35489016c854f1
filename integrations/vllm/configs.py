"""HF config classes for LLaDA (``model_type: llada``) and Dream (``model_type: Dream``) without
remote code, and the vLLM config hook that turns them into diffusion models.

``canvas_length`` (the block length, default 32) makes vLLM treat the model as a discrete
diffusion model (``model_config.is_diffusion``); override it with ``--hf-overrides
'{"canvas_length": 64}'`` or ``--diffusion-config '{"canvas_length": 64}'``.
"""
from __future__ import annotations

import logging

from transformers import PretrainedConfig, Qwen2Config

logger = logging.getLogger(__name__)

DEFAULT_CANVAS = 32
VALIDATOR = "integrations.vllm.options:DllmRequestValidator"


class LLaDAConfig(PretrainedConfig):
    """LLaDA's OLMo-style fields, exposed under the names vLLM reads."""

    model_type = "llada"
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                     "num_key_value_heads": "n_kv_heads", "intermediate_size": "mlp_hidden_size",
                     "max_position_embeddings": "max_sequence_length"}

    def __init__(self, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=None, mlp_hidden_size=12288,
                 vocab_size=126464, embedding_size=None, max_sequence_length=4096, rope_theta=500000.0,
                 rms_norm_eps=1e-5, weight_tying=False, mask_token_id=126336, canvas_length=DEFAULT_CANVAS, **kw):
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.mlp_hidden_size, self.max_sequence_length = mlp_hidden_size, max_sequence_length
        self.embedding_size = embedding_size or vocab_size
        self.vocab_size = self.embedding_size  # logits over every embedding row, as the native model
        self.rope_theta, self.rms_norm_eps, self.weight_tying = float(rope_theta), rms_norm_eps, weight_tying
        self.mask_token_id, self.canvas_length = mask_token_id, canvas_length
        kw.setdefault("tie_word_embeddings", bool(weight_tying))
        super().__init__(**kw)


class DreamConfig(Qwen2Config):
    """Dream-v0 (Qwen2.5 layout) plus its mask token."""

    model_type = "Dream"

    def __init__(self, mask_token_id=151666, canvas_length=DEFAULT_CANVAS, **kw):
        self.mask_token_id, self.canvas_length = mask_token_id, canvas_length
        super().__init__(**kw)


def register_configs() -> None:
    """Make ``AutoConfig`` resolve both model types locally (no trust_remote_code)."""
    from transformers import AutoConfig

    for cls in (LLaDAConfig, DreamConfig):
        AutoConfig.register(cls.model_type, cls, exist_ok=True)


def config_hook():
    """The ``VerifyAndUpdateConfig`` subclass vLLM runs for our architectures (built lazily so
    importing this module does not import vLLM)."""
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    class DllmDiffusionConfig(VerifyAndUpdateConfig):
        """Diffusion config + the engine settings the block-canvas semantics need."""

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            from vllm.config.diffusion import DiffusionConfig

            from .options import DllmOptions

            from .options import SERVED

            mc, sc, cc = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
            if vllm_config.diffusion_config is None:
                vllm_config.diffusion_config = DiffusionConfig(
                    canvas_length=getattr(mc.hf_config, "canvas_length", None) or DEFAULT_CANVAS)
            SERVED["canvas_length"] = vllm_config.diffusion_config.canvas_length
            DllmOptions.from_additional_config(vllm_config.additional_config)  # fail fast at startup
            # The prompt is prefilled bidirectionally: its K/V depend on the whole prompt, so a
            # prompt must be prefilled in one chunk and never shared through prefix caching.
            cc.enable_prefix_caching = False
            sc.enable_chunked_prefill = False
            sc.long_prefill_token_threshold = 0
            if sc.max_num_batched_tokens < mc.max_model_len:
                logger.info("dllm: max_num_batched_tokens %d -> %d (prompts are prefilled in one chunk)",
                            sc.max_num_batched_tokens, mc.max_model_len)
                sc.max_num_batched_tokens = mc.max_model_len
            mc.enforce_eager = True  # the per-step canvas plan is data dependent: no CUDA graphs
            ac = vllm_config.attention_config
            if ac.backend is None and not ac.use_non_causal:
                ac.use_non_causal = True
            procs = list(mc.logits_processors or [])
            if VALIDATOR not in procs:
                mc.logits_processors = [*procs, VALIDATOR]

    return DllmDiffusionConfig
