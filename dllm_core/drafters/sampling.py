"""Sampling on the causal-target side: DFlash speculative decoding, TokenSwift and training-data regeneration.

- ``SamplingParams``: temperature / top-k / top-p of one generation, validated once.
- ``filter_logits`` / ``probs_from_logits``: temperature, top-k and top-p through the diffusion samplers'
  ``dllm_core.sampling.base.filter_logits`` - one top-p rule in the whole package (Dream's: keep the smallest
  sorted prefix whose mass *before* each token is <= top_p; the most likely token always survives).
- ``sample_probs`` / ``target_choice``: one categorical draw per row; the target's token (argmax or a sample).
- ``Emitter`` / ``clip_at_stop``: the generated tokens of a request, cut at max_new_tokens and the first stop.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..sampling import base


@dataclass(frozen=True)
class SamplingParams:
    """How the target's logits become the distribution p that decoding samples (and verification preserves)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_args(cls, a) -> SamplingParams:
        """From the ``add_sampling_args`` flags of a parsed command line."""
        return cls(a.temperature, a.top_k, a.top_p)


def add_sampling_args(p) -> None:
    """``--temperature``, ``--top-k``, ``--top-p`` (defaults: greedy, filters off) on an argparse parser."""
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] -> float32 logits after temperature, top-k and top-p (filtered tokens at -inf)."""
    tc = base.TokenContext(mask_id=-1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    return base.filter_logits(logits.float(), tc)  # (mask_id is not read by the filter)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> float32 probabilities after temperature, top-k and top-p (requires temperature > 0)."""
    if params.greedy:
        raise ValueError("probs_from_logits: temperature 0 is greedy; use argmax / accept_greedy")
    return filter_logits(logits, params).softmax(-1)


def sample_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One categorical draw per row of probs [..., V] -> [...] (exponential race; no host sync)."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(-1)


def target_choice(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
                  ) -> torch.Tensor:
    """The target's token per row: logits [..., V] -> [...] (argmax when greedy, else one sample of p)."""
    if params.greedy:
        return logits.argmax(-1)
    return sample_probs(probs_from_logits(logits, params), generator)


def clip_at_stop(new: Sequence[int], limit: int, stop_token_ids: Collection[int]) -> list[int]:
    """The first ``limit`` tokens of ``new``, cut just after the first stop token among them (kept)."""
    new = list(new[: max(limit, 0)])
    for i, t in enumerate(new):
        if t in stop_token_ids:
            return new[: i + 1]
    return new


class Emitter:
    """The generated tokens of one request. ``emit(new)`` appends accepted tokens until ``max_new_tokens`` or
    the first stop token (included) and returns the ones it appended; ``done`` once either is reached."""

    def __init__(self, max_new_tokens: int, stop_token_ids: Iterable[int] = ()):
        self.max_new_tokens, self.stop_token_ids = max_new_tokens, frozenset(stop_token_ids)
        self.tokens: list[int] = []
        self.done = False

    def __call__(self, new: Sequence[int]) -> list[int]:
        new = clip_at_stop(new, self.max_new_tokens - len(self.tokens), self.stop_token_ids)
        self.tokens += new  # in place: callers may hold the list
        self.done = (self.done or len(self.tokens) >= self.max_new_tokens
                     or (bool(new) and new[-1] in self.stop_token_ids))
        return new
