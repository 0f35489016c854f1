"""The one TokenSwift drafter: the embedded loop (``generate.py``), vLLM's proposer and SGLang's worker all draft
through it, with one set of options (``DraftOptions``).

Per request (``RequestDrafter``): the n-gram table, fed incrementally from the request's token list; the last
tree drafted and the hidden rows of its verification. h0 for the next draft is the row of the accepted path's
last node, found by walking that tree with the tokens emitted since (the root's row when nothing was accepted;
the last prefill row before the first tree). A draft is ``candidate_paths`` (the heads' best paths merged with
the most frequent n-grams) -> ``build_tree`` (at most ``max_nodes`` below the root); a host that verifies one
chain per request takes ``main_branch`` of that same tree.

``TokenSwiftDrafter`` serves many requests: one ``RequestDrafter`` per host key (request id, batch row), restarted
when a key's token list stops extending what it saw (another request took the row); it runs the heads on h0.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from .config import DraftOptions
from .draft import candidate_paths, head_levels
from .ngram import NGramTable
from .tree import Tree, build_tree, main_branch

IDENTITY = 16  # first tokens of a request remembered to tell it from the next request under the same key


def row_at(hidden: torch.Tensor, positions: torch.Tensor, qsl: torch.Tensor, row: int, pos: int) -> torch.Tensor | None:
    """[H]: a host forward's row at position ``pos`` of its request row ``row`` (its flat rows: ``hidden`` [T, H] at
    ``positions`` [T], request row r over [qsl[r], qsl[r + 1]), positions in order); None where it did not run it."""
    if row + 1 >= qsl.numel() or int(qsl[row + 1]) <= (lo := int(qsl[row])):
        return None
    i = lo + pos - int(positions[lo])
    return hidden[i] if lo <= i < int(qsl[row + 1]) and int(positions[i]) == pos else None


class RequestDrafter:
    """One request's drafting state (n-gram table, last tree, h0 bookkeeping) and its trees."""

    def __init__(self, opts: DraftOptions):
        self.opts = opts
        self.table = NGramTable(opts.ngram_n, keep=opts.ngram_topk)
        self.seen, self.head, self.last = 0, (), -1  # tokens fed, the first IDENTITY of them, the newest
        self.tree: Tree | None = None
        self.tree_len = 0  # token count when the tree was drafted (its root is token tree_len - 1)
        self.hidden: torch.Tensor | None = None  # [N, H] verify rows of the tree, or [1, H] the last prefill row

    def extends(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` continue the token list fed so far (else they are another request's)."""
        s = self.seen
        return len(tokens) >= s and (s == 0 or int(tokens[s - 1]) == self.last
                                     and tuple(int(t) for t in tokens[:len(self.head)]) == self.head)

    def feed(self, tokens: Sequence[int]) -> None:
        """Count the n-grams of the request's token list ``tokens`` that were not fed yet."""
        if len(tokens) > self.seen:
            self.table.update([int(t) for t in tokens[self.seen:]])
            self.seen, self.last = len(tokens), int(tokens[-1])
            if len(self.head) < IDENTITY:
                self.head = tuple(int(t) for t in tokens[:IDENTITY])

    def set_hidden(self, rows: torch.Tensor) -> None:
        """Rows of the newest target forward: [N, H] the verification of the last tree (row i = node i), or
        [1, H] the row that produced the newest token (the last prefill row)."""
        self.hidden = rows

    def h0(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """[H] the hidden state that produced the newest of ``tokens``: the row of the last tree's node reached
        by the drafts accepted since (the newest token is the target's own after them); None if unknown."""
        if self.hidden is None:
            return None
        if self.tree is None or self.hidden.shape[0] == 1:
            return self.hidden[-1]
        parents, toks = self.tree.parents.tolist(), self.tree.tokens.tolist()
        child = {(parents[i], toks[i]): i for i in range(1, len(toks))}
        node = 0
        for t in tokens[self.tree_len:-1]:  # the accepted drafts
            node = child.get((node, int(t)))
            if node is None:
                return None
        return self.hidden[node] if node < self.hidden.shape[0] else None

    def draft(self, tokens: Sequence[int], levels: torch.Tensor | None = None, drafted_first: bool = False,
              device: str | torch.device = "cpu") -> Tree:
        """The tree below the newest of ``tokens`` (the request's whole token list) from the heads' level
        logits [D, V] (``head_levels``; None: n-grams only) and the request's n-grams."""
        self.feed(tokens)
        o, root = self.opts, int(tokens[-1])
        paths = candidate_paths(levels, self.table, root, drafted_first, o.head_topk, o.head_paths, o.ngram_topk,
                                o.ngram_paths)
        self.tree, self.tree_len, self.hidden = build_tree(root, paths, o.max_nodes, device), len(tokens), None
        return self.tree


class TokenSwiftDrafter:
    """TokenSwift drafts for a serving host: one ``RequestDrafter`` per key, the heads run through the host's
    ``lm_head`` (hidden [.., H] -> logits [.., V]); without heads, n-gram trees only."""

    def __init__(self, opts: DraftOptions, heads=None, lm_head=None):
        if heads is not None and lm_head is None:
            raise ValueError("TokenSwiftDrafter: heads need the target's lm_head")
        self.opts, self.heads, self.lm_head = opts, heads, lm_head
        self.requests: dict[Hashable, RequestDrafter] = {}

    def request(self, key: Hashable, tokens: Sequence[int]) -> RequestDrafter:
        """The state of ``key`` fed with its token list ``tokens`` (restarted if they are another request's)."""
        st = self.requests.get(key)
        if st is None or not st.extends(tokens):
            st = self.requests[key] = RequestDrafter(self.opts)
        st.feed(tokens)
        return st

    def set_hidden(self, key: Hashable, rows: torch.Tensor) -> None:
        """``RequestDrafter.set_hidden`` of ``key``."""
        if key not in self.requests:
            self.requests[key] = RequestDrafter(self.opts)
        self.requests[key].set_hidden(rows)

    @torch.inference_mode()
    def tree(self, key: Hashable, tokens: Sequence[int], h0: torch.Tensor | None = None) -> Tree:
        """The tree below the newest of ``tokens``. h0 [H]: the hidden state that produced that token (None:
        the request's own bookkeeping, ``set_hidden``)."""
        st = self.request(key, tokens)
        levels = None
        if self.heads is not None:
            h0 = st.h0(tokens) if h0 is None else h0
            levels = None if h0 is None else head_levels(self.heads, self.lm_head, h0)  # [gamma, V]
        return st.draft(tokens, levels)

    def chain(self, key: Hashable, tokens: Sequence[int], k: int, h0: torch.Tensor | None = None) -> list[int]:
        """At most ``k`` draft tokens for a host that verifies one chain: ``main_branch`` of the same tree."""
        return main_branch(self.tree(key, tokens, h0), k)

    def erase(self, keys) -> None:
        """Forget finished requests."""
        for key in keys:
            self.requests.pop(key, None)
