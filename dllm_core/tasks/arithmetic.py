"""GSM8K-like multi-step word problems with small numbers and a worked solution ending in ``#### n``.

The default worked solution chains the running total (``form=chain``: ``19-15=4-3=1``), so each
intermediate result is written once. With GSM8K's restated form (``form=restated``:
``19-15=4. 4-3=1.``) a masked-diffusion model trained with random masks learns to copy a result from
its restatement instead of computing it (measured on a model trained that way: 99% of masked results
recovered with the rest visible, 5% computed from the prefix alone)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from ..options import check_choice
from .base import Example, Task, final_answer

FORMS = ("chain", "restated")
NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Leo", "Emma", "Max", "Zoe", "Jack", "Lily", "Noah",
         "Ava", "Owen", "Ella"]
ITEMS = ["apples", "marbles", "stickers", "coins", "books", "pencils", "cookies", "cards", "shells", "stamps",
         "balloons", "candies"]
ADD = ["buys {n} more", "finds {n} more", "gets {n} more from a friend", "picks up {n} more", "wins {n} more"]
SUB = ["gives {n} to a friend", "loses {n}", "sells {n}", "gives away {n}", "uses {n}"]
LINKS = ["Then", "After that", "Later", "Next"]


@dataclass(frozen=True)
class Arithmetic(Task):
    """``start`` in [lo, hi], then 2-3 add/subtract steps with operands in [1, max_operand];
    every intermediate total stays in [0, max_total]. The defaults keep every number one digit:
    the difficulty a ~3M-parameter masked-diffusion model learns on a CPU budget (wider ranges,
    e.g. ``hi=40,max_operand=15,max_total=99``, are learnt by the AR model but not by it)."""

    name: ClassVar[str] = "arithmetic"
    gen_length: ClassVar[int] = 24
    block_length: ClassVar[int] = 8
    lo: int = 2
    hi: int = 9
    max_operand: int = 9
    max_total: int = 9
    min_steps: int = 2
    max_steps: int = 3
    form: str = "chain"

    def __post_init__(self):
        super().__post_init__()
        if not (0 <= self.lo <= self.hi <= self.max_total and self.max_operand >= 1 and
                1 <= self.min_steps <= self.max_steps):
            raise ValueError(f"arithmetic: inconsistent ranges {self}")
        check_choice(self.form, FORMS, "--tasks arithmetic.form")

    def _ops(self, rng: random.Random, start: int) -> list[tuple[str, int]]:
        total, ops = start, []
        for _ in range(rng.randint(self.min_steps, self.max_steps)):
            can_sub = total >= 1
            can_add = total + 1 <= self.max_total
            sign = "+" if not can_sub or (can_add and rng.random() < 0.5) else "-"
            room = self.max_total - total if sign == "+" else total
            n = rng.randint(1, min(self.max_operand, room))
            total += n if sign == "+" else -n
            ops.append((sign, n))
        return ops

    def draw(self, rng: random.Random) -> Example:
        start = rng.randint(self.lo, self.hi)
        ops = self._ops(rng, start)
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        sentences = [f"{name} has {start} {item}."]
        chain, lines, total = str(start), [], start
        for i, (sign, n) in enumerate(ops):
            verb = rng.choice(ADD if sign == "+" else SUB).format(n=n)
            sentences.append(f"{rng.choice(LINKS) if i else 'Then'}, {name} {verb}.")
            new = total + n if sign == "+" else total - n
            chain += f"{sign}{n}={new}"
            lines.append(f"{total}{sign}{n}={new}.")
            total = new
        sentences.append(f"How many {item} does {name} have now?")
        key = f"{start}" + "".join(f"{s}{n}" for s, n in ops)
        work = chain if self.form == "chain" else " ".join(lines)
        return Example(self.name, " ".join(sentences), f"{work}\n#### {total}", str(total), key)

    def extract(self, text: str) -> str:
        return final_answer(text)
