"""lm-evaluation-harness integration (``pip install dllm-serve[eval]``): ``--model dllm`` and the shipped tasks.

- ``model.DllmLM``: lm-eval's ``LM`` over the embedded engine (any sampler x cache policy), LLaDA's Monte-Carlo
  log-likelihood, and AR targets with lossless DFlash / TokenSwift speculation.
- ``tasks/``: ``dllm_arithmetic`` (generate_until, exact match) and ``dllm_arithmetic_mc`` (multiple choice) on
  the task suite's test split, shipped as JSONL (``data.py`` writes and loads it).
- Discovery: lm-eval releases that read the ``lm_eval.models`` / ``lm_eval.tasks`` entry points find both from
  the installed package; with lm-eval 0.4.13, which reads none, ``dllm-lm-eval`` (``python -m
  dllm_core.harness``) is lm-eval's own CLI with them registered (``cli.py``), and ``register()`` does the same
  for ``lm_eval.simple_evaluate``.
"""
from __future__ import annotations

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
MODEL_NAME = "dllm"
MODEL_TARGET = "dllm_core.harness.model:DllmLM"


def register() -> None:
    """Register ``--model dllm`` in lm-eval's model registry (a lazy placeholder: ``model.py`` is imported when
    the model is first asked for). Idempotent; lm-eval's own models stay registered."""
    import lm_eval.models  # noqa: F401  (lm-eval fills its registry lazily only while it is empty)
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)


__all__ = ["MODEL_NAME", "MODEL_TARGET", "TASKS_DIR", "register"]
