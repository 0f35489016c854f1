"""Key-value retrieval from a long prompt (~1,000+ tokens at the default 100 pairs).

The asked key ends the prompt on a line of its own, written as in its entry (``\nsbnj:``), so it has the
same tokens there: in running text the tokenizer would merge its first letter with the space before it
(`` s`` + ``bnj``), and the lookup would first have to learn that two token strings name one key."""
from __future__ import annotations

import random
import string
from dataclasses import dataclass, replace
from typing import ClassVar

from .base import Example, Task


@dataclass(frozen=True)
class Retrieval(Task):
    """``pairs`` lines ``key: value`` (4-letter keys, 4-digit values), then a question about one key.
    ``min_pairs`` < ``pairs`` draws the count uniformly (a training curriculum); test uses ``pairs``."""

    name: ClassVar[str] = "retrieval"
    gen_length: ClassVar[int] = 8
    block_length: ClassVar[int] = 8
    pairs: int = 100
    min_pairs: int | None = None
    key_len: int = 4

    def __post_init__(self):
        super().__post_init__()
        lo = self.pairs if self.min_pairs is None else self.min_pairs
        if not (1 <= lo <= self.pairs and self.key_len >= 2):
            raise ValueError(f"retrieval: need 1 <= min_pairs <= pairs and key_len >= 2, got {self}")

    def test_variant(self) -> "Retrieval":
        return replace(self, min_pairs=None)

    def draw(self, rng: random.Random) -> Example:
        n = self.pairs if self.min_pairs is None else rng.randint(self.min_pairs, self.pairs)
        keys: dict[str, str] = {}
        while len(keys) < n:
            keys["".join(rng.choices(string.ascii_lowercase, k=self.key_len))] = str(rng.randint(1000, 9999))
        q = rng.choice(list(keys))
        lines = "\n".join(f"{k}: {v}" for k, v in keys.items())
        prompt = f"Here are some keys and their values.\n{lines}\nWhat is the value of this key?\n{q}:"
        key = "|".join(f"{k}={v}" for k, v in keys.items()) + f"?{q}"
        return Example(self.name, prompt, keys[q], keys[q], key)
