"""One denoise step over the rows it is given, and per-row block progress: the loop body every
engine runs (the embedded loop, the vLLM sampler, the SGLang algorithm).

    plan = plan_step(sampler, st, masked)            # active rows -> focus -> window (before the forward)
    ...                                              # the engine's forward: logits of plan.window
    x, done = take_step(sampler, st, plan, logits, x, tc)   # propose -> commit (active rows) -> advance

``x`` is the block's tokens [B, L]; ``done`` [B] says which rows finished their block (the
sampler's ``rows_done``). A paged host's requests move through their canvases in ``slots.ResponseSlots``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import Sampler, TokenContext


def mask_in_prompt(prompt, mask_id: int) -> str | None:
    """The admission rule of every engine: a prompt may not hold the mask token (it would be decoded
    as a position to fill). -> the error text, or None."""
    ids = list(prompt)
    if mask_id in ids:
        return f"prompts must not contain the mask token id {mask_id} (found at position {ids.index(mask_id)})"
    return None


def token_range_error(prompt, vocab_size: int) -> str | None:
    """Every prompt id is a token of the model's vocabulary [0, vocab_size) (an id past it would index past the
    embedding). -> the error text, or None."""
    for i, t in enumerate(prompt):
        if not 0 <= t < vocab_size:
            return f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary), got {t} at position {i}"
    return None


@dataclass
class StepPlan:
    """What one step is about, per row: decoding or idle, and the windows its logits must cover."""

    active: torch.Tensor                        # [B] bool: rows that take part (others idle)
    focus: tuple[torch.Tensor, torch.Tensor] | None  # [B], [B]: each row's window [lo, hi) in the block (None:
    #                                                  the caller gave the window)
    window: tuple[int, int]                     # union of the active rows' windows (host ints)


def plan_step(sampler: Sampler, st: dict, masked: torch.Tensor, window: tuple[int, int] | None = None) -> StepPlan:
    """masked [B, L] -> the step's plan (no device sync, except SlowFast's window union when ``window`` - the
    union of the rows' windows, known to the caller - is not given)."""
    active = sampler.active(st, masked)
    if window is not None:
        return StepPlan(active, None, window)
    return StepPlan(active, sampler.focus(st), sampler.window(st, active))


def take_step(sampler: Sampler, st: dict, plan: StepPlan, logits: torch.Tensor, x: torch.Tensor,
              tc: TokenContext, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, W, V] of ``plan.window``, x [B, L] block tokens -> (x [B, L], done [B] bool).

    Commits only in active rows (``Sampler.step``'s contract); a variable-step rule that leaves masks after L steps
    is an error (every step of such a rule commits at least one token)."""
    return _commit(sampler, st, plan.window, logits, x, tc, check)


def _commit(sampler: Sampler, st: dict, window: tuple[int, int], logits: torch.Tensor, x: torch.Tensor,
            tc: TokenContext, check: bool) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = window
    if (lo, hi) == (0, x.shape[1]):  # the whole block
        x0, commit = sampler.step(logits, x, st, tc)
        x = torch.where(commit, x0, x)
    else:
        x0, commit = sampler.step(logits, x[:, lo:hi], st, tc, lo)
        x = x.clone()
        x[:, lo:hi] = torch.where(commit, x0, x[:, lo:hi])
    masked = x == tc.mask_id
    if check and (bad := stuck(sampler, st, masked)) is not None and bool(bad.any()):
        raise stuck_error(sampler, x.shape[1])
    return x, sampler.rows_done(st, masked)


def stuck(sampler: Sampler, st: dict, masked) -> torch.Tensor | None:
    """[B] rows that a variable-step rule left with masks after L steps of a block of L (an error: every step of
    such a rule commits at least one token); None when it cannot happen yet. masked [B, L] (or a callable giving
    it: computed only when needed)."""
    L = st["L"]
    if sampler.fixed_steps or st["n"] < L:
        return None
    return (st["i"] >= L) & (masked() if callable(masked) else masked).any(-1)


def stuck_error(sampler: Sampler, L: int) -> RuntimeError:
    return RuntimeError(f"sampler {sampler.name} left masks after {L} steps of a block of {L}")


def denoise_step(sampler: Sampler, st: dict, logits: torch.Tensor, x: torch.Tensor, tc: TokenContext,
                 window: tuple[int, int] | None = None, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A host engine's step with the whole block's logits [B, L, V]: plan + take_step (``window``: the union of
    the rows' windows when the caller knows it; ``check``: read the ``stuck`` rule here)."""
    if window is None:
        window = plan_step(sampler, st, x == tc.mask_id).window
    lo, hi = window
    return _commit(sampler, st, window, logits if (lo, hi) == (0, x.shape[1]) else logits[:, lo:hi], x, tc, check)


class SlotStates:
    """A sampler's per-request rows (``new_state``) kept between a host's scheduler rounds, one row
    per request slot (``grow`` adds slots). Host-side entries (block counters) keep the latest value.
    A caller that names a batch by a host ``key`` (its slots as a tuple) keeps that batch's rows gathered
    between steps: the same batch again reads and writes them in place, another batch writes them back
    first (no gather / scatter per step while a host's batch is unchanged)."""

    def __init__(self, sampler: Sampler, block_len: int, steps: int, device, slots: int = 0):
        self.sampler, self.L, self.steps, self.device = sampler, block_len, steps, device
        self.full = sampler.new_state(slots, block_len, steps, device)
        self.slots = slots
        self.held: list | None = None  # [key, slots, batch state, dirty]

    def grow(self, slots: int) -> None:
        """At least ``slots`` rows."""
        if slots > self.slots:
            self.flush()
            extra = self.sampler.new_state(slots - self.slots, self.L, self.steps, self.device)
            self.full = {k: torch.cat([v, extra.get(k, v[:0].new_zeros(slots - self.slots, *v.shape[1:]))])
                         if isinstance(v, torch.Tensor) else v for k, v in self.full.items()}
            self.slots = slots

    def flush(self) -> None:
        """Write the held batch back into its rows."""
        held, self.held = self.held, None
        if held is not None and held[3]:
            self._write(held[1], held[2])

    def gather(self, slots: torch.Tensor, key: tuple | None = None) -> dict:
        """The rows of ``slots`` [m] as one batch state (held under ``key``)."""
        if key is not None and self.held is not None and self.held[0] == key:
            return self.held[2]
        self.flush()
        st = {k: v[slots] if isinstance(v, torch.Tensor) else v for k, v in self.full.items()}
        if key is not None:
            self.held = [key, slots, st, False]
        return st

    def scatter(self, slots: torch.Tensor, st: dict, key: tuple | None = None) -> None:
        """Write a batch state back into the rows of ``slots`` (under ``key``: when another batch needs them)."""
        if key is not None and (self.held is None or self.held[0] == key):
            self.held = [key, slots, st, True]
            return
        self.flush()
        self._write(slots, st)

    def _write(self, slots: torch.Tensor, st: dict) -> None:
        for k, v in st.items():
            if not isinstance(v, torch.Tensor):
                self.full[k] = v
                continue
            if k not in self.full:
                self.full[k] = v.new_zeros((self.slots, *v.shape[1:]))
            self.full[k][slots] = v

    def reset(self, slots: torch.Tensor, masked: torch.Tensor | None = None) -> None:
        """Fresh rows (``new_state``) for new requests in ``slots``; ``masked`` [m, L]: their block begins too."""
        st = self.sampler.new_state(len(slots), self.L, self.steps, self.device)
        if masked is not None:
            self.sampler.begin_block(st, masked)
        self.scatter(slots, st)

    def begin_block(self, slots: torch.Tensor, masked: torch.Tensor, key: tuple | None = None) -> None:
        """``Sampler.begin_block`` for the rows of ``slots``; masked [m, L] (``key``: the batch is held, as by
        ``gather``)."""
        st = self.gather(slots, key)
        self.sampler.begin_block(st, masked)
        self.scatter(slots, st, key)
