"""TEST-ONLY: lm-evaluation-harness's two routes on the shipped ``dllm_arithmetic`` task - the embedded engine
(``--model dllm``) and lm-eval's OpenAI-compatible ``local-completions`` against a running server - as (accuracy,
responses), for the tests that compare them (tests/test_lm_eval_servers.py, tests/test_sglang_server*.py)."""
from __future__ import annotations

import functools
from pathlib import Path

N = 12  # the first N examples of the shipped split
CANVAS = {"gen_length": 24, "block_length": 8}  # the arithmetic task's canvas (dllm eval's task_config)


def responses(model: str, model_args: dict, gen_kwargs: dict | None = None,
              limit: int = N) -> tuple[float, tuple[str, ...]]:
    """``simple_evaluate`` on ``dllm_arithmetic`` (chat template, as ``dllm eval`` prompts) -> (exact match, the
    responses in document order)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from dllm_core.harness import TASKS_DIR, register

    register()
    out = simple_evaluate(model=model, model_args=model_args, tasks=["dllm_arithmetic"], limit=limit,
                          apply_chat_template=True, log_samples=True, gen_kwargs=gen_kwargs,
                          task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False))
    samples = sorted(out["samples"]["dllm_arithmetic"], key=lambda s: s["doc_id"])
    return out["results"]["dllm_arithmetic"]["exact_match,final-answer"], tuple(s["resps"][0][0] for s in samples)


@functools.lru_cache(maxsize=None)
def embedded(model_dir: Path, **decoding) -> tuple[float, tuple[str, ...]]:
    """``--model dllm`` (one batch, one thread) with ``decoding`` model args; computed once per test run for each
    model and decoding (every server test that compares its route with it shares the answer)."""
    return responses("dllm", {"pretrained": str(model_dir), "batch_size": N, "threads": 1, **decoding})


def served(url: str, model_dir: Path, gen_kwargs: dict | None = None,
           model: str | None = None) -> tuple[float, tuple[str, ...]]:
    """``local-completions`` against the server at ``url`` (token-id prompts from the checkpoint's tokenizer)."""
    return responses("local-completions", {
        "model": model or str(model_dir), "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
        "tokenizer": str(model_dir), "num_concurrent": 4, "max_retries": 1, "tokenized_requests": True}, gen_kwargs)
