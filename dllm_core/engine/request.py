"""How one request is decoded, whatever the engine: ``DecodeOptions`` (built by one builder from a CLI,
a vLLM ``extra_args`` / ``additional_config`` mapping or an SGLang YAML) and ``ResponsePlan``, the one
response-length / whole-blocks / ``steps`` rule.

    opts = DecodeOptions.build({"sampler": "threshold:tau=0.9", "steps": 64}, where="extra_args.dllm_")
    plan = opts.response(max_tokens=50, block_length=32)    # decoded 64 (2 blocks), 50 emitted

``steps`` is the **total** number of denoising steps over the response (LLaDA's and ``dllm generate``'s
meaning; fixed-schedule samplers split it evenly over the blocks; variable-step samplers ignore it);
default one step per decoded position. A response of ``n`` tokens is decoded in whole blocks covering it
(the last block whole, as LLaDA2 decodes its grid) and its first ``n`` tokens are returned.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Mapping

from ..cache import CachePolicy, make_cache
from ..options import OptionError, check_min, check_value
from ..sampling import Sampler, make_sampler
from ..sampling.base import check_proposal

STEPS_NOTE = ("(steps is the total over the response, as in `dllm generate --steps`; the vLLM and SGLang "
              "options read it per block before 0.2)")


NOT_DECODED = {  # what a request may ask of a left-to-right decoder that a diffusion decode does not do, and why
    "samples": "several answers per request (n > 1); send one request per answer",
    "grammar": "constrained decoding (regex, JSON schema, EBNF, structural tags: a grammar constrains "
               "left-to-right sampling)",
    "min_tokens": "a minimum answer length (the canvas holds max_new_tokens positions; EOS ends the answer)",
    "penalties": "repetition, frequency or presence penalties (they condition each token on the ones before it)",
}


def not_decoded_error(asked: Mapping[str, str]) -> str | None:
    """``asked``: {concept of ``NOT_DECODED``: the request field that asks it, in the host's spelling} ->
    the error text naming the field (the first), or None. Hosts refuse such requests instead of ignoring them."""
    for concept, field in asked.items():
        return f"{field}: a diffusion decode does not do {NOT_DECODED[concept]}"
    return None


@dataclass(frozen=True)
class ResponsePlan:
    """One response: ``length`` tokens returned, ``decoded`` positions decoded (whole blocks), ``blocks`` of
    ``block_length``, ``steps_per_block`` for fixed-schedule samplers."""

    length: int
    decoded: int
    block_length: int
    blocks: int
    steps_per_block: int


def response_plan(length: int, block_length: int, steps: int | None, fixed_steps: bool,
                  flag: Callable[[str], str] = str) -> ResponsePlan:
    """The one response-length rule of every engine: ``length`` tokens are decoded in the whole blocks that
    cover them; ``steps`` (None: one per decoded position) is split evenly over the blocks by fixed-schedule
    samplers. ``flag`` names an option in the caller's vocabulary (``--gen-length``, ``max_tokens``, ...)."""
    check_min(length, 1, flag("gen_length"))
    check_min(block_length, 1, flag("block_length"))
    blocks = -(-length // block_length)
    decoded = blocks * block_length
    total = decoded if steps is None else steps
    check_min(total, 1, flag("steps"))
    if fixed_steps and total % blocks:
        raise OptionError(flag("steps"), f"{total} must be a multiple of the number of blocks {blocks} "
                                         f"({decoded} positions in blocks of {block_length}) {STEPS_NOTE}")
    return ResponsePlan(length, decoded, block_length, blocks, max(total // blocks, 1))


@dataclass(frozen=True)
class DecodeOptions:
    """The decoding options of one request (any engine). ``sampler`` / ``cache``: dllm_core specs or instances
    (parsed once, here); ``block_length``: semi-autoregressive blocks (None: the engine's default - the
    embedded engine's 32, a host's served block); ``steps``: total denoising steps over the response (None:
    one per decoded position); ``temperature`` / ``top_p`` / ``top_k``: proposal sampling (0 = greedy);
    ``logits_eos_inf`` / ``confidence_eos_eot_inf`` / ``eot_id``: LLaDA-Instruct's EOS / EOT suppression;
    ``stream``: a host emits each block when decoded (None: when its policy refreshes the prefix and the response
    is one canvas); ``chain``: a host may decode a response longer than its canvas as chained canvases, each
    blind to the rest (lossy: asked for by name only); ``seed``: the generator of sampled proposals."""

    sampler: Sampler | str = "low_confidence"
    cache: CachePolicy | str = "none"
    block_length: int | None = None
    steps: int | None = None
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    eot_id: int | None = None
    stream: bool | None = None
    chain: bool = False
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "sampler", make_sampler(self.sampler))
        object.__setattr__(self, "cache", make_cache(self.cache))
        for name in ("block_length", "steps"):
            if getattr(self, name) is not None:
                check_min(getattr(self, name), 1, name)
        if self.eot_id is not None:
            check_min(self.eot_id, 0, "eot_id", note=" (a token id)")
        check_proposal(self.temperature, self.top_p, self.top_k)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def build(cls, raw: Mapping | None, where: str = "", base: "DecodeOptions | None" = None,
              only: tuple[str, ...] | None = None) -> "DecodeOptions":
        """The one builder: ``base`` (default: the defaults) overridden by ``raw`` (JSON / YAML values:
        checked and coerced by field type). Every error names the option as ``where + key`` (the host's
        vocabulary: ``extra_args.dllm_``, ``--additional-config dllm.``, ``DllmCore.``); ``only``: the keys
        this caller may set."""
        raw = dict(raw or {})
        allowed = cls.keys() if only is None else list(only)
        unknown = sorted(set(raw) - set(allowed))
        if unknown:
            raise ValueError(f"{where}{unknown[0]}: unknown dllm option; allowed: {sorted(allowed)}")
        types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        vals = {}
        for k, v in raw.items():  # one at a time, so the error names the option
            if k not in ("sampler", "cache") or isinstance(v, str) or v is None:  # a spec, or a JSON / YAML value
                v = check_value(v, "str" if k in ("sampler", "cache") else types[k], where + k)
            try:
                cls(**{k: v})
            except ValueError as e:
                raise ValueError(f"{where}{k}: {e}") from None
            vals[k] = v
        return dataclasses.replace(base or cls(), **vals)

    def response(self, length: int, block_length: int | None = None, flag: Callable[[str], str] = str) -> ResponsePlan:
        """The response of ``length`` tokens under these options (``block_length``: the engine's default when
        the options name none)."""
        return response_plan(length, self.block_length or block_length or 32, self.steps, self.sampler.fixed_steps,
                             flag)


@lru_cache(maxsize=4096)
def _cached_build(items: tuple, where: str, base: DecodeOptions, only) -> DecodeOptions:
    return DecodeOptions.build(dict(items), where, base, only)


def build_cached(raw: Mapping | None, where: str, base: DecodeOptions, only=None) -> DecodeOptions:
    """``DecodeOptions.build`` remembered per distinct request mapping (a host parses each spelling once)."""
    try:
        return _cached_build(tuple(sorted((raw or {}).items())), where, base, only)
    except TypeError:  # unhashable values (a list where a string belongs): the builder names the error
        return DecodeOptions.build(raw, where, base, only)
