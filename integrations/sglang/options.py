"""``--dllm-algorithm-config`` YAML -> dllm_core ``FlatOptions`` (the keys: ``integrations/sglang/README.md``), every
value validated by the core's builders: a bad option fails at launch with its name and allowed values."""
from __future__ import annotations

from dllm_core.engine.config import MAX_LOGPROBS
from dllm_core.engine.host_options import POLICY_KEY, FlatOptions, read_mapping, with_default_policy

from sglang.srt.sampling.sampling_params import TOP_K_ALL

HOST_KEYS = ("block_size",)  # SGLang's own DllmConfig reads these
RENAMED = "dllm_cache"  # before 0.2: dLLM-Cache over the block as a mapping


def read_yaml(path: str | None) -> dict:  # ({} when no config was given)
    return read_mapping(path, "--dllm-algorithm-config")


def with_default_cache(cfg: dict, whole_response: bool) -> dict:
    """The YAML with the default cache of our LLaDA / Dream classes (the whole response, Fast-dLLM's dual);
    SGLang's block canvas only when asked for by name (``cache: canvas``)."""
    return cfg if RENAMED in cfg else with_default_policy(cfg, whole_response)


def parse(algo: str, sampler_name: str | None, cfg: dict) -> FlatOptions:
    """``sampler_name``: the dllm_core sampler behind a named algorithm (its options are the YAML's top-level
    keys); None: the generic algorithm (``sampler: <spec>``, ``steps``)."""
    if RENAMED in cfg:
        old = cfg[RENAMED]
        spec = "canvas:" + ",".join(f"{k}={v}" for k, v in old.items()) if isinstance(old, dict) else "canvas:.."
        raise ValueError(f"{algo}.{RENAMED}: renamed in 0.2 to {algo}.{POLICY_KEY} with vLLM's spelling: "
                         f"cache: \"{spec}\" (dLLM-Cache over SGLang's block canvas)")
    return FlatOptions.parse(algo, sampler_name, cfg, HOST_KEYS)


# --- one request's options: ``custom_params: {"dllm": {...}}`` and SGLang's sampling parameters -----------------------
CUSTOM = "dllm"  # the request's own options: custom_params.dllm.<key> (the core's FLAT_REQUEST_KEYS and cache)
WHERE = f"custom_params.{CUSTOM}."
SEED_FIELD = "sampling_params.sampling_seed"
NOT_DECODED = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
               "min_new_tokens": 0, "logit_bias": None, "json_schema": None, "regex": None, "ebnf": None,
               "structural_tag": None}  # SGLang's sampler options a diffusion decode does not run (their defaults)


def sampling(sp) -> dict:
    """SGLang's sampling parameters as the proposal sampler's (None: not set, the launch YAML decides). SGLang
    normalizes temperature 0 to (1.0, top_k 1): greedy; its defaults (1.0, every token, top_p 1.0) are not set."""
    t, k, p = float(sp.temperature), int(sp.top_k), float(sp.top_p)
    if k == 1:
        return {"temperature": 0.0}
    top_k, top_p = (k if 0 < k < TOP_K_ALL else None), (p if p < 1.0 else None)
    unset = t == 1.0 and top_k is None and top_p is None
    return {"temperature": None if unset else t, "top_p": top_p, "top_k": top_k}


def request(flat: FlatOptions, req, block: int) -> FlatOptions:
    """One SGLang request's options: the launch's ``flat`` overridden by ``custom_params.dllm`` and its sampling
    parameters (the core's ``FlatOptions.request``); raises ValueError naming the option (the scheduler's 400)."""
    sp = req.sampling_params
    for name, default in NOT_DECODED.items():
        value = getattr(sp, name, default)
        if value is not None and value != default and value != {}:
            raise ValueError(f"{name}: not supported by a diffusion decode (dllm-serve)")
    own = (getattr(sp, "custom_params", None) or {}).get(CUSTOM)
    if own is not None and not isinstance(own, dict):
        raise ValueError(f"custom_params.{CUSTOM} must be an object of dllm options, got {own!r}")
    opts = flat.request(own, WHERE, SEED_FIELD, **sampling(sp))
    if opts.decode.block_length not in (None, block):
        raise ValueError(f"{WHERE}block_length {opts.decode.block_length}: this server's block is SGLang's "
                         f"(--dllm-algorithm-config block_size {block}); allowed: {block}")
    return opts


def logprobs(req) -> int | None:
    """A request's logprobs: None, or the top alternatives it asks with ``return_logprob`` (``top_logprobs_num``,
    0-20); chosen token ids are refused (ValueError naming the field: the scheduler's 400; prompt logprobs: the
    admission hook)."""
    if not getattr(req, "return_logprob", False):
        return None
    lp = getattr(req, "logprob", None)
    if getattr(lp, "token_ids_logprob", None) is not None:
        raise ValueError("token_ids_logprob: not reported by a diffusion decode (dllm-serve); top_logprobs_num is")
    k = int(getattr(lp, "top_logprobs_num", 0) or 0)
    if not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"top_logprobs_num: {k}; allowed: 0 to {MAX_LOGPROBS} (dllm-serve)")
    return k
