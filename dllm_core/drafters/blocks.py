"""DFlash training blocks: random anchors, many blocks packed per sequence under a sparse mask.

For a sequence of L tokens (prompt + the target's own response) and N anchors a_j in the response, block j
is ``[x[a_j], MASK x (B-1)]`` at positions a_j .. a_j+B-1 with labels x[a_j+1 .. a_j+B-1] (position 0 is
the clean anchor, as at inference where it is the last verified token). All N blocks are queries of one
drafter forward over keys ``[target context (L) ; blocks (N*B)]`` with::

    query in block j may see context key t   iff  t < a_j      (the target's features up to the anchor)
    query in block j may see block key in j' iff  j' == j     (bidirectional in-block, nothing across)

Loss weights decay with the in-block position: w_k = exp(-(k-1)/gamma), k = 1..B-1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class PackedBlocks:
    ids: torch.Tensor      # [S, N*B] block inputs (anchor token, then mask tokens)
    pos: torch.Tensor      # [S, L + N*B] positions of the context tokens, then of the block tokens
    mask: torch.Tensor     # [S, 1, N*B, L + N*B] bool, True = may attend
    labels: torch.Tensor   # [S, N*B] token to predict or IGNORE
    weights: torch.Tensor  # [S, N*B] loss weight (0 where ignored)


def sample_anchors(lengths: torch.Tensor, starts: torch.Tensor, n_blocks: int, max_len: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``n_blocks`` distinct anchors per row, uniform over [start, length-2] (each has >= 1 label).

    lengths, starts [S] -> anchors [S, N] (ascending; 0 where invalid), valid [S, N] bool."""
    t = torch.arange(max_len, device=lengths.device)
    ok = (t >= starts[:, None]) & (t <= lengths[:, None] - 2)  # [S, L]
    score = torch.rand(ok.shape, generator=generator, device=ok.device).masked_fill(~ok, -1.0)
    n = min(n_blocks, max_len)
    top, idx = score.topk(n, -1)  # [S, N]
    valid = top >= 0
    idx = torch.where(valid, idx, torch.full_like(idx, max_len))  # invalid ones sort last
    idx, order = idx.sort(-1)
    valid = valid.gather(1, order)
    return torch.where(valid, idx, 0), valid


def loss_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B]: 0 for the anchor, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def block_mask(anchors: torch.Tensor, valid: torch.Tensor, block_size: int, ctx_len: int) -> torch.Tensor:
    """anchors, valid [S, N] -> bool mask [S, 1, N*B, L + N*B] (see module docstring).

    An invalid block still sees itself, so no query row is empty."""
    s, n = anchors.shape
    dev = anchors.device
    qa = anchors.repeat_interleave(block_size, 1)  # [S, N*B] anchor of each query
    qv = valid.repeat_interleave(block_size, 1)
    ctx = (torch.arange(ctx_len, device=dev)[None, None] < qa[..., None]) & qv[..., None]  # [S, N*B, L]
    blk = torch.arange(n, device=dev).repeat_interleave(block_size)  # [N*B] block of each query/key
    own = (blk[:, None] == blk[None, :]).expand(s, -1, -1)  # [S, N*B, N*B]
    return torch.cat([ctx, own], -1)[:, None]


def pack_blocks(tokens: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                block_size: int, mask_token_id: int, gamma: float) -> PackedBlocks:
    """tokens [S, L] (right-padded), lengths [S], anchors/valid [S, N] -> the packed training blocks."""
    s, L = tokens.shape
    k = torch.arange(block_size, device=tokens.device)
    tpos = anchors[..., None] + k  # [S, N, B] sequence position of each block slot
    gathered = tokens.gather(1, tpos.clamp(max=L - 1).flatten(1)).view_as(tpos)
    ids = torch.where(k == 0, gathered, torch.full_like(gathered, mask_token_id))
    has_label = (k > 0) & (tpos < lengths[:, None, None]) & valid[..., None]  # [S, N, B]
    labels = torch.where(has_label, gathered, torch.full_like(gathered, IGNORE))
    weights = loss_weights(block_size, gamma, tokens.device) * has_label
    pos = torch.cat([torch.arange(L, device=tokens.device).expand(s, L), tpos.flatten(1)], 1)
    return PackedBlocks(ids.flatten(1), pos, block_mask(anchors, valid, block_size, L), labels.flatten(1),
                        weights.flatten(1))
