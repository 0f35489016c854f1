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


def make_task(spec: "str | Task") -> Task:
    """``name[:key=value,...]`` -> task, e.g. ``"retrieval:pairs=40"``."""
    return spec if isinstance(spec, Task) else parse_spec(spec, TASKS, "--tasks")


def parse_tasks(spec: str) -> list[Task]:
    """``';'``-separated task specs -> tasks (error names the option and the allowed names)."""
    tasks = [make_task(s) for s in filter(None, (s.strip() for s in spec.split(";")))]
    if not tasks:
        raise ValueError(f"--tasks: no task given; allowed: {sorted(TASKS)}")
    return tasks


__all__ = ["DEFAULT_TASKS", "LONG_TASKS", "SPLITS", "TASKS", "Arithmetic", "Count", "Example", "Progression", "Retrieval", "Sort", "Task",
           "final_answer", "make_task", "parse_tasks", "split_of"]
