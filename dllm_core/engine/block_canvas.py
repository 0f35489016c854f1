"""The lifecycle of a host that decodes each request one block at a time in the request's own rows (SGLang's block
canvas: each host block of ``L`` ids is a canvas of one block of the request's slot), written once. The host hands
over a new block's ids (a literal [MASK] id inside the prompt as -1: never decoded); the core plans each forward
(``plan``: dLLM-Cache over the block's cached layers, or None: the model's plain forward), steps it (``take``,
commits written back into the host's ids) and says when a block is final: decoded, and seen decoded by a forward,
which the host persists (that forward runs exact).

    lc = BlockLifecycle(L, mask_id, device, seed, features=(layers, kv_width, dim, like))
    lc.admit(slot, rid, opts, max_new_tokens, prompt_len, seed)
    lc.start(fresh_slots, ids, prompt)   # a new block of each: the host's ids [k, L] (prompt positions [k, L])
    ctx = lc.plan(slots, live, caching)  # before the forward (None: the model's plain forward)
    done, final = lc.take(slots, live, logits, ids)
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ..cache import HostRequest
from ..cache.executor import CachedStep, PartStores
from .context import StepContext
from .logprobs import Logprobs
from .slots import WORK_KEPT, ResponseSlots, SlotConfig


class BlockLifecycle:
    """The module doc's lifecycle over the core's ``ResponseSlots`` (``slots``): a request's sampler rows and policy
    state kept across its blocks; ``features``: dLLM-Cache's feature stores over a block (layers, kv width, dim, a
    weight of the model's dtype)."""

    def __init__(self, L: int, mask_id: int, device, seed: int = 0, features=(0, 0, 0, None)):
        self.L, self.mask_id, self.device, self.features = L, mask_id, device, features
        self.slots = ResponseSlots(0, L, mask_id, device, seed=seed, layers=features[0])
        self.configs: dict = {}  # (ResponsePlan, DecodeOptions) -> SlotConfig (built once)
        self.lengths: dict[int, int] = {}  # per slot: prompt + response in whole blocks (the uncached loop's rows)
        self.literal: frozenset = frozenset()  # slots whose block holds literal prompt [MASK] ids (as -1)
        # logprobs (a request that asks): its block's response columns while it decodes, each decoded block's by rid
        self.open: dict[int, torch.Tensor] = {}
        self.decoded: OrderedDict[str, list[Logprobs]] = OrderedDict()

    def admit(self, slot: int, rid: str, opts, max_new_tokens: int | None, prompt_len: int, seed: int | None,
              logprobs: int | None = None) -> None:
        """A new request in ``slot`` (free) with its options (``FlatOptions``); a fixed schedule's steps per block
        follow from its ``max_new_tokens``; ``logprobs``: its tokens' and top k are kept (``logprobs``)."""
        L, core = self.L, self.slots
        core.fit(slot + 1, L)
        fixed = opts.decode.steps is not None and opts.sampler.fixed_steps
        plan = opts.response(max_new_tokens if fixed else L, L)
        config = self.configs.get((plan, opts.decode))
        if config is None:
            config = self.configs[plan, opts.decode] = SlotConfig.of(opts.decode, plan)
        core.admit(slot, config, HostRequest(opts.cache, 0), rid,
                   None if opts.cache.exact else PartStores(*self.features), seed, logprobs)
        if logprobs is not None:
            self.decoded[rid] = []
            while len(self.decoded) > WORK_KEPT:
                self.decoded.popitem(last=False)
        self.lengths[slot] = prompt_len + opts.response(max(max_new_tokens or 0, 1), L).decoded

    def start(self, slots: np.ndarray, ids: torch.Tensor, prompt: torch.Tensor | None = None) -> None:
        """A new block for each of ``slots`` from the host's ids [k, L]; ``prompt`` [k, L] bool: the positions that
        hold prompt tokens, where a [MASK] id is the prompt's own (literal, never decoded; None: no prompt there)."""
        literal = prompt is not None
        if literal:  # marked -1 in the canvas
            ids = torch.where(prompt & (ids == self.mask_id), -1, ids)
        self.slots.start(slots, 0, self.L, ids)
        for s, row in zip(slots.tolist(), ids):
            if self.slots.lp_k[s] >= 0:  # the block's response positions: its masks (a host read, when asked)
                self.open[s] = (row == self.mask_id).nonzero()[:, 0]
        fs = frozenset(slots.tolist())
        self.literal = (self.literal - fs) | (fs if literal else frozenset())

    def plan(self, slots: np.ndarray, live: list[int], caching: bool, counted: bool = True) -> StepContext | None:
        """The forward of a batch whose row b is slot ``slots[b]``'s block, rows ``live`` stepped (the others: final,
        persisted): their blocks begun, what the uncached loop runs counted; -> the context of a forward that runs
        cached layers (dLLM-Cache over the block), else None (every row through every layer: counted here).
        ``counted`` False: a model that counts no work (not one of ours) runs the block whole."""
        core, L = self.slots, self.L
        ls = slots if len(live) == len(slots) else slots[live]
        core.begin(ls)
        if not counted:
            return None
        core.count(ls, np.array([self.lengths[s] for s in ls.tolist()], dtype=np.int64) * core.layers)
        at = np.full(len(slots), core.n_slots)  # each row's slot; a block that is not stepped: the spare one
        at[live] = slots[live]
        rows = torch.as_tensor(np.repeat(at, L), device=self.device)  # [B * L]
        regions = [r for i, hp in zip(live, core.plan(ls, 0, L, 0)) for r in hp.regions(
            i * L, core.stores[slots[i]], self.device)] if caching else []
        if not regions:
            core.ran_whole(rows)
            return None
        return StepContext(CachedStep(regions), work=core.token_layers, row_slots=rows)

    def take(self, slots: np.ndarray, live: list[int], logits: torch.Tensor,
             ids: torch.Tensor) -> tuple[list[bool], list[bool]]:
        """One step of the live rows' blocks (``logits`` [B * L, V]), commits written into the host's ids [B, L] in
        place -> per live row (decoded, final): final when a step that changed nothing decoded it; one that changed
        something is final at its next forward, which persists it exact (its stores cleared)."""
        core, (B, L) = self.slots, ids.shape
        whole, lg = len(live) == B, logits.view(B, L, -1)
        ls = slots if whole else slots[live]
        done = core.take(ls, lg if whole else lg[torch.as_tensor(live, device=lg.device)])
        final = []
        for s, d, c in zip(ls.tolist(), done.tolist(), core.changed[ls].tolist()):
            final.append(d and not c)
            if d and core.stores[s] is not None:
                core.stores[s].clear()
            if d and s in self.open:
                self.decoded[core.rid[s]].append(core.logprobs_of(s, self.open.pop(s)))
        x = core.canvas[core.rows(ls), :L]
        if whole and self.literal.isdisjoint(ls.tolist()):
            ids.copy_(x)
        else:
            r = torch.as_tensor(live, device=ids.device)
            ids[r] = torch.where(x == -1, ids[r], x)
        return done.tolist(), final

    def logprobs(self, rid: str, have: int, n: int) -> Logprobs | None:
        """The logprobs of request ``rid``'s output positions [have, n) of its decoded blocks (None: not asked, or
        nothing new)."""
        parts = self.decoded.get(rid)
        if not parts:
            return None
        got = Logprobs(*(torch.cat([getattr(p, f) for p in parts]) for f in Logprobs.FIELDS))
        n = min(n, got.token.shape[0])
        return Logprobs(*(getattr(got, f)[have:n] for f in Logprobs.FIELDS)) if n > have else None
