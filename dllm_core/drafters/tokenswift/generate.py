"""TokenSwift decoding of one prompt on a transformers causal LM, and the AR baseline on the same machinery.

One step, with ``b`` = the newest emitted token at position t (not yet in the full cache)::

    h0      = hidden state that drafts: shared - the last accepted node of the previous verification;
              dynamic - the target re-run on [b] over the draft-side dynamic KV cache (budget |B|)
    levels  = heads(h0) through the frozen LM head, penalised            -> D drafted distributions
    tree    = trie(root b; heads' best paths + top-k n-grams)            -> N nodes
    target([b, nodes], full cache, tree mask, positions t + depth)      -> penalised logits per node
    accept_tree                                                          -> path + the target's next token
    commit root + path K/V (full cache); n-gram table, penalty window and draft cache learn the new tokens

``autoregressive_generate`` runs the same target forward, cache, attention and penalty one token at a time,
so greedy outputs must be identical and timings compare the algorithms, not the plumbing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..sampling import Emitter, target_choice
from .attention import use_tokenswift_attention
from .config import TokenSwiftConfig
from .draft import head_levels
from .drafter import RequestDrafter
from .heads import TokenSwiftHeads, check_compatible
from .kvcache import DynamicDraftCache, KVCache
from .penalty import ContextualPenalty
from .tree import accept_tree, path_token_mask, tree_attention_mask, tree_position_ids


@dataclass
class LongResult:
    tokens: list[int]                  # generated ids (stop token included when hit)
    seconds: float                     # prefill + decoding
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verification (path + 1)
    forwards: int = 0                  # target forwards after prefill (verification + drafting)
    draft_depth: int = 1               # deepest drafted position per step (D): max(heads, n-gram) levels
    marks: list[tuple[int, float]] = field(default_factory=list)  # (tokens so far, seconds) after each step
    rebuilds: int = 0                  # dynamic draft cache re-rankings

    @property
    def alpha(self) -> float:
        """Acceptance rate: sum a_i / ((D + 1) T), a_i = tokens of step i, D + 1 its most (the paper's gamma + 1
        with gamma = 3 heads and 4-grams)."""
        return sum(self.accept_lengths) / max((self.draft_depth + 1) * len(self.accept_lengths), 1)

    @property
    def tokens_per_step(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def tokens_per_forward(self) -> float:
        return sum(self.accept_lengths) / max(self.forwards, 1)

    def seconds_at(self, n: int) -> float:
        """Wall time until the first ``n`` tokens were out (the step that crossed n)."""
        for count, sec in self.marks:
            if count >= n:
                return sec
        raise ValueError(f"seconds_at: only {len(self.tokens)} tokens were generated, asked for {n}")


class _Clock:
    """Own time of one decoder: runs only between its resumptions and its yields (see ``iter_*``)."""

    def __init__(self):
        self.spent, self.since = 0.0, time.perf_counter()

    def pause(self) -> None:
        self.spent += time.perf_counter() - self.since

    def resume(self) -> None:
        self.since = time.perf_counter()

    def now(self) -> float:
        return self.spent + time.perf_counter() - self.since


class _Emitter(Emitter):
    """``sampling.Emitter`` that also records the timeline (tokens so far, seconds) after every call."""

    def __init__(self, cfg: TokenSwiftConfig, clock: _Clock):
        super().__init__(cfg.max_new_tokens, cfg.stop_token_ids)
        self.clock, self.marks = clock, []

    def __call__(self, new: list[int]) -> list[int]:
        new = super().__call__(new)
        self.marks.append((len(self.tokens), self.clock.now()))
        return new


def _forward(target, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor | None = None,
             queries: dict | None = None) -> torch.Tensor:
    """Final-norm hidden states [q, H] of ``ids`` [1, q] at ``positions`` [1, q] over ``cache``."""
    out = target.get_decoder()(input_ids=ids, position_ids=positions, attention_mask={"full_attention": mask},
                               past_key_values=cache, use_cache=True, ts_queries=queries)
    return out.last_hidden_state[0]


def _prefill(target, prompt: list[int], cache: KVCache, queries: dict | None) -> torch.Tensor:
    if not prompt:
        raise ValueError("TokenSwift: the prompt is empty")
    dev = target.device
    ids = torch.tensor([prompt], device=dev)
    h = _forward(target, ids, torch.arange(len(prompt), device=dev)[None], cache, None, queries)[-1:]  # [1, H]
    cache.commit()
    return h


def _setup(target, prompt: list[int], cfg: TokenSwiftConfig):
    g = torch.Generator(target.device).manual_seed(cfg.seed)
    cache = KVCache(len(prompt) + cfg.max_new_tokens + cfg.max_nodes + 2)
    shaper = ContextualPenalty(target.config.vocab_size, cfg.penalty, cfg.penalty_window, cfg.banned_token_ids,
                               target.device)
    return g, cache, shaper


def _last(steps):
    res = None
    for res in steps:
        pass
    return res


def autoregressive_generate(target, prompt: list[int], cfg: TokenSwiftConfig) -> LongResult:
    """Plain decoding, one target forward per token, with TokenSwift's cache, attention and penalty."""
    return _last(iter_autoregressive(target, prompt, cfg))


def tokenswift_generate(target, heads: TokenSwiftHeads, prompt: list[int], cfg: TokenSwiftConfig) -> LongResult:
    """Lossless TokenSwift decoding of one prompt (list of ids) on ``target`` with drafting ``heads``."""
    return _last(iter_tokenswift(target, heads, prompt, cfg))


@torch.inference_mode()
def iter_autoregressive(target, prompt: list[int], cfg: TokenSwiftConfig) -> Iterator[LongResult]:
    """``autoregressive_generate`` one step at a time: yields the growing result after every token. Its
    ``seconds`` / ``marks`` count only time spent inside this generator, so two decoders advanced in turns
    (``bench.race``) are timed under the same machine load."""
    lm_head = target.get_output_embeddings()
    clock = _Clock()
    res = LongResult([], 0.0, draft_depth=0)
    with use_tokenswift_attention(target):
        g, cache, shaper = _setup(target, prompt, cfg)
        emit = _Emitter(cfg, clock)
        res.tokens, res.marks = emit.tokens, emit.marks
        h = _prefill(target, prompt, cache, None)
        b = int(target_choice(shaper.apply(lm_head(h)), cfg.sampling, g)[0])
        shaper.push(emit([b]))
        while not emit.done:
            res.seconds = clock.now()
            clock.pause()
            yield res
            clock.resume()
            t = cache.length
            h = _forward(target, torch.tensor([[b]], device=target.device),
                         torch.tensor([[t]], device=target.device), cache)
            cache.commit()
            res.forwards += 1
            res.accept_lengths.append(1)
            b = int(target_choice(shaper.apply(lm_head(h)), cfg.sampling, g)[0])
            shaper.push(emit([b]))
        res.seconds = clock.now()
    yield res


@torch.inference_mode()
def iter_tokenswift(target, heads: TokenSwiftHeads, prompt: list[int], cfg: TokenSwiftConfig
                    ) -> Iterator[LongResult]:
    """``tokenswift_generate`` one verification step at a time (timing as in ``iter_autoregressive``)."""
    check_compatible(heads, target)
    lm_head = target.get_output_embeddings()
    dev, vocab = target.device, target.config.vocab_size
    dynamic = cfg.draft == "dynamic"
    # deepest drafted position below the root: the heads' levels or a retrieved n-gram's continuation
    depth = max(heads.cfg.num_heads, cfg.ngram_n - 1 if cfg.ngram_topk else 0) + (1 if dynamic else 0)
    clock = _Clock()
    res = LongResult([], 0.0, draft_depth=depth)
    with use_tokenswift_attention(target):
        g, cache, shaper = _setup(target, prompt, cfg)
        drafter, history = RequestDrafter(cfg), list(prompt)  # n-gram table, last tree, h0 bookkeeping
        dcache = DynamicDraftCache(cfg.budget, cfg.sinks, cfg.rebuild_every) if dynamic else None
        queries: dict | None = {} if dynamic else None
        emit = _Emitter(cfg, clock)
        res.tokens, res.marks = emit.tokens, emit.marks
        h0 = _prefill(target, prompt, cache, queries)  # [1, H]
        drafter.set_hidden(h0)
        b = int(target_choice(shaper.apply(lm_head(h0)), cfg.sampling, g)[0])
        new = emit([b])
        shaper.push(new)
        history += new
        while not emit.done:
            res.seconds = clock.now()
            clock.pause()
            yield res
            clock.resume()
            t = cache.length
            if dynamic:
                dcache.sync(cache, queries)
                h0 = _forward(target, torch.tensor([[b]], device=dev), torch.tensor([[t]], device=dev), dcache,
                              None, queries)
                res.forwards += 1
            # dynamic: [gamma+1, V] positions t+1 .. t+gamma+1; shared: [gamma, V] positions t+1 .. t+gamma
            levels = head_levels(heads, lm_head, h0[0] if dynamic else drafter.h0(history), dynamic)
            tree = drafter.draft(history, shaper.apply(levels), dynamic, dev)
            hidden = _forward(target, tree.tokens[None], tree_position_ids(tree, t), cache,
                              tree_attention_mask(tree, t))  # [N, H]
            res.forwards += 1
            logits = shaper.apply(lm_head(hidden), tree.depth,
                                  path_token_mask(tree, vocab) if shaper.theta != 1.0 else None)
            acc = accept_tree(tree, target_choice(logits, cfg.sampling, g), g)
            cache.commit([0] + acc.nodes)
            b = int(acc.next_token)
            new = emit(tree.tokens[acc.nodes].tolist() + [b])
            res.accept_lengths.append(len(new))
            shaper.push(new)
            history += new
            drafter.set_hidden(hidden)  # shared: h0 = the accepted path's last node
            res.rebuilds = dcache.rebuilds if dcache else 0
        res.seconds = clock.now()
    yield res
