"""Long free-running generation: count from a to b (thousands of tokens at the default span; the long-answer
settings: ``span=48`` on a 256-token canvas, ``span=100`` on 512).

Every number follows from the previous one and the n-grams repeat heavily, so a model that has
learnt the rule can keep going for thousands of tokens and n-gram drafters have a lot to reuse."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import ClassVar

from .base import Example, Task


@dataclass(frozen=True)
class Count(Task):
    """Count up by one from ``start`` in [lo, hi) for ``min_span``..``span`` numbers."""

    name: ClassVar[str] = "count"
    block_length: ClassVar[int] = 32
    lo: int = 100
    hi: int = 9000
    span: int = 500
    min_span: int | None = None

    def __post_init__(self):
        super().__post_init__()
        lo = self.span if self.min_span is None else self.min_span
        if not (1 <= lo <= self.span and 0 <= self.lo < self.hi):
            raise ValueError(f"count: need 1 <= min_span <= span and lo < hi, got {self}")

    @property
    def gen_length(self) -> int:
        """Room for ``span`` numbers of up to 4 digits + spaces + EOT, in whole blocks (256 at 48,
        512 at 100, 2,528 at 500)."""
        return (5 * self.span + self.block_length) // self.block_length * self.block_length

    def test_variant(self) -> "Count":
        return replace(self, min_span=None)

    def draw(self, rng: random.Random) -> Example:
        n = self.span if self.min_span is None else rng.randint(self.min_span, self.span)
        a = rng.randint(self.lo, self.hi - 1)
        b = a + n
        text = " ".join(str(i) for i in range(a + 1, b + 1))
        return Example(self.name, f"Count up from {a} to {b}.", text, text, f"{a}")

    def extract(self, text: str) -> str:
        return " ".join(text.split())

    @staticmethod
    def prefix_match(text: str, answer: str) -> float:
        """Fraction of the answer's numbers reproduced before the first mistake."""
        got, want = text.split(), answer.split()
        n = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
        return n / max(len(want), 1)
