"""Sort a short list of digits in ascending order."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from .base import Example, Task


@dataclass(frozen=True)
class Sort(Task):
    """Lists of ``min_len``..``max_len`` integers in [0, max_value] (repeats allowed)."""

    name: ClassVar[str] = "sort"
    gen_length: ClassVar[int] = 24
    block_length: ClassVar[int] = 8
    min_len: int = 4
    max_len: int = 8
    max_value: int = 9

    def __post_init__(self):
        super().__post_init__()
        if not (2 <= self.min_len <= self.max_len and self.max_value >= 1):
            raise ValueError(f"sort: inconsistent sizes {self}")

    def draw(self, rng: random.Random) -> Example:
        xs = [rng.randint(0, self.max_value) for _ in range(rng.randint(self.min_len, self.max_len))]
        ans = " ".join(map(str, sorted(xs)))
        prompt = f"Sort the numbers from smallest to largest: {' '.join(map(str, xs))}"
        return Example(self.name, prompt, ans, ans, ",".join(map(str, xs)))

    def extract(self, text: str) -> str:
        return " ".join(text.split())
