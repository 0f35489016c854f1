"""Adaptive draft length: how many drafted tokens a speculative step verifies (0 = a plain decoding step), from the
batch size and the measured acceptance, so that speculation runs only where it is faster than plain decoding.

Cost model (``docs/dflash.md`` "Adaptive draft length"). With b requests in the step and k drafts each:

    plain step         time T(b, 0)      tokens per request 1
    speculative step   time T(b, k)      tokens per request E(k) = 1 + sum_{i=1..k} s_i
                       (drafter forward + target verify over b (k + 1) tokens)

where s_i is the measured probability that the first i drafts are all accepted, counted in the tokens the host kept
(drafts accepted past an answer's end gain nothing). Where a host runs a request one step past its end (it
dispatches a step before the previous result), a request's answer of L tokens takes L / E(k) + 1 steps, so a step
gains E(k) L / (L + E(k)) per request, L measured (tokens kept per step run after an end). The policy picks the k
of the candidates with the most tokens per second, that gain over T(b, k), and k = 0 unless that beats plain
decoding by ``margin``. T is measured, not modelled: each host reports every step's wall time with its batch size and k
(``observe``); per batch-size bucket (powers of two) and k the last ``time_window`` step times are kept and T is
their lower quartile (the smallest of 2 or 3; a step is never faster than its work, and the minimum of a long
window would favour the length measured most), so the policy follows the host's real costs (a GPU verify that is
free up to some tokens, a CPU one that grows with them) and a step slowed by something else (a collection, another
process, a new request's arrival) decides nothing.
Unmeasured (bucket, k) cells are measured first (twice: one slow step alone cannot rule a length out; asked at most
``PATIENCE`` times per ``explore_every`` steps, as a host may never time it in that bucket), shortest first, a
longer one only while its rate predicted from the measured step times may compete (a large batch never pays for a
long useless draft; a cold bucket predicts from the nearest bucket's times scaled by its own plain step, so a wave
whose batch shrinks through the buckets does not spend its steps measuring); every ``explore_every`` steps a bucket
re-measures (two fresh samples into the length's window, asked until they are in, as a host may time a step late),
in turn, plain decoding (when it is not the choice) and the best-rated length above its choice when it may compete
(from plain decoding: always, the shortest draft, which measures the first draft's acceptance again), so a change in
acceptance or cost is seen at a bounded price. While speculating, plain decoding is also re-measured at a bucket's
step 16, 32, 64 and 128: a length's time taken in a slow spell is too slow, so it is not chosen and not measured
again (a time too fast corrects itself: the length is chosen, and its window refills).
A host may tell it each request's tokens left (a request gains no more than those) and that its drafter runs for the
next step (``switch``: a switch from plain decoding then costs a step that gains one token, rated over the spell it
starts; ``DraftLength.rates``); while speculating, a length stays while it beats plain decoding at all.
Lossless by construction: it only chooses how many drafts the lossless verifier sees.

One ``DraftLength`` per engine (it is the engine's measurements), used by one thread; ``AdaptiveDraft`` holds the
options (frozen, validated).
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, fields
from typing import Any, Callable, Hashable, Mapping, Sequence

from ..options import check_min, check_range, check_value

PROBE = 0.8  # a longer draft is re-measured when its rate is within this fraction of the best
SAMPLES = 2  # step times a (bucket, k) cell needs before it is measured
PATIENCE = 2 * SAMPLES + 2  # steps a re-measured or unmeasured length is asked for its samples (a host times a step
# late, or never in some bucket: ``DraftLength.ask``)
EARLY = 16  # while speculating, plain decoding is re-measured at a bucket's step 16, 32, 64, ... (its first samples
# may have come from a slow spell: too slow, it would not be chosen, so not measured again until explore_every)
REFIT_EVERY = 4  # past its first windows, a bucket's plain steps refit the fixed parts every this many (30 us each)
REFIT = 0.02  # a bucket's fixed part is taken anew (its lengths' times scaled again) when it moves by more than this
PRIOR = 1.0  # acceptance counts start as if one request had accepted every draft (a first rejection is not all)


@dataclass(frozen=True)
class AdaptiveDraft:
    """Options: ``max_draft`` (the drafter's most drafts per step), ``candidates`` (draft lengths tried; default
    0, 1, 2, 4, ... up to ``max_draft``), ``margin`` (start speculating when its tokens/s exceed plain's times this),
    ``explore_every`` (steps between re-measurements per bucket), ``time_window`` (step times kept per bucket and
    length), ``accept_decay`` (weight of the past in the acceptance counts, per step)."""

    max_draft: int
    candidates: tuple[int, ...] | None = None
    margin: float = 1.05
    explore_every: int = 256
    time_window: int = 16
    accept_decay: float = 0.99

    def __post_init__(self):
        check_min(self.max_draft, 1, "max_draft")
        check_min(self.margin, 0.0, "margin", strict=True)
        check_min(self.explore_every, 1, "explore_every")
        check_min(self.time_window, 1, "time_window")
        check_range(self.accept_decay, 0.0, 0.999, "accept_decay")
        if self.candidates is None:
            ks, k = [0], 1
            while k < self.max_draft:
                ks.append(k)
                k *= 2
            object.__setattr__(self, "candidates", (*ks, self.max_draft))
        for k in self.candidates:
            check_range(k, 0, self.max_draft, "candidates")
        if 0 not in self.candidates or len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"candidates must hold 0 (plain decoding) once and no length twice, got "
                             f"{list(self.candidates)}")
        object.__setattr__(self, "candidates", tuple(sorted(self.candidates)))

    @classmethod
    def of(cls, max_draft: int, options: Mapping | None = None, where: str = "options") -> "AdaptiveDraft":
        """From option names and values as a launch spells them (JSON / YAML); a name not an option is refused."""
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"{where} must be a mapping of option names to values, got {options!r}")
        options, types = dict(options or {}), {f.name: f.type for f in fields(cls)[1:]}
        if set(options) - set(types):
            raise ValueError(f"{where}: unknown options {sorted(set(options) - set(types))}; allowed: {list(types)}")
        for name, value in options.items():
            if name != "candidates":
                options[name] = check_value(value, types[name], f"{where} {name}")
            elif value is not None:
                if not isinstance(value, (list, tuple)):
                    raise ValueError(f"{where} candidates must be a list of draft lengths, got {value!r}")
                options[name] = tuple(check_value(k, "int", f"{where} candidates") for k in value)
        try:
            return cls(max_draft, **options)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def new(self, per_request: bool = False, switch: int = 0) -> "DraftLength":
        return DraftLength(self, per_request, switch)


def neighbours(b: int) -> tuple[int, int, int]:
    """Bucket ``b`` and the buckets either side of it (b / 2: 0 for bucket 1, which holds nothing)."""
    return b // 2, b, 2 * b


def bucket(batch: int) -> int:
    """The batch-size bucket of ``batch`` requests: the largest power of two <= batch."""
    return 1 << (max(batch, 1).bit_length() - 1)


class DraftLength:
    """An engine's measurements and the choice they give: ``choose(batch)`` -> k, ``observe(...)`` after the step."""

    def __init__(self, opts: AdaptiveDraft, per_request: bool = False, switch: int = 0):
        self.opts, self.per_request = opts, per_request  # per_request: see observe
        self.switch, self.last = switch, 0  # see rates; the last length chosen
        self.samples: dict[tuple[int, int], deque[tuple[int, float]]] = {}  # (bucket, k) -> the last steps' (batch,
        # seconds)
        self.time: dict[tuple[int, int], float] = {}  # (bucket, k) -> seconds per step: its window's lower quartile
        self.fixed: dict[int, float] = {}  # bucket -> a step's fixed part in requests' worth (per_request)
        self.steps: dict[int, int] = {}  # bucket -> steps decided
        self.probing: dict[int, tuple[int, int, int]] = {}  # bucket -> (k re-measured, steps it may still be asked,
        # its samples taken in all when done)
        self.taken: dict[tuple[int, int], int] = {}  # (bucket, k) -> step times observed in all
        self.asked: dict[tuple[int, int], tuple[int, int]] = {}  # (bucket, k) short of samples -> (the bucket's
        # explore_every period, the times it was asked for them in that period)
        self.reached = [0.0] * (opts.max_draft + 1)  # [i]: (decayed) requests offered >= i drafts that accepted i - 1
        self.passed = [0.0] * (opts.max_draft + 1)  # [i]: (decayed) requests that accepted >= i drafts
        self.longest = 0  # the most drafts a request was offered
        self.answer = (0.0, 0.0)  # (decayed) (tokens kept, steps run after a request's end): tokens per answer L
        self.s: list[float] | None = None  # survival(), until the counts change
        self.cs: list[float] | None = None  # cumulative(), the same

    def survival(self) -> list[float]:
        """s_i, i = 0..max_draft: the measured probability that the first i drafts are all accepted: s_0 = 1, s_i =
        s_{i-1} times the measured rate of accepting draft i where draft i - 1 was accepted (the counts start from
        ``PRIOR``, so a draft offered where the one before was never accepted has rate 1; a draft never offered yet:
        the last rate carried on). So a change in the first drafts' acceptance moves every s_i at once, not only
        those of the lengths offered since; and every count decays at every step that drafts, so the rate of a draft
        not offered for long returns toward ``PRIOR``'s and its length is chosen or re-measured again (a plain step
        decays nothing: a server that stops drafting keeps the acceptance it last measured)."""
        if self.s is not None:
            return self.s
        s, rate = [1.0], 1.0
        for i in range(1, self.opts.max_draft + 1):
            if i <= self.longest:
                rate = (self.passed[i] + PRIOR) / (self.reached[i] + PRIOR)
            s.append(s[-1] * rate)
        self.s = s
        return s

    def expected_tokens(self, k: int, s: Sequence[float] | None = None, left: Mapping[int, int] | None = None) -> float:
        """Tokens a request gains per step verifying k drafts: E(k) (the bonus token included; with ``left``, requests
        per number of tokens left to emit (>= 1), their mean E(min(k, left - 1))) times the share of a request's steps
        that run while it lives, L / (L + E(k)) for answers of L tokens where a request runs one step after its end (a
        host that dispatches a step before the previous result: ``count``'s ``ended``)."""
        cs = self.cumulative() if s is None else list(itertools.accumulate(s))  # [i]: E(i)
        if left:
            e = sum(c * cs[min(k, n - 1)] for n, c in left.items()) / sum(left.values())
        else:
            e = cs[k]
        return e if not self.answer[1] else e * self.answer[0] / (self.answer[0] + e * self.answer[1])

    def cumulative(self) -> list[float]:
        """E(i) = s_0 + ... + s_i, i = 0..max_draft (``survival``'s, until the counts change)."""
        if self.cs is None:
            self.cs = list(itertools.accumulate(self.survival()))
        return self.cs

    def spell(self, left: Sequence[int] | None) -> tuple[Counter | None, float]:
        """``left`` as ``rates`` reads it: (requests per tokens left, capped at max_draft + 1; the mean tokens left
        where a switch from plain decoding is rated as the spell it starts, else 0)."""
        if not left:
            return None, 0.0
        need, cap = Counter(), self.opts.max_draft + 1
        for n, c in Counter(left).items():  # left -> requests
            need[min(max(n, 1), cap)] += c
        return need, (sum(left) / len(left) if self.switch and not self.last else 0.0)

    def rates(self, batch: int, left: Sequence[int] | None = None) -> dict[int, float]:
        """Measured tokens per second per request for each candidate k in ``batch``'s bucket (unmeasured: absent).
        ``left``: each request's tokens left to emit from the step verifying this choice's drafts (E(k) counts no
        more). A switch from plain decoding on a host whose drafter runs for the next step (``switch`` S = 1: the
        step that switches runs a plain verify and the drafter, its time measured as the key (bucket, -k)) gains S
        tokens in S such steps before n = (h - S) / E(k) >= 1 steps at k, h = mean(left): the rate of the spell, so a
        wave's last requests, with a few tokens left, do not switch (``rate``)."""
        return self.rated(bucket(batch), *self.spell(left))

    def rated(self, b: int, need: Counter | None, h: float) -> dict[int, float]:
        """``rates`` of bucket ``b`` with ``spell``'s need and h."""
        return {k: self.rate(b, k, self.time[b, k], need, h) for k in self.opts.candidates if (b, k) in self.time}

    def rate(self, b: int, k: int, t: float, need: Counter | None, h: float) -> float:
        """Tokens per second per request of k drafts in bucket ``b`` at step time t (``spell``'s need and h: with h,
        a switch from plain decoding is rated over the spell it starts; its step's time unmeasured for k: the
        bucket's switch measured for the nearest length, else plain decoding's)."""
        e = self.expected_tokens(k, None, need)
        if not k or not h:
            return e / max(t, 1e-12)
        ts = self.time.get((b, -k))
        if ts is None:
            near = sorted((abs(j + k), tj) for (bb, j), tj in self.time.items() if bb == b and j < 0)
            ts = near[0][1] if near else self.time.get((b, 0), t)
        n = max((h - self.switch) / e, 1.0)
        return (self.switch + n * e) / (self.switch * ts + n * t)

    def step_time(self, b: int, k: int) -> float | None:
        """Bucket ``b``'s time for k drafts: measured, or interpolated linearly in k from its two measured draft
        lengths nearest to k (None with fewer)."""
        if (b, k) in self.time:
            return self.time[b, k]
        near = sorted(((abs(j - k), j, t) for (bb, j), t in self.time.items() if bb == b and j > 0))[:2]
        if len(near) < 2:
            return None
        (_, k1, t1), (_, k2, t2) = near
        return t2 + (t2 - t1) / (k2 - k1) * (k - k2)

    def predicted(self, b: int, k: int, need: Counter | None = None, h: float = 0.0) -> float:
        """An unmeasured length's rate in bucket ``b`` (``rate``, with ``spell``'s need and h): over its
        ``step_time``, or else, with plain decoding measured in ``b``, over plain's time scaled as in the nearest
        bucket that has both (a cold bucket need not measure what its neighbour found losing). Plain decoding's time
        is never predicted (it has no drafter forward); inf: to be measured."""
        t = self.step_time(b, k) if k else None
        if t is None and k and (b, 0) in self.time:
            for _, nb in sorted((abs(nb.bit_length() - b.bit_length()), nb) for (nb, j) in self.time if j == 0):
                if nb != b and (tn := self.step_time(nb, k)) is not None:
                    t = self.time[b, 0] * tn / self.time[nb, 0]
                    break
        return float("inf") if t is None else self.rate(b, k, t, need, h)

    def choose(self, batch: int, left: Sequence[int] | None = None) -> int:
        """The draft length for a step of ``batch`` requests (``left``: each one's tokens left to emit, see rates)."""
        self.last = self.pick(batch, left)
        return self.last

    def pick(self, batch: int, left: Sequence[int] | None) -> int:
        b, ks = bucket(batch), self.opts.candidates
        n = self.steps[b] = self.steps.get(b, 0) + 1
        if b in self.probing:  # a re-measurement goes on until it has its samples (a host may time a step late)
            k, asks, want = self.probing.pop(b)
            if self.taken.get((b, k), 0) < want and asks:
                self.probing[b] = (k, asks - 1, want)
                return k
        need, h = self.spell(left)
        rates = self.rated(b, need, h)
        for k in ks:  # shortest first; a longer one only while its predicted rate may compete
            short = len(self.samples.get((b, k), ())) < SAMPLES
            if short and (k in rates or self.predicted(b, k, need, h) >= PROBE * max(rates.values(), default=0.0)) \
                    and self.ask(b, k, n):
                return k
        if not rates:  # nothing measured in the bucket, nothing left to ask: plain decoding (held at k = 0: always)
            return 0
        best = max(rates, key=rates.get)
        margin = 1.0 if self.last else self.opts.margin  # (already speculating: stay while it beats plain decoding)
        if best and rates[best] < margin * rates.get(0, 0.0):  # (plain not measured yet: keep best)
            best = 0
        early = best and EARLY <= n < self.opts.explore_every and not n & (n - 1)  # plain again, at 16, 32, 64, ...
        if early or n % self.opts.explore_every == 0:  # re-measure plain decoding or the best-rated longer length
            up = {k: r for k, r in rates.items() if k > best}  # from plain: the shortest (the first draft's rate)
            probe = (min(up) if best == 0 else max(up, key=up.get)) if up else best
            if best and (early or n // self.opts.explore_every % 2):
                probe = 0
            elif best and up.get(probe, 0) < PROBE * rates[best]:
                probe = best
            if probe != best:  # fresh samples into its window: a cost that fell shows, one that rose shows when chosen
                self.probing[b] = (probe, PATIENCE, self.taken.get((b, probe), 0) + SAMPLES)
                return probe
        return best

    def ask(self, b: int, k: int, n: int) -> bool:
        """Whether length k, still short of its samples in bucket ``b``, is asked for them at the bucket's step n (and
        count the ask): ``PATIENCE`` times per ``explore_every`` steps of the bucket. A host may never time a length
        in a bucket: SGLang times no step that follows a prefill, and a wave of 64 requests spends its first two
        steps at 64, so a length asked only there ran untimed in both steps of every wave."""
        epoch = n // self.opts.explore_every
        at, asked = self.asked.get((b, k), (epoch, 0))
        if at == epoch and asked >= PATIENCE:
            return False
        self.asked[b, k] = (epoch, asked + 1 if at == epoch else 1)
        return True

    def observe(self, batch: int, k: int, seconds: float, accepted: Sequence[int] = (), switch: bool = False) -> None:
        """A step of ``batch`` requests that verified ``k`` drafts each took ``seconds``; ``accepted``: the drafts
        accepted per request (k > 0); ``switch``: the step verified none and drafted k for the next (see rates).
        ``per_request`` (a host whose step time grows with its batch: a CPU): each time is taken as the bucket's
        smallest batch would take it, so that of lengths measured as the batch shrank the later one does not look
        cheaper; a step's time is its fixed part and a part per request, their ratio measured by the bucket's plain
        steps (``window_time``)."""
        key = (b := bucket(batch), -k if switch else k)
        self.samples.setdefault(key, deque(maxlen=self.opts.time_window)).append((batch, seconds))
        self.taken[key] = self.taken.get(key, 0) + 1
        moved = []  # buckets whose fixed part moved: every length of theirs timed again
        if self.per_request and key[1] == 0 and (self.taken[key] <= 2 * self.opts.time_window
                                                  or self.taken[key] % REFIT_EVERY == 0):
            for nb in neighbours(b):  # (the fits that hold bucket b's plain steps)
                f, before = self.fixed_part(nb), self.fixed.get(nb, 0.0)
                if abs(f - before) > REFIT * (before + 1.0):
                    self.fixed[nb] = f
                    moved.append(nb)
        for other in [kk for kk in self.samples if kk[0] in moved or kk == key]:
            self.time[other] = self.window_time(other)
        self.count(k, accepted)

    def window_time(self, key: tuple[int, int]) -> float:
        """The lower quartile of the cell's window, a step of m requests counted (f + b) / (f + m) of its time in
        bucket b (``fixed_part`` f; a host that is not ``per_request``: as it was)."""
        b, f = key[0], self.fixed.get(key[0], 0.0)
        times = sorted(t * (f + b) / (f + m) if self.per_request else t for m, t in self.samples[key])
        return times[len(times) // 4]

    def fixed_part(self, b: int) -> float:
        """The fixed part of a step in bucket ``b``, in requests' worth: f = alpha / beta of T = alpha + beta m fitted
        to the plain steps of bucket b and its two neighbours (batches b / 2 to 4 b - 1), one point per batch size:
        its steps' median time (0, proportional, until two batch sizes are timed or where the fit is not positive).
        Fitted over the bucket alone (batches b to 2 b - 1, each step a point), a few steps slowed by what else a
        step after a wave's ends does moved f from 0 to hundreds, plain decoding's time with it by 30 %."""
        times: dict[int, list[float]] = {}
        for nb in neighbours(b):
            for m, t in self.samples.get((nb, 0), ()):
                times.setdefault(m, []).append(t)
        if len(times) < 2:
            return 0.0
        pts = [(m, sorted(ts)[len(ts) // 2]) for m, ts in times.items()]
        mm, mt = sum(m for m, _ in pts) / len(pts), sum(t for _, t in pts) / len(pts)
        beta = sum((m - mm) * (t - mt) for m, t in pts) / sum((m - mm) ** 2 for m, _ in pts)
        alpha = mt - beta * mm
        return alpha / beta if alpha > 0 and beta > 0 else 0.0

    def count(self, k: int, accepted: Sequence[int], ended: int | None = None, kept: int | None = None,
              offered: Sequence[int] | None = None) -> None:
        """The drafts each request accepted in a step that verified ``k`` drafts each (a host that learns a step's
        time and its acceptance apart); ``ended``: the step's requests that had ended before it ran, ``kept``: the
        tokens the others kept (default: their accepted drafts + 1 each), given by a host that knows them for every
        step, k = 0 included: the answers' length is then measured. ``offered``: the drafts each of those requests
        could keep (default k each; fewer where its drafts were cut or its token budget ends sooner: a draft past
        that is not a rejection)."""
        d = self.opts.accept_decay
        if ended is not None:
            kept = sum(a + 1 for a in accepted) if kept is None else kept
            self.answer = (d * self.answer[0] + kept, d * self.answer[1] + ended)
        if k and accepted:
            self.s, self.cs, offered = None, None, [k] * len(accepted) if offered is None else offered
            self.longest = max(self.longest, *offered)
            risk = Counter(min(o, a + 1) for a, o in zip(accepted, offered))
            took = Counter(min(a, o) for a, o in zip(accepted, offered))  # (a budget read late: never above offered)
            n_risk, n_took = 0, 0  # requests offered draft i that accepted draft i - 1, that accepted draft i
            for i in range(self.opts.max_draft, 0, -1):  # every rate decays (one not measured now: its counts fade)
                n_risk, n_took = n_risk + risk.get(i, 0), n_took + took.get(i, 0)
                self.reached[i] = d * self.reached[i] + n_risk
                self.passed[i] = d * self.passed[i] + n_took


class StepClock:
    """A host's view of one engine: ``lengths`` asked each step (``choose``), and each step reported with its time
    since the previous report (a host that steps back to back: the loop's period). Two ways to report: ``done`` as a
    step ends (a host that knows its requests then: vLLM), or ``dispatched`` as it goes to the device and ``result``
    when its acceptance comes back, later steps possibly dispatched meanwhile (SGLang's overlap scheduling);
    ``synchronous``: the device computes a step as it is dispatched (the host's CPU), an asynchronous one in the
    background. Time is wall time (a CPU's process time counts a step's threads, not its throughput: it rated a short
    plain step on two cores at 1.17x its wall time and a long verify at 1.05x).
    ``kept`` (a host whose result comes before it cuts a request's tokens at its end - EOS, a stop, its token budget):
    a request's output length as the host keeps it; a step's acceptance then counts the tokens each request kept
    (drafts accepted past its end gain nothing), read at the next result."""

    def __init__(self, lengths: DraftLength, synchronous: bool = False, kept: Callable[[Any], int] | None = None,
                 left: Callable[[Any], int] | None = None):
        self.lengths, self.last, self.synchronous, self.kept = lengths, time.perf_counter(), synchronous, kept
        self.left = left  # a request's tokens left to emit (``DraftLength.rates``), read from the host's handle
        self.pending: deque[tuple | None] = deque(maxlen=16)  # dispatched: (batch, k, requests); None: a prefill
        self.since: list[tuple | None] = []  # dispatched since the previous result
        self.unsettled: tuple | None = None  # (k, requests, kept lengths before, tokens left) of a result

    def done(self, scheduled: Mapping[Hashable, int], drafts: Mapping[Hashable, int],
             emitted: Mapping[Hashable, int], k: int | None = None, timed: bool = True,
             left: Mapping[Hashable, int] | None = None) -> None:
        """A step ended: ``scheduled`` tokens per request, ``drafts`` verified per request, ``emitted`` tokens per
        request, ``k`` the draft count chosen for it (default: the most verified; a drafter may offer fewer than it
        was asked for, and the step then counts as the choice's, or that choice would stay unmeasured). A
        decode-only step (every request runs its drafts + 1) reports its batch, draft count, time and the drafts each
        request accepted (``timed=False``: its acceptance only - a host whose step also drafts for the next one with
        another count); a step with a prefill only restarts the clock. ``left``: tokens left to emit per request at
        the step (drafts past that are not rejections)."""
        seconds = self.restart()
        k = max(drafts.values(), default=0) if k is None else k
        if scheduled and all(n == 1 + drafts.get(r, 0) for r, n in scheduled.items()):
            live = {r for r in scheduled if emitted.get(r, 0) > 0}  # (none emitted: scheduled after its end, async)
            if timed:
                self.lengths.observe(len(scheduled), k, seconds)
            left, ran = left or {}, [r for r in drafts if r in live]
            self.lengths.count(k, [emitted[r] - 1 for r in ran], len(scheduled) - len(live),
                               sum(emitted[r] for r in live), [min(drafts[r], left.get(r, 1 << 30) - 1) for r in ran])

    def dispatched(self, batch: int, requests: Sequence = ()) -> int:
        """A step goes to the device: ``batch`` requests decoding (0: a step with a prefill; ``requests``: the host's
        handles of them, read by ``kept``) -> its draft length."""
        left = [self.left(r) for r in requests] if self.left is not None and requests else None
        k = self.lengths.choose(batch, left) if batch else 0
        self.pending.append((batch, k, requests) if batch else None)
        self.since = self.since[:1] + [self.pending[-1]]  # (one step, or more than one)
        return k

    def result(self, accepted: Sequence[int]) -> None:
        """The oldest dispatched decode step's result (results come in step order, a prefill's is not reported):
        the drafts each request accepted. The time since the previous result is the computing of this step on an
        asynchronous device, and on a synchronous one of the steps dispatched meanwhile (under overlap scheduling
        the step after this one); it is measured when that is one decode step, with no prefill."""
        seconds, prefill, step = self.restart(), False, None
        ran, self.since = (self.since[0] if len(self.since) == 1 else None), []
        while self.pending and (step := self.pending.popleft()) is None:
            prefill = True
        if step is None or step[0] != len(accepted):  # not a step dispatched here
            return
        if self.kept is None:
            self.lengths.count(step[1], accepted)
        else:
            self.settle()
            left = [self.left(r) for r in step[2]] if self.left is not None else None  # (its budget at the step)
            self.unsettled = step[1], step[2], [self.kept(r) for r in step[2]], left
        if not self.synchronous:
            ran = None if prefill else step
        if ran is not None:
            self.lengths.observe(*ran[:2], seconds)

    def settle(self) -> None:
        """Count the previous result's acceptance as the tokens its requests kept (a request that kept none had ended
        before the step ran; one whose token budget left room for fewer than k drafts was offered those)."""
        if self.unsettled is not None:
            k, requests, before, left = self.unsettled
            gains = [self.kept(r) - b for r, b in zip(requests, before)]
            offered = [min(k, n - 1) for g, n in zip(gains, left) if g > 0] if left is not None else None
            self.lengths.count(k, [g - 1 for g in gains if g > 0], sum(g <= 0 for g in gains), offered=offered)
            self.unsettled = None

    def restart(self) -> float:
        """Restart the clock -> the seconds since the previous step."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds


class DraftLengths(StepClock):
    """A host's batch size -> draft count table (vLLM's ``Scheduler.dynamic_sd_lookup``), answered by the policy. A step
    verifies the drafts proposed with the count of the schedule ``lag`` schedules before the newest when its output
    comes back (1; 2 under async scheduling, which schedules the next step first), and proposes with its own: its
    time is the cost of one count only where the counts in between are that count (``steady``)."""

    def __init__(self, lengths, lag: int = 1, left: Callable[[], Mapping[Hashable, int]] | None = None):
        super().__init__(lengths)
        self.asked: deque[int] = deque(maxlen=lag + 1)
        self.lefts: deque[Mapping] = deque(maxlen=lag + 1)  # (the left of each schedule in asked)
        self.left_now = left  # request -> tokens left to emit at the step verifying this schedule's drafts

    def __getitem__(self, batch: int) -> int:
        self.lefts.append(self.left_now() if self.left_now is not None else {})
        self.asked.append(self.lengths.choose(batch, list(self.lefts[-1].values()) or None))
        return self.asked[-1]

    def done(self, scheduled, drafts, emitted, k: int | None = None, timed: bool = True) -> None:
        """``StepClock.done``; a step that verified no draft and drafted for the next (a switch from plain decoding,
        or the first decode step of requests that came with no drafts) is timed as a switch (``DraftLength.rates``),
        not as a step of the count its drafts were asked with."""
        new = self.asked[-1] if self.asked else 0
        if new and scheduled and all(n == 1 for n in scheduled.values()):
            self.lengths.observe(len(scheduled), new, self.restart(), switch=True)
        else:
            super().done(scheduled, drafts, emitted, k, timed, self.lefts[0] if len(self.lefts) == self.lefts.maxlen
                         else None)

    def verified(self) -> int | None:
        """The count chosen for the drafts the step just ended verified (None: not known yet)."""
        return self.asked[0] if len(self.asked) == self.asked.maxlen else None

    def steady(self) -> bool:
        """The step just ended verified and proposed with the same count."""
        return len(set(self.asked)) == 1
