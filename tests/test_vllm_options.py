"""dLLM options in vLLM's vocabulary (no engine): --additional-config, extra_args / vllm_xargs,
the admission check and the ``--dllm-*`` launcher flags."""
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from dllm_core.cache import CanvasCache, DLLMCache, DualCache, PrefixCache
from dllm_core.engine.request import DecodeOptions
from dllm_core.sampling import make_sampler
from integrations.vllm.options import DEFAULTS, SERVED, check_sampling, request_options, server_options, validate_request
from integrations.vllm.serve import fold_dllm_flags


def test_server_wide_options_from_additional_config():
    o = server_options({"dllm": {"sampler": "threshold:tau=0.9", "cache": "dllm:kr=4", "steps": 16, "seed": 3}})
    assert (o.sampler, o.cache, o.steps, o.seed) == (make_sampler("threshold:tau=0.9"), DLLMCache(kr=4), 16, 3)
    assert server_options(None) == DEFAULTS == DecodeOptions(cache="dual")
    assert DEFAULTS.cache == DualCache()  # no option at all: the quality-preserving default
    assert server_options({"dllm": {"cache": "canvas:kr=4"}}).cache == CanvasCache(kr=4)
    assert server_options({"dllm": {"cache": "prefix:every=4"}}).cache == PrefixCache(every=4)
    assert server_options({"other_plugin": 1}) == DEFAULTS


def request_plan(opts, max_tokens, canvas):
    return replace(SERVED, canvas_length=canvas).plan(opts, max_tokens)  # the core's rule on the served canvas


def test_steps_is_the_total_over_the_response():
    """One meaning of ``steps`` in every engine: the total, split over the response's blocks; a response that
    is not whole blocks is decoded in the blocks covering it."""
    opts = request_options({"dllm_steps": 12, "dllm_block_length": 8}, DEFAULTS)
    plan = request_plan(opts, 20, 32)
    assert (plan.length, plan.decoded, plan.blocks, plan.steps_per_block) == (20, 24, 3, 4)
    assert request_plan(DEFAULTS, None, 32).steps_per_block == 32  # default: one canvas, one step per position
    with pytest.raises(ValueError, match="max_tokens 40: the response \\(64 positions in whole blocks\\) is longer than "
                                         "the served canvas_length 32; it would be decoded as chained canvases"):
        request_plan(DEFAULTS, 40, 32)  # the default never chains canvases: lossy, asked for by name only
    assert request_plan(request_options({"dllm_chain": True}, DEFAULTS), 40, 32).decoded == 64
    with pytest.raises(ValueError, match=r"extra_args.dllm_steps 4 must be a multiple of the number of blocks 3 "
                                         r"\(24 positions in blocks of 8\) \(steps is the total over the response"):
        request_plan(request_options({"dllm_steps": 4, "dllm_block_length": 8}, DEFAULTS), 24, 32)


@pytest.mark.parametrize("raw, msg", [
    ({"sampler": "nope"}, "--additional-config dllm.sampler: --sampler: unknown policy 'nope'"),
    ({"cache": "dual:every=x"}, "--additional-config dllm.cache: --cache dual.every"),
    ({"cache": "bogus"}, "--additional-config dllm.cache: --cache: unknown policy 'bogus'"),
    ({"steps": 0}, "--additional-config dllm.steps: steps must be >= 1"),
    ({"steps": "8"}, "--additional-config dllm.steps must be an integer"),
    ({"speed": 2}, "--additional-config dllm.speed: unknown dllm option; allowed: ['block_length', 'cache', "),
])
def test_server_wide_errors_name_the_option(raw, msg):
    with pytest.raises(ValueError, match=msg.replace("[", "\\[").replace("(", "\\(")):
        server_options({"dllm": raw})


def test_request_options_override_server_ones():
    base = DecodeOptions(sampler="threshold:tau=0.8", cache="dllm:kr=2")
    o = request_options({"dllm_sampler": "slowfast:k=4", "dllm_temperature": 1, "dllm_logits_eos_inf": "true",
                         "other": 1}, base)
    assert (o.sampler, o.cache, o.temperature, o.logits_eos_inf) == (make_sampler("slowfast:k=4"), DLLMCache(kr=2),
                                                                       1.0, True)
    assert request_options({"dllm_confidence_eos_eot_inf": 0}, base).confidence_eos_eot_inf is False
    assert request_options(None, base) == base
    assert request_options({"dllm_sampler": "factor"}, base) is request_options({"dllm_sampler": "factor"}, base)  # parsed once


@pytest.mark.parametrize("xargs, msg", [
    ({"dllm_sampler": "threshold:tau=1.5"}, "extra_args.dllm_sampler: --sampler threshold.tau must be in"),
    ({"dllm_cache": "prefix:every=-2"}, "extra_args.dllm_cache: --cache prefix.every must be >= 0"),
    ({"dllm_logits_eos_inf": "maybe"}, "extra_args.dllm_logits_eos_inf must be true or false"),
    ({"dllm_temperature": -1}, "extra_args.dllm_temperature: temperature must be >= 0"),
    ({"dllm_seed": 1}, "extra_args.dllm_seed: a request's seed is its SamplingParams.seed"),
    ({"dllm_bogus": 1}, "extra_args.dllm_bogus: unknown dllm option"),
])
def test_request_errors_name_the_option(xargs, msg):
    with pytest.raises(ValueError, match=msg.replace("[", "\\[")):
        request_options(xargs, DEFAULTS)


def test_admission_check_bounds_logprobs_and_rejects_prompt_logprobs():
    validate_request(SimpleNamespace(extra_args={"dllm_sampler": "factor"}, logprobs=None, prompt_logprobs=None))
    for k in (0, 2, 20):
        validate_request(SimpleNamespace(extra_args=None, logprobs=k, prompt_logprobs=None))
    for k in (-1, 21):
        with pytest.raises(ValueError, match=rf"logprobs: {k} top alternatives asked; allowed: 0 to 20"):
            validate_request(SimpleNamespace(extra_args=None, logprobs=k, prompt_logprobs=None))
    with pytest.raises(ValueError, match="prompt_logprobs: not supported"):
        validate_request(SimpleNamespace(extra_args=None, logprobs=None, prompt_logprobs=1))


def test_openai_temperature_and_seed():
    """OpenAI clients (lm-eval's local-completions) send ``temperature`` 0 and a ``seed``: the temperature is the
    sampler's proposal temperature (1.0, vLLM's default, reads as unset), a seed is the request's own generator;
    vLLM's other refusals stay."""
    assert request_options(None, DEFAULTS, 0.0).temperature == 0.0
    assert request_options(None, DEFAULTS, 1.0) == DEFAULTS
    assert request_options(None, DEFAULTS, 0.7).temperature == 0.7
    assert request_options({"dllm_temperature": 0.7}, DEFAULTS, 0.7).temperature == 0.7
    with pytest.raises(ValueError, match="temperature 0.0 and extra_args.dllm_temperature 0.5 differ"):
        request_options({"dllm_temperature": 0.5}, DEFAULTS, 0.0)
    sp = dict(extra_args=None, logprobs=None, prompt_logprobs=None, max_tokens=8)
    validate_request(SimpleNamespace(**sp, temperature=0.0, seed=1234))  # greedy: the seed changes nothing
    validate_request(SimpleNamespace(**sp, temperature=0.8, seed=1234))  # sampled: the request's own generator
    ok = dict(min_p=0.0, logit_bias=None, bad_words=[], allowed_token_ids=None, min_tokens=0)
    check_sampling(SimpleNamespace(**ok))
    for field, value, msg in [("min_p", 0.1, "min_p: not supported"), ("logit_bias", {1: 2.0}, "logit_bias: not"),
                              ("min_tokens", 4, "min_tokens: a diffusion decode does not do a minimum answer length")]:
        with pytest.raises(ValueError, match=msg):
            check_sampling(SimpleNamespace(**{**ok, field: value}))


def test_launcher_folds_dllm_flags_into_additional_config():
    argv = fold_dllm_flags(["MODEL", "--dllm-sampler", "threshold:tau=0.9", "--port", "8000", "--dllm-steps", "16",
                            "--additional-config", '{"dllm": {"cache": "dllm:kr=4"}, "x": 1}'])
    assert argv[:3] == ["MODEL", "--port", "8000"] and argv[3] == "--additional-config"
    assert json.loads(argv[4]) == {"dllm": {"cache": "dllm:kr=4", "sampler": "threshold:tau=0.9", "steps": 16}, "x": 1}
    assert fold_dllm_flags(["MODEL", "--port", "1"]) == ["MODEL", "--port", "1"]
    with pytest.raises(ValueError, match="dllm.cache: --cache: unknown policy 'duel'"):
        fold_dllm_flags(["MODEL", "--dllm-cache", "duel"])
