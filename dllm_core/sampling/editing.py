"""LLaDA2.1's token editing (joint threshold decoding), an option of the parallel (variable-step) rules.

Each step decodes masked positions with the rule's own commit (mask-to-token, M2T) and, with ``edit`` set,
also replaces already-committed tokens of the block (token-to-token, T2T) whose proposal differs from
them with probability above ``edit``. Positions that were not masks when the block began (a prompt's
tail in a block-causal model's first block) are never edited. Once a block has no mask left, editing
continues for at most ``post_edit`` more steps; a row's block ends at the first step that changes
nothing (that step's forward already saw the final block) or when the budget is spent. ``edit``
unset: the plain rule (its block ends when no mask is left).

When the budget is spent, this runs one more forward for the block (its step commits nothing), as SGLang does;
a rule whose ``ends_at_budget`` holds (``threshold:schedule=llada2``) ends the block at the step after which the
next one would be past the budget, without that forward, as LLaDA2.1's official ``generate`` does.

Greedy (temperature 0) this is SGLang's ``JointThreshold`` (threshold, edit_threshold, max_post_edit_steps)
step for step, with two stated differences: [MASK] is never a proposal here (SGLang takes the plain
argmax, so where a model's argmax is [MASK] it may re-mask a committed token), and the M2T threshold
admits confidence == tau (SGLang: > tau). Its ``penalty_lambda`` (a repetition penalty, default 0) is
not offered.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Sampler, TokenContext
from ..options import check_min, check_range


def edit_commit(p: torch.Tensor, x0: torch.Tensor, x: torch.Tensor, masked: torch.Tensor, free: torch.Tensor,
                tau: float) -> torch.Tensor:
    """T2T: committed, editable positions whose proposal x0 differs with probability p > tau. [B, W] -> [B, W].
    ``free``: the positions that were masks when the block began (``masked`` lies within them)."""
    return (p > tau) & (x0 != x) & (free ^ masked)


@dataclass(frozen=True)
class Editable(Sampler):
    """A variable-step rule with optional LLaDA2.1 token editing (``edit``: T2T probability threshold in
    [0, 1], None = off; ``post_edit``: editing steps allowed after the last mask)."""

    edit: float | None = None
    post_edit: int = 16

    def __post_init__(self):
        super().__post_init__()
        if self.edit is not None:
            check_range(self.edit, 0.0, 1.0, f"--sampler {self.name}.edit")
        check_min(self.post_edit, 0, f"--sampler {self.name}.post_edit")

    def new_state(self, batch, block_len, steps, device):
        st = super().new_state(batch, block_len, steps, device)
        if self.edit is not None:
            st.update(fin=torch.zeros(batch, dtype=torch.bool, device=device),
                      post=torch.zeros(batch, dtype=torch.long, device=device),
                      free=torch.zeros(batch, block_len, dtype=torch.bool, device=device))
        return st

    def begin_block(self, st, masked):
        super().begin_block(st, masked)
        if self.edit is not None:
            st["free"] = masked
            st["post"] = torch.zeros_like(st["post"])
            st["fin"] = ~masked.any(-1)  # a block without masks has nothing to decode

    def rows_done(self, st, masked):
        return st["fin"] if self.edit is not None else super().rows_done(st, masked)

    def active(self, st, masked):
        return ~st["fin"] if self.edit is not None else super().active(st, masked)

    def max_steps(self, block_len, steps):
        return block_len + (self.post_edit + 1 if self.edit is not None else 0)

    def ends_at_budget(self) -> bool:
        """True: a block ends with its post-edit budget, without the forward of a step past it."""
        return False

    def device_step(self, logits: torch.Tensor, x: torch.Tensor, st: dict, tc: TokenContext, lo: int = 0):
        if self.edit is None:
            return super().device_step(logits, x, st, tc, lo)
        masked, fin = x == tc.mask_id, st["fin"]  # [B, W], [B]
        x0, m2t, conf = self.scored_step(logits, x, st, tc, lo, masked)
        post = st["post"] + ~(fin | masked.any(-1))  # a running row without masks spends a post-edit step
        # rows that may commit: running, post-edit budget not spent (post > 0 only once the block has no mask)
        go = ~(fin | (post > self.post_edit))  # [B]
        if self.confidence == "low_confidence" and not tc.confidence_eos_eot_inf:  # the same probability, ranked
            p = conf if conf.dtype == logits.dtype else conf.to(logits.dtype)
        else:
            p = logits.softmax(-1).gather(-1, x0[..., None])[..., 0]  # probability of the proposal
        free = st["free"]
        if lo or x.shape[1] != free.shape[1]:
            free = free[:, lo:lo + x.shape[1]]
        commit = (m2t | edit_commit(p, x0, x, masked, free, self.edit)) & go[:, None]
        fin = fin | ~commit.any(-1)  # a running row's block ends at a step changing nothing
        if self.ends_at_budget():  # ... or when the next step (no mask left: a post-edit one) is past the budget
            fin = fin | (~(masked & ~commit).any(-1) & (post >= self.post_edit))
        st["post"], st["fin"] = post, fin
        return x0, commit
