"""``transformers`` config classes for LLaDA (``model_type: llada``), Dream (``model_type: Dream``) and
TokenSwift's heads (``model_type: tokenswift_heads``), so that a host engine's ``AutoConfig`` reads the
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


class TokenSwiftHeadsConfig(PretrainedConfig):
    """A TokenSwift heads checkpoint (``dllm_core.drafters.tokenswift.heads``), readable by a host's
    ``AutoConfig`` when it is passed as a draft model path."""

    model_type = "tokenswift_heads"

    def __init__(self, hidden_size=4096, vocab_size=32000, num_heads=3, **kw):
        self.hidden_size, self.vocab_size, self.num_heads = hidden_size, vocab_size, num_heads
        super().__init__(**kw)
