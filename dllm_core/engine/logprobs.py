"""Log-probabilities of a diffusion answer: each position's committed token under the distribution of the step that
committed it - the log-softmax of that step's logits (classifier-free guidance applied; before temperature, top-p
and top-k, as OpenAI-style APIs report them) - and the top k alternatives at that step. A token an editing sampler
changes later takes the step of its last change. Every engine reports these (``docs/architecture.md``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Logprobs:
    """token [B, T]: the committed token's log-probability per position (0 where nothing was committed); rank
    [B, T]: its rank in the step's distribution (1: the most likely); top / top_ids [B, T, k]: the step's k most
    likely tokens and their log-probabilities (k = 0: empty)."""

    token: torch.Tensor
    top: torch.Tensor
    top_ids: torch.Tensor
    rank: torch.Tensor

    FIELDS = ("token", "top", "top_ids", "rank")

    @classmethod
    def empty(cls, rows: int, width: int, k: int, device) -> "Logprobs":
        return cls(torch.zeros(rows, width, device=device), torch.zeros(rows, width, k, device=device),
                   torch.zeros(rows, width, k, dtype=torch.long, device=device),
                   torch.zeros(rows, width, dtype=torch.long, device=device))

    def record(self, logits: torch.Tensor, old: torch.Tensor, new: torch.Tensor, lo: int) -> None:
        """A step that turned ``old`` into ``new`` [B, W] at columns [lo, lo + W) of every row, from ``logits``
        [B, W, V]: the changed positions take this step's log-probabilities (no host sync)."""
        B, W = new.shape
        cols = torch.arange(lo, lo + W, device=new.device).expand(B, W)
        self.record_at(torch.arange(B, device=new.device), cols, logits, old, new)

    def record_at(self, rows: torch.Tensor, cols: torch.Tensor, logits: torch.Tensor, old: torch.Tensor,
                  new: torch.Tensor) -> None:
        """``record`` for rows ``rows`` [m] at their own columns ``cols`` [m, W] (a host's slots and blocks)."""
        r, changed = rows[:, None], new != old  # [m, W]
        logp = torch.log_softmax(logits.float(), -1)  # [m, W, V]
        tok = logp.gather(-1, new[..., None])  # [m, W, 1]
        self.token[r, cols] = torch.where(changed, tok[..., 0], self.token[r, cols])
        self.rank[r, cols] = torch.where(changed, (logp > tok).sum(-1) + 1, self.rank[r, cols])
        k = self.top.shape[-1]
        if k:
            v, i = logp.topk(k, -1)  # [m, W, k]
            self.top[r, cols] = torch.where(changed[..., None], v, self.top[r, cols])
            self.top_ids[r, cols] = torch.where(changed[..., None], i, self.top_ids[r, cols])

    def resized(self, rows: int, width: int, k: int) -> "Logprobs":
        """At least ``rows`` x ``width`` positions and ``k`` alternatives, what is held kept."""
        R, W, K = self.token.shape[0], self.token.shape[1], self.top.shape[-1]
        if rows <= R and width <= W and k <= K:
            return self
        out = Logprobs.empty(max(rows, R), max(width, W), max(k, K), self.token.device)
        out.token[:R, :W], out.top[:R, :W, :K], out.top_ids[:R, :W, :K] = self.token, self.top, self.top_ids
        out.rank[:R, :W] = self.rank
        return out

    def gather(self, cols: torch.Tensor) -> "Logprobs":
        """The columns ``cols`` [B, G] of each row."""
        return self.take(torch.arange(cols.shape[0], device=cols.device), cols)

    def take(self, rows: torch.Tensor, cols: torch.Tensor, k: int | None = None) -> "Logprobs":
        """Rows ``rows`` [m] at their columns ``cols`` [m, G], with the first ``k`` alternatives (None: all)."""
        r, k = rows[:, None], self.top.shape[-1] if k is None else k
        return Logprobs(self.token[r, cols], self.top[r, cols, :k], self.top_ids[r, cols, :k], self.rank[r, cols])

    @staticmethod
    def cat(parts: list["Logprobs"]) -> "Logprobs":
        """Consecutive canvases' answers, side by side."""
        return Logprobs(*(torch.cat([getattr(p, f) for p in parts], 1) for f in Logprobs.FIELDS))

    def flat(self, tokens: torch.Tensor, n) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``n[i]`` positions of each row, row after row (a host's layout of emitted tokens), ``tokens``
        [B, T] the committed ones: (ids [sum n, 1 + k]: the token, then its step's top k; their log-probabilities
        [sum n, 1 + k]; the token's rank [sum n])."""
        dev = tokens.device
        keep = torch.arange(self.token.shape[1], device=dev) < torch.as_tensor(n, device=dev)[:, None]  # [B, T]
        ids = torch.cat([tokens[:, :, None], self.top_ids], -1)[keep]  # [sum n, 1 + k]
        return ids, torch.cat([self.token[:, :, None], self.top], -1)[keep], self.rank[keep]

    def rows(self) -> list[list[dict]]:
        """Per row, per position: {"logprob": float, "top": [(token id, logprob), ...]} (one device read)."""
        tok, top, ids = self.token.tolist(), self.top.tolist(), self.top_ids.tolist()
        return [[{"logprob": t, "top": list(zip(i, v))} for t, v, i in zip(tr, vr, ir)]
                for tr, vr, ir in zip(tok, top, ids)]
