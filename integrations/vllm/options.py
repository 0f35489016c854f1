"""dLLM options in vLLM's vocabulary: server-wide ``--additional-config '{"dllm": {...}}'`` and per request
``SamplingParams.extra_args`` (HTTP ``vllm_xargs``) keys ``dllm_<option>``: dllm_core ``DecodeOptions`` (one
builder, each distinct request mapping parsed once) checked by the core's ``Served`` rules; the admission check
that makes a bad request an HTTP 400 (``DllmRequestValidator``).
"""
from __future__ import annotations

import dataclasses

from dllm_core.engine.host_options import Served
from dllm_core.engine.request import DecodeOptions, build_cached

PREFIX = "dllm_"
SERVER, REQUEST = "--additional-config dllm.", f"extra_args.{PREFIX}"
DEFAULTS = Served().defaults  # the server's options before --additional-config
REQUEST_KEYS = tuple(k for k in DecodeOptions.keys() if k != "seed")  # the seed is server-wide
SERVED = Served(prefix=REQUEST, canvas_flag=" (--diffusion-config canvas_length; the default is max_model_len)")


def serve(canvas_length: int, block_causal: int | None, additional_config) -> Served:
    """What this process serves (set by the config hook and the worker; immutable, replaced whole)."""
    global SERVED
    SERVED = dataclasses.replace(SERVED, canvas_length=canvas_length, block_causal=block_causal)
    SERVED = dataclasses.replace(SERVED, defaults=server_options(additional_config))
    return SERVED


def server_options(additional_config) -> DecodeOptions:
    """Server-wide options from ``vllm_config.additional_config["dllm"]``."""
    raw = (additional_config or {}).get("dllm") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"--additional-config dllm must be an object, got {raw!r}")
    return SERVED.check(DecodeOptions.build(raw, SERVER, DEFAULTS), SERVER)


def request_options(extra_args, base: DecodeOptions) -> DecodeOptions:
    """``base`` overridden by a request's ``extra_args`` keys ``dllm_<option>``."""
    raw = {k[len(PREFIX):]: v for k, v in (extra_args or {}).items() if k.startswith(PREFIX)}
    if "seed" in raw:
        raise ValueError(f"{REQUEST}seed: the seed is server-wide (--additional-config dllm.seed)")
    return SERVED.check(build_cached(raw, REQUEST, base, REQUEST_KEYS))


def request_plan(opts: DecodeOptions, max_tokens: int | None, canvas: int):
    """The request's response in whole blocks (the core's rule on a canvas of ``canvas``)."""
    return dataclasses.replace(SERVED, canvas_length=canvas).plan(opts, max_tokens)


def validate_request(sampling_params, defaults: DecodeOptions | None = None) -> None:
    """Admission check of one request (raises ValueError with the offending option)."""
    opts = request_options(getattr(sampling_params, "extra_args", None), defaults or SERVED.defaults)
    SERVED.admit(opts, getattr(sampling_params, "max_tokens", None))
    for field in ("logprobs", "prompt_logprobs"):
        if getattr(sampling_params, field, None) is not None:
            raise ValueError(f"{field}: not supported for diffusion models served by the dllm adapter")


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
