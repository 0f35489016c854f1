"""One forward's plan, built by the core once per step and read by the model alone (nano-vllm's per-step context):
which rows run beside the host's scheduled ones (``RowLayout``), which layers run cached (``CachedStep``), which
final hidden rows are kept (Dream's shifted row), the attention requests of block-causal prompt chunks
(``GridRequests``), and each row's request slot (work). A host hands the model nothing else."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..cache.executor import CachedStep


def as_rows(a, device) -> torch.Tensor:
    """Host ints -> a device index (long)."""
    return torch.as_tensor(np.asarray(a), dtype=torch.long, device=device)


@dataclass
class RowLayout:
    """The forward's rows when a step runs prefix rows beside the host's scheduled ones (Fast-dLLM's refreshes, Dream's
    shifted row, a block-causal canvas's prompt tail) or leaves scheduled rows out (DPad): per request, [its extra
    prefix positions ; its scheduled tokens it keeps]."""

    n_tokens: int               # rows of the extended batch
    qsl: np.ndarray             # [n + 1] query start of each request in it
    orig: torch.Tensor          # [N'] row of each kept scheduled token
    rows: torch.Tensor          # [E] rows of the extra prefix positions
    ids: torch.Tensor           # [E] their token ids
    pos: torch.Tensor           # [E] their positions
    extra: np.ndarray           # [n] extra rows per request (host)
    drop: np.ndarray            # [n] scheduled rows a plan leaves out (host)
    sched: torch.Tensor | None = None  # [N'] the scheduled tokens the rows ``orig`` carry (None: all, in order)
    at: torch.Tensor | None = None     # [N'] the scheduled tokens whose paged slots those rows take

    @classmethod
    def of(cls, q0: np.ndarray, qlen: np.ndarray, done: np.ndarray, extra: np.ndarray, drop: np.ndarray,
           keep: dict, ids, device) -> "RowLayout":
        """Requests scheduled at rows ``q0`` [n] (``qlen`` rows each, after ``done`` held positions) with ``extra``
        prefix rows before them and ``drop`` scheduled rows left out (``keep[i]``: the positions request i keeps);
        ``ids(i, pos)`` -> the token ids of request i at held positions ``pos``. The kept rows, in order, take the
        paged slots of the first scheduled tokens (the attention reads a compact sequence)."""
        n = len(qlen)
        qsl = np.concatenate([[0], np.cumsum(extra + qlen - drop)])
        orig = np.concatenate([np.arange(qsl[i] + extra[i], qsl[i + 1]) for i in range(n)])
        who, none = np.flatnonzero(extra), [np.zeros(0, dtype=np.int64)]  # (a DPad step may add no prefix row)
        rows = np.concatenate(none + [np.arange(qsl[i], qsl[i] + extra[i]) for i in who])
        pos = [np.arange(done[i] - extra[i], done[i]) for i in who]
        ids_ = torch.cat([ids(int(i), as_rows(p, device)) for i, p in zip(who, pos)]) if len(who) else \
            torch.zeros(0, dtype=torch.long, device=device)
        out = cls(int(qsl[-1]), qsl.astype(np.int32), as_rows(orig, device), as_rows(rows, device), ids_.long(),
                  as_rows(np.concatenate(none + pos), device), extra, drop)
        if drop.any():
            kept = qlen - drop
            cols = [keep[i][done[i]:] - done[i] if drop[i] else np.arange(qlen[i]) for i in range(n)]
            out.sched = as_rows(np.concatenate([q0[i] + c for i, c in enumerate(cols)]), device)
            out.at = as_rows(np.concatenate([q0[i] + np.arange(kept[i]) for i in range(n)]), device)
        return out

    def extend(self, x: torch.Tensor, positions: torch.Tensor, embed) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rows x [N, d] / positions [N] with the extra prefix rows placed among them and the rows left
        out gone -> [N_ext, d], [N_ext] (no padding rows are carried into the extended batch)."""
        src = slice(0, self.orig.shape[0]) if self.sched is None else self.sched
        xe = x.new_empty(self.n_tokens, x.shape[-1])
        xe[self.orig], xe[self.rows] = x[src], embed(self.ids)
        pe = positions.new_empty(self.n_tokens)
        pe[self.orig], pe[self.rows] = positions[src], self.pos.to(positions.dtype)
        return xe, pe

    def back(self, h: torch.Tensor, n: int) -> torch.Tensor:
        """The extended rows h [N_ext, d] back at the step's ``n`` scheduled tokens (rows left out: zeros)."""
        if self.sched is None:
            return h[self.orig]
        return h.new_zeros(n, h.shape[-1]).index_copy_(0, self.sched, h[self.orig])


@dataclass
class GridRequests:
    """A forward's requests as the host's (non-causal, paged) attention sees them when a block-causal model prefills
    a prompt chunk: each grid block of a chunk is a request of its own, whose queries attend the keys up to its
    block's end, so the attention is block-causal over the cached prefix and the chunk alike (a chunk after cached
    pages included). Other requests stay one each."""

    req: np.ndarray   # [R] the forward's request of each attention request
    qsl: np.ndarray   # [R + 1] query start of each, in the forward's rows (int32)
    back: np.ndarray  # [R] positions between its last key and its request's last one (its sequence: seq_len - back)

    @classmethod
    def of(cls, qsl: np.ndarray, end: np.ndarray, chunk: np.ndarray, block: int) -> "GridRequests":
        """Requests of rows [qsl[i], qsl[i + 1]) ending at position ``end[i]``; ``chunk`` [n]: a prompt chunk, cut at
        multiples of ``block``."""
        req, start, back = [], [], []
        for i in range(len(end)):
            q0, q1, e = int(qsl[i]), int(qsl[i + 1]), int(end[i])
            p0 = e - (q1 - q0)  # the chunk's first position
            edges = [p0, *range((p0 // block + 1) * block, e, block), e] if chunk[i] else [p0, e]
            for a, b in zip(edges, edges[1:]):
                req.append(i), start.append(q0 + a - p0), back.append(e - b)
        return cls(np.array(req), np.array([*start, int(qsl[len(end)])], dtype=np.int32), np.array(back))


@dataclass
class StepContext:
    """One forward's plan (module doc); rows count in the extended batch when ``layout`` is set."""

    cached: CachedStep | None = None
    layout: RowLayout | None = None
    capture_rows: torch.Tensor | None = None   # [k] rows whose final hidden state is kept (Dream's shifted row)
    capture_slots: torch.Tensor | None = None  # [k] the request slot each one is kept for
    row_slots: torch.Tensor | None = None      # [N] request slot of each row (work; padding rows: the spare slot)
    work: torch.Tensor | None = None           # [slots + 1] the requests' token-layers (``ResponseSlots.token_layers``)
    grid: GridRequests | None = None  # a block-causal model's prompt chunks: one attention request per grid block
    attention: object = None  # the host's attention metadata of the layout's rows / the grid's requests
    packed: object = None  # a host that runs every position of its requests: its rows (``cache.host.PackedStep``)

    def run(self, layers, x: torch.Tensor, positions: torch.Tensor, full, ops=None) -> torch.Tensor:
        """Every layer over x [N, d]: the cached step where one is planned (``ops(layer)``: its ``LayerOps``), else
        ``full(layer, x)``; each row's full-layer runs added to ``work`` at ``row_slots`` (no sync)."""
        tally = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        if self.cached is not None:
            x = self.cached.run([layer if ops is None else ops(layer) for layer in layers], x, positions, tally)
        else:
            for layer in layers:
                x = full(layer, x)
            tally += len(layers)
        self.count(tally)
        return x

    def count(self, tally: torch.Tensor) -> None:
        """``tally`` [N] full-layer runs per row added to ``work`` at ``row_slots`` (no sync)."""
        if self.work is not None and self.row_slots is not None:
            self.work.index_add_(0, self.row_slots, tally[:self.row_slots.shape[0]])

    def keep(self, h: torch.Tensor, store: torch.Tensor) -> None:
        """The final hidden rows the step keeps: ``store[capture_slots] = h[capture_rows]``."""
        if self.capture_rows is not None:
            store[self.capture_slots] = h[self.capture_rows]
