"""vLLM adapter: serve LLaDA (``LLaDAModelLM``), Dream (``DreamModel``) and LLaDA2 (``LLaDA2MoeModelLM``,
block-causal MoE) through vLLM's native discrete-diffusion pathway (Model Runner V2) with dllm_core's samplers
and canvas cache policy.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point ``dllm``
(``register``). Host vocabulary only: decisions are dllm_core's (see ``docs/vllm.md``).

Modules: ``configs`` (HF configs + vLLM config hook), ``options`` (server-wide / per-request
options and their admission check), ``renderer`` (prompt admission), ``model`` (the models on vLLM
layers; ``llada2``: LLaDA2 on vLLM's Bailing-MoE layers), ``state`` (ModelState + per-request diffusion state), ``sampler`` (the custom sampler),
``serve`` (``vllm serve`` with ``--dllm-sampler`` / ``--dllm-cache``).
"""
from __future__ import annotations

ARCHITECTURES = {"LLaDAModelLM": "integrations.vllm.model:LLaDAForDiffusion",
                 "DreamModel": "integrations.vllm.model:DreamForDiffusion",
                 "LLaDA2MoeModelLM": "integrations.vllm.llada2:LLaDA2ForDiffusion"}

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` hook: idempotent, imports no model code (lazy registration)."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    from .configs import config_hook, register_configs

    register_configs()
    TokenizerRegistry.register("dllm", "vllm.tokenizers.hf", "CachedHfTokenizer")  # + prompt admission:
    RENDERER_REGISTRY.register("dllm", "integrations.vllm.renderer", "DllmRenderer")  # renderer.py
    hook = config_hook()
    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
        MODELS_CONFIG_MAP[arch] = hook
    _registered = True
