"""The shipped lm-eval data: the task suite's arithmetic test split as JSONL, and the loader the task YAMLs call.

``tasks/arithmetic_test.jsonl`` holds ``arithmetic_rows()``: the first ``N_DOCS`` test examples (seed 0), which
are the examples ``dllm eval --tasks arithmetic --n N`` scores for any N <= N_DOCS (``--limit N`` in lm-eval
takes the same first N). Each row: ``prompt`` (user text), ``response`` (the worked solution), ``answer``,
``key`` (content key), and for the multiple-choice variant ``choices`` (the response and N_CHOICES - 1 responses
whose last result and final answer are another number) and ``label`` (the index of the right one).

Regenerate (the test suite checks the shipped file is exactly this): ``python -m dllm_core.harness.data``.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from ..tasks import Arithmetic
from ..tasks.base import Example
from . import TASKS_DIR

ARITHMETIC_JSONL = TASKS_DIR / "arithmetic_test.jsonl"
N_DOCS = 200
N_CHOICES = 4


def arithmetic_choices(ex: Example, task: Arithmetic, n: int = N_CHOICES) -> tuple[list[str], int]:
    """``n`` candidate responses of ``ex`` (the right one at a position drawn from its key) and its index; the
    wrong ones end in another total in [0, max_total]: ``8+1=9-1=7\\n#### 7`` for ``8+1=9-1=8\\n#### 8``."""
    work = ex.response.rpartition("\n#### ")[0]
    head = work.rpartition("=")[0]
    rng = random.Random(f"choices:{ex.key}")
    wrong = rng.sample([v for v in range(task.max_total + 1) if str(v) != ex.answer], n - 1)
    choices = [f"{head}={v}\n#### {v}" for v in wrong]
    label = rng.randrange(n)
    choices.insert(label, ex.response)
    return choices, label


def arithmetic_rows(n: int = N_DOCS, seed: int = 0) -> list[dict]:
    """The first ``n`` arithmetic test examples as task rows (module docstring)."""
    task = Arithmetic()
    rows = []
    for ex in task.examples("test", n, seed):
        choices, label = arithmetic_choices(ex, task)
        rows.append({"key": ex.key, "prompt": ex.prompt, "response": ex.response, "answer": ex.answer,
                     "choices": choices, "label": label})
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def arithmetic_docs(**_ignored) -> dict:
    """``custom_dataset`` of the task YAMLs: {"test": the shipped rows} (lm-eval passes its metadata and model
    args as keywords; none is read)."""
    import datasets

    return {"test": datasets.Dataset.from_list(read_jsonl(ARITHMETIC_JSONL))}


if __name__ == "__main__":
    print(write_jsonl(arithmetic_rows(), ARITHMETIC_JSONL))
