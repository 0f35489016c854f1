"""dLLM options in vLLM's vocabulary: server-wide ``--additional-config '{"dllm": {...}}'`` and per request
``SamplingParams.extra_args`` (HTTP ``vllm_xargs``) keys ``dllm_<option>``.

Both are dllm_core ``DecodeOptions`` built by its one builder (each distinct request mapping parsed once);
this module adds what the served engine fixes (the canvas, a block-causal model's block) and the admission
check that makes a bad request an HTTP 400 (``DllmRequestValidator``).
"""
from __future__ import annotations

from dllm_core.cache import host_cache
from dllm_core.engine.generate import check_paged_block_causal
from dllm_core.engine.request import DecodeOptions, ResponsePlan, build_cached
from dllm_core.options import OptionError

from .configs import BLOCK

PREFIX = "dllm_"
SERVER, REQUEST = "--additional-config dllm.", f"extra_args.{PREFIX}"
SERVED = {"canvas_length": None, "block_causal": None, "defaults": None}  # set by the config hook in every process that builds a config
DEFAULTS = DecodeOptions(cache="dual")  # the server's options before --additional-config
REQUEST_KEYS = tuple(k for k in DecodeOptions.keys() if k != "seed")  # the seed is server-wide


def served(opts: DecodeOptions, where: str) -> DecodeOptions:
    """``opts`` checked against what the engine serves (its canvas, a block-causal model's block)."""
    try:
        cache = host_cache(opts.cache)
        if SERVED["block_causal"]:
            check_paged_block_causal(SERVED["block_causal"], opts.block_length, cache)
        if opts.stream and not cache.refreshes_prefix:
            raise OptionError("stream", f"needs a cache that refreshes the prefix (prefix, dual, dllm), got cache "
                                        f"{opts.cache.name!r}")
        canvas = SERVED["canvas_length"]
        if opts.block_length and canvas and canvas % opts.block_length:
            raise OptionError("block_length", f"{opts.block_length} must divide the served canvas_length {canvas}")
    except OptionError as e:
        raise ValueError(f"{where}{e.key} {e.rule}") from None
    return opts


def server_options(additional_config) -> DecodeOptions:
    """Server-wide options from ``vllm_config.additional_config["dllm"]``."""
    raw = (additional_config or {}).get("dllm") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"--additional-config dllm must be an object, got {raw!r}")
    return served(DecodeOptions.build(raw, SERVER, DEFAULTS), SERVER)


def request_options(extra_args, base: DecodeOptions) -> DecodeOptions:
    """``base`` overridden by a request's ``extra_args`` keys ``dllm_<option>``."""
    raw = {k[len(PREFIX):]: v for k, v in (extra_args or {}).items() if k.startswith(PREFIX)}
    if "seed" in raw:
        raise ValueError(f"{REQUEST}seed: the seed is server-wide (--additional-config dllm.seed)")
    return served(build_cached(raw, REQUEST, base, REQUEST_KEYS), REQUEST)


def request_plan(opts: DecodeOptions, max_tokens: int | None, canvas: int) -> ResponsePlan:
    """The request's response (``max_tokens``, default one canvas) in whole blocks (default block: 32, or the canvas
    when shorter). A response longer than the canvas is decoded as chained canvases only when asked for by name
    (``chain``: each canvas blind to the rest, lossy); a block-causal model's canvas is its grid block (exact)."""
    names = {"gen_length": "max_tokens"}
    try:
        plan = opts.response(max_tokens or canvas, min(BLOCK, canvas), lambda n: names.get(n, REQUEST + n))
    except OptionError as e:
        raise ValueError(str(e)) from None
    if plan.decoded > canvas and not opts.chain and not SERVED["block_causal"]:
        raise ValueError(f"max_tokens {plan.length}: the response ({plan.decoded} positions in whole blocks) is longer "
                         f"than the served canvas_length {canvas}; it would be decoded as chained canvases, each blind "
                         f"to the rest (lossy): serve a longer canvas (--diffusion-config canvas_length; the default "
                         f"is max_model_len) or ask for chained canvases ({REQUEST}chain: true)")
    return plan


def streams(opts: DecodeOptions, cache, plan: ResponsePlan, canvas: int) -> bool:
    """Whether a request emits each block when decoded: as asked, else when its policy refreshes the prefix and
    the response is one canvas (the next canvas is then the rest of the response)."""
    return opts.stream if opts.stream is not None else cache.refreshes_prefix and plan.decoded <= canvas


def validate_request(sampling_params, defaults: DecodeOptions | None = None) -> None:
    """Admission check of one request (raises ValueError with the offending option)."""
    opts = request_options(getattr(sampling_params, "extra_args", None), defaults or SERVED["defaults"] or DEFAULTS)
    max_tokens, canvas = getattr(sampling_params, "max_tokens", None), SERVED["canvas_length"]
    if opts.stream and opts.cache.spans_response and canvas and max_tokens and max_tokens > canvas:
        raise ValueError(f"max_tokens {max_tokens}: a streamed dLLM-Cache response must fit the served canvas_length "
                         f"{canvas} (its features span the response; cache {opts.cache.name})")
    if canvas:
        request_plan(opts, max_tokens, canvas)
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
