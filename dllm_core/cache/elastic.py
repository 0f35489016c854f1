"""Elastic-Cache-style adaptive refresh (arXiv 2510.14973), policy ``elastic``: WHEN to refresh decided by an
attention-aware drift test on the most-attended token, WHERE by depth (recompute from the failing layer onward).

The policy keeps every layer's features (K, V, attention and FFN outputs) of every position of a request, and runs
each layer through the shared executor (``executor.run_layers``: the same code in the embedded engine and the
hosts). A step recomputes its *query rows* in every layer - the fresh range (the block, or SlowFast's span), the
previous step's fresh range (its commits: their K/V are then computed from the committed tokens) and ``window``
more positions after the range - against the cached features of every other position (the prompt, committed
tokens, the masked suffix outside the window).

The drift test (``Drift``), per request and layer l < L - 1, after the layer ran, against the layer's state when
it was last fresh. At a layer that ran over every position the *anchor* becomes the key left of the fresh range
(the prompt or a committed token) that the *probe rows* (every ``probe``-th response position) attend to most,
over heads and probe rows, and their weights to it are kept as the reference. At a later step the probe rows among
the query rows whose token has not changed since attend to the anchor again; the cosine similarity of those
weights (over heads and rows) with the reference falls as the context moved on - the most-attended token moves
least, so a similarity below ``gamma`` says the cache has drifted. The request then runs layer l again over every
position (its new reference) and layers l + 1 .. L - 1 recompute every position. Layers before the first failing
test are not refreshed (their drift is smallest; layer 0's K/V depend on each position's token alone). A request
decides alone: a batched row equals its run alone, and a host request equals the embedded row.

Differences from the paper's procedure (not public code): the test compares with the layer's last refresh, not
the previous step (slow drift adds up), the anchor is looked for among the prompt and committed tokens, and only
every ``probe``-th response position takes part (the weights are computed explicitly; the step's attention itself
is the engine's).

``every``: also refresh every layer of every position after this many steps (0 = only by the drift test).
``layers``: the drift test at layers [0, layers) only (0 = every layer but the last; 1 = layer 0 alone: cheaper, as
only a change of the keys' tokens moves layer 0's attention, and a failure there refreshes every layer).
Exact modes: ``gamma=1`` (every step a full refresh) or ``every=1``; both equal ``none`` token for token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import CachePolicy, CacheState, nbytes
from .executor import CachedRows, Features, Probed, run_layers
from .host import HostPart, HostPlan, HostRequest, HostStep
from ..models.layers import BlockOps
from ..options import check_min, check_range


class Drift:
    """One request's Elastic-Cache state over its positions [0, T) (an embedded row, or a host request;
    ``executor.LayerProbe``): the canvas tokens its cache saw, per layer the drift test's anchor and reference
    (the probe rows' weights to it, [H, np], and the step it was taken), and this step's query rows [lo, hi) and
    first layer recomputed over every position (``full_from``). ``bias`` [1 | T, T]: 0 / -inf per key (padding)."""

    def __init__(self, policy: "ElasticCache", prompt: int, length: int, device, bias: torch.Tensor | None = None):
        self.policy, self.P, self.T, self.bias = policy, prompt, length, bias
        self.probes = torch.arange(prompt, length, policy.probe, device=device)  # [np] positions
        self.changed = torch.full((len(self.probes),), -1, dtype=torch.long, device=device)  # step of the last change
        self.refs: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # layer -> (anchor [], weights, step)
        self.ids = torch.full((length,), -1, dtype=torch.long, device=device)  # the tokens the cache saw
        self.canvas = prompt  # the first position of the canvas the last step saw
        self.steps = self.age = 0
        self.prev: tuple[int, int] | None = None
        self.lo = self.hi = self.start = 0
        self.full_from: int | None = None
        self.failed: int | None = None  # the layer whose test failed at this step
        self.depth = self.seen = 0  # layers seen, and by the steps before this one (the last one is not tested)

    def begin(self, tokens: torch.Tensor, fresh: tuple[int, int], canvas: int) -> None:
        """A step: ``tokens`` [T - canvas] the canvas's tokens now (positions [canvas, T)), ``fresh`` its range."""
        pol = self.policy
        full = self.prev is None or (pol.every > 0 and self.age + 1 >= pol.every) or pol.gamma >= 1
        lo, hi = fresh[0], min(fresh[1] + pol.window, self.T)
        self.steps, self.seen = self.steps + 1, self.depth
        if self.prev is not None:  # the previous step's commits lie in its fresh range
            lo, hi = min(lo, self.prev[0]), max(hi, self.prev[1])
            self._mark(tokens, canvas, self.steps)
        self.ids[canvas:], self.canvas = tokens, canvas
        self.prev, self.age = fresh, 0 if full else self.age + 1
        self.lo, self.hi, self.start, self.full_from, self.failed = lo, hi, fresh[0], 0 if full else None, None

    def canvas_done(self, tokens: torch.Tensor) -> None:
        """A host emitted the canvas that began at ``self.canvas``: its final tokens ``tokens`` [>= T - canvas] (the
        last step's commits, which no later canvas shows, count as changed at the next step, as in one canvas)."""
        if self.prev is None:
            return
        self._mark(tokens, self.canvas, self.steps + 1)
        self.ids[self.canvas:] = tokens[:self.T - self.canvas]

    def _probe(self, pos: int) -> int:
        """The index of the first probe row at or after position ``pos``."""
        return min(-(-max(pos - self.P, 0) // self.policy.probe), len(self.probes))

    def _mark(self, tokens: torch.Tensor, canvas: int, step: int) -> None:
        """The probes in [canvas, T) whose token in ``tokens`` (from position ``canvas``) differs from the one the
        cache saw changed at ``step``."""
        i = self._probe(canvas)
        k = self.probes[i:]
        self.changed[i:] = torch.where(tokens[k - canvas] != self.ids[k], step, self.changed[i:])

    def full_at(self, layer: int) -> bool:
        """Whether ``layer`` recomputes every position at this step."""
        return self.full_from is not None and layer >= self.full_from

    def query(self) -> tuple[int, int]:
        """This step's query rows [lo, hi) (positions)."""
        return self.lo, self.hi

    def after(self, layer, ops, x, pos, keys):
        """``LayerProbe.after``: a fully recomputed layer takes its reference; otherwise the drift test of the probe
        rows among the query rows whose token has not changed since the reference -> [] bool (True: drifted)."""
        pol, last = self.policy, 0 < self.seen <= layer + 1  # the last layer has nothing after it to refresh
        self.depth = max(self.depth, layer + 1)  # (a request's first step runs every layer in full: references)
        if last or 0 < pol.layers <= layer:  # a layer the test does not run at
            return None
        if self.full_at(layer):
            self._reference(layer, ops, x, pos, keys)
            return None
        ref = self.refs.get(layer)
        j0, j1 = self._probe(self.lo), self._probe(self.hi)
        if ref is None or j0 >= j1:
            return None
        anchor, old, at = ref
        cols = self.probes[j0:j1]
        cur = self._weights(ops, x[cols], pos[cols], keys, cols).index_select(-1, anchor.view(1))[..., 0]  # [H, n]
        ok = (self.changed[j0:j1] <= at)[None]
        cur, old = cur * ok, old[:, j0:j1] * ok
        reduce = getattr(ops, "reduce", None)  # tensor parallel: this rank's heads; the sums over every rank's heads
        if reduce is None:
            sim = (cur * old).sum() / (cur.norm() * old.norm()).clamp_min(1e-12)
        else:
            dot, cc, oo = reduce(torch.stack([(cur * old).sum(), cur.square().sum(), old.square().sum()]))
            sim = dot / (cc * oo).sqrt().clamp_min(1e-12)
        return ok.any() & (sim < pol.gamma)

    def refreshed(self, layer, ops, x, pos, keys) -> None:
        """``LayerProbe.refreshed``: ``layer`` ran again over every position: its new reference; the later layers
        recompute every position."""
        self.failed = self.full_from = layer
        self._reference(layer, ops, x, pos, keys)

    def _reference(self, layer, ops, x, pos, keys) -> None:
        """``layer`` is fresh: its anchor (the key left of the fresh range the probe rows attend to most, over heads
        and rows) and the probe rows' weights to it become the reference."""
        p = self.probes
        w = self._weights(ops, x[p], pos[p], keys, p)  # [H, np, T]
        mass = w.sum((0, 1))  # [T]
        if (reduce := getattr(ops, "reduce", None)) is not None:  # tensor parallel: over every rank's heads
            mass = reduce(mass)
        anchor = mass.masked_fill(torch.arange(self.T, device=mass.device) >= self.start, -1).argmax()
        self.refs[layer] = anchor, w.index_select(-1, anchor.view(1))[..., 0], self.steps

    def _weights(self, ops, x, pos, keys, cols) -> torch.Tensor:
        """Attention probabilities of rows ``x`` [n, d] (positions ``cols``) over ``keys`` [T, Hkv*D] -> [H, n, T]."""
        Hq, Hkv, D = ops.heads
        q = ops.qkv(x, pos)[0].view(-1, Hq, D).transpose(0, 1)  # [Hq, n, D]
        k = keys.view(-1, Hkv, D).transpose(0, 1).repeat_interleave(Hq // Hkv, 0)  # [Hq, T, D]
        s = (q * D ** -0.5) @ k.transpose(-1, -2)
        if self.bias is not None:
            s = s + (self.bias if self.bias.shape[0] == 1 else self.bias[cols])
        return s.float().softmax(-1)


class ElasticState(CacheState):
    """The embedded batch as B requests of T positions in one dense feature store per layer ([B, T, *]), each row
    with its own ``Drift``; every layer through ``executor.run_layers``."""

    def __init__(self, policy, model, canvas):
        super().__init__(policy, model, canvas)
        a, (B, T), dev = model.args, canvas.pos.shape, canvas.pos.device
        like = torch.zeros(0, dtype=model.dtype, device=dev)
        self.feats = [Features.zeros(B, T, a.n_kv_heads * a.head_dim, a.dim, like) for _ in model.layers]
        self.rows = torch.arange(B * T, device=dev).view(B, T)  # [B, T] flat row of each position
        bias = None if canvas.mask is None else \
            torch.zeros(canvas.mask.shape, dtype=torch.float32, device=dev).masked_fill(~canvas.mask, float("-inf"))
        self.drift = [Drift(policy, canvas.prompt_len, T, dev, None if bias is None else bias[b, 0])
                      for b in range(B)]
        self.probed = [Probed(d, self.rows[b], [(0, b)]) for b, d in enumerate(self.drift)]
        self.refreshes = torch.zeros(a.n_layers + 1, dtype=torch.long)  # row refreshes by first layer (n: none)
        self.counters.cache_bytes = nbytes([f.tensors() for f in self.feats])

    def end(self) -> None:
        refreshes = self.refreshes
        super().end()
        self.refreshes = refreshes  # readable after the generation, like the counters

    def hidden(self, x, need, fresh, active=None):
        m, cv = self.model, self.canvas
        (B, T), P, L = x.shape, cv.prompt_len, len(m.layers)
        live = [b for b, a in enumerate([True] * B if active is None else active.tolist()) if a]
        for b, f in zip(live, fresh[live].tolist()):
            self.drift[b].begin(x[b, P:], tuple(f), P)
        ds = [self.drift[b] for b in live]
        probes = [self.probed[b] for b in live] if self.policy.tests else []
        h, pos = m.embed(x).flatten(0, 1), cv.pos.flatten()  # [B*T, d], [B*T]
        tally = torch.zeros(B * T, dtype=torch.long, device=x.device)

        def groups(i):  # layer i: each live row's query rows, or every position from its refresh on
            rec = torch.zeros(B, T, dtype=torch.bool, device=x.device)
            for b, d in zip(live, ds):
                lo, hi = (0, T) if d.full_at(i) else d.query()
                rec[b, lo:hi] = True
            return [CachedRows(self.rows, self.feats[i], rec, False, None, (0, T), dense=True)], None

        ops = [BlockOps(layer, m.rotary, B, cv.mask, ragged=True) for layer in m.layers]
        h = run_layers(ops, h, pos, groups, probes, tally=tally)
        for d in ds:
            self.refreshes[L if d.full_from is None else d.full_from + (d.failed is not None)] += 1
        c = self.counters
        c.forwards += 1
        c.token_layers += round(int(tally.view(B, T)[live].sum()) / B)
        c.full_token_layers += T * L
        return h.view(B, T, -1)[:, need[0]:need[1]]


@dataclass(frozen=True)
class ElasticCache(CachePolicy):
    """Elastic-Cache-style adaptive refresh (see the module docstring). ``gamma``: the drift test's cosine
    similarity threshold (a layer whose test gives less refreshes from there; 1 = every step, every layer: exact;
    0 = never); ``window``: masked positions after the fresh range recomputed with it (Elastic-Cache's sliding
    window: MASK positions outside it are cached); ``every``: a full refresh after this many steps (0 = only by the
    test; 1 = exact); ``probe``: every probe-th response column takes part in the test; ``layers``: the test runs at
    layers [0, layers) only (0 = at every layer but the last, the paper's; 1: at layer 0 alone, whose failure refreshes
    every layer)."""

    name: ClassVar[str] = "elastic"
    state_cls: ClassVar[type[CacheState]] = ElasticState
    refreshes_prefix: ClassVar[bool] = True
    spans_response: ClassVar[bool] = True  # the response part holds every emitted token of a streamed request
    gamma: float = 0.9
    window: int = 32
    every: int = 0
    probe: int = 4
    layers: int = 0

    def __post_init__(self):
        check_range(self.gamma, 0.0, 1.0, "--cache elastic.gamma")
        check_min(self.window, 0, "--cache elastic.window")
        check_min(self.every, 0, "--cache elastic.every", note=" (0 = refresh only by the drift test)")
        check_min(self.probe, 1, "--cache elastic.probe")
        check_min(self.layers, 0, "--cache elastic.layers", note=" (0 = the test at every layer but the last)")

    def host_plan(self, req: HostRequest, step: HostStep) -> HostPlan:
        """A host request's step: every position runs, in two parts - the generation's prompt and its response - with
        this step's query rows recomputed in every layer, every position from the layer whose drift test fails (the
        request's ``Drift``, kept in ``req.state``, is the plan's probe)."""
        P, T = step.prompt, step.end
        d = req.state
        if not isinstance(d, Drift) or (d.P, d.T) != (P, T):  # a new generation (or canvas): nothing cached
            d = req.state = Drift(self, P, T, req.device)
        d.begin(step.tokens, step.fresh, step.prefix)
        lo, hi = d.query()
        full = lambda layer: (d.full_at(layer), False)  # noqa: E731
        return HostPlan(0, [HostPart("prompt", 0, P, (min(lo, P), P), full),
                            HostPart("response", P, T, (max(lo - P, 0), hi - P), full)],
                        probe=d if self.tests else None)

    @property
    def tests(self) -> bool:
        """Whether the drift test runs (``gamma`` 0: never fails; 1: every step refreshes every layer anyway)."""
        return 0 < self.gamma < 1
