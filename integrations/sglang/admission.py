"""Requests a server cannot serve get HTTP 400 naming the field (``patches/sglang/README.md``): the rules are the
core's (``token_range_error``, ``not_decoded_error``), SGLang's field names are here."""
from __future__ import annotations

from dllm_core.engine.request import not_decoded_error
from dllm_core.engine.step import token_range_error

HOOK = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
PENALTIES = (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0))
GRAMMARS = ("regex", "json_schema", "ebnf", "structural_tag")


def validate_request(result, manager, obj, input_ids, *args, **_):
    """AFTER ``TokenizerManager._validate_one_request``: prompt ids in the vocabulary (every server); on a dLLM
    server also a prompt of at least one token and nothing asked that a diffusion decode does not do."""
    from sglang.srt.arg_groups.overrides import resolving_view

    if input_ids is not None and (err := token_range_error(input_ids, manager.model_config.vocab_size)):
        raise ValueError(err)
    if resolving_view(manager.server_args).dllm_algorithm is None:
        return result
    if input_ids is not None and len(input_ids) == 0:
        raise ValueError("prompt: a diffusion decode needs at least one prompt token, got an empty prompt")
    if err := not_decoded_error(asked(obj)):
        raise ValueError(err)
    if getattr(obj, "return_logprob", False) is True and getattr(obj, "logprob_start_len", -1) not in (None, -1):
        raise ValueError("logprob_start_len: prompt logprobs are not reported by a diffusion decode (dllm-serve); "
                         "allowed: -1")
    return result


def asked(obj) -> dict[str, str]:
    """What a ``GenerateReqInput`` asks beyond the defaults, as {``NOT_DECODED`` concept: its field}."""
    sp, out = obj.sampling_params if isinstance(getattr(obj, "sampling_params", None), dict) else {}, {}
    if (sp.get("n") or 1) > 1:
        out["samples"] = "sampling_params.n"
    if grammar := next((k for k in GRAMMARS if sp.get(k) is not None), None):
        out["grammar"] = f"sampling_params.{grammar}"
    if (sp.get("min_new_tokens") or 0) > 0:
        out["min_tokens"] = "sampling_params.min_new_tokens"
    for k, neutral in PENALTIES:
        if sp.get(k, neutral) not in (None, neutral):
            out.setdefault("penalties", f"sampling_params.{k}")
    return out
