"""TokenSwift decoding options (validated once; CLI flags name the fields)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..verify import SamplingParams

# where the heads' input h0 comes from:
#   shared  - the verification forward (full cache) at the last accepted node: one target forward per step,
#             h0 gives the (already verified) next token, the heads draft the gamma tokens after it;
#   dynamic - the paper's drafting forward: the target re-runs the newest token over the draft-side dynamic
#             KV cache (sinks + importance-ranked entries, budget |B|) and h0 there drafts gamma+1 tokens;
#             verification still uses the full cache.
DRAFTS = ("shared", "dynamic")


@dataclass(frozen=True)
class TokenSwiftConfig:
    max_new_tokens: int = 1024
    draft: str = "shared"
    head_topk: int = 4           # candidates per tree level taken from each head
    head_paths: int = 8          # head paths in the tree (best by summed log-probability)
    ngram_n: int = 4             # n of the reused n-grams (first token + n-1 drafted)
    ngram_topk: int = 20         # most frequent n-grams retrieved per step
    ngram_paths: int | None = None  # of those, the ones the heads rank highest enter the tree (None: all)
    max_nodes: int = 64          # tree nodes below the root verified per step
    budget: int = 4096           # |B| of the dynamic draft cache (reference: 4096)
    sinks: int = 16              # |S| attention sinks kept in it
    rebuild_every: int | None = None  # replaced entries before a full re-ranking (None: |S|)
    penalty: float = 1.0         # theta of the windowed contextual penalty (1 = off)
    penalty_window: int = 1024   # W: generated tokens the penalty looks back on
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()    # end the generation when emitted
    banned_token_ids: tuple[int, ...] = ()  # never emitted (free-running generation bans its stop tokens)
    seed: int = 0

    def __post_init__(self):
        if self.draft not in DRAFTS:
            raise ValueError(f"--draft must be one of {list(DRAFTS)}, got {self.draft!r}")
        for n in ("max_new_tokens", "head_topk", "head_paths", "budget", "penalty_window"):
            if getattr(self, n) < 1:
                raise ValueError(f"--{n.replace('_', '-')} must be >= 1, got {getattr(self, n)}")
        for n in ("ngram_topk", "max_nodes", "sinks"):
            if getattr(self, n) < 0:
                raise ValueError(f"--{n.replace('_', '-')} must be >= 0, got {getattr(self, n)}")
        if self.ngram_paths is not None and self.ngram_paths < 0:
            raise ValueError(f"--ngram-paths must be >= 0, got {self.ngram_paths}")
        if self.ngram_n < 2:
            raise ValueError(f"--ngram-n must be >= 2, got {self.ngram_n}")
        if self.penalty < 1:
            raise ValueError(f"--penalty must be >= 1 (1 = off), got {self.penalty}")
        if self.draft == "dynamic":
            every = self.sinks if self.rebuild_every is None else self.rebuild_every
            if every < 1:
                raise ValueError(f"--rebuild-every must be >= 1 (it defaults to --sinks), got {every}")
            if self.budget <= self.sinks + every:
                raise ValueError(f"--budget {self.budget} must exceed --sinks {self.sinks} + --rebuild-every {every}")
