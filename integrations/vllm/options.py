"""dLLM options in vLLM's vocabulary: server-wide ``--additional-config '{"dllm": {...}}'`` and
per request ``SamplingParams.extra_args`` (HTTP ``vllm_xargs``) keys ``dllm_<option>``.

Every value is validated with dllm_core's own parsers (``make_sampler``, ``cache.host_cache``);
a bad per-request value fails at admission (HTTP 400) through ``DllmRequestValidator``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from dllm_core.cache import CachePolicy, DLLMCache, PrefixCache, host_cache
from dllm_core.engine.generate import check_paged_block_causal
from dllm_core.options import OptionError, check_value
from dllm_core.sampling import Sampler, make_sampler

PREFIX = "dllm_"
SERVED = {"canvas_length": None, "block_causal": None, "defaults": None}  # set by the config hook in every process that builds a config


@dataclass(frozen=True)
class DllmOptions:
    """``sampler`` / ``cache``: dllm_core specs (``threshold:tau=0.9``, ``dllm:kr=4,rho=0.25``);
    ``block_length``: semi-autoregressive blocks inside the canvas (a divisor of the canvas length;
    default: the canvas is one block); ``steps``: denoising steps per block for fixed-schedule
    samplers (default: the block length);
    ``temperature``: > 0 samples proposals (Gumbel-max), 0 = greedy; ``logits_eos_inf`` /
    ``confidence_eos_eot_inf``: LLaDA-Instruct's EOS / EOT suppression (``eot_id``: the EOT token);
    ``stream``: emit each block as soon as it is decoded, the next canvas being the rest of the response
    (prefix / dual / dllm caches; with ``canvas_length >= max_tokens`` the embedded engine's output);
    ``seed``: seeds the server's generator for sampled proposals (server-wide only).
    A block-causal model (LLaDA2) is served one grid block per canvas: ``block_length`` its ``block_size``,
    ``cache`` one of none / prefix / dual (all exact there: earlier blocks' paged K/V are final)."""

    sampler: str = "low_confidence"
    cache: str = "dual"  # quality-preserving default: Fast-dLLM's DualCache
    block_length: int | None = None
    steps: int | None = None
    temperature: float = 0.0
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    eot_id: int | None = None
    stream: bool = False
    seed: int = 0

    def __post_init__(self):
        make_sampler(self.sampler)
        cache = host_cache(self.cache)
        if SERVED["block_causal"]:
            check_paged_block_causal(SERVED["block_causal"], self.block_length, cache)
        if self.stream and not isinstance(cache, (PrefixCache, DLLMCache)):
            raise OptionError("stream", f"needs a cache that refreshes the prefix (prefix, dual, dllm), got cache "
                              f"{self.cache!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.block_length is not None:
            if self.block_length < 1:
                raise ValueError(f"block_length must be >= 1, got {self.block_length}")
            if SERVED["canvas_length"] and SERVED["canvas_length"] % self.block_length:
                raise ValueError(f"block_length {self.block_length} must divide the served canvas_length "
                                 f"{SERVED['canvas_length']}")
        if self.eot_id is not None and self.eot_id < 0:
            raise ValueError(f"eot_id must be a token id >= 0, got {self.eot_id}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_additional_config(cls, additional_config) -> "DllmOptions":
        """Server-wide options from ``vllm_config.additional_config["dllm"]``."""
        raw = (additional_config or {}).get("dllm") or {}
        if not isinstance(raw, dict):
            raise ValueError(f"--additional-config dllm must be an object, got {raw!r}")
        return cls()._merge(dict(raw), "--additional-config dllm.")

    def with_request(self, extra_args) -> "DllmOptions":
        """These options overridden by a request's ``extra_args`` keys ``dllm_<option>``."""
        raw = {k[len(PREFIX):]: v for k, v in (extra_args or {}).items() if k.startswith(PREFIX)}
        if "seed" in raw:
            raise ValueError(f"extra_args.{PREFIX}seed: the seed is server-wide (--additional-config dllm.seed)")
        return self._merge(raw, f"extra_args.{PREFIX}")

    def _merge(self, raw: dict, where: str) -> "DllmOptions":
        types = {f.name: f.type for f in fields(self)}
        unknown = sorted(set(raw) - set(types))
        if unknown:
            raise ValueError(f"{where}{unknown[0]}: unknown dllm option; allowed: {sorted(types)}")
        vals = {k: check_value(v, types[k], where + k) for k, v in raw.items()}
        for k, v in vals.items():  # one at a time, so the error names the option
            try:
                replace(DllmOptions(), **{k: v})
            except ValueError as e:
                raise ValueError(f"{where}{k}: {e}") from None
        try:  # rules between options
            return replace(self, **vals)
        except OptionError as e:
            raise ValueError(f"{where}{e.key} {e.rule}") from None

    # ---- resolved policy -----------------------------------------------------------------
    def sampler_obj(self) -> Sampler:
        return make_sampler(self.sampler)

    def cache_obj(self) -> CachePolicy:
        return host_cache(self.cache)


def validate_request(sampling_params, defaults: DllmOptions | None = None) -> None:
    """Admission check of one request (raises ValueError with the offending option)."""
    opts = (defaults or SERVED["defaults"] or DllmOptions()).with_request(getattr(sampling_params, "extra_args", None))
    max_tokens, canvas = getattr(sampling_params, "max_tokens", None), SERVED["canvas_length"]
    if opts.stream and isinstance(opts.cache_obj(), DLLMCache) and canvas and max_tokens and max_tokens > canvas:
        raise ValueError(f"max_tokens {max_tokens}: a streamed dLLM-Cache response must fit the served canvas_length "
                         f"{canvas} (its features span the response)")
    if getattr(sampling_params, "logprobs", None) is not None:
        raise ValueError("logprobs: not supported for diffusion models served by the dllm adapter")
    if getattr(sampling_params, "prompt_logprobs", None) is not None:
        raise ValueError("prompt_logprobs: not supported for diffusion models served by the dllm adapter")


def _validator_cls():
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor

    class DllmRequestValidator(LogitsProcessor):
        """Admission-time validation of ``dllm_*`` extra_args (vLLM calls ``validate_params`` in the
        frontend). It never edits logits: the dllm sampler replaces vLLM's sampler."""

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            validate_request(sampling_params)

        def add_request(self, req_idx, sampling_params) -> bool:
            return False

        def apply(self, logits, ctx):
            return logits

    return DllmRequestValidator


def __getattr__(name):  # lazy, so dllm_core users need no vLLM
    if name == "DllmRequestValidator":
        cls = _validator_cls()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
