"""dLLM options in vLLM's vocabulary: server-wide ``--additional-config '{"dllm": {...}}'`` and per request
``SamplingParams.extra_args`` (HTTP ``vllm_xargs``) keys ``dllm_<option>``: dllm_core ``DecodeOptions`` (one
builder, each distinct request mapping parsed once) checked by the core's ``Served`` rules; the admission check
that makes a bad request an HTTP 400 (``validate_request``, run by ``sampler.DllmRequestValidator``).
"""
from __future__ import annotations

import dataclasses

from dllm_core.engine import host_options
from dllm_core.engine.host_options import REQUEST_KEYS, Served
from dllm_core.engine.config import MAX_LOGPROBS
from dllm_core.engine.request import DecodeOptions, not_decoded_error

PREFIX = "dllm_"
SERVER, REQUEST = "--additional-config dllm.", f"extra_args.{PREFIX}"
DEFAULTS = Served().defaults  # the server's options before --additional-config
SEED_FIELD = "SamplingParams.seed (OpenAI's seed)"
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


def request_options(extra_args, base: DecodeOptions, temperature: float | None = None) -> DecodeOptions:
    """``base`` overridden by a request's ``extra_args`` keys ``dllm_<option>`` (the core's ``request_options``);
    the request's own ``temperature`` (OpenAI's; 1.0 is vLLM's default, read as unset) is the sampler's proposal
    temperature (0: greedy)."""
    raw = {k[len(PREFIX):]: v for k, v in (extra_args or {}).items() if k.startswith(PREFIX)}
    t = None if temperature is None or temperature == 1.0 else float(temperature) if temperature > 1e-5 else 0.0
    return SERVED.check(host_options.request_options(raw, base, REQUEST, REQUEST_KEYS, SEED_FIELD, temperature=t))


UNSUPPORTED = ("min_p", "logit_bias", "bad_words", "allowed_token_ids")  # vLLM's own diffusion check, less two


def check_sampling(sampling_params) -> None:
    """vLLM's diffusion check for our models, less its refusal of any ``temperature`` but 1.0 (read by
    ``request_options``) and any ``seed`` (a request's own generator: ``ResponseSlots.admit``); OpenAI clients such as
    lm-eval send temperature 0 and a seed."""
    for field in UNSUPPORTED:
        value = getattr(sampling_params, field, None)
        if value and (field != "min_p" or value > 1e-5):
            raise ValueError(f"{field}: not supported for diffusion models served by the dllm adapter")
    if (getattr(sampling_params, "min_tokens", 0) or 0) > 0:
        raise ValueError(not_decoded_error({"min_tokens": "min_tokens"}))


def patch_diffusion_check(architectures) -> None:
    """``SamplingParams._validate_diffusion`` -> ``check_sampling`` for ``architectures`` (no hook reaches it;
    ``patches/vllm/README.md``)."""
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_diffusion

    def _validate_diffusion(self, model_config) -> None:
        if model_config.is_diffusion and model_config.architecture in architectures:
            return check_sampling(self)
        return original(self, model_config)

    SamplingParams._validate_diffusion = _validate_diffusion


def validate_request(sampling_params, defaults: DecodeOptions | None = None) -> None:
    """Admission check of one request (raises ValueError with the offending option)."""
    opts = request_options(getattr(sampling_params, "extra_args", None), defaults or SERVED.defaults,
                           getattr(sampling_params, "temperature", None))
    SERVED.admit(opts, getattr(sampling_params, "max_tokens", None))
    if getattr(sampling_params, "prompt_logprobs", None) is not None:
        raise ValueError("prompt_logprobs: not supported for diffusion models served by the dllm adapter (the prompt "
                         "is not predicted)")
    k = getattr(sampling_params, "logprobs", None)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"logprobs: {k} top alternatives asked; allowed: 0 to {MAX_LOGPROBS} for diffusion models "
                         f"served by the dllm adapter")
