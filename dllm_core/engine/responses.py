"""The lifecycle of a host that steps each response as one canvas after its prompt and runs every live request's
positions [0, P + G) in one packed forward (SGLang's block scheduler with a policy over the whole response), written
once: the host's block of ``L`` ids is a window onto the canvas (at the request's block offset). The host supplies,
at admission, a request's prompt, the output it committed before and its options; per forward, its batch's slots,
block offsets and committed lengths; after it, the logits of its blocks.

    lc = ResponseLifecycle(L, mask_id, device, seed, features=(layers, kv_width, dim, like))
    lc.admit(slot, rid, prompt, output, decode, plan, policy, seed, logprobs)  # its committed output kept
    ctx = lc.plan(slots, offsets, committed, shift)   # before the forward: StepContext(packed=ForwardPlan)
    x = ctx.packed.hidden(embed, n, ops, prompt_kv)   # the model: every kept position through every layer
    done = lc.take(logits, ids)                       # after it: the core's step, the canvas mirrored into ids
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..cache import CachePolicy, HostPlan, HostRequest
from ..cache.executor import PartStores
from ..cache.host import PackedStep
from .context import StepContext
from .logprobs import Logprobs
from .request import DecodeOptions, ResponsePlan
from .slots import ResponseSlots, SlotConfig

logger = logging.getLogger(__name__)


@dataclass
class Response:
    """One request on the core's slots: prompt ids [P], ``G`` response positions (``ResponseSlots.canvas[slot, :G]``);
    while decoding, its features (``feats``)."""

    slot: int
    rid: str
    prompt: torch.Tensor  # [P]
    G: int
    feats: PartStores | None = None

    def __post_init__(self):
        self.P, self.end = self.prompt.shape[0], self.prompt.shape[0] + self.G


@dataclass
class RowPlan:
    """One request's share of a forward: the core's plan of its step, logits for [start, start + L)."""

    resp: Response
    plan: HostPlan
    start: int
    ids: torch.Tensor  # [P + G] its sequence


@dataclass
class ForwardPlan:
    """The packed rows of a forward (``StepContext.packed``): per batch row its ``RowPlan`` (None: nothing to run);
    ``shift`` 1: the logit row of position i is the hidden state of i - 1 (Dream)."""

    slots: list[int]
    rows: list[RowPlan | None]
    shift: int
    work: torch.Tensor | None = None  # the core's per-slot tally (full-layer rows are added to it, no sync)
    step: PackedStep | None = None  # the forward's executor step (``hidden``)
    buckets: bool = False  # rows, requests and keys padded to the bucket set (``PackedStep``)

    def hidden(self, embed, n_layers: int, ops, prompt_kv=None) -> torch.Tensor:
        """Pre-norm final hidden states [N, d] of each live request's positions [0, P + G) that its plan keeps,
        concatenated (and ``buckets``' padding rows after them): two parts per request (prompt, response) through
        the core's ``PackedStep``; ``ops(i, step)``: layer i's ``LayerOps`` (its ``attend`` may use
        ``step.attention``); ``prompt_kv(i, k, v)``: the prompts' K / V [sum P, kv] of a layer that recomputed some of
        them (a host writes them into its pool)."""
        rows = [r for r in self.rows if r is not None]
        ids = torch.cat([r.ids for r in rows])
        self.step = step = PackedStep([r.plan for r in rows], [r.resp.end for r in rows],
                                      [[("prompt", 0, r.resp.P), ("response", r.resp.P, r.resp.end)] for r in rows],
                                      [r.resp.feats for r in rows], ids.device, self.buckets)
        x = step.padded(embed(ids if step.kept is None else ids[step.kept]))  # [N (+ pad), d] (kept positions)
        x = step.run([ops(i, step) for i in range(n_layers)], x)
        for i in range(n_layers) if prompt_kv is not None else ():
            if step.recomputed(0, i):  # the prompts' K/V moved (a drift test's refresh included)
                prompt_kv(i, *(torch.cat([g[0].store.bufs[j][i, 0] for g in step.regions]) for j in (0, 1)))
        self.work[torch.tensor([r.resp.slot for r in rows], device=x.device)] += step.work()  # no sync
        return x

    def logit_rows(self, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the forward's [B * L] logits, rows of ``hidden``'s output) of each live request's block."""
        live = [(b, r) for b, r in enumerate(self.rows) if r is not None]
        dev = live[0][1].ids.device
        out = torch.tensor([b for b, _ in live], device=dev)[:, None] * L + torch.arange(L, device=dev)
        return out.flatten(), self.step.rows([r.start for _, r in live], L, self.shift).flatten()


class ResponseLifecycle:
    """The module doc's lifecycle over the core's ``ResponseSlots`` (``slots``): each request's ``Response`` by slot,
    its plan per forward (``plan``), the core's step after it (``take``) and its logprobs for the host (``logprobs``).
    ``features`` (layers, kv width, dim, a weight of the model's dtype): each decoding request's feature stores.
    ``buckets`` (a host that captures a graph per shape sets it; none does yet): each forward's shapes from the
    bucket set."""

    buckets = False

    def __init__(self, L: int, mask_id: int, device, seed: int = 0, features=(0, 0, 0, None)):
        self.L, self.mask_id, self.device, self.features = L, mask_id, device, features
        self.slots = ResponseSlots(0, L, mask_id, device, seed=seed, layers=features[0])
        self.responses: dict[int, Response] = {}  # by slot (replaced when the host gives the slot a new request)
        self.batch: tuple[list[Response], list[int], np.ndarray] | None = None  # (responses, offsets, live rows)

    def admit(self, slot: int, rid: str, prompt: list[int], output: list[int], decode: DecodeOptions,
              plan: ResponsePlan, policy: CachePolicy, seed: int | None, logprobs: int | None) -> None:
        """A new request in ``slot`` (free): ``plan``'s response, decoded by ``decode`` under ``policy``; ``output``:
        the tokens it committed before (a request the host retracted and re-admitted), kept, the loop resuming at
        their block."""
        core, G, config = self.slots, plan.decoded, SlotConfig.of(decode, plan)
        r = self.responses[slot] = Response(slot, rid, torch.tensor(prompt, dtype=torch.long, device=self.device), G)
        core.fit(slot + 1, G)
        core.admit(slot, config, HostRequest(policy, 0), rid, seed=seed, logprobs=logprobs)
        out = list(output)[:G]
        core.start(np.array([slot]), r.P, G, torch.tensor([out], dtype=torch.long, device=self.device) if out else None,
                   len(out) // self.L)

    def release(self, slot: int) -> None:
        """The request in ``slot`` ended (decoded, or gone): its work kept by request id, its features freed."""
        self.slots.release(slot)
        if slot in self.responses:
            self.responses[slot].feats = None

    def ids(self, r: Response) -> torch.Tensor:
        """The request's sequence [P + G]: prompt and canvas."""
        return torch.cat([r.prompt, self.slots.canvas[r.slot, :r.G]])

    def plan(self, slots: list[int], offsets: list[int], committed: list[int], shift: int) -> StepContext:
        """The forward of a batch whose row b is the host's block [offsets[b], offsets[b] + L) of slot ``slots[b]``,
        after ``committed[b]`` tokens the host holds (prompt + output): a block of committed tokens (a prefill, or
        what a re-admitted request committed) runs nothing; each other row steps its request's canvas."""
        core, L = self.slots, self.L
        resps = [self.responses[s] for s in slots]
        live = np.array([b for b, (r, c, o) in enumerate(zip(resps, committed, offsets))
                         if core.config[r.slot] is not None and o + L > c], dtype=np.int64)
        rows: list[RowPlan | None] = [None] * len(resps)
        if len(live):
            ls = np.array([resps[b].slot for b in live.tolist()])
            P, G = (np.array([getattr(resps[b], k) for b in live.tolist()]) for k in ("P", "G"))
            core.begin(ls)
            starts = P + core.block_columns(ls)
            for b, hp, a in zip(live.tolist(), core.plan(ls, P, G, shift), starts.tolist()):
                r = resps[b]
                rows[b] = RowPlan(r, hp, a, self.ids(r))
                if r.feats is None:  # its prompt's and its response's features, in every layer
                    r.feats = PartStores(*self.features)
            core.count(ls, (P + G) * core.layers)  # what the uncached loop runs
        self.batch = (resps, offsets, live)
        return StepContext(packed=ForwardPlan(slots, rows, shift, core.token_layers,  # the plan tallies work
                                              buckets=self.buckets))

    def take(self, logits: torch.Tensor, ids: torch.Tensor) -> list[bool]:
        """After the forward: one step of the loop for the live rows (``logits`` [B * L, V] of the batch's blocks);
        the host's block ids [B, L] rewritten from the canvas (mask ids past a response's end: never emitted) ->
        per row whether its block's response positions are decoded."""
        resps, offsets, live = self.batch
        B, L = ids.shape
        if len(live):
            lg = logits.view(B, L, -1)
            lg = lg if len(live) == B else lg[torch.as_tensor(live, device=lg.device)]
            done = self.slots.take(np.array([resps[b].slot for b in live.tolist()]), lg)
            for b in live[done].tolist():
                self.finish(resps[b])
        span = []
        for b, (r, o) in enumerate(zip(resps, offsets)):
            n = max(0, min(L, r.end - o))
            ids[b, :n] = self.ids(r)[o:o + n]
            ids[b, n:] = self.mask_id
            span.append(n)
        inside = torch.arange(L, device=ids.device) < torch.tensor(span, device=ids.device)[:, None]
        return (~((ids == self.mask_id) & inside).any(-1)).tolist()

    def finish(self, r: Response) -> None:
        """A response decoded: its work kept (by request id) and logged; its features freed."""
        name = self.slots.host[r.slot].policy.name
        self.release(r.slot)
        w = self.slots.finished_work[r.rid]
        logger.debug("dllm-serve %s: request %s decoded: %d forwards, %d token-layers of %d uncached (%.3f)", name,
                     r.rid, w["forwards"], w["token_layers"], w["full_token_layers"],
                     w["token_layers"] / max(w["full_token_layers"], 1))

    def logprobs(self, rid: str, have: int, n: int) -> Logprobs | None:
        """The logprobs of request ``rid``'s response positions [have, n) (None: not known here, or nothing new)."""
        r = next((x for x in self.responses.values() if x.rid == rid), None)  # by id: its slot may be given back
        n = min(n, 0 if r is None else r.G)
        return self.slots.logprobs_of(r.slot, slice(have, n)) if n > have else None
