"""The windowed contextual penalty (TokenSwift section 4), applied to the *target's* logits.

Only the last W generated tokens are penalised, by a factor theta > 1: p_i ~ exp(l_i / (t * I(l_i))) with
I = theta for tokens in the window and 1 otherwise. A positive logit is divided by theta and a negative one
multiplied by it (CTRL's reading of the rule: plain division would *raise* a negative logit, rewarding the
repetition it is meant to discourage). ``banned`` ids (stop tokens of a free-running generation) get -inf.

The penalty is part of the target distribution, so AR decoding and every verified tree node use it alike,
which keeps TokenSwift lossless with the penalty on. A tree node at depth d sees the window of the
sequence it continues: the last W-d generated tokens plus the d tokens on its path (``apply``).
"""
from __future__ import annotations

import torch


class ContextualPenalty:
    """Tracks the window of generated tokens; ``apply`` reshapes logits of root/tree nodes."""

    def __init__(self, vocab_size: int, theta: float = 1.0, window: int = 1024, banned: tuple[int, ...] = (),
                 device: str | torch.device = "cpu"):
        if theta < 1:
            raise ValueError(f"--penalty must be >= 1 (1 = off), got {theta}")
        if window < 1:
            raise ValueError(f"--penalty-window must be >= 1, got {window}")
        bad = [b for b in banned if not 0 <= b < vocab_size]
        if bad:
            raise ValueError(f"banned token ids {bad} outside the vocabulary [0, {vocab_size})")
        self.vocab_size, self.theta, self.window = vocab_size, float(theta), window
        self.device = torch.device(device)
        self.banned = torch.tensor(sorted(set(banned)), dtype=torch.long, device=self.device)
        self.history: list[int] = []
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=self.device)  # tokens in the window

    @property
    def active(self) -> bool:
        return self.theta != 1.0 or self.banned.numel() > 0

    def push(self, tokens: list[int]) -> None:
        """Append generated tokens; tokens leaving the window stop counting."""
        if self.theta == 1.0 or not tokens:
            self.history += tokens
            return
        start = max(len(self.history) - self.window, 0)
        self.history += tokens
        added = torch.tensor(tokens, device=self.device)
        self.counts.index_add_(0, added, torch.ones_like(added, dtype=torch.int32))
        gone = self.history[start:max(len(self.history) - self.window, 0)]  # left the window (old or new)
        if gone:
            g = torch.tensor(gone, device=self.device)
            self.counts.index_add_(0, g, -torch.ones_like(g, dtype=torch.int32))

    def window_mask(self, depth: torch.Tensor, path_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """[N, V] bool: token in the window of node i = last W - depth[i] generated tokens + its path.

        depth [N] int64; path_tokens [N, V] bool (tokens on the path below the root, node included) or None."""
        dmax = int(depth.max()) if depth.numel() else 0
        n = len(self.history)
        start0 = max(n - self.window, 0)
        rows = [self.counts]
        for d in range(1, dmax + 1):  # the window of depth d starts d tokens later
            start = max(n - (self.window - d), 0)
            gone = self.history[start0:start]
            c = rows[0].clone()
            if gone:
                g = torch.tensor(gone, device=self.device)
                c.index_add_(0, g, -torch.ones_like(g, dtype=torch.int32))
            rows.append(c)
        mask = torch.stack(rows)[depth] > 0  # [N, V]
        return mask if path_tokens is None else mask | path_tokens

    def apply(self, logits: torch.Tensor, depth: torch.Tensor | None = None,
              path_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """logits [N, V] of nodes at ``depth`` [N] (default: all at the root) -> penalised logits [N, V]."""
        if not self.active:
            return logits
        out = logits
        if self.theta != 1.0:
            if depth is None:
                depth = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
            hit = self.window_mask(depth, path_tokens)
            out = torch.where(hit, torch.where(logits > 0, logits / self.theta, logits * self.theta), logits)
        if self.banned.numel():
            out = out.index_fill(-1, self.banned, float("-inf"))
        return out
