"""TokenSwift options (validated once; CLI flags name the fields): the drafting options every host shares
(``DraftOptions``) and the embedded loop's (``TokenSwiftConfig``)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from ...options import OptionError, check_min, check_value
from ..verify import SamplingParams

# where the heads' input h0 comes from:
#   shared  - the verification forward (full cache) at the last accepted node: one target forward per step,
#             h0 gives the (already verified) next token, the heads draft the gamma tokens after it;
#   dynamic - the paper's drafting forward: the target re-runs the newest token over the draft-side dynamic
#             KV cache (sinks + importance-ranked entries, budget |B|) and h0 there drafts gamma+1 tokens;
#             verification still uses the full cache.
DRAFTS = ("shared", "dynamic")


@dataclass(frozen=True)
class DraftOptions:
    """What one TokenSwift draft holds, for every host (embedded loop, vLLM, SGLang): the heads' best paths
    and the most frequent n-grams, merged into a tree of at most ``max_nodes`` nodes below the root."""

    head_topk: int = 4           # candidates per tree level taken from each head
    head_paths: int = 8          # head paths in the tree (best by summed log-probability)
    ngram_n: int = 4             # n of the reused n-grams (first token + n-1 drafted)
    ngram_topk: int = 20         # most frequent n-grams retrieved per step (0: no reuse)
    ngram_paths: int | None = None  # of those, the ones the heads rank highest enter the tree (None: all)
    max_nodes: int = 64          # tree nodes below the root verified per step

    def __post_init__(self):
        for n, lo in (("head_topk", 1), ("head_paths", 1), ("ngram_n", 2), ("ngram_topk", 0), ("max_nodes", 0),
                      ("ngram_paths", 0)):
            if getattr(self, n) is not None:  # ngram_paths None: all retrieved n-grams
                check_min(getattr(self, n), lo, "--" + n.replace("_", "-"))

    @classmethod
    def from_mapping(cls, raw, where: str, host_keys: tuple[str, ...] = ()) -> DraftOptions:
        """Options from a host's config object ``raw`` (``where`` names it in errors: ``where.key: ...``);
        ``host_keys`` are allowed keys the host reads itself (not options)."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where} must be an object, got {raw!r}")
        names = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(raw) - names - set(host_keys))
        if unknown:
            raise ValueError(f"{where}: unknown option(s) {unknown}; allowed: {sorted(names | set(host_keys))}")
        types = {f.name: f.type for f in fields(cls)}
        opts = {k: check_value(v, types[k], f"{where}.{k}") for k, v in raw.items() if k in names}
        try:
            return cls(**opts)
        except OptionError as e:
            raise ValueError(e.under(where)) from None


@dataclass(frozen=True)
class TokenSwiftConfig(DraftOptions):
    """The embedded decoding loop's options: ``DraftOptions`` plus generation, draft cache and penalty."""

    max_new_tokens: int = 1024
    draft: str = "shared"
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
        super().__post_init__()
        for n in ("max_new_tokens", "budget", "penalty_window"):
            if getattr(self, n) < 1:
                raise ValueError(f"--{n.replace('_', '-')} must be >= 1, got {getattr(self, n)}")
        if self.sinks < 0:
            raise ValueError(f"--sinks must be >= 0, got {self.sinks}")
        if self.penalty < 1:
            raise ValueError(f"--penalty must be >= 1 (1 = off), got {self.penalty}")
        if self.draft == "dynamic":
            every = self.sinks if self.rebuild_every is None else self.rebuild_every
            if every < 1:
                raise ValueError(f"--rebuild-every must be >= 1 (it defaults to --sinks), got {every}")
            if self.budget <= self.sinks + every:
                raise ValueError(f"--budget {self.budget} must exceed --sinks {self.sinks} + --rebuild-every {every}")
