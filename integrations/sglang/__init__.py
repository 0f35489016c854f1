"""dllm-serve inside SGLang, loaded through the ``sglang.srt.plugins`` entry point (``plugin.register``); this package
imports nothing from SGLang at import time."""
