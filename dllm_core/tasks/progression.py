"""A GSM8K-like word problem with a long worked solution: a total that grows by the same amount every
day, written out day by day after restating the givens (``Day 0: 384 +4``, ``Day 1: 388``, ...), then
``#### total``. The work is hundreds of tokens at the
long settings (``days=20``: 251 tokens, canvas 256; ``days=40``: 491, canvas 512), each line
follows from the one before, and the final answer is right only when every line is. The ``Day 0`` line
copies the givens next to the work, so every day is the same local step (copy, then add)."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import ClassVar

from .arithmetic import ADD, ITEMS, NAMES
from .base import Example, Task, final_answer

# tokens in the task tokenizer (every digit its own token): "Day 0: ddd +d\n", "Day d: ddd\n",
# "Day dd: ddd\n", "#### ddd" + EOT
HEAD_TOKENS, SHORT_LINE, LONG_LINE, TAIL_TOKENS = 14, 11, 12, 6


@dataclass(frozen=True)
class Progression(Task):
    """``start`` in [lo, hi], ``step`` in [1, max_step] added every day for ``min_days``..``days`` days;
    totals stay below 1000 (three digits) at the defaults of every size used."""

    name: ClassVar[str] = "progression"
    block_length: ClassVar[int] = 32
    days: int = 20
    min_days: int | None = None
    lo: int = 100
    hi: int = 599
    max_step: int = 9

    def __post_init__(self):
        super().__post_init__()
        lo = self.days if self.min_days is None else self.min_days
        if not (1 <= lo <= self.days and 0 <= self.lo <= self.hi and self.max_step >= 1):
            raise ValueError(f"progression: need 1 <= min_days <= days, lo <= hi, max_step >= 1, got {self}")
        if self.hi + self.days * self.max_step > 999:
            raise ValueError(f"progression: totals must stay below 1000: hi + days * max_step = "
                             f"{self.hi + self.days * self.max_step}")

    @property
    def gen_length(self) -> int:
        """The longest worked solution + EOT in whole blocks (256 at ``days=20``, 512 at ``days=40``)."""
        need = HEAD_TOKENS + SHORT_LINE * min(self.days, 9) + LONG_LINE * max(self.days - 9, 0) + TAIL_TOKENS
        return -(-need // self.block_length) * self.block_length

    def test_variant(self) -> "Progression":
        return replace(self, min_days=None)

    def draw(self, rng: random.Random) -> Example:
        k = self.days if self.min_days is None else rng.randint(self.min_days, self.days)
        start, step = rng.randint(self.lo, self.hi), rng.randint(1, self.max_step)
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        verb = rng.choice(ADD).format(n=step)
        prompt = (f"{name} has {start} {item}. Every day, {name} {verb}. How many {item} does {name} have "
                  f"after {k} days? Write the total after each day.")
        lines = [f"Day 0: {start} +{step}"] + [f"Day {i}: {start + i * step}" for i in range(1, k + 1)]
        total = start + k * step
        return Example(self.name, prompt, "\n".join(lines) + f"\n#### {total}", str(total), f"{start}+{step}x{k}")

    def extract(self, text: str) -> str:
        return final_answer(text)
