"""TEST-ONLY stand-in for ``sgl_kernel.speculative`` (the NGRAM tree metadata op), in torch."""
from __future__ import annotations

import torch


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrieve_index,
                                       retrieve_next_token, retrieve_next_sibling, batch_size: int,
                                       draft_token_num: int) -> None:
    """From ``tree_mask`` ([bs * n * n], mask[b, i, j]: j is i or an ancestor of i) write, per node:
    position = prefix length + depth, its global index b * n + i, its first child and next sibling (-1: none).
    """
    n = draft_token_num
    idx = torch.arange(n, device=tree_mask.device)
    anc = tree_mask.view(batch_size, n, n).bool() & (idx[None, :] < idx[:, None])  # [bs, n, n] strict
    positions.view(batch_size, n).copy_(anc.sum(-1) + verified_seq_len.view(-1, 1).long())
    retrieve_index.view(batch_size, n).copy_(torch.arange(batch_size * n, device=idx.device).view(batch_size, n))
    parent = torch.where(anc, idx, -1).amax(-1)  # [bs, n]
    child_of = torch.where(anc, idx[:, None], n).amin(1)  # [bs, n]: smallest k with tid an ancestor of k
    retrieve_next_token.view(batch_size, n).copy_(torch.where(child_of < n, child_of, -1))
    later = (parent[:, :, None] == parent[:, None, :]) & (idx[:, None] > idx[None, :])  # [bs, k, tid]
    sibling = torch.where(later, idx[None, :, None], n).amin(1)  # [bs, n]
    retrieve_next_sibling.view(batch_size, n).copy_(torch.where((parent >= 0) & (sibling < n), sibling, -1))
