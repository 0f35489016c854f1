"""dLLM options in vLLM's vocabulary (no engine): --additional-config, extra_args / vllm_xargs,
the admission check and the ``--dllm-*`` launcher flags."""
import json
from types import SimpleNamespace

import pytest

from dllm_core.cache import CanvasCache, DLLMCache, DualCache, PrefixCache
from integrations.vllm.options import DllmOptions, validate_request
from integrations.vllm.serve import fold_dllm_flags


def test_server_wide_options_from_additional_config():
    o = DllmOptions.from_additional_config({"dllm": {"sampler": "threshold:tau=0.9", "cache": "dllm:kr=4",
                                                     "steps": 16, "seed": 3}})
    assert (o.sampler, o.steps, o.seed) == ("threshold:tau=0.9", 16, 3)
    assert o.sampler_obj().tau == 0.9 and o.cache_obj() == DLLMCache(kr=4)
    assert DllmOptions(cache="canvas:kr=4").cache_obj() == CanvasCache(kr=4)
    assert DllmOptions.from_additional_config(None) == DllmOptions()
    assert DllmOptions().cache_obj() == DualCache()  # no option at all: the quality-preserving default
    assert DllmOptions(cache="prefix:every=4").cache_obj() == PrefixCache(every=4)
    assert DllmOptions.from_additional_config({"other_plugin": 1}) == DllmOptions()


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
        DllmOptions.from_additional_config({"dllm": raw})


def test_request_options_override_server_ones():
    base = DllmOptions(sampler="threshold:tau=0.8", cache="dllm:kr=2")
    o = base.with_request({"dllm_sampler": "slowfast:k=4", "dllm_temperature": 1, "dllm_logits_eos_inf": "true",
                           "other": 1})
    assert (o.sampler, o.cache, o.temperature, o.logits_eos_inf) == ("slowfast:k=4", "dllm:kr=2", 1.0, True)
    assert base.with_request({"dllm_confidence_eos_eot_inf": 0}).confidence_eos_eot_inf is False
    assert base.with_request(None) == base


@pytest.mark.parametrize("xargs, msg", [
    ({"dllm_sampler": "threshold:tau=1.5"}, "extra_args.dllm_sampler: --sampler threshold.tau must be in"),
    ({"dllm_cache": "prefix:every=-2"}, "extra_args.dllm_cache: --cache prefix.every must be >= 0"),
    ({"dllm_logits_eos_inf": "maybe"}, "extra_args.dllm_logits_eos_inf must be true or false"),
    ({"dllm_temperature": -1}, "extra_args.dllm_temperature: temperature must be >= 0"),
    ({"dllm_seed": 1}, "extra_args.dllm_seed: the seed is server-wide"),
    ({"dllm_bogus": 1}, "extra_args.dllm_bogus: unknown dllm option"),
])
def test_request_errors_name_the_option(xargs, msg):
    with pytest.raises(ValueError, match=msg.replace("[", "\\[")):
        DllmOptions().with_request(xargs)


def test_admission_check_rejects_logprobs():
    validate_request(SimpleNamespace(extra_args={"dllm_sampler": "factor"}, logprobs=None, prompt_logprobs=None))
    with pytest.raises(ValueError, match="logprobs: not supported"):
        validate_request(SimpleNamespace(extra_args=None, logprobs=2, prompt_logprobs=None))


def test_launcher_folds_dllm_flags_into_additional_config():
    argv = fold_dllm_flags(["MODEL", "--dllm-sampler", "threshold:tau=0.9", "--port", "8000", "--dllm-steps", "16",
                            "--additional-config", '{"dllm": {"cache": "dllm:kr=4"}, "x": 1}'])
    assert argv[:3] == ["MODEL", "--port", "8000"] and argv[3] == "--additional-config"
    assert json.loads(argv[4]) == {"dllm": {"cache": "dllm:kr=4", "sampler": "threshold:tau=0.9", "steps": 16}, "x": 1}
    assert fold_dllm_flags(["MODEL", "--port", "1"]) == ["MODEL", "--port", "1"]
    with pytest.raises(ValueError, match="dllm.cache: --cache: unknown policy 'duel'"):
        fold_dllm_flags(["MODEL", "--dllm-cache", "duel"])
