"""dllm-serve inside SGLang: dllm_core samplers as dLLM algorithms, dLLM-Cache, and LLaDA-8B /
Dream as SGLang dLLM models. Loaded by SGLang through the ``sglang.srt.plugins`` entry point
(``plugin.register``); this package imports nothing from SGLang at import time."""
