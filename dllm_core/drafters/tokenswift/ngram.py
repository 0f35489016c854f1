"""Token reutilization (TokenSwift section 2): a table of the n-grams of the text generated so far.

``update`` adds every n-gram ending at a newly committed token; ``top(first, k)`` returns the continuations
(the n-1 tokens after ``first``) of the k most frequent n-grams starting with ``first``, most frequent first,
ties broken by recency. Per first token the counts live in one dict, and the ``keep`` best entries are kept
ranked as counts change (an entry only moves up when it is counted again, so the ranking stays exact with
O(keep) work per counted n-gram); larger queries scan that token's dict.
"""
from __future__ import annotations

import heapq
from collections import defaultdict


class NGramTable:
    """Counts of the n-grams of a growing token stream, indexed by their first token."""

    def __init__(self, n: int = 4, keep: int = 20):
        if n < 2:
            raise ValueError(f"--ngram-n must be >= 2, got {n}")
        if keep < 0:
            raise ValueError(f"n-gram table: keep must be >= 0, got {keep}")
        self.n, self.keep = n, keep
        self.table: dict[int, dict[tuple[int, ...], list[int]]] = defaultdict(dict)  # first -> rest -> [count, last]
        self.best: dict[int, list[tuple[int, int, tuple[int, ...]]]] = defaultdict(list)  # first -> ranked keys
        self.tail: list[int] = []  # the last n-1 tokens seen
        self.seen = 0

    def update(self, tokens: list[int]) -> None:
        """Count the n-grams that end at each of ``tokens`` (appended to the stream)."""
        n = self.n
        window = self.tail + list(tokens)
        for end in range(len(self.tail), len(window)):
            self.seen += 1
            if end < n - 1:
                continue
            first, rest = window[end - n + 1], tuple(window[end - n + 2:end + 1])
            entry = self.table[first].setdefault(rest, [0, 0])
            old = (entry[0], entry[1], rest)
            entry[0] += 1
            entry[1] = self.seen
            if self.keep:
                self._rerank(self.best[first], old, (entry[0], entry[1], rest))
        self.tail = window[-(n - 1):]

    def _rerank(self, best: list, old: tuple, new: tuple) -> None:
        if old in best:
            best.remove(old)
        elif len(best) == self.keep and new <= best[-1]:
            return
        i = len(best)
        while i and best[i - 1] < new:  # descending by (count, recency)
            i -= 1
        best.insert(i, new)
        del best[self.keep:]

    def count(self, gram: tuple[int, ...]) -> int:
        """How often the full n-gram ``gram`` occurred."""
        if len(gram) != self.n:
            raise ValueError(f"n-gram table of n={self.n}: got a {len(gram)}-gram")
        entry = self.table.get(gram[0], {}).get(tuple(gram[1:]))
        return entry[0] if entry else 0

    def top(self, first: int, k: int) -> list[tuple[int, ...]]:
        """Continuations of the ``k`` most frequent n-grams starting with ``first`` (recency breaks ties)."""
        if k < 1 or first not in self.table:
            return []
        if k <= self.keep:
            return [rest for _, _, rest in self.best[first][:k]]
        best = heapq.nlargest(k, self.table[first].items(), key=lambda kv: (kv[1][0], kv[1][1]))
        return [rest for rest, _ in best]

    def __len__(self) -> int:
        return sum(len(r) for r in self.table.values())
