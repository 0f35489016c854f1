"""Candidate continuations of the root for one verification: the heads' best paths + reused n-grams.

``head_paths``: the heads' distributions of consecutive levels are independent given h0, so the best m
token paths by summed log-probability come from a beam over the per-level top-k (one top-k on the tensor,
then a tiny beam on the host). ``candidate_paths`` interleaves them with the continuations of the most
frequent n-grams that start with the token the first level is keyed on (the root itself, or the drafted
first token). Verifying a tree costs compute per node on a CPU, so of the ``ngram_topk`` retrieved n-grams
only the ``ngram_paths`` the heads find most likely (summed log-probability of their tokens at the heads'
levels) enter the tree. ``head_levels`` turns h0 into those level distributions with the host's LM head.
"""
from __future__ import annotations

import torch

from .ngram import NGramTable


def head_levels(heads, lm_head, h0: torch.Tensor, drafted_first: bool = False) -> torch.Tensor:
    """h0 [H] -> the heads' logits [D, V] of the D positions after the root, through the host's ``lm_head``.

    h0 from the verification (it produced the root, so its own l_0 is spent): l_1 .. l_gamma; with
    ``drafted_first`` (h0 from a drafting forward on the root): l_0 .. l_gamma."""
    hs = heads(h0.to(heads.layers[0].weight.dtype))  # [gamma+1, H]
    return lm_head(hs if drafted_first else hs[1:])


def head_paths(logits: torch.Tensor, k: int, m: int) -> list[list[int]]:
    """logits [D, V] of D consecutive levels -> the m most likely length-D token paths, best first."""
    val, tok = logits.float().log_softmax(-1).topk(min(k, logits.shape[-1]), -1)  # [D, k]
    val, tok = val.tolist(), tok.tolist()
    beam = [(0.0, [])]
    for lv, lt in zip(val, tok):
        beam = sorted(((s + v, p + [t]) for s, p in beam for v, t in zip(lv, lt)), key=lambda sp: -sp[0])[:m]
    return [p for _, p in beam]


def rank_by_levels(paths: list[list[int]], logp: torch.Tensor, keep: int) -> list[list[int]]:
    """The ``keep`` paths (all of one length) with the highest summed log-probability of their tokens under
    the level distributions logp [D, V] (first min(len, D) tokens); ties keep the given order."""
    if len(paths) <= keep:
        return paths
    w = min(len(paths[0]), logp.shape[0])
    toks = torch.tensor([p[:w] for p in paths], device=logp.device)  # [K, w]
    score = logp[torch.arange(w, device=logp.device), toks].sum(-1)  # [K]
    order = torch.sort(score, descending=True, stable=True).indices[:keep].tolist()
    return [paths[i] for i in order]


def candidate_paths(level_logits: torch.Tensor | None, table: NGramTable, root: int, drafted_first: bool,
                    head_topk: int, num_head_paths: int, ngram_topk: int,
                    ngram_paths: int | None = None) -> list[list[int]]:
    """Token paths below ``root``: heads' paths and n-gram continuations, alternating, most likely first.

    level_logits [D, V]: the drafted distributions of the D positions after the root (None: no heads, the
    n-grams keyed on the root only). With ``drafted_first`` (dynamic drafting) n-grams are keyed on the first
    level's argmax and that token leads each retrieved path; otherwise they are keyed on the root and continue
    it directly. ``ngram_paths`` (None: all) of the retrieved n-grams are kept, ranked by the heads."""
    if level_logits is None:
        return [list(rest) for rest in table.top(root, ngram_topk)][:ngram_paths]
    heads = head_paths(level_logits, head_topk, num_head_paths)
    if drafted_first:
        first = int(level_logits[0].argmax())
        grams = [[first, *rest] for rest in table.top(first, ngram_topk)]
    else:
        grams = [list(rest) for rest in table.top(root, ngram_topk)]
    if ngram_paths is not None and grams:
        grams = rank_by_levels(grams, level_logits.float().log_softmax(-1), ngram_paths)
    out: list[list[int]] = []
    for i in range(max(len(heads), len(grams))):
        out += heads[i:i + 1] + grams[i:i + 1]
    return out
