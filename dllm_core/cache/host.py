"""The host contract: what a paged host engine (vLLM, SGLang) asks the core at each step of a request, and what
the core answers. The host supplies positions and storage; the cache policy decides what is recomputed.

    req = HostRequest(policy, prompt_len, stream)       # admission (``engine.slots.ResponseSlots.admit``)
    req.begin_canvas(prefix)                             # a canvas starts after ``prefix`` held positions
    req.begin_block()                                    # a block of the canvas starts
    plan = req.plan(start, focus, shift, prefix, width)  # before the forward (``ResponseSlots.plan``)
    ...                                                  # the host runs ``plan`` (rows, parts, stores)

A ``HostPlan`` names the step's live positions and how each layer treats them (positions are the request's
sequence: prompt, emitted tokens, then the canvas):

* positions ``< run_from`` are not run: their K/V are the ones the host holds (paged cache, stored features);
* live positions ``[run_from, prefix + width)`` are run; those in no ``HostPart`` are recomputed in every layer;
* a ``HostPart`` is a range of positions with its own feature store (``name``: ``prompt`` or ``response``; no
  name: nothing is kept and nothing stale is read - a forward whose rows the next step recomputes anyway),
  whose features (K, V, attention and FFN outputs) the host keeps between steps: per layer the part recomputes
  ``always`` and, where ``schedule(layer)`` says so, every position (``full``) or the V-verify pick (``verify``,
  by ``reuse``); other positions reuse the stored features. Every part's features are stored back;
* a ``probe`` (``executor.LayerProbe``: Elastic-Cache's drift test) is called after each layer with the request's
  layer inputs and keys; it may have the layer run again over every position and moves what ``schedule`` says;
* ``keep`` (DPad's suffix dropout): the positions the forward sees, ascending; the others are neither queries nor
  keys. Run from, parts and columns then count kept positions (position p is kept position ``compact(p)``): the
  host runs the kept positions as a compact sequence (their RoPE positions their own; vLLM: the kept rows take the
  paged slots of the first ones; ``PackedStep``: only the kept rows).

No host asks which policy it runs: it translates the plan into its own rows and slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

Schedule = Callable[[int], tuple[bool, bool]]  # layer -> (every position recomputed, V-verify pick runs)


@dataclass(frozen=True)
class HostStep:
    """Where one request's step is: its block starts at sequence position ``start``; ``focus`` is the sampler's
    window in the block; ``shift`` 1 when position i is predicted by row i - 1 (Dream); the host holds
    ``prefix`` positions before the canvas of ``width`` positions; ``prompt``: the current generation's
    prompt part (the request's prompt, or everything before a canvas decoded as a generation of its own);
    ``tokens`` [width]: the canvas's tokens now (on the device; None where the host does not say); ``block``: the
    block's length (0 where the host does not say)."""

    start: int
    focus: tuple[int, int]
    shift: int
    prefix: int
    width: int
    prompt: int
    tokens: torch.Tensor | None = field(default=None, compare=False)
    block: int = 0

    @property
    def fresh(self) -> tuple[int, int]:
        """The positions the step is about (the embedded loop's ``fresh`` range): [lo, hi)."""
        return self.start + self.focus[0] - self.shift, self.start + self.focus[1]

    @property
    def end(self) -> int:
        return self.prefix + self.width


@dataclass
class HostPart:
    """A range [start, end) of a request's positions with its own feature store ``name`` (see the module doc)."""

    name: str
    start: int
    end: int
    always: tuple[int, int] = (0, 0)   # part columns recomputed in every layer
    schedule: Schedule | None = None   # per layer: (full, verify)
    reuse: object | None = None        # a FeatureReuse: the V-verify pick of ``verify`` layers

    @property
    def length(self) -> int:
        return self.end - self.start

    def scheduled(self, layer: int) -> tuple[bool, bool]:
        """(every position recomputed, V-verify pick runs) in ``layer`` by the schedule alone."""
        return self.schedule(layer) if self.schedule is not None else (False, False)

    def recomputes(self, layer: int) -> bool:
        """Whether ``layer`` recomputes any position of the part (besides a V-verify pick): host values, no read."""
        return self.scheduled(layer)[0] or self.always[1] > self.always[0]

    def layer(self, layer: int, device) -> tuple[torch.Tensor, bool, int]:
        """The part's plan in ``layer``, as the executor's ``Region.plan`` wants it: ([1, n] bool, verify, at most
        the positions it recomputes besides the pick)."""
        full, verify = self.scheduled(layer)
        rec = torch.full((1, self.length), full, dtype=torch.bool, device=device)
        if full:
            return rec, False, self.length
        lo, hi = self.always
        if hi > lo:
            rec[:, lo:hi] = True
        return rec, verify, max(hi - lo, 0)


@dataclass
class HostPlan:
    """One request's step on a host: live positions from ``run_from`` and the cached ``parts``; ``probe``: the
    policy's test after each layer (``executor.LayerProbe``: parts covering [0, end) in order, every position live);
    ``keep`` [n]: the positions the forward sees, ascending (None: every one; positions and parts then count kept
    positions, see the module doc)."""

    run_from: int
    parts: list[HostPart] = field(default_factory=list)
    probe: object | None = field(default=None, compare=False)
    keep: np.ndarray | None = field(default=None, compare=False)

    def compact(self, p: int) -> int:
        """Position ``p`` counted in kept positions (those before it)."""
        return p if self.keep is None else int(np.searchsorted(self.keep, p))

    def regions(self, base_row: int, stores, device, parts: list[HostPart] | None = None) -> list:
        """The executor's ``Region``s of ``parts`` (default: the plan's): position p at the forward's row
        ``base_row + p``, each part's features in ``stores.get(name, length)`` (a ``PartStores``)."""
        from .executor import Region

        return [Region(torch.arange(base_row + p.start, base_row + p.end, device=device)[None],
                       torch.zeros(1, dtype=torch.long, device=device), stores.get(p.name, p.length), p.reuse,
                       lambda layer, p=p: p.layer(layer, device), self.probe)
                for p in (self.parts if parts is None else parts)]

    def cover(self, name: str, start: int, end: int) -> HostPart:
        """The part ``name`` over [start, end) for a host that runs every position and keeps every position's
        features: the plan's own part of that name, else the contract's rule for positions in no part (live
        ones, from ``run_from``, recomputed in every layer; held ones reused)."""
        for p in self.parts:
            if p.name == name:
                if (p.start, p.end) != (start, end):
                    raise ValueError(f"host plan: part {name} covers [{p.start}, {p.end}), the host holds "
                                     f"[{start}, {end})")
                return p
        return HostPart(name, start, end, always=(min(max(self.run_from - start, 0), end - start), end - start))


@dataclass
class HostRequest:
    """The core's per-request policy state on a host (``engine.slots.ResponseSlots`` keeps one per slot): the
    policy's refresh key / age (Fast-dLLM), the step counters (the generation's, the block's, the canvas's:
    dLLM-Cache and the canvas schedule) and the generation's prompt part. ``stream``: the whole response is one generation (canvases after the first continue it);
    otherwise each canvas is a generation of its own (prompt = everything before it)."""

    policy: object
    prompt_len: int
    stream: bool = False
    device: object = "cpu"
    key: torch.Tensor = field(default_factory=lambda: torch.full((1, 2), -1, dtype=torch.long))
    age: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.long))
    steps: int = 0          # denoise steps of the generation
    block_steps: int = 0    # ... of the block
    canvas_steps: int = 0   # ... of the canvas
    gen_prompt: int = 0     # the generation's prompt part
    canvases: int = 0
    changed: int = 0        # tokens the request's last step changed (``plan``'s ``changed``)
    since: list[int] = field(default_factory=lambda: [0, 0])  # tokens changed since the prompt's / response's refresh
    state: object = field(default=None, repr=False, compare=False)  # a policy's own per-request state (Elastic)
    _reuse: object = field(default=None, repr=False, compare=False)

    def reuse(self, policy):
        """``policy``'s V-verify pick with this request's own generator (seeded like the embedded state's)."""
        if self._reuse is None or self._reuse.policy is not policy:
            from .executor import SeededReuse

            self._reuse = SeededReuse(policy, self.device)
        return self._reuse

    def begin_canvas(self, prefix: int, last: torch.Tensor | None = None) -> None:
        """A canvas starts after ``prefix`` held positions; ``last`` [W]: the previous canvas's final tokens, from its
        first column (a policy state that follows tokens reads them: ``canvas_done``)."""
        if last is not None and hasattr(self.state, "canvas_done"):
            self.state.canvas_done(last)
        if not (self.stream and self.canvases):
            self.gen_prompt, self.steps = (self.prompt_len if self.stream else prefix), 0
        self.canvases += 1
        self.canvas_steps = 0

    def begin_block(self) -> None:
        self.block_steps = 0

    def plan(self, start: int, focus: tuple[int, int], shift: int, prefix: int, width: int,
             changed: int = 0, tokens: torch.Tensor | None = None, block: int = 0) -> HostPlan:
        """The policy's plan of this request's next denoise step, ``changed``: tokens its previous step changed (the
        counters then move on); ``tokens`` [width]: the canvas now; ``block``: the block's length."""
        self.changed = changed
        plan = self.policy.host_plan(self, HostStep(start, focus, shift, prefix, width, self.gen_prompt, tokens,
                                                    block))
        self.steps, self.block_steps, self.canvas_steps = self.steps + 1, self.block_steps + 1, self.canvas_steps + 1
        return plan

    def commit_plan(self, prefix: int, width: int) -> HostPlan | None:
        """The forward that emits a finished canvas: a policy that refreshes the prefix runs no layer there (its
        next step recomputes those positions); None: the host runs it whole (its K/V are kept)."""
        return HostPlan(prefix, [HostPart("", prefix, prefix + width)]) if self.policy.refreshes_prefix else None

    def prefill_plan(self, length: int) -> HostPlan | None:
        """The prompt prefill (positions [0, length)): no layer run under a policy that refreshes the prefix (the
        first step recomputes it); None: the host runs it whole."""
        return HostPlan(0, [HostPart("", 0, length)]) if self.policy.refreshes_prefix else None


class PackedStep:
    """The step of a host that runs every position of its requests, laid out back to back in one forward's rows
    (request i: its whole sequence [0, ends[i]) - or the positions its plan keeps - at rows [off[i], off[i + 1])),
    through the executor with the parts each request's plan names (``parts``: (name, start, end) per request in
    positions, ``HostPlan.cover``) and the core's ``PackedAttention``. ``kept`` [N]: each row's index in the requests'
    whole sequences concatenated (None: every position is a row). ``tally`` [N] counts each row's full-layer runs
    (work, summed without a sync). ``buckets`` (a host that captures a graph per shape): the rows padded to the
    bucket set {16, 32, 64, ...} (``pad`` rows after the requests', run through every layer as requests of at most
    the longest's keys, their work not counted), and the attention's requests and keys too (``PackedAttention``)."""

    def __init__(self, plans: list[HostPlan], ends: list[int], parts: list[list[tuple[str, int, int]]], stores: list,
                 device, buckets: bool = False):
        from ..models.layers import PackedAttention
        from .executor import CachedStep, bucket

        seen = [np.arange(e) if p.keep is None else p.keep for p, e in zip(plans, ends)]  # each request's positions
        self.plans, self.ends, self.lengths, self.device = plans, ends, [len(k) for k in seen], device
        self.off = [0, *np.cumsum(self.lengths).tolist()]
        self.pad = bucket(self.off[-1], 1 << 62) - self.off[-1] if buckets else 0
        self.pos = torch.as_tensor(np.concatenate([*seen, np.arange(self.pad)]), device=device)  # [N (+ pad)]
        self.kept = None if all(p.keep is None for p in plans) else torch.as_tensor(  # offsets in the whole sequences
            np.concatenate([o + k for o, k in zip(np.cumsum([0, *ends[:-1]]).tolist(), seen)]), device=device)
        self.parts = [[p.cover(n, p.compact(a), p.compact(b)) for n, a, b in names] for p, names in zip(plans, parts)]
        self.regions = [p.regions(o, st, device, parts) for p, o, st, parts in zip(plans, self.off, stores, self.parts)]
        self.step = CachedStep([r for rs in self.regions for r in rs])
        n, t = self.off[-1], 1 << (max(self.lengths) - 1).bit_length()  # padding rows: requests of <= t keys
        self.attention = PackedAttention(self.off + [*range(n + t, n + self.pad, t), n + self.pad] * bool(self.pad),
                                         device, buckets)
        self.tally = torch.zeros(self.pos.shape[0], dtype=torch.long, device=device)

    def run(self, ops, x: torch.Tensor, wrap=None) -> torch.Tensor:
        """Every layer over every row (``ops[i]``: layer i's ``LayerOps``, whose ``attend`` may call ``attention``):
        x [N, d] -> [N, d] (``wrap``: ``executor.run_layers``)."""
        return self.step.run(ops, x, self.pos, self.tally, wrap)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """The requests' rows x [N, d] with the padding rows (zeros) after them: [N + pad, d]."""
        return torch.cat([x, x.new_zeros(self.pad, x.shape[1])]) if self.pad else x

    def recomputed(self, part: int, layer: int) -> bool:
        """Whether ``layer`` recomputes any position of part ``part`` of some request (host ints: no read)."""
        return any(parts[part].recomputes(layer) for parts in self.parts)

    def rows(self, starts: list[int], width: int, shift: int = 0) -> torch.Tensor:
        """The rows whose hidden states predict positions [start, start + width) of each request: [m, width]
        (``shift`` 1: position p is predicted by row p - 1; those rows must be kept)."""
        base = []
        for p, o, s in zip(self.plans, self.off, starts):
            a = p.compact(s - shift)
            if p.compact(s - shift + width) - a != width:
                raise ValueError(f"packed step: positions [{s - shift}, {s - shift + width}) are not all kept")
            base.append(o + a)
        return torch.tensor(base, device=self.device)[:, None] + torch.arange(width, device=self.device)

    def work(self) -> torch.Tensor:
        """Rows x layers run through a full layer, per request: [m] (no sync)."""
        n, dev = len(self.lengths), self.device
        rid = torch.repeat_interleave(torch.arange(n, device=dev), torch.tensor(self.lengths, device=dev))
        return torch.zeros(n, dtype=torch.long, device=dev).index_add_(0, rid, self.tally[:self.off[-1]])
