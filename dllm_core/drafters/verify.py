"""Lossless verification of drafted tokens, shared by every drafter (DFlash, TokenSwift, ...).

A *chain* verifier gets K drafted tokens and the target's distribution at the K+1 positions
[last verified token, draft_1 .. draft_K] (one causal forward) and returns, per row, how many drafts
are accepted and the one extra token the target emits after them (a correction on rejection, a bonus
after full acceptance). Everything is batched over rows and free of host syncs.

- ``accept_greedy``: draft_i is kept while it equals the target's argmax at i-1 (temperature 0).
- ``accept_sampled``: speculative sampling (Leviathan et al. / Chen et al.): keep draft_i with
  probability min(1, p(x)/q(x)); at the first rejection sample from norm(max(p - q, 0)); after full
  acceptance sample the bonus from p. With a greedy drafter q is one-hot (pass ``draft_probs=None``).
  The emitted tokens are distributed exactly as sampling from p token by token.

A tree verifier (candidates with parent pointers, tree attention in the target) belongs beside these as
``accept_tree`` returning the same ``Acceptance`` plus the chosen path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, probs_from_logits, sample_probs


@dataclass(frozen=True)
class Acceptance:
    num_accepted: torch.Tensor  # [B] int64: drafts accepted (0..K)
    next_token: torch.Tensor    # [B] int64: token the target emits after the accepted drafts


def accept_match(draft: torch.Tensor, choice: torch.Tensor) -> Acceptance:
    """draft [B, K], choice [B, K+1] (the target's token after each of [last, draft_1..K]) -> longest prefix
    of drafts equal to the target's choices, + the choice after it. Greedy when ``choice`` is the argmax; with
    one target sample per position it is exact-match verification of sampled tokens (tree verification)."""
    n = (draft == choice[:, :-1]).long().cumprod(-1).sum(-1)  # [B]
    return Acceptance(n, choice.gather(1, n[:, None])[:, 0])


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """draft [B, K], target_logits [B, K+1, V] -> longest prefix matching the target's argmax, + its next."""
    return accept_match(draft, target_logits.argmax(-1))  # choice [B, K+1]


def accept_sampled(draft: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> Acceptance:
    """Speculative sampling. draft [B, K]; target_probs p [B, K+1, V]; draft_probs q [B, K, V] the
    distributions the drafts were sampled from, or None for a greedy (one-hot) drafter."""
    b, k = draft.shape
    if k == 0:
        return Acceptance(draft.new_zeros(b), sample_probs(target_probs[:, 0], generator))
    p_draft = target_probs[:, :k].gather(-1, draft[..., None])[..., 0]  # [B, K]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(-1, draft[..., None])[..., 0]
    u = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)
    n = (u * q_draft < p_draft).long().cumprod(-1).sum(-1)  # [B]: accept w.p. min(1, p/q)
    at = n.clamp(max=k - 1)[:, None, None]  # row of the first rejection (clamped when none)
    p_rej = target_probs.gather(1, at.expand(b, 1, target_probs.shape[-1]))[:, 0]  # [B, V]
    if draft_probs is None:
        resid = p_rej.scatter(-1, draft.gather(1, at[:, :, 0]), 0.0)  # p - onehot, clamped at 0
    else:
        resid = (p_rej - draft_probs.gather(1, at.expand(b, 1, draft_probs.shape[-1]))[:, 0]).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(torch.finfo(resid.dtype).tiny), p_rej)
    dist = torch.where((n == k)[:, None], target_probs[:, k], resid)  # [B, V]
    return Acceptance(n, sample_probs(dist, generator))


def accept_chain(draft: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams,
                 draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Acceptance:
    """Verify a chain of drafts against target_logits [B, K+1, V] under ``params`` (greedy or sampled)."""
    if params.greedy:
        return accept_greedy(draft, target_logits)
    return accept_sampled(draft, probs_from_logits(target_logits, params), draft_probs, generator)
