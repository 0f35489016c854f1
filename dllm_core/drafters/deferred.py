"""A drafter's context deferred over the steps that draft nothing (the adaptive draft length's k = 0): the target's
rows of those steps are held and written to the drafter's cache in one append by the next step that drafts, so the
drafter still sees every token (lossless) while a plain step pays no drafter write. Host-agnostic: a host hands its
rows in and writes what ``take`` returns with its own cache append."""
from __future__ import annotations

import torch

LIMIT = 64 << 20  # bytes of hidden rows held at most (1,600 rows of an 8B target's 5 layers in bf16); reaching it
# asks for the write at once


class DeferredContext:
    """The held rows: per plain step (hidden [n, H], the target's KV slots [n], the drafter's slots [n], positions
    [n], request ids)."""

    def __init__(self, limit: int = LIMIT):
        self.parts: list[tuple] = []
        self.rows, self.bytes, self.limit = 0, 0, limit  # limit: bytes of hidden rows

    def add(self, hidden: torch.Tensor, slots: torch.Tensor, locs: torch.Tensor, pos: torch.Tensor, rids,
            alive=None) -> bool:
        """One plain step's rows -> whether to write the rows held now: they reached the limit in bytes (with
        ``alive``, the requests still running: the rows of the others dropped first, and the rest reach half of
        it)."""
        self.parts.append((hidden, slots, locs, pos, list(rids)))
        self.rows += len(slots)
        self.bytes += hidden.nbytes
        if self.bytes >= self.limit and alive is not None:
            self.keep(alive)
            return 2 * self.bytes >= self.limit
        return self.bytes >= self.limit

    def keep(self, alive) -> None:
        """Drop the rows of the requests not in ``alive`` (a finished request's context is never read)."""
        parts = []
        for p in self.parts:
            keep = [r in alive for r in p[4]]
            if all(keep):
                parts.append(p)
            elif any(keep):
                m = torch.tensor(keep, dtype=torch.bool)
                parts.append((*(x[m.to(x.device)] for x in p[:4]), [r for r, k in zip(p[4], keep) if k]))
        self.parts = parts
        self.rows = sum(len(p[4]) for p in parts)
        self.bytes = sum(p[0].nbytes for p in parts)

    def take(self, live: dict | None = None, alive=None) -> tuple[torch.Tensor, ...] | None:
        """Every held row of a request in ``live`` (request id -> its row in the batch now), and nothing is held
        after: (hidden, target slots, drafter slots, positions, batch rows) [n] each; None when nothing was held. The
        host keeps the rows whose request still holds that slot at that position (not retracted since). ``live``
        None: the newest row of each drafter slot, no batch rows (what writing each step's rows at once leaves there;
        one write of rows that share a slot keeps any one of them), of the requests in ``alive`` if given
        (``keep``)."""
        if alive is not None:
            self.keep(alive)
        if not self.parts:
            return None
        hidden, slots, locs, pos = (torch.cat(x) for x in list(zip(*self.parts))[:4])
        if live is None:
            self.parts, self.rows, self.bytes = [], 0, 0
            j = newest(locs)
            return (hidden[j], slots[j], locs[j], pos[j], None) if len(j) else None
        rows = [(j, live[r]) for j, r in enumerate(r for p in self.parts for r in p[4]) if r in live]
        self.parts, self.rows, self.bytes = [], 0, 0
        j, i = torch.tensor(rows, dtype=torch.long, device=hidden.device).view(-1, 2).T  # [n] each
        return hidden[j], slots[j], locs[j], pos[j], i

    def write(self, append, alive=None) -> None:
        """Every held row (of a request in ``alive`` if given), the newest of each drafter slot (``take``), handed to
        ``append(hidden, drafter slots, positions)`` (nothing held: not called)."""
        got = self.take(alive=alive)
        if got is not None:
            append(got[0], got[2], got[3])


def newest(slots: torch.Tensor) -> torch.Tensor:
    """The index of the last row of each distinct slot in ``slots`` [n] (ascending slots)."""
    s, i = torch.sort(slots, stable=True)
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]
    return i[last]

