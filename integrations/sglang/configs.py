"""SGLang's ``ModelConfig`` (``AutoConfig``) reads LLaDA / Dream / LLaDA2 checkpoints and TokenSwift heads through
dllm_core's HF config classes (``dllm_core.models.hf_config``), without ``--trust-remote-code``."""
from __future__ import annotations

from dllm_core.models.hf_config import DreamConfig, LLaDA2MoeConfig, LLaDAConfig, TokenSwiftHeadsConfig


def register_configs() -> None:
    """Make ``AutoConfig`` resolve these model types locally (no remote code). A class already registered for the
    type (e.g. by the vLLM adapter in the same process, a superset of these fields) is kept."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for cls in (LLaDAConfig, DreamConfig, LLaDA2MoeConfig, TokenSwiftHeadsConfig):
        if cls.model_type not in CONFIG_MAPPING:
            AutoConfig.register(cls.model_type, cls)

