"""vLLM adapter: LLaDA, Dream and LLaDA2 (block-causal MoE) through vLLM's discrete-diffusion pathway (Model Runner
V2), loaded in every process by the ``vllm.general_plugins`` entry point ``dllm`` (``register``). Host vocabulary
only; ``docs/vllm.md`` says what runs where.
"""
from __future__ import annotations

import multiprocessing

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
    from .options import patch_diffusion_check

    register_configs()
    TokenizerRegistry.register("dllm", "vllm.tokenizers.hf", "CachedHfTokenizer")  # + prompt admission:
    RENDERER_REGISTRY.register("dllm", "integrations.vllm.renderer", "DllmRenderer")  # renderer.py
    hook = config_hook()
    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
        MODELS_CONFIG_MAP[arch] = hook
    patch_diffusion_check(ARCHITECTURES)  # OpenAI temperature / seed (options.check_sampling)
    if multiprocessing.current_process().name.startswith("VllmWorker"):  # a multi-process executor's worker
        from .spec import patch_runner
        patch_runner()  # the runner's side of the adaptive draft length (spec.py)
    _registered = True
