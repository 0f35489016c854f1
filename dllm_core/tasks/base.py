"""Task interface: a deterministic generator of (prompt, response) examples with an exact-match score.

Splits are decided by a stable hash of an example's *content key* (the numbers / list / pairs that
define the problem, not its wording), so a test problem never appears in training under any seed::

    task = make_task("arithmetic")
    test = task.examples("test", n=200, seed=0)     # always the same 200 problems
    ex = task.sample(random.Random(7), "train")      # an endless stream for training
    task.score(model_text, ex)                      # -> bool (exact match of the final answer)
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field, replace
from typing import ClassVar

SPLITS = ("train", "test")
TEST_FRACTION = 0.1


@dataclass(frozen=True)
class Example:
    """One problem: ``prompt`` (user text), ``response`` (the full target text the model is trained
    to produce) and ``answer`` (what exact match compares)."""

    task: str
    prompt: str
    response: str
    answer: str
    key: str  # content key that decides the split
    turns: tuple[tuple[str, str], ...] = ()  # earlier (user, assistant) chat turns: few-shot as multi-turn


SHOT_FORMATS = ("one_turn", "turns")


def split_of(key: str) -> str:
    """'test' for a fixed ~10% of content keys (sha256, stable across runs and machines), else 'train'."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if h % 1000 < TEST_FRACTION * 1000 else "train"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")


@dataclass(frozen=True)
class Task:
    """Base task. Subclasses implement ``draw(rng) -> Example``; ``gen_length`` / ``block_length``
    are the response canvas the models are trained and evaluated with."""

    name: ClassVar[str] = "base"
    gen_length: ClassVar[int] = 32
    block_length: ClassVar[int] = 16
    # worked examples (from the train split) before the question, the papers' few-shot prompts; shot_format
    # one_turn: all in the question's user turn (Fast-dLLM), turns: a user/assistant pair each (dLLM-Cache)
    shots: int = field(default=0, kw_only=True)
    shot_format: str = field(default="one_turn", kw_only=True)

    def __post_init__(self):
        if isinstance(self.shots, bool) or not isinstance(self.shots, int) or self.shots < 0:
            raise ValueError(f"{self.name}.shots must be an integer >= 0, got {self.shots!r}")
        if self.shot_format not in SHOT_FORMATS:
            raise ValueError(f"{self.name}.shot_format must be one of {list(SHOT_FORMATS)}, got {self.shot_format!r}")

    def draw(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def sample(self, rng: random.Random, split: str) -> Example:
        """Next example of ``split`` from ``rng`` (rejection on the content hash), after ``shots`` worked examples."""
        check_split(split)
        while True:
            ex = self.draw(rng)
            if split_of(ex.key) == split:
                return self.with_shots(ex) if self.shots else ex

    def with_shots(self, ex: Example) -> Example:
        """``ex`` after ``shots`` distinct worked examples of this task drawn from the train split (fixed by the
        question's key, as lm-eval fixes a question's exemplars), in ``shot_format``."""
        rng, plain, shots = random.Random(f"shots:{self.name}:{ex.key}"), replace(self, shots=0), []
        while len(shots) < self.shots:
            s = plain.sample(rng, "train")
            if s.key != ex.key and all(s.key != t.key for t in shots):
                shots.append(s)
        if self.shot_format == "turns":
            return replace(ex, turns=tuple((s.prompt, s.response) for s in shots))
        worked = "\n\n".join(f"{s.prompt}\n{s.response}" for s in shots)
        return replace(ex, prompt=f"{worked}\n\n{ex.prompt}")

    def examples(self, split: str, n: int, seed: int = 0) -> list[Example]:
        """``n`` distinct examples of ``split``, deterministic in ``seed``."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng, out, seen = random.Random(f"{self.name}:{split}:{seed}"), [], set()
        for _ in range(200 * n + 1000):
            if len(out) == n:
                return out
            ex = self.sample(rng, split)
            if ex.key not in seen:
                seen.add(ex.key)
                out.append(ex)
        raise ValueError(f"task {self.name}: could not draw {n} distinct {split} examples")

    def test_variant(self) -> "Task":
        """The task as evaluated: training-only curriculum options (``min_*``) dropped."""
        return self

    @property
    def label(self) -> str:
        """The task's spec string: its name, plus the options that differ from the defaults."""
        from dataclasses import fields

        changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != f.default]
        return self.name + (":" + ",".join(changed) if changed else "")

    def extract(self, text: str) -> str:
        """The answer part of a model's response (default: the whole stripped text)."""
        return text.strip()

    def score(self, text: str, ex: Example) -> bool:
        """Exact match of the extracted answer."""
        return self.extract(text) == ex.answer


FINAL = re.compile(r"####\s*(-?\d+)")


def final_answer(text: str) -> str:
    """GSM8K convention: the number after the last ``####`` ('' when there is none)."""
    m = FINAL.findall(text)
    return m[-1] if m else ""
