"""Synthetic task suite with train/test splits and exact-match scoring (see ``base.py``)."""
from __future__ import annotations

from ..options import parse_spec
from .arithmetic import Arithmetic
from .base import SPLITS, Example, Task, final_answer, split_of
from .counting import Count
from .progression import Progression
from .retrieval import Retrieval
from .sorting import Sort

TASKS: dict[str, type[Task]] = {c.name: c for c in (Arithmetic, Sort, Retrieval, Count, Progression)}
DEFAULT_TASKS = ("arithmetic", "sort", "retrieval")
LONG_TASKS = {256: "count:span=48;progression:days=20", 512: "count:span=100;progression:days=40"}  # by canvas
# the same questions after worked examples, prompts of about GSM8K 5-shot's length (740 tokens): 256-token answers
# after 3 counts / 2 progressions (802 / 706 tokens at p50), 512-token answers after one (546 / 630)
LONG_FEW_SHOT = {256: "count:span=48,shots=3;progression:days=20,shots=2",
                 512: "count:span=100,shots=1;progression:days=40,shots=1"}


def make_task(spec: "str | Task", option: str = "--tasks") -> Task:
    """``name[:key=value,...]`` -> task, e.g. ``"retrieval:pairs=40"`` (errors name ``option``)."""
    return spec if isinstance(spec, Task) else parse_spec(spec, TASKS, option)


def parse_tasks(spec: str, option: str = "--tasks") -> list[Task]:
    """``';'``-separated task specs -> tasks (error names ``option`` and the allowed names)."""
    tasks = [make_task(s, option) for s in filter(None, (s.strip() for s in spec.split(";")))]
    if not tasks:
        raise ValueError(f"{option}: no task given; allowed: {sorted(TASKS)}")
    return tasks


__all__ = ["DEFAULT_TASKS", "LONG_FEW_SHOT", "LONG_TASKS", "SPLITS", "TASKS", "Arithmetic", "Count", "Example", "Progression", "Retrieval", "Sort", "Task",
           "final_answer", "make_task", "parse_tasks", "split_of"]
