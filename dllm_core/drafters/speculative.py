"""Speculative decoding of a causal target (any transformers causal LM) with a DFlash drafter.

One iteration, with ``last`` = the newest token (emitted but not yet run through the target) at ``pos``::

    drafter([last, MASK x (q-1)] | target features of the tokens it has not seen)  -> q-1 drafts
    target([last, drafts]) with its KV cache                                       -> p at q positions
    accept_chain(drafts, p)                        -> n accepted + 1 next token  (lossless, verify.py)
    crop the target cache to pos+n+1, the draft cache to pos (context only); the target features of
    [last, accepted drafts] become the drafter's next new context.

``ar_generate`` is the plain one-token-per-forward baseline with the same cache machinery, so greedy
outputs must be identical and timings are comparable within one run (``compare``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .adaptive import DraftLength
from .dflash import DFlashDrafter
from .sampling import Emitter, SamplingParams, probs_from_logits, sample_probs, target_choice
from .verify import accept_chain


@dataclass(frozen=True)
class SpecConfig:
    """Decoding options shared by the speculative loop and the AR baseline."""

    max_new_tokens: int = 128
    block_size: int | None = None      # tokens verified per target forward (None = the drafter's)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    greedy_draft: bool = True          # drafter proposes argmax (q one-hot) even when sampling
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")


@dataclass
class DecodeResult:
    tokens: list[int]            # generated ids (stop token included when hit)
    accept_lengths: list[int]    # tokens emitted per verification forward (accepted drafts + 1)
    seconds: float

    @property
    def mean_accept(self) -> float:
        """Mean acceptance length tau (tokens per target forward after prefill)."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def crop_cache(cache, length: int) -> None:
    """Cut a transformers cache back to its first ``length`` positions."""
    cache.crop(length - cache.get_seq_length())


def _prefill(target, prompt: list[int], cache, hidden: bool):
    ids = torch.tensor([prompt], device=target.device)
    return target(ids, past_key_values=cache, use_cache=True, output_hidden_states=hidden, logits_to_keep=1)


@torch.inference_mode()
def ar_generate(target, prompt: list[int], cfg: SpecConfig) -> DecodeResult:
    """Plain autoregressive decoding with a ``DynamicCache`` (one target forward per token)."""
    from transformers import DynamicCache

    g = torch.Generator(target.device).manual_seed(cfg.seed)
    t0 = _now(target.device)
    cache = DynamicCache()
    last = target_choice(_prefill(target, prompt, cache, False).logits[:, -1], cfg.sampling, g)  # [1]
    emit = Emitter(cfg.max_new_tokens, cfg.stop_token_ids)
    emit([int(last)])
    while not emit.done:
        logits = target(last[:, None], past_key_values=cache, use_cache=True).logits[:, -1]  # [1, V]
        last = target_choice(logits, cfg.sampling, g)
        emit([int(last)])
    return DecodeResult(emit.tokens, [1] * (len(emit.tokens) - 1), _now(target.device) - t0)


@torch.inference_mode()
def speculative_generate(target, drafter: DFlashDrafter, prompt: list[int], cfg: SpecConfig,
                         lengths: DraftLength | None = None) -> DecodeResult:
    """Lossless DFlash speculative decoding of one prompt (list of ids) on ``target``. ``lengths``: the engine's
    adaptive draft length (``adaptive.py``: each step verifies the drafts it chooses, 0 = a plain step, and
    reports its time); None: every step verifies a whole block."""
    from transformers import DynamicCache

    dev = target.device
    bs = cfg.block_size or drafter.cfg.block_size
    g = torch.Generator(dev).manual_seed(cfg.seed)
    t0 = _now(dev)
    tcache, dcache = DynamicCache(), DynamicCache()
    out = _prefill(target, prompt, tcache, True)
    feats = drafter.features(out.hidden_states)  # [1, T, k*H]: context the drafter has not seen yet
    last = target_choice(out.logits[:, -1], cfg.sampling, g)  # [1]
    pos = len(prompt)  # position of `last`
    emit = Emitter(cfg.max_new_tokens, cfg.stop_token_ids)
    emit([int(last)])
    accepted: list[int] = []
    while not emit.done:
        q = min(bs, cfg.max_new_tokens - len(emit.tokens))  # verify q tokens -> at most q new ones
        k = q - 1 if lengths is None else min(lengths.choose(1), q - 1)  # drafts verified this step
        t = _now(dev) if lengths is not None else 0.0
        block = torch.full((1, q), drafter.cfg.mask_token_id, device=dev)
        block[:, 0] = last
        dprobs = None
        if k:
            positions = torch.arange(pos - feats.shape[1], pos + q, device=dev)[None]  # [1, C+q]
            h = drafter(drafter.embed(block), feats, positions, cache=dcache)  # [1, q, H]
            crop_cache(dcache, pos)  # keep context K/V only
            dlogits = drafter.logits(h[:, 1:k + 1])  # [1, k, V]
            if cfg.sampling.greedy or cfg.greedy_draft:
                block[:, 1:k + 1] = dlogits.argmax(-1)
            else:
                dprobs = probs_from_logits(dlogits, cfg.sampling)
                block[:, 1:k + 1] = sample_probs(dprobs, g)
        block = block[:, :k + 1]
        out = target(block, past_key_values=tcache, use_cache=True, output_hidden_states=q > 1)
        acc = accept_chain(block[:, 1:], out.logits, cfg.sampling, dprobs, g)
        n = int(acc.num_accepted)
        accepted.append(len(emit(block[0, 1:n + 1].tolist() + [int(acc.next_token)])))
        crop_cache(tcache, pos + n + 1)
        if q > 1:  # the drafter's unseen context: these n + 1 tokens (after a plain step: appended)
            new = drafter.features(out.hidden_states)[:, :n + 1]
            feats = new if k else torch.cat([feats, new], 1)
        if lengths is not None:
            lengths.observe(1, k, _now(dev) - t, [n] if k else ())
        pos += n + 1
        last = acc.next_token
    return DecodeResult(emit.tokens, accepted, _now(dev) - t0)
