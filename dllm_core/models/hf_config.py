"""``transformers`` config classes for LLaDA (``model_type: llada``), Dream (``model_type: Dream``), LLaDA2
(``model_type: llada2_moe``) and TokenSwift's heads (``model_type: tokenswift_heads``), so that a host engine's ``AutoConfig`` reads the
checkpoints without ``trust_remote_code``.

Only field *names* are mapped (LLaDA's OLMo names -> hidden_size, ...); the hyper-parameters
themselves are parsed by ``LLaDAModelLM.parse_config`` / ``DreamModel.parse_config``. Engine
adapters subclass these for their own fields and defaults."""
from __future__ import annotations

from transformers import PretrainedConfig, Qwen2Config


class LLaDAConfig(PretrainedConfig):
    """LLaDA's config.json, exposed under the standard names."""

    model_type = "llada"
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                     "num_key_value_heads": "n_kv_heads", "intermediate_size": "mlp_hidden_size",
                     "max_position_embeddings": "max_sequence_length"}

    def __init__(self, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=None, mlp_hidden_size=12288,
                 vocab_size=126464, embedding_size=None, max_sequence_length=4096, rope_theta=500000.0,
                 rms_norm_eps=1e-5, weight_tying=False, mask_token_id=None, **kw):
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.mlp_hidden_size, self.max_sequence_length = mlp_hidden_size, max_sequence_length
        self.embedding_size = embedding_size or vocab_size
        self.vocab_size = self.embedding_size  # logits over every embedding row, like the native model
        self.rope_theta, self.rms_norm_eps, self.weight_tying = float(rope_theta), rms_norm_eps, weight_tying
        self.mask_token_id = mask_token_id
        kw.setdefault("tie_word_embeddings", bool(weight_tying))
        super().__init__(**kw)


class DreamConfig(Qwen2Config):
    """Dream-v0 (the Qwen2.5 layout) plus its mask token."""

    model_type = "Dream"

    def __init__(self, mask_token_id=None, **kw):
        self.mask_token_id = mask_token_id
        super().__init__(**kw)


class LLaDA2MoeConfig(PretrainedConfig):
    """LLaDA2.0 / 2.1's config.json (the published field names; defaults of LLaDA2.0-mini). Fields not
    listed (``block_size``, ``mask_token_id``, ``rotary_dim``, ...) stay attributes as given."""

    model_type = "llada2_moe"

    def __init__(self, vocab_size=157184, hidden_size=2048, intermediate_size=5120, num_hidden_layers=20,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=128, hidden_act="silu", use_qkv_bias=False,
                 use_bias=False, use_qk_norm=True, rms_norm_eps=1e-6, tie_word_embeddings=False, embedding_dropout=0.0,
                 max_position_embeddings=32768, rope_theta=600000.0, partial_rotary_factor=0.5, num_experts=256,
                 num_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=512,
                 first_k_dense_replace=1, routed_scaling_factor=2.5, score_function="sigmoid",
                 moe_router_enable_expert_bias=True, norm_topk_prob=True, norm_head=False, **kw):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.head_dim, self.hidden_act = num_key_value_heads, head_dim, hidden_act
        self.use_qkv_bias, self.use_bias, self.use_qk_norm = use_qkv_bias, use_bias, use_qk_norm
        self.rms_norm_eps, self.embedding_dropout = rms_norm_eps, embedding_dropout
        self.max_position_embeddings, self.rope_theta = max_position_embeddings, float(rope_theta)
        self.partial_rotary_factor, self.num_experts, self.num_shared_experts = partial_rotary_factor, num_experts, num_shared_experts
        self.num_experts_per_tok, self.n_group, self.topk_group = num_experts_per_tok, n_group, topk_group
        self.moe_intermediate_size, self.first_k_dense_replace = moe_intermediate_size, first_k_dense_replace
        self.routed_scaling_factor, self.score_function = routed_scaling_factor, score_function
        self.moe_router_enable_expert_bias, self.norm_topk_prob, self.norm_head = (
            moe_router_enable_expert_bias, norm_topk_prob, norm_head)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kw)


class TokenSwiftHeadsConfig(PretrainedConfig):
    """A TokenSwift heads checkpoint (``dllm_core.drafters.tokenswift.heads``), readable by a host's
    ``AutoConfig`` when it is passed as a draft model path."""

    model_type = "tokenswift_heads"

    def __init__(self, hidden_size=4096, vocab_size=32000, num_heads=3, **kw):
        self.hidden_size, self.vocab_size, self.num_heads = hidden_size, vocab_size, num_heads
        super().__init__(**kw)


def register_configs(classes=None, replace: bool = False) -> None:
    """Make ``AutoConfig`` resolve these model types locally (no remote code): ``classes`` (default: this module's
    four). A class already registered for the type (e.g. a host adapter's subclass with its own fields, in the same
    process) is kept unless ``replace``."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for cls in classes or (LLaDAConfig, DreamConfig, LLaDA2MoeConfig, TokenSwiftHeadsConfig):
        if replace or cls.model_type not in CONFIG_MAPPING:
            AutoConfig.register(cls.model_type, cls, exist_ok=True)
