"""One cached layer over flat token rows: dLLM-Cache's V-verify / pick / partial recompute /
assemble, shared by every engine.

An engine runs a forward over N token rows (the embedded engine: its [B, T] or [B, L] canvas
flattened; vLLM / SGLang: the batch's scheduled tokens). Some of those rows belong to *cached
regions* (a request's response or canvas, L positions each) whose per-layer features - K, V,
attention output, FFN output - are kept between steps. ``cached_layer`` runs layer l for all rows:

    rows recomputed  = every row outside a cached region
                     + the region positions the plan recomputes regardless (``recompute``)
                     + for ``verify`` rows: the n = int(rho * |cand|) candidates whose V (or K)
                       moved most since cached (V-verify refreshes every candidate's V)
    attention        = the recomputed queries against [fresh K/V of recomputed rows ; cached K/V]
    output           = x + attn + ffn (fresh where recomputed, cached elsewhere)

Fixed shapes: given a ``bound`` (at least the rows recomputed, known from the plan on the host; ``bucket`` rounds
it up to a finite set), the recomputed rows are ``nonzero_static`` to that size, padded with a row that is not
recomputed, whose features are written back unchanged: no device read, one shape per bucket (CUDA graphs,
``torch.compile(dynamic=False)``), the same values as the exact count.

A host model supplies the layer in its own vocabulary as ``LayerOps`` (flat rows, pre-norm x):

    q, k, v = ops.qkv(x, pos)         # x [n, d], pos [n] -> q [n, Hq*D], k / v [n, Hkv*D] (RoPE on q, k)
    v       = ops.value(x)            # [n, d] -> [n, Hkv*D]   (the V projection alone)
    a       = ops.attend(q, k, v, r)  # q [n, Hq*D] of rows r [n]; k / v [N, Hkv*D] of every row -> [n, d]
    f       = ops.ffn(h)              # [n, d] -> [n, d]        (FFN on its own pre-norm input)
    t       = ops.reduce(t)           # optional: t summed over the tensor-parallel ranks (absent: one rank)

Tensor parallelism: a rank's ``qkv`` / ``value`` hold its own heads, so a pick scored on them would differ per rank.
Every data-dependent pick (V-verify's cosine or distance, Elastic's drift test) is made from sums that ``reduce``
adds over the ranks, so every rank picks the same rows: the pick of the whole model's heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from ..options import check_choice, check_range
from .graphs import note


class LayerOps(Protocol):
    def qkv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def value(self, x: torch.Tensor) -> torch.Tensor: ...
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor: ...
    def ffn(self, h: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class FeatureReuse:
    """dLLM-Cache's adaptive-update knobs (a mixin of the policies that reuse features):
    ``rho``: fraction of the candidates recomputed; ``select``: value (V-verify) | key | random;
    ``metric``: cosine | l2; ``first_layer``: always recompute layer 0; ``seed``: random select."""

    rho: float = 0.25
    select: str = "value"
    metric: str = "cosine"
    first_layer: bool = True
    seed: int = 0

    def check_reuse(self, where: str) -> None:
        check_range(self.rho, 0.0, 1.0, f"{where}.rho")
        check_choice(self.select, ("value", "key", "random"), f"{where}.select")
        check_choice(self.metric, ("cosine", "l2"), f"{where}.metric")

    def n_update(self, candidates: int) -> int:
        """Candidates recomputed by an adaptive layer."""
        return int(self.rho * candidates)

    def pick(self, new: torch.Tensor, old: torch.Tensor, n: int, generator: torch.Generator | None = None,
             reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The n candidates whose feature moved most: new / old [m, R, F] -> [m, n] (most moved first). ``reduce``:
        a tensor-parallel rank's features are its own heads; the score's sums are added over the ranks."""
        if self.select == "random":
            score = torch.rand(new.shape[:2], device=new.device, generator=generator)
        elif reduce is None:
            new, old = new.float(), old.float()
            score = -F.cosine_similarity(new, old, dim=-1) if self.metric == "cosine" else (new - old).norm(dim=-1)
        elif self.metric == "cosine":
            new, old = new.float(), old.float()
            dot, nn, oo = reduce(torch.stack([(new * old).sum(-1), (new * new).sum(-1), (old * old).sum(-1)]))
            score = -dot / (nn * oo).sqrt().clamp_min(1e-8)  # [m, R]
        else:
            score = reduce((new.float() - old.float()).square().sum(-1)).sqrt()
        return score.topk(n, -1).indices


@dataclass
class Features:
    """One layer's cached features of m regions of L positions: k / v [m, L, Hkv*D], a / f [m, L, d]."""

    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    f: torch.Tensor

    @classmethod
    def zeros(cls, m: int, L: int, kv: int, d: int, like: torch.Tensor) -> "Features":
        return cls(*(like.new_zeros(m, L, w) for w in (kv, kv, d, d)))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v, self.a, self.f


@dataclass
class CachedRows:
    """Cached regions of one forward that share a ``FeatureReuse`` policy, for one layer."""

    rows: torch.Tensor        # [m, L] flat row ids of each region
    feats: Features           # [m, L, *] cached features (updated in place)
    recompute: torch.Tensor   # [m, L] bool: positions recomputed regardless
    verify: torch.Tensor | bool  # [m] bool on the device: regions whose adaptive pick runs (True / False: all, none)
    reuse: FeatureReuse | None  # None: no adaptive pick (``verify`` False)
    cand: tuple[int, int]     # region columns [lo, hi) the pick draws from
    dense: bool = False       # rows == arange(N).view(m, L): the features are the forward's own rows

    @property
    def picks(self) -> int:
        """Candidates each verified region adds (host int; 0: no pick runs)."""
        if self.reuse is None or self.verify is False:
            return 0
        return self.reuse.n_update(self.cand[1] - self.cand[0])


def bucket(n: int, total: int) -> int:
    """The bucket of ``n`` rows out of ``total``: the least of {16, 32, 64, ...} and ``total`` at least n (so a
    forward's recomputed-row shapes come from a finite set)."""
    return min(total, max(16, 1 << max(n - 1, 0).bit_length()))


def _candidates(ops: LayerOps, x, pos, g: CachedRows):
    """(new, old) features the pick compares, [m, R, F]; V-verify stores the new V of the verified regions."""
    lo, hi = g.cand
    rows = g.rows[:, lo:hi]  # [m, R]
    if g.reuse.select == "value":
        new = ops.value(x.index_select(0, rows.flatten())).view(*rows.shape, -1)
        old = g.feats.v[:, lo:hi].clone()
        g.feats.v[:, lo:hi] = new if g.verify is True else torch.where(g.verify[:, None, None], new, old)
        return new, old
    if g.reuse.select == "key":
        return ops.qkv(x[rows.flatten()], pos[rows.flatten()])[1].view(*rows.shape, -1), g.feats.k[:, lo:hi]
    return x[rows], x[rows]  # random: only the shape is read


def recompute_mask(ops: LayerOps, x, pos, groups: Sequence[CachedRows], generator=None) -> torch.Tensor:
    """[N] bool: the rows this layer recomputes (runs V-verify and the picks; no device read)."""
    rec = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    for g in groups:
        rec[g.rows.flatten()] = g.recompute.flatten()
        if n := g.picks:
            new, old = _candidates(ops, x, pos, g)
            pick = g.reuse.pick(new, old, n, generator, getattr(ops, "reduce", None))
            hit = g.rows.gather(1, pick + g.cand[0])  # [m, n] flat rows
            if g.verify is True:
                rec.index_fill_(0, hit.flatten(), True)  # a scalar fill: no copy (CUDA graphs)
            else:
                rec[hit] = rec[hit] | g.verify[:, None]
    return rec


def cached_layer(ops: LayerOps, x: torch.Tensor, pos: torch.Tensor, groups: Sequence[CachedRows],
                 generator: torch.Generator | None = None, bound: int | None = None,
                 tally: torch.Tensor | None = None, live: tuple[int, int] | None = None) -> torch.Tensor:
    """Run one layer over x [N, d] (positions pos [N]) with the cached regions ``groups`` (at least
    one): -> [N, d]. ``bound``: at least the number of recomputed rows, when the caller knows it (fixed shapes, no
    device read: CUDA-graph capturable; see the module doc); otherwise the rows are read from the mask. ``tally``
    [N]: + 1 at each row run through the full layer (a host's per-request work, no sync). ``live`` (one dense
    group): the region columns [lo, hi) whose output is read downstream; only they are assembled, in x itself (the
    other rows of the result hold stale values)."""
    rec = recompute_mask(ops, x, pos, groups, generator)
    if tally is not None:
        tally += rec
    ridx, pad, spare = _recomputed(rec, bound)
    note("layer", x.shape[0], ridx.shape[0])
    dense = len(groups) == 1 and groups[0].dense
    k, v, a, f = _flat(groups, x) if not dense else (t.flatten(0, 1) for t in groups[0].feats.tensors())
    if ridx.shape[0]:  # (index_select / index_copy_: row copies without advanced indexing's overhead)
        xr = x.index_select(0, ridx)  # [n, d]
        q, kr, vr = ops.qkv(xr, pos.index_select(0, ridx))
        _put(k, ridx, kr, pad, spare)
        _put(v, ridx, vr, pad, spare)
        att = ops.attend(q, k, v, ridx)
        _put(a, ridx, att, pad, spare)
        _put(f, ridx, ops.ffn(xr + att), pad, spare)
    if not dense:
        for g in groups:
            r = g.rows.flatten()
            for buf, t in zip(g.feats.tensors(), (k, v, a, f)):
                buf.copy_(t.index_select(0, r).view_as(buf))
    if live is None:
        return x + a + f
    m, (lo, hi) = groups[0].rows.shape[0], live
    cols = [t.view(m, -1, t.shape[-1])[:, lo:hi] for t in (x, a, f)]  # [m, hi - lo, d] each
    cols[0].add_(cols[1]).add_(cols[2])
    return x


def _recomputed(rec: torch.Tensor, bound: int | None):
    """The rows ``rec`` [N] marks, ascending: (ridx [n], pad [n, 1] bool or None, spare [1] or None). With a
    ``bound``, n = min(bound, N): the places past the marked rows hold ``spare``, a row not recomputed (its features
    are written back unchanged: ``_put``; where every row is recomputed there are no such places)."""
    N = rec.shape[0]
    if bound is None:
        return rec.nonzero()[:, 0], None, None
    bound = min(bound, N)
    if rec.device.type == "cpu" and not torch.compiler.is_compiling() and int(rec.sum()) > bound:
        raise AssertionError(f"cached_layer: {int(rec.sum())} rows recomputed, bound {bound}")  # a plan's bug
    spare = (~rec).to(torch.int8).argmax().view(1)  # [1] (row 0 when every row is recomputed)
    ridx = torch.nonzero_static(rec, size=bound, fill_value=N)[:, 0]
    ridx = torch.where(ridx == N, spare, ridx).sort().values  # ascending (hosts' attention wants row order)
    return ridx, ((ridx == spare) & ~rec.index_select(0, spare))[:, None], spare


def _put(buf: torch.Tensor, ridx: torch.Tensor, new: torch.Tensor, pad, spare) -> None:
    """buf[ridx] = new, the padded rows keeping the spare row's own value."""
    if pad is not None:
        new = torch.where(pad, buf.index_select(0, spare), new)
    buf.index_copy_(0, ridx, new)


def _flat(groups: Sequence[CachedRows], x: torch.Tensor):
    """k, v [N, Hkv*D], a, f [N, d]: the groups' cached features at their rows (other rows are all
    recomputed, so they are left unset)."""
    fe = groups[0].feats
    k, v = x.new_empty(x.shape[0], fe.k.shape[-1]), x.new_empty(x.shape[0], fe.v.shape[-1])
    a, f = torch.empty_like(x), torch.empty_like(x)
    for g in groups:
        r = g.rows.flatten()
        for buf, t in zip((k, v, a, f), g.feats.tensors()):
            buf.index_copy_(0, r, t.flatten(0, 1))
    return k, v, a, f


class FeatureStore:
    """Cached features of request slots for every layer: k / v [n_layers, S, L, Hkv*D], a / f
    [n_layers, S, L, d] (a host engine's per-request storage; ``grow`` adds slots)."""

    def __init__(self, n_layers: int, slots: int, L: int, kv: int, d: int, like: torch.Tensor):
        self.bufs = [like.new_zeros(n_layers, slots, L, w) for w in (kv, kv, d, d)]

    @property
    def slots(self) -> int:
        return self.bufs[0].shape[1]

    @property
    def length(self) -> int:
        return self.bufs[0].shape[2]

    def grow(self, extra: int) -> None:
        self.bufs = [torch.cat([b, b.new_zeros(b.shape[0], extra, *b.shape[2:])], 1) for b in self.bufs]

    def gather(self, layer: int, slots: torch.Tensor, width: int | None = None) -> Features:
        """Features of ``slots`` [m] in ``layer``: [m, width or L, *] (a canvas may be shorter than L)."""
        w = self.length if width is None else width
        return Features(*(b[layer, slots, :w] for b in self.bufs))

    def scatter(self, layer: int, slots: torch.Tensor, feats: Features) -> None:
        for b, t in zip(self.bufs, feats.tensors()):
            b[layer, slots, :t.shape[1]] = t


class PartStores:
    """One request's feature stores on a host, one per part name (``HostPart.name``), each sized to its part: a
    part whose length moved (a new canvas, whose first step recomputes it) gets a new store."""

    def __init__(self, n_layers: int, kv: int, d: int, like: torch.Tensor):
        self.shape, self.like, self.stores = (n_layers, kv, d), like, {}

    def clear(self) -> None:
        """Drop every part's features (the next step of each part recomputes it)."""
        self.stores = {}

    def get(self, name: str, length: int) -> "FeatureStore | NoFeatures":
        """The part's store; a part with no name keeps nothing (``NoFeatures``)."""
        if not name:
            return NoFeatures(self.shape[1], self.shape[2], self.like)
        store = self.stores.get(name)
        if store is None or store.length != length:
            n_layers, kv, d = self.shape
            store = self.stores[name] = FeatureStore(n_layers, 1, length, kv, d, self.like)
        return store


class SeededReuse:
    """A ``FeatureReuse`` policy with one request's own generator for ``select=random`` (the embedded state seeds one
    per generation with ``seed``), so a host request's picks do not depend on the other requests of its batch."""

    def __init__(self, policy: FeatureReuse, device):
        self.policy, self.gen = policy, torch.Generator(device).manual_seed(policy.seed)

    @property
    def select(self) -> str:
        return self.policy.select

    def n_update(self, candidates: int) -> int:
        return self.policy.n_update(candidates)

    def pick(self, new, old, n, generator=None, reduce=None):
        return self.policy.pick(new, old, n, self.gen, reduce)


class NoFeatures:
    """A ``FeatureStore`` stand-in for rows whose layers are skipped and whose features are never read
    back (a host's prompt prefill that the first refresh recomputes before anything attends to it):
    zeros in, nothing kept."""

    def __init__(self, kv: int, d: int, like: torch.Tensor):
        self.widths, self.like = (kv, kv, d, d), like

    def gather(self, layer: int, slots: torch.Tensor, width: int | None = None) -> Features:
        return Features(*(self.like.new_zeros(len(slots), width, w) for w in self.widths))  # transient

    def scatter(self, layer: int, slots: torch.Tensor, feats: Features) -> None:
        pass


class LayerProbe(Protocol):
    """A policy's test of one request after each layer (Elastic-Cache's drift test). ``x`` [T, d] / ``pos`` [T]: the
    layer's input rows of the request's positions [0, T), ``keys`` [T, Hkv*D] its K after the layer ran."""

    def after(self, layer: int, ops: LayerOps, x: torch.Tensor, pos: torch.Tensor,
              keys: torch.Tensor) -> torch.Tensor | None:
        """After ``layer`` ran by the plan: [] bool (True: run it again over every position of the request), or
        None (no test)."""
        ...

    def refreshed(self, layer: int, ops: LayerOps, x: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> None:
        """``layer`` ran again over every position of the request (its test said so)."""
        ...


@dataclass
class Probed:
    """A request's ``LayerProbe`` in one forward: its rows [T] (positions [0, T) in order) and its parts as
    (group, region row) pairs, in position order."""

    probe: LayerProbe
    rows: torch.Tensor
    members: list[tuple[int, int]]

    def keys(self, groups: Sequence[CachedRows]) -> torch.Tensor:
        return torch.cat([groups[g].feats.k[j] for g, j in self.members])  # [T, Hkv*D]


def run_layers(ops: Sequence[LayerOps], x: torch.Tensor, pos: torch.Tensor,
               layer_groups: Callable[[int], tuple[list[CachedRows], int | None]], probes: Sequence[Probed] = (),
               generator: torch.Generator | None = None, tally: torch.Tensor | None = None,
               stored: Callable[[int, list[CachedRows]], None] | None = None, wrap=None) -> torch.Tensor:
    """Every layer over x [N, d] -> [N, d]: ``layer_groups(i)`` gives layer i's cached regions and a bound on the
    region rows it recomputes (None: read from the mask; rows in no region are always recomputed), ``stored(i,
    groups)`` is told after they ran. With ``probes`` (one per request, ``LayerProbe``) the step runs in two passes:
    the planned pass tests each request after every layer on the device (``ProbedPass``: no read); then, one read for
    the step, each request whose test failed runs again from its first failing layer over every one of its positions
    (``ProbedPass.refresh``). ``wrap(f)``: what runs each pass (a compiler or a graph capture; None: eager)."""
    wrap = wrap or (lambda f: f)
    run = ProbedPass(probes, len(ops), x) if probes else None
    x = wrap(_planned)(ops, x, pos, layer_groups, run, generator, tally, stored)
    if run is None:
        return x
    fails = run.at.tolist()  # the step's one read
    return x if min(fails) == len(ops) else wrap(run.refresh)(ops, x, pos, fails, layer_groups, stored, tally)


def _planned(ops, x, pos, layer_groups, run: "ProbedPass | None", generator, tally, stored) -> torch.Tensor:
    """``run_layers``'s planned pass (no read)."""
    for i, o in enumerate(ops):
        groups, bound = layer_groups(i)
        if run is not None:
            groups = run.drop(groups)
        out = cached_layer(o, x, pos, groups, generator, _bound(bound, groups, x.shape[0]), tally)
        if run is not None:
            run.test(i, o, x, pos, groups)  # (and keeps the layer's input of the rows in no region)
        if stored is not None:
            stored(i, groups)
        x = out
    return x


def _bound(regions: int | None, groups: Sequence[CachedRows], N: int) -> int | None:
    """The bucket of a layer's recomputed rows: ``regions`` (at least those in the groups) + the rows in none."""
    return None if regions is None else bucket(N - sum(g.rows.numel() for g in groups) + regions, N)


class ProbedPass:
    """The planned pass of a step with ``LayerProbe``s and its refresh. ``at`` [R]: each request's first failing
    layer (n: none), ``keep`` [N, d]: its rows' input to that layer, both on the device. A request that failed runs
    no more rows in later layers of the planned pass (``drop``: its refresh recomputes them); its rows of the planned
    pass's output are replaced by the refresh's. The refresh gives what a per-layer read would (a request's rows
    attend to its own rows only): layer l of a request failing at l runs again over all of its positions, the
    later layers recompute all of them, and the work counts the plan's rows and the rows it had not run. Every row's
    K / V of a layer is what it was in the planned pass (a host's paged attention writes them all again): the rows
    in no region run again from their input to the layer (``inputs``), the other rows' come from their features."""

    def __init__(self, probes: Sequence[Probed], n: int, x: torch.Tensor):
        self.probes, self.n = list(probes), n
        self.at = torch.full((len(self.probes),), n, dtype=torch.long, device=x.device)  # [R]
        self.keep = torch.empty_like(x)  # [N, d]
        self.outside: torch.Tensor | None = None  # [n_out] the rows in no region
        self.inputs: list[torch.Tensor] = []  # per layer [n_out, d]: their input to it

    def drop(self, groups: list[CachedRows]) -> list[CachedRows]:
        """The layer's groups without the rows of the requests that failed at an earlier layer (no read)."""
        rec = [g.recompute for g in groups]
        for r, p in enumerate(self.probes):
            live = self.at[r] == self.n  # [] bool
            for g, j in p.members:
                rec[g] = rec[g].index_copy(0, torch.tensor([j], device=live.device), (rec[g][j] & live)[None])
        return [CachedRows(g.rows, g.feats, m, g.verify, g.reuse, g.cand, g.dense) for g, m in zip(groups, rec)]

    def test(self, layer: int, ops: LayerOps, x, pos, groups: list[CachedRows]) -> None:
        """Each request's test after ``layer`` (its input rows x, its keys); a first failure keeps its input rows."""
        if self.outside is None:  # (a host int bounds them: no read)
            free = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
            for g in groups:
                free[g.rows.flatten()] = False
            size = x.shape[0] - sum(g.rows.numel() for g in groups)
            self.outside = torch.nonzero_static(free, size=size)[:, 0]
        self.inputs.append(x.index_select(0, self.outside))
        for r, p in enumerate(self.probes):
            f = p.probe.after(layer, ops, x[p.rows], pos[p.rows], p.keys(groups))
            if f is None:
                continue
            first = f & (self.at[r] == self.n)  # [] bool
            self.at[r] = torch.where(first, layer, self.at[r])
            self.keep[p.rows] = torch.where(first, x[p.rows], self.keep[p.rows])

    def refresh(self, ops: Sequence[LayerOps], x, pos, fails: list[int], layer_groups, stored, tally) -> torch.Tensor:
        """The requests that failed again from their first failing layer (``fails``: ``at`` read) -> x [N, d]."""
        again = [(p, a) for p, a in zip(self.probes, fails) if a < self.n]
        h, N = x.clone(), x.shape[0]
        for i in range(min(a for _, a in again), self.n):
            h.index_copy_(0, self.outside, self.inputs[i])  # the rows in no region: the same K / V again
            plan, planned = layer_groups(i)
            redo = [CachedRows(g.rows, g.feats, torch.zeros_like(g.recompute), False, g.reuse, g.cand, g.dense)
                    for g in plan]
            for p, a in again:
                if a == i:  # its input rows of the layer that failed
                    h[p.rows] = self.keep[p.rows]
                for g, j in p.members if a <= i else ():
                    redo[g].recompute[j] = True
                    if tally is not None:  # the rows the plan had not run (the planned pass counted the others)
                        tally[plan[g].rows[j]] += 1 if a < i else (~plan[g].recompute[j]).long()
            bound = None if planned is None else _bound(sum(len(p.rows) for p, a in again if a <= i), plan, N)
            out = cached_layer(ops[i], h, pos, redo, bound=bound)
            for p, a in again:
                if a == i:
                    p.probe.refreshed(i, ops[i], h[p.rows], pos[p.rows], p.keys(redo))
                elif a < i:
                    p.probe.after(i, ops[i], h[p.rows], pos[p.rows], p.keys(redo))  # takes the layer's reference
            if stored is not None:
                stored(i, redo)
            h = out
        rows = torch.cat([p.rows for p, _ in again])
        return x.index_copy(0, rows, h.index_select(0, rows))  # the failed requests' rows from the refresh


@dataclass
class Region:
    """Cached regions of one host forward that share a policy: their rows [m, L] in the forward's
    flat token rows, their features (rows ``slots`` [m] of ``store``, the first L columns) and what
    each layer recomputes: ``plan(layer) -> (recompute [m, L] bool, verify: bool or [m] bool, at most the rows
    ``recompute`` marks: host int)``. ``probe``: the request's ``LayerProbe`` (one region of L = 1 row per part; a
    request's parts in position order)."""

    rows: torch.Tensor
    slots: torch.Tensor
    store: FeatureStore | NoFeatures
    reuse: FeatureReuse | None
    plan: Callable[[int], tuple[torch.Tensor, "torch.Tensor | bool", int]]
    probe: LayerProbe | None = None


class CachedStep:
    """The cached regions of one host forward; ``run`` runs every layer over all of its rows."""

    def __init__(self, regions: Sequence[Region], generator: torch.Generator | None = None):
        self.regions, self.generator = list(regions), generator
        probed: dict[int, Probed] = {}
        for i, r in enumerate(self.regions):
            if r.probe is not None:
                p = probed.setdefault(id(r.probe), Probed(r.probe, r.rows[0][:0], []))
                p.rows, p.members = torch.cat([p.rows, r.rows[0]]), p.members + [(i, 0)]
        self.probes = list(probed.values())

    def run(self, ops: Sequence[LayerOps], x: torch.Tensor, pos: torch.Tensor,
            tally: torch.Tensor | None = None, wrap=None) -> torch.Tensor:
        """Every layer (``ops[i]``: layer i's ``LayerOps``) over the rows of the forward x [N, d]: -> [N, d] (features
        stored back; ``tally`` [N] counts the rows run through the full layer; ``wrap``: ``run_layers``)."""
        return run_layers(ops, x, pos, self.groups, self.probes, self.generator, tally, self.store, wrap)

    def groups(self, layer: int) -> tuple[list[CachedRows], int]:
        """Layer ``layer``'s regions as ``CachedRows`` (their features gathered) and a bound on the region rows it
        recomputes (each region's bound and its picks)."""
        plans = [r.plan(layer) for r in self.regions]
        groups = [CachedRows(r.rows, r.store.gather(layer, r.slots, r.rows.shape[1]), rec, verify, r.reuse,
                             (0, r.rows.shape[1])) for r, (rec, verify, _) in zip(self.regions, plans)]
        return groups, sum(b for _, _, b in plans) + sum(g.picks * g.rows.shape[0] for g in groups)

    def store(self, layer: int, groups: list[CachedRows]) -> None:
        """The features ``groups`` hold back into the regions' stores."""
        for r, g in zip(self.regions, groups):
            r.store.scatter(layer, r.slots, g.feats)
