"""``--dllm-algorithm-config`` YAML -> dllm_core ``FlatOptions`` (the keys: ``integrations/sglang/README.md``), every
value validated by the core's builders: a bad option fails at launch with its name and allowed values."""
from __future__ import annotations

from dllm_core.engine.host_options import POLICY_KEY, FlatOptions, read_mapping, with_default_policy

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
