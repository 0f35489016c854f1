"""The lifecycle of a host that runs each canvas as draft rows after a request's held sequence (vLLM's diffusion
pathway), written once: prefill -> denoise steps over the canvas (the host rolls them back) -> a commit step (emits
the canvas, or its first block when streaming) -> the next canvas. The host classifies its batch's rows (canvas or
prefill chunk) and supplies its rows, paged slots and token ids; the core plans each step (``plan`` ->
``StepContext``, kept as ``context`` for the model) and samples it (``sample``) on ``ResponseSlots``.

    lc = CanvasLifecycle(served, n_slots, mask_id, device, ...)
    lc.add(slot, opts, max_tokens, prompt_len, rid, seed)     # admission (the request's options built by the host)
    ctx = lc.plan(slots, q0, qlen, prefix, canvas, prefilled, whole_prompt)   # before the forward: lc.context
    out = lc.sample(slots, nlog, cu, prefilled, logits, head)  # after it: what each row emits / rolls back
    lc.remove(slot)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..cache import CanvasCache, HostRequest, host_cache
from ..cache.executor import CachedStep, PartStores
from .context import GridRequests, RowLayout, StepContext, as_rows
from .generate import grid_canvas_width
from .host_options import Served
from .logprobs import Logprobs
from .request import DecodeOptions
from .slots import ResponseSlots, SlotConfig

PREFILL, DENOISE, COMMIT = 0, 1, 2


@dataclass
class Sampled:
    """One step's outcome per row of the host's batch: ``emit`` the rows that emit (a commit step), ``tokens``
    [k, W] / ``n`` [k] what they emit (``logprobs``: theirs, with the largest top k asked); ``rejected`` [n] the
    rows' logits the host rolls back; ``touched`` the slots whose canvas the host's draft rows take next
    (``CanvasLifecycle.scheduled``)."""

    emit: np.ndarray
    tokens: torch.Tensor | None
    n: np.ndarray
    rejected: np.ndarray
    touched: np.ndarray
    logprobs: Logprobs | None = None  # [k, W] of the emitted tokens, when an emitting request asks


class CanvasLifecycle:
    """The per-slot lifecycle of the module doc over the core's ``ResponseSlots``: each slot's phase, the canvas
    column of its first scheduled position (``offset``), what it holds and has left to decode, whether it streams,
    and Dream's kept final hidden row (``last_hidden``)."""

    def __init__(self, served: Served, n_slots: int, mask_id: int | None, device, eos_id: int | None = None,
                 pad_id: int | None = None, block_causal: int = 0, shift: int = 0, feature_shape=(0, 0),
                 dim: int = 0, dtype=torch.float32):
        if mask_id is None:
            raise ValueError("config.json: mask_token_id is required to serve a masked diffusion model")
        self.served, self.canvas_len, self.block_causal = served, served.canvas_length, block_causal
        self.shift = shift  # Dream: position i is predicted by logit row i - 1
        self.n_slots, self.device, self.feature_shape, self.dim = n_slots, device, feature_shape, dim
        pad = pad_id if pad_id is not None else eos_id or 0
        self.slots = ResponseSlots(n_slots, self.canvas_len, mask_id, device, eos_id, pad, served.defaults.seed,
                                   feature_shape[0])
        self.phase = np.zeros(n_slots, dtype=np.int8)
        self.offset = np.zeros(n_slots, dtype=np.int64)  # canvas column of the first scheduled position
        self.held = np.zeros(n_slots, dtype=np.int64)  # prompt + emitted tokens
        self.response_left = np.zeros(n_slots, dtype=np.int64)  # positions to decode not emitted yet
        self.stream = np.zeros(n_slots, dtype=bool)  # emit each block when decoded
        self.last_hidden = torch.zeros(n_slots, dim, dtype=dtype, device=device)
        self.token_ids: torch.Tensor | None = None  # the host's [n_slots, max_len] prompt + output ids
        self.context: StepContext | None = None  # the next forward's plan (None: a host's dummy run)

    def bind_tokens(self, token_ids: torch.Tensor) -> None:
        """The host's [n_slots, max_len] prompt + output ids (read for prompt tails and refreshed prefix rows)."""
        self.token_ids = token_ids

    def no_plan(self) -> None:
        """The next forward is not the core's (a host's dummy run or graph capture): every row runs plainly."""
        self.context = None

    # ---- admission -------------------------------------------------------------------------------------
    def add(self, slot: int, opts: DecodeOptions, max_tokens: int | None, prompt_len: int, rid: str | None = None,
            seed: int | None = None, top_p: float | None = None, top_k: int | None = None,
            logprobs: int | None = None) -> None:
        """A new request in ``slot``: its response plan by the served rules, its policy (a block-causal model: the
        canvas schedule, every policy exact on one path); ``logprobs``: its tokens' and top k (``Sampled``)."""
        plan = self.served.plan(opts, max_tokens)
        cache = CanvasCache() if self.block_causal else host_cache(opts.cache)
        self.stream[slot] = stream = self.served.streams(opts, cache, plan)
        self.phase[slot], self.held[slot], self.response_left[slot] = PREFILL, prompt_len, plan.decoded
        self.slots.admit(slot, SlotConfig.of(opts, plan, top_p, top_k),
                         HostRequest(cache, prompt_len, stream, self.device), rid,
                         PartStores(*self.feature_shape, self.dim, self.last_hidden), seed, logprobs)

    def remove(self, slot: int) -> None:
        self.slots.release(slot)
        self.phase[slot] = PREFILL

    def known(self, slots: np.ndarray) -> np.ndarray:
        """[n] bool: the slots hold a request (a host's dummy runs have none)."""
        return np.array([self.slots.config[s] is not None for s in slots.tolist()], dtype=bool)

    # ---- canvases --------------------------------------------------------------------------------------
    def canvas_width(self, slot: int) -> int:
        """Width of the slot's next canvas: the served length cut at the response, or for a block-causal model
        the rest of the grid block (decoded whole, cut when emitted)."""
        if self.block_causal:
            return grid_canvas_width(int(self.held[slot]), self.block_causal)
        return int(min(self.canvas_len, max(self.response_left[slot], 1)))

    def scheduled(self, slots: np.ndarray) -> torch.Tensor:
        """The canvases of ``slots`` from their first scheduled position: [m, canvas_len] (a block-causal
        canvas holds its grid block's prompt tail in the columns before ``offset``; later columns repeat)."""
        return self.slots.canvas[as_rows(slots, self.device)].gather(1, self._columns(slots))

    def _columns(self, slots: np.ndarray) -> torch.Tensor:
        """[m, canvas_len] the canvas columns from each slot's first scheduled position (later ones repeat)."""
        off = torch.as_tensor(self.offset[slots], device=self.device)
        return (off[:, None] + torch.arange(self.canvas_len, device=self.device)).clamp(max=self.canvas_len - 1)

    def start_canvas(self, slots: np.ndarray) -> None:
        """A fresh all-mask canvas for ``slots`` (after their prefill or commit): one block when streaming, else
        the blocks of its width (a block-causal canvas: its grid block's prompt tail first, from the host's ids)."""
        width = np.array([self.canvas_width(s) for s in slots.tolist()], dtype=np.int64)
        self.phase[slots] = DENOISE
        self.slots.start(slots, self.held[slots], width)
        if self.block_causal:
            self.offset[slots] = tail = self.canvas_len - width
            for s, t in zip(slots.tolist(), tail.tolist()):
                if t:
                    self.slots.canvas[s, :t] = self.token_ids[s, self.held[s] - t:self.held[s]]

    # ---- the step's plan -------------------------------------------------------------------------------
    def plan(self, slots: np.ndarray, q0: np.ndarray, qlen: np.ndarray, prefix: np.ndarray, canvas: np.ndarray,
             prefilled: np.ndarray, whole_prompt: np.ndarray) -> StepContext:
        """The plan (``context``) of a host forward whose row i runs ``qlen[i]`` scheduled positions of slot
        ``slots[i]`` from row ``q0[i]``, after ``prefix[i]`` held ones: ``canvas`` rows are a canvas (draft rows),
        the others a prompt chunk (``prefilled``: the prompt's last; ``whole_prompt``: all of it in one chunk)."""
        core, n = self.slots, len(slots)
        known = self.known(slots)
        canvas, prefilled = known & canvas, known & prefilled
        denoise, commit = canvas & (self.phase[slots] == DENOISE), canvas & (self.phase[slots] == COMMIT)
        core.begin(slots[denoise], self.offset[slots[denoise]] + qlen[denoise])
        hosts = [core.host[s] if k else None for s, k in zip(slots.tolist(), known)]
        refresh = np.array([h is not None and h.policy.refreshes_prefix for h in hosts], dtype=bool)
        # canvases the policies run cached: whole blocks (a policy that refreshes the prefix: its canvases shrink
        # with max_tokens and streaming), the served width (block canvas); others (cut short) run exact
        lb = np.array([core.config[s].block_length if k else 1 for s, k in zip(slots.tolist(), known)])
        whole = np.where(refresh, qlen % lb == 0, qlen == self.canvas_len)
        rows = np.flatnonzero(denoise & whole)
        plans = dict(zip(rows.tolist(), core.plan(slots[rows], prefix[rows], qlen[rows], self.shift)))
        for i in np.flatnonzero(commit & whole):  # emitted as is (a refreshing policy's next step refreshes it)
            if (hp := hosts[i].commit_plan(int(prefix[i]), int(qlen[i]))) is not None:
                plans[i] = hp
        extra, drop = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for i, hp in plans.items():
            extra[i] = prefix[i] - hp.run_from
            drop[i] = 0 if hp.keep is None else prefix[i] + qlen[i] - len(hp.keep)
        if self.block_causal:  # the canvas's grid block begins with the prompt tail: recomputed beside it
            extra[canvas] = self.offset[slots[canvas]]
        ctx = StepContext(work=core.token_layers)
        if extra.any() or drop.any():
            ctx.layout = RowLayout.of(q0, qlen, prefix, extra, drop, {i: hp.keep for i, hp in plans.items()},
                                      lambda i, pos: self.token_ids[slots[i], pos], self.device)
        # request starts in the forward's rows [n + 1]
        start = ctx.layout.qsl if ctx.layout is not None else np.append(q0, q0[-1] + qlen[-1])
        if self.block_causal and (known & ~canvas).any():  # prompt chunks (after cached pages too): block-causal
            ctx.grid = GridRequests.of(start, prefix + qlen, known & ~canvas, self.block_causal)
        if self.shift:  # Dream: the last prefix row predicts the first canvas position
            cap = np.flatnonzero(prefilled | (commit & ~refresh) | (extra > 0))
            if len(cap):
                last = start[cap] + np.where(extra[cap] > 0, extra[cap], qlen[cap]) - 1
                ctx.capture_rows = as_rows(last, self.device)
                ctx.capture_slots = as_rows(slots[cap], self.device)
        regions = [r for i, hp in plans.items()  # position p of request i at row start[i] + p - run_from
                   for r in hp.regions(int(start[i]) - hp.run_from, core.stores[slots[i]], self.device)]
        for i in np.flatnonzero(prefilled & whole_prompt):  # a whole prompt prefill
            if (hp := hosts[i].prefill_plan(int(qlen[i]))) is not None:
                regions += hp.regions(int(start[i]), core.stores[slots[i]], self.device)
        if regions:
            ctx.cached = CachedStep(regions, core.generator)
        # work: each row's slot (the forward sums its full-layer runs into it) and, for denoise steps, what the
        # vanilla loop would run (the whole sequence in every layer)
        ctx.row_slots = as_rows(np.repeat(np.where(known, slots, self.n_slots), qlen + extra - drop), self.device)
        core.count(slots[known], np.where(denoise, (prefix + qlen) * core.layers, 0)[known])
        self.context = ctx
        return ctx

    # ---- the step's outcome ----------------------------------------------------------------------------
    def sample(self, slots: np.ndarray, nlog: np.ndarray, cu: np.ndarray, prefilled: np.ndarray,
               logits: torch.Tensor, head) -> Sampled:
        """After the forward (``nlog[i]`` logits rows of row i from ``cu[i]``; ``prefilled``: its prompt's last
        chunk): a denoise step runs the core's step on its block and emits nothing; a commit step emits the canvas
        (or its first block when streaming); a finished prefill or commit gets a fresh canvas. ``head(h)``: the
        model's logits of kept final hidden rows (Dream's first canvas position)."""
        known = self.known(slots)
        prefilled = known & (nlog == 0) & prefilled
        commit = known & (nlog > 0) & (self.phase[slots] == COMMIT)
        denoise = known & (nlog > 0) & (self.phase[slots] == DENOISE)
        rejected = np.where(denoise, nlog, 0)  # a denoise step keeps nothing; a commit keeps what it emits
        emit = np.flatnonzero(commit)
        n_emit = self.emitted(slots[emit], nlog[emit])
        rejected[emit] = nlog[emit] - n_emit
        tokens = lp = None
        if len(emit):
            keep = torch.arange(self.canvas_len, device=self.device) < as_rows(n_emit, self.device)[:, None]
            tokens = torch.where(keep, self.scheduled(slots[emit]), 0)  # [k, W]
            k = int(self.slots.lp_k[slots[emit]].max())
            if k >= 0:  # read before a fresh canvas clears them
                lp = self.slots.logprobs.take(as_rows(slots[emit], self.device), self._columns(slots[emit]), k)
        if denoise.any():
            rows = np.flatnonzero(denoise)
            self.phase[slots[rows]] = np.where(self._denoise(slots[rows], nlog[rows], cu[rows], logits, head),
                                               COMMIT, DENOISE)
        fresh = slots[prefilled | commit]
        if len(fresh):
            self.start_canvas(fresh)
        return Sampled(emit, tokens, n_emit, rejected, slots[prefilled | commit | denoise], lp)

    def emitted(self, slots: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Tokens each commit emits (the canvas, or its first block when streaming), counted as held."""
        n = np.where(self.stream[slots], np.minimum(self.slots.block_len[slots], valid), valid)
        self.held[slots] += n
        self.response_left[slots] -= n
        return n

    def _denoise(self, sl: np.ndarray, valid: np.ndarray, cu: np.ndarray, logits: torch.Tensor, head) -> np.ndarray:
        """The core's step of each request's block (one batched sampler call per configuration, one device read)
        from its logits rows -> [m] the canvas is done."""
        core = self.slots
        Lb = core.block_len[sl]
        if (Lb != Lb[0]).any():  # blocks of different lengths: one take each
            done = np.zeros(len(sl), dtype=bool)
            for b in np.unique(Lb):
                done[Lb == b] = self._denoise(sl[Lb == b], valid[Lb == b], cu[Lb == b], logits, head)
            return done
        shift, off = self.shift, self.offset[sl]
        cols = core.block_columns(sl)[:, None] + np.arange(Lb[0]) - shift  # [m, Lb] the column each logit row is of
        src = as_rows(cu[:, None] + np.clip(np.minimum(cols - off[:, None], valid[:, None] - 1), 0, None),
                      self.device)  # a block-causal prompt tail: never decoded
        lg = logits[src].float()  # [m, Lb, V]
        if shift and (cols[:, 0] < 0).any():  # Dream: the first canvas position from the last held row
            first = np.flatnonzero(cols[:, 0] < 0)
            lg[first, 0] = head(self.last_hidden[as_rows(sl[first], self.device)]).float()
        return core.take(sl, lg, off + valid)
