"""Tree-structured candidates verified in one target forward (TokenSwift section 5).

Candidate continuations of the root (the newest emitted token, not yet run through the target) are merged
into a trie: node 0 is the root, every other node one drafted token whose parent index is smaller. One
forward over [root, nodes...] with ``tree_attention_mask`` (each node sees the committed prefix and its own
ancestors only - never a sibling or a cousin) and ``position_ids = prefix + depth`` gives the target's
distribution after every node. ``accept_tree`` picks, among the root-to-leaf chains, the longest prefix
whose tokens equal the target's choice at their parent (``verify.accept_match``, shared with the chain
verifiers), breaking ties uniformly at random, and returns the target's token after it.

Lossless: the emitted tokens are the target's choices along the accepted path - the argmax (greedy: the
same tokens as AR decoding) or one sample per node from the target's distribution (sampling: each token is
drawn from the right conditional, so the output is distributed as AR sampling).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..verify import accept_match


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor     # [N] int64: node tokens, node 0 = root
    parents: torch.Tensor    # [N] int64: parent node (root: 0)
    depth: torch.Tensor      # [N] int64: 0 for the root
    ancestors: torch.Tensor  # [N, N] bool: row i = the nodes on the root..i path, i included
    chains: torch.Tensor     # [P, D] int64: node ids of each root->leaf chain below the root, -1 padded
    drafts: torch.Tensor     # [P, D] int64: their tokens, -1 padded (never equal to a target choice)
    before: torch.Tensor     # [P, D+1] int64: the node each chain position is verified against (root first)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def build_tree(root: int, paths: Iterable[Sequence[int]], max_nodes: int | None = None,
               device: str | torch.device = "cpu") -> Tree:
    """Trie of the candidate ``paths`` (token lists continuing ``root``) with at most ``max_nodes`` nodes
    below the root; paths are inserted in order, so earlier (more likely) candidates survive the cap."""
    tokens, parents, depth = [root], [0], [0]
    children: list[dict[int, int]] = [{}]
    for path in paths:
        cur = 0
        for t in path:
            nxt = children[cur].get(int(t))
            if nxt is None:
                if max_nodes is not None and len(tokens) > max_nodes:
                    break
                nxt = len(tokens)
                tokens.append(int(t))
                parents.append(cur)
                depth.append(depth[cur] + 1)
                children.append({})
                children[cur][int(t)] = nxt
            cur = nxt
    n = len(tokens)
    paths = [[0]]  # root..node, per node (parents come first, so one pass builds them all)
    for i in range(1, n):
        paths.append(paths[parents[i]] + [i])
    anc = [[False] * n for _ in range(n)]
    for i, path in enumerate(paths):
        for j in path:
            anc[i][j] = True
    leaves = [paths[i][1:] for i in range(1, n) if not children[i]]
    width = max((len(c) for c in leaves), default=0)
    chains = [c + [-1] * (width - len(c)) for c in leaves]
    drafts = [[tokens[j] if j >= 0 else -1 for j in c] for c in chains]
    before = [[0] + [max(j, 0) for j in c] for c in chains]
    as_long = dict(dtype=torch.long, device=device)
    return Tree(torch.tensor(tokens, **as_long), torch.tensor(parents, **as_long), torch.tensor(depth, **as_long),
                torch.tensor(anc, dtype=torch.bool, device=device),
                torch.tensor(chains, **as_long).view(len(chains), width),
                torch.tensor(drafts, **as_long).view(len(chains), width),
                torch.tensor(before, **as_long).view(len(chains), width + 1))


def main_branch(tree: Tree, k: int) -> list[int]:
    """The one chain a chain-verifying host checks, at most ``k`` tokens: from the root, always into the child
    the most candidates continue through (most leaves below it; ties: the first inserted, i.e. more likely)."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    leaves = [0] * len(parents)
    for i in range(len(parents) - 1, 0, -1):  # children come after their parents
        leaves[i] = leaves[i] or 1
        leaves[parents[i]] += leaves[i]
    best: dict[int, int] = {}
    for i in range(1, len(parents)):
        j = best.get(parents[i])
        if j is None or leaves[i] > leaves[j]:
            best[parents[i]] = i
    out, node = [], 0
    while node in best and len(out) < k:
        node = best[node]
        out.append(tokens[node])
    return out


def padded(tree: Tree, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree as a fixed number of nodes: (tokens [W], ancestors [W, W] bool, mask[i, j] = j is i or an
    ancestor of i). Missing nodes are extra children of the root repeating the root token - verified like any
    candidate, so they can only be accepted if correct."""
    n = tree.size
    if n > width:
        raise ValueError(f"tree of {n} nodes does not fit {width} draft tokens")
    tokens = tree.tokens.new_full((width,), int(tree.tokens[0]))
    tokens[:n] = tree.tokens
    mask = torch.eye(width, dtype=torch.bool, device=tree.tokens.device)
    mask[:n, :n] = tree.ancestors
    mask[n:, 0] = True
    return tokens, mask


def tree_attention_mask(tree: Tree, prefix_len: int) -> torch.Tensor:
    """[1, 1, N, prefix_len + N] bool (True = attend): the whole committed prefix plus the node's ancestors."""
    n = tree.size
    prefix = torch.ones(n, prefix_len, dtype=torch.bool, device=tree.tokens.device)
    return torch.cat([prefix, tree.ancestors], 1)[None, None]


def tree_position_ids(tree: Tree, prefix_len: int) -> torch.Tensor:
    """[1, N]: the root sits at ``prefix_len``, a node at depth d at ``prefix_len + d``."""
    return (tree.depth + prefix_len)[None]


def path_token_mask(tree: Tree, vocab_size: int) -> torch.Tensor:
    """[N, V] bool: the tokens on node i's path below the root (i included) - for the contextual penalty."""
    anc = tree.ancestors[:, 1:].float()  # [N, N-1]
    onehot = torch.nn.functional.one_hot(tree.tokens[1:], vocab_size).float()  # [N-1, V]
    return (anc @ onehot) > 0


@dataclass(frozen=True)
class TreeAcceptance:
    nodes: list[int]          # accepted node ids below the root, root to leaf
    next_token: torch.Tensor  # [] int64: the target's token after the last accepted node


def accept_tree(tree: Tree, choice: torch.Tensor, generator: torch.Generator | None = None) -> TreeAcceptance:
    """Longest chain prefix whose tokens equal ``choice`` [N] at their parents; ties broken at random."""
    if tree.chains.numel() == 0:
        return TreeAcceptance([], choice[0])
    chains = tree.chains  # [P, D]
    acc = accept_match(tree.drafts, choice[tree.before])  # per chain: drafts vs the target's choices
    noise = torch.rand(chains.shape[0], generator=generator, device=chains.device)
    best = int((acc.num_accepted.float() + 0.5 * noise).argmax())  # the longest; uniform among equals
    n = int(acc.num_accepted[best])
    return TreeAcceptance(chains[best, :n].tolist(), acc.next_token[best])
