"""The request lifecycle of a paged host engine (vLLM, SGLang), written once: every running request's canvas,
block cursor, sampler rows, policy state (``HostRequest``), features and work, one row per host request slot,
planned and stepped for the whole batch at once.

    slots = ResponseSlots(n_slots, width, mask_id, device)
    slots.admit(slot, SlotConfig.of(opts, plan), HostRequest(policy, prompt_len, stream), rid)
    slots.start(s, prefix, width)                 # a fresh all-mask canvas after ``prefix`` held positions
    slots.begin(s, valid)                         # rows whose block starts now: ``Sampler.begin_block``
    plans = slots.plan(s, prefix, width, shift)   # each row's ``HostPlan`` (no device read)
    ...                                           # the host's forward -> each row's block logits [m, Lb, V]
    done = slots.take(s, logits, valid)           # the denoise step; one device read -> [m] canvas done
    slots.release(slot)                           # its work kept by request id

``s`` are host slot indices (numpy [m]). Rows sharing a ``SlotConfig`` step as one sampler batch; a step reads
the device once (every group's ``done``, and for a sampler that moves its window the next step's ``focus``).
A block's first step is about the whole block (``Sampler.focus`` after ``begin_block``), so planning needs no
read. The host keeps the rows of its batch layout (extended rows, pool slots); the core decides the rest.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..cache.executor import PartStores
from ..cache.host import HostPlan, HostRequest
from ..sampling import Sampler, TokenContext
from .logprobs import Logprobs
from .request import DecodeOptions, ResponsePlan
from .step import SlotStates, denoise_step, stuck, stuck_error

WORK_KEPT = 4096  # finished requests whose work stays readable (``ResponseSlots.finished_work``)


@dataclass(frozen=True)
class SlotConfig:
    """What one request's sampler runs with: its block, steps per block and its decoding options with what the
    sampler does not read set to the defaults (``of``); requests with equal configs step as one batch."""

    block_length: int
    steps: int  # per block (fixed-schedule samplers: the request's total split over its blocks)
    decode: DecodeOptions

    @classmethod
    def of(cls, opts: DecodeOptions, plan: ResponsePlan, top_p: float | None = None,
           top_k: int | None = None) -> "SlotConfig":
        """A request's config from its options and response plan (``top_p`` / ``top_k``: a host's own)."""
        sampling = dataclasses.replace(opts, cache="none", block_length=None, steps=None, stream=None, chain=False,
                                       seed=0, top_p=opts.top_p if top_p is None else top_p,
                                       top_k=opts.top_k if top_k is None else top_k)
        return cls(plan.block_length, plan.steps_per_block, sampling)

    @property
    def sampler(self) -> Sampler:
        return self.decode.sampler


class ResponseSlots:
    """Per-slot response state of a paged host (module doc). ``canvas`` [S, W] lives on the device; the block
    cursor, the sampler's focus and the work counters on the host, read from the device once per step."""

    def __init__(self, n_slots: int, width: int, mask_id: int, device, eos_id: int | None = None,
                 pad_id: int = 0, seed: int = 0, layers: int = 0):
        self.mask_id, self.eos_id, self.pad_id, self.device, self.layers = mask_id, eos_id, pad_id, device, layers
        self.canvas = torch.full((n_slots, width), mask_id, dtype=torch.long, device=device)  # [S, W]
        self.block = np.zeros(n_slots, dtype=np.int64)      # block of the canvas in flight
        self.n_blocks = np.ones(n_slots, dtype=np.int64)
        self.new = np.zeros(n_slots, dtype=bool)            # the block begins at the next step
        self.focus = np.zeros((n_slots, 2), dtype=np.int64)  # the sampler's window of the next step, in the block
        self.changed = np.zeros(n_slots, dtype=np.int64)  # tokens of the block the last step changed (0: none)
        self.block_len = np.ones(n_slots, dtype=np.int64)  # each slot's block length
        self.group = np.full(n_slots, -1, dtype=np.int64)  # each slot's config, as an index into ``configs``
        self.configs: list[SlotConfig] = []
        self.config_ids: dict[SlotConfig, int] = {}
        self.config: list[SlotConfig | None] = [None] * n_slots
        self.host: list[HostRequest | None] = [None] * n_slots
        self.stores: list[PartStores | None] = [None] * n_slots
        self.rid: list[str | None] = [None] * n_slots
        self.states: dict[tuple, SlotStates] = {}
        self.runs: list[tuple[SlotStates, TokenContext]] = []  # per config id: its sampler rows and token context
        self.aranges: dict[int, torch.Tensor] = {}
        self._index: tuple[tuple, torch.Tensor] = ((), torch.zeros(0, dtype=torch.long, device=device))
        self._rows: tuple[tuple, slice | torch.Tensor] = ((), slice(0, 0))
        self._groups: tuple[tuple, list] = ((), [])  # the last batch's groups (cleared at admission)
        self.generator = torch.Generator(device).manual_seed(seed)  # the server's: requests without their own seed
        self.generators: list[torch.Generator | None] = [None] * n_slots  # a request's own seed's
        # work (the embedded engine's ``Counters`` units): rows x layers run through a full layer (device, summed
        # without a sync; + 1 row: a host's padding rows), forwards taken part in, what the uncached loop runs
        self.token_layers = torch.zeros(n_slots + 1, dtype=torch.long, device=device)
        self.forwards = np.zeros(n_slots, dtype=np.int64)
        self.full_token_layers = np.zeros(n_slots, dtype=np.int64)
        self.finished_work: OrderedDict[str, dict] = OrderedDict()  # the last WORK_KEPT finished, by request id
        # log-probabilities of the canvas positions of the slots whose request asks (``lp_k``: its top k; -1: none)
        self.lp_k = np.full(n_slots, -1, dtype=np.int64)
        self.logprobs: Logprobs | None = None

    @property
    def n_slots(self) -> int:
        return self.canvas.shape[0]

    def fit(self, n_slots: int, width: int) -> None:
        """At least ``n_slots`` rows of at least ``width`` columns (a host that learns its sizes late)."""
        S, W = self.canvas.shape
        if n_slots <= S and width <= W:
            return
        S2, W2, grow = max(S, n_slots), max(W, width), max(n_slots - S, 0)
        canvas = torch.full((S2, W2), self.mask_id, dtype=torch.long, device=self.device)
        canvas[:S, :W] = self.canvas
        self.canvas = canvas
        if grow:
            pad = lambda a, v=0: np.concatenate([a, np.full((grow, *a.shape[1:]), v, dtype=a.dtype)])
            self.block, self.n_blocks, self.new, self.focus, self.changed, self.block_len, self.group = (
                pad(self.block), pad(self.n_blocks, 1), pad(self.new), pad(self.focus), pad(self.changed),
                pad(self.block_len, 1), pad(self.group, -1))
            self.forwards, self.full_token_layers, self.lp_k = pad(self.forwards), pad(self.full_token_layers), \
                pad(self.lp_k, -1)
            self.token_layers = torch.cat([self.token_layers[:S], self.token_layers.new_zeros(grow + 1)])
            for lst in (self.config, self.host, self.stores, self.rid, self.generators):
                lst.extend([None] * grow)
        if self.logprobs is not None:
            self.logprobs = self.logprobs.resized(S2, W2, 0)

    # ---- admission -----------------------------------------------------------------------------------
    def admit(self, slot: int, config: SlotConfig, host: HostRequest, rid: str | None = None,
              stores: PartStores | None = None, seed: int | None = None, logprobs: int | None = None) -> None:
        """A new request in ``slot``: fresh sampler rows and work counters; ``seed``: its own generator (a sampled
        request then draws what the embedded engine draws for it alone with that seed), else the server's;
        ``logprobs``: its positions' log-probabilities and top ``logprobs`` alternatives are kept (``logprobs_of``)."""
        self.config[slot], self.host[slot], self.stores[slot], self.rid[slot] = config, host, stores, rid
        self.lp_k[slot] = -1 if logprobs is None else logprobs
        if logprobs is not None:
            self.logprobs = (self.logprobs or Logprobs.empty(0, 0, 0, self.device)).resized(*self.canvas.shape,
                                                                                            logprobs)
        self.generators[slot] = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        gid = self.config_ids.setdefault(config, len(self.configs))
        if gid == len(self.configs):
            self.configs.append(config)
            self.runs.append((self.sampler_states(config), self.token_context(config)))
        self.group[slot], self.block_len[slot], self._groups = gid, config.block_length, ((), [])
        self.token_layers[slot], self.forwards[slot], self.full_token_layers[slot] = 0, 0, 0
        for ss, _ in self.runs:  # every config's rows cover every slot
            ss.grow(self.n_slots)
        self.runs[gid][0].reset(torch.tensor([slot], device=self.device))

    def release(self, slot: int) -> None:
        """The request in ``slot`` ended: its work kept by request id (the last ``WORK_KEPT``); state freed."""
        if self.config[slot] is not None and self.rid[slot] is not None:
            self.finished_work[self.rid[slot]] = self.slot_work(slot)
            self.finished_work.move_to_end(self.rid[slot])
            while len(self.finished_work) > WORK_KEPT:
                self.finished_work.popitem(last=False)
        self.config[slot] = self.host[slot] = self.stores[slot] = self.rid[slot] = self.generators[slot] = None

    def slot_work(self, slot: int) -> dict[str, int]:
        return {"forwards": int(self.forwards[slot]), "token_layers": int(self.token_layers[slot]),
                "full_token_layers": int(self.full_token_layers[slot])}

    def all_work(self) -> dict[str, dict[str, int]]:
        """Every known request's work by request id: the last ``WORK_KEPT`` finished, and those in a slot (a host
        may release a slot a step after the request's last output: their counts are final by then)."""
        live = {rid: self.slot_work(slot) for slot, rid in enumerate(self.rid) if rid is not None}
        return {**self.finished_work, **live}

    def work(self, rid: str) -> dict[str, int] | None:
        """A request's work (``forwards``, ``token_layers``, ``full_token_layers``): in flight, or one of the
        last ``WORK_KEPT`` finished; None if unknown."""
        if rid in self.rid:
            return self.slot_work(self.rid.index(rid))
        return self.finished_work.get(rid)

    def ran_whole(self, row_slots: torch.Tensor) -> None:
        """A forward that ran each of its rows through every layer: each row counted for its slot (``row_slots`` [N];
        a host's padding rows: the spare slot ``n_slots``). No sync."""
        self.token_layers.index_add_(0, row_slots, torch.full_like(row_slots, self.layers))

    def count(self, slots: np.ndarray, full_token_layers: np.ndarray | int = 0) -> None:
        """One forward taken part in by each of ``slots`` (what the uncached loop runs in it: per slot)."""
        self.forwards[slots] += 1
        self.full_token_layers[slots] += full_token_layers

    # ---- the loop ------------------------------------------------------------------------------------
    def sampler_states(self, c: SlotConfig) -> SlotStates:
        """The sampler rows of ``c``'s sampler, block length and steps (configs that differ in proposal knobs only
        share them)."""
        key = (c.sampler, c.block_length, c.steps)
        ss = self.states.get(key)
        if ss is None:
            ss = self.states[key] = SlotStates(c.sampler, c.block_length, c.steps, self.device)
        ss.grow(self.n_slots)
        return ss

    def token_context(self, c: SlotConfig) -> TokenContext:
        """The token context of ``c``'s decoding options (built once per config, at its first admission)."""
        d = c.decode
        return TokenContext(self.mask_id, d.temperature, d.top_p, d.top_k, self.eos_id, d.eot_id, d.logits_eos_inf,
                            d.confidence_eos_eot_inf, self.generator)

    def groups(self, slots: np.ndarray, key: tuple | None = None) -> list[tuple[np.ndarray | None, int]]:
        """Positions in ``slots`` grouped by config (one sampler batch each): [(positions [k], config id)];
        positions None: all of ``slots`` (``key``: ``tuple(slots)``; the last batch's answer is kept)."""
        key = tuple(slots.tolist()) if key is None else key
        if key != self._groups[0]:
            g = self.group[slots]
            if len(set(g.tolist())) == 1:
                self._groups = (key, [(None, int(g[0]))])
            else:
                self._groups = (key, [(np.flatnonzero(g == c), int(c)) for c in np.unique(g)])
        return self._groups[1]

    def index(self, slots: np.ndarray, key: tuple | None = None) -> torch.Tensor:
        """``slots`` as a device index [m] (the last one kept: a host's batch repeats step after step)."""
        key = tuple(slots.tolist()) if key is None else key
        if key != self._index[0]:
            self._index = (key, torch.as_tensor(slots, dtype=torch.long, device=self.device))
        return self._index[1]

    def rows(self, slots: np.ndarray, key: tuple | None = None) -> slice | torch.Tensor:
        """``slots`` as canvas rows: a slice when they are consecutive (a view, no gather), else ``index``."""
        key = tuple(slots.tolist()) if key is None else key
        if key != self._rows[0]:
            run = key == tuple(range(key[0], key[0] + len(key))) if key else False
            self._rows = (key, slice(key[0], key[0] + len(key)) if run else self.index(slots, key))
        return self._rows[1]

    def start(self, slots: np.ndarray, prefix: np.ndarray, width: np.ndarray,
              tokens: torch.Tensor | None = None, block: int = 0) -> None:
        """A fresh all-mask canvas of ``width`` columns for each of ``slots``, after ``prefix`` held positions: the
        blocks covering it, or one block for a streamed request (it emits each block; the next canvas is the rest).
        ``tokens`` [k, t]: the canvas's first t columns as the host holds them (the rest: masks); ``block``: the block
        the loop starts at (a request a host re-admits with tokens it committed before)."""
        idx, W = self.index(slots), self.canvas.shape[1]
        last = self.canvas[idx].clone() if any(self.host[s].state is not None for s in slots.tolist()) else None
        if tokens is None:
            self.canvas[idx] = self.mask_id
        else:
            self.canvas[idx] = tokens if tokens.shape[1] == W else F.pad(tokens, (0, W - tokens.shape[1]),
                                                                         value=self.mask_id)
        self.block[slots], self.new[slots] = block, True
        if self.logprobs is not None:
            self.logprobs.token[idx] = 0.0
        stream = np.array([self.host[s].stream for s in slots.tolist()], dtype=bool)
        self.n_blocks[slots] = np.where(stream, 1, -(-np.asarray(width) // self.block_len[slots]))
        for i, (s, p) in enumerate(zip(slots.tolist(), np.broadcast_to(prefix, slots.shape).tolist())):
            self.host[s].begin_canvas(p, None if last is None else last[i])

    def begin(self, slots: np.ndarray, valid: np.ndarray | None = None) -> None:
        """``Sampler.begin_block`` for the rows of ``slots`` whose block starts at this step (``valid``: the canvas
        columns that exist; positions past it are not decoded)."""
        fresh = self.new[slots]
        if True not in fresh.tolist():  # (a numpy reduction costs more than the list on a host's small batch)
            return
        new = slots[fresh]
        v = None if valid is None else np.asarray(valid)[fresh]
        for pos, gid in self.groups(new):
            s, c = (new if pos is None else new[pos]), self.configs[gid]
            key = tuple(s.tolist())
            rows, cols = self._blocks(s, c.block_length, v is not None, key)
            masked = self._read(rows, cols) == self.mask_id  # [k, Lb]
            if v is not None:
                masked &= cols < torch.as_tensor(v if pos is None else v[pos], device=self.device)[:, None]
            self.runs[gid][0].begin_block(self.index(s, key), masked, key)
            self.focus[s] = (0, c.block_length)  # a block's first step is about all of it
            for h in (self.host[x] for x in s.tolist()):
                h.begin_block()
        self.new[new] = False

    def plan(self, slots: np.ndarray, prefix: np.ndarray, width: np.ndarray, shift: int) -> list[HostPlan]:
        """Each row's ``HostPlan`` of this step (its canvas: positions [prefix, prefix + width) of the sequence),
        from its block and the sampler's focus; the policies' step counters move on."""
        start = np.asarray(prefix) + self.block_columns(slots)
        return [self.host[s].plan(a, (lo, hi), shift, p, w, n, self.canvas[s, :w], b) for s, a, (lo, hi), p, w, n, b in
                zip(slots.tolist(), start.tolist(), self.focus[slots].tolist(), np.broadcast_to(prefix, slots.shape)
                    .tolist(), np.broadcast_to(width, slots.shape).tolist(), self.changed[slots].tolist(),
                    self.block_len[slots].tolist())]

    def block_columns(self, slots: np.ndarray) -> np.ndarray:
        """The canvas column where each row's block begins: [m]."""
        return self.block[slots] * self.block_len[slots]

    def take(self, slots: np.ndarray, logits: torch.Tensor, valid: np.ndarray | None = None) -> np.ndarray:
        """One denoise step of each row's block: ``logits`` [m, Lb, V] (row i: slot ``slots[i]``'s block);
        commits written into the canvas (``changed``: the block's tokens the step changed); finished blocks move
        on. -> [m] bool: the row's canvas is decoded.
        ``valid``: canvas columns that exist (positions past it are padding, never decoded). One device read."""
        read, parts, batch = [], [], tuple(slots.tolist())
        for pos, gid in self.groups(slots, batch):
            s, c, (ss, tc) = (slots if pos is None else slots[pos]), self.configs[gid], self.runs[gid]
            key = batch if pos is None else tuple(s.tolist())
            rows, cols = self._blocks(s, c.block_length, valid is not None, key)
            x0 = self._read(rows, cols)  # [k, Lb] (a view of the canvas where it can be)
            if valid is not None:
                v = np.asarray(valid) if pos is None else np.asarray(valid)[pos]
                x0 = torch.where(cols < torch.as_tensor(v, device=self.device)[:, None], x0, self.pad_id)
            idx = self.index(s, key)
            st = ss.gather(idx, key)
            lg = logits if pos is None else logits[torch.as_tensor(pos, device=logits.device)]
            own = [self.generators[x] for x in s.tolist()]
            if any(g is not None for g in own):  # requests with their own seed: each row its own stream
                tc = dataclasses.replace(tc, generator=tuple(g or self.generator for g in own))
            x, done = denoise_step(c.sampler, st, lg, x0, tc, self._window(s, c), check=False)
            ss.scatter(idx, st, key)
            self._record(s, idx, rows, cols, c.block_length, lg, x0, x)
            read += [done, (x != x0).sum(-1)]  # before the write: x0 may be a view of the canvas
            self._write(rows, cols, x)
            bad = stuck(c.sampler, st, lambda: x == self.mask_id)
            read += [*(c.sampler.focus(st) if c.sampler.moves_focus else ()), *(() if bad is None else (bad,))]
            parts.append((slice(None) if pos is None else pos, s, c, bad is not None))
        flat = torch.cat(read).numpy(force=True) if read else np.zeros(0, dtype=np.int64)  # the one device read
        done_canvas = np.zeros(len(slots), dtype=bool)
        at = 0
        for pos, s, c, checked in parts:
            k = len(s)
            done, self.changed[s] = flat[at:at + k] != 0, flat[at + k:at + 2 * k]
            at += 2 * k
            if c.sampler.moves_focus:
                self.focus[s, 0], self.focus[s, 1] = flat[at:at + k], flat[at + k:at + 2 * k]
                at += 2 * k
            if checked:
                if flat[at:at + k].any():
                    raise stuck_error(c.sampler, c.block_length)
                at += k
            self.block[s[done]] += 1
            self.new[s] = done
            done_canvas[pos] = self.block[s] >= self.n_blocks[s]
        return done_canvas

    def _record(self, s: np.ndarray, idx: torch.Tensor, rows, cols, L: int, lg, x0, x) -> None:
        """The step's log-probabilities for the rows whose request asks (``engine.logprobs``; before the canvas is
        written: ``x0`` may be a view of it)."""
        want = self.lp_k[s] >= 0
        if not want.any():
            return
        if isinstance(cols, slice):
            cols = torch.arange(cols.start, cols.stop, device=self.device).expand(len(s), L)
        w = None if want.all() else torch.as_tensor(np.flatnonzero(want), device=self.device)
        pick = (lambda t: t) if w is None else (lambda t: t[w])
        self.logprobs.record_at(pick(idx), pick(cols), pick(lg), pick(x0), pick(x))

    def logprobs_of(self, slot: int, cols: slice) -> Logprobs:
        """The log-probabilities of slot ``slot``'s canvas columns ``cols``, with its request's top k (``admit``)."""
        lp, k = self.logprobs, int(self.lp_k[slot])
        return Logprobs(lp.token[slot, cols], lp.top[slot, cols, :k], lp.top_ids[slot, cols, :k], lp.rank[slot, cols])

    def _blocks(self, slots: np.ndarray, L: int, columns: bool = False,
                key: tuple | None = None) -> tuple[slice | torch.Tensor, slice | torch.Tensor]:
        """(canvas rows: ``rows``, canvas columns of each row's block: a slice when every row is in the same block
        and ``columns`` is not asked for, else [k, L] with the rows as an index [k])."""
        b = self.block[slots].tolist()
        if not columns and b.count(b[0]) == len(b):
            return self.rows(slots, key), slice(b[0] * L, (b[0] + 1) * L)
        return (self.index(slots, key),
                torch.as_tensor(self.block[slots] * L, device=self.device)[:, None] + self._arange(L))

    def _read(self, rows: slice | torch.Tensor, cols: slice | torch.Tensor) -> torch.Tensor:
        return self.canvas[rows, cols] if isinstance(cols, slice) else self.canvas[rows[:, None], cols]

    def _write(self, rows: slice | torch.Tensor, cols: slice | torch.Tensor, x: torch.Tensor) -> None:
        if isinstance(cols, slice):
            self.canvas[rows, cols] = x
        else:
            self.canvas[rows[:, None], cols] = x

    def _arange(self, L: int) -> torch.Tensor:
        a = self.aranges.get(L)
        if a is None:
            a = self.aranges[L] = torch.arange(L, device=self.device)
        return a

    def _window(self, slots: np.ndarray, c: SlotConfig) -> tuple[int, int]:
        """The union of the rows' focus windows (host ints: the whole block unless the sampler moves its window)."""
        if not c.sampler.moves_focus:
            return 0, c.block_length
        f = self.focus[slots]
        return int(f[:, 0].min()), int(f[:, 1].max())
