"""``--dllm-algorithm-config`` YAML -> validated dllm_core objects (``AlgorithmOptions``); the keys are listed in
``integrations/sglang/README.md``: the sampler's own options (or ``sampler`` / ``steps`` for ``DllmCore``),
``temperature, top_p, top_k, seed``, ``cache`` (a dllm_core spec in vLLM's vocabulary: ``canvas[:kr=..]`` over
SGLang's block, a policy that refreshes the prefix over the whole response) and ``block_size`` (SGLang's own).
Every value is validated by constructing the dllm_core object, so a bad option fails at launch with its name and
allowed values.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from dllm_core.cache import CachePolicy, host_cache, registry
from dllm_core.cache.canvas import CanvasCache
from dllm_core.engine.request import DecodeOptions, ResponsePlan
from dllm_core.options import OptionError, check_value, parse_spec
from dllm_core.sampling import SAMPLERS, Sampler

DECODING = ("temperature", "top_p", "top_k", "seed")
HOST_KEYS = {"block_size"}  # SGLang's own DllmConfig reads these
POLICY_KEY = "cache"
RENAMED = "dllm_cache"  # before 0.2: dLLM-Cache over the block as a mapping
BLOCK_CANVAS = ("canvas", "none")  # SGLang's own block-canvas semantics
NOT_IN_SGLANG = ("graphs", "blocks")  # reference-engine knobs with no meaning inside SGLang (its canvas is one block)


def parse_policy(algo: str, value) -> CachePolicy:
    """``cache: <spec>`` -> a policy over the request's whole response (one that refreshes the prefix: Fast-dLLM's,
    dLLM-Cache's, or ``module.Class``) or SGLang's block canvas (a ``CanvasCache``: ``canvas`` / ``none``, with
    dLLM-Cache's options), by dllm_core's spec parser; errors name ``<algo>.cache`` and the allowed values."""
    where = f"{algo}.{POLICY_KEY}"
    spec = check_value(value, "str", where)
    name, _, rest = (s.strip() for s in spec.partition(":"))
    found = {n: c for n, c in registry(spec, where).items() if c.refreshes_prefix or n in BLOCK_CANVAS}
    if name not in found:
        raise ValueError(f"{where}: unknown policy {name!r}; allowed: {sorted(found)}")
    cls = CanvasCache if name in BLOCK_CANVAS else found[name]
    keys = [item.partition("=")[0].strip() for item in rest.split(",") if item.strip()]
    known = sorted(options_of(cls, NOT_IN_SGLANG))
    extra = sorted(set(keys) - set(known))
    if extra:
        raise ValueError(f"{where}: {name} has no option {extra[0]!r}; allowed: {known}")
    try:
        pol = parse_spec(spec, found, where)
    except OptionError as e:  # dllm_core names its CLI flag; name the YAML key instead
        raise ValueError(e.under(where)) from None
    return host_cache(pol, where)  # the core's rule: the block canvas unless the policy refreshes the prefix


DEFAULT_POLICY = "dual"  # no `cache` on our model classes: the whole response, Fast-dLLM's dual


def with_default_cache(cfg: dict, whole_response: bool) -> dict:
    """The YAML with the default cache policy of a model that serves the whole response as one canvas (our LLaDA /
    Dream classes): defaults never decode a response as chained block canvases; SGLang's block canvas only when
    asked for by name (``cache: canvas``)."""
    if whole_response and POLICY_KEY not in cfg and RENAMED not in cfg:
        return {**cfg, POLICY_KEY: DEFAULT_POLICY}
    return cfg


def read_yaml(path: str | None) -> dict:
    """The YAML mapping at ``path`` ({} when no config was given)."""
    if path is None:
        return {}
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--dllm-algorithm-config: {path} does not exist")
    try:
        cfg = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--dllm-algorithm-config: {path} is not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--dllm-algorithm-config: {path} must hold a YAML mapping, got {type(cfg).__name__}")
    return cfg


def options_of(cls, exclude=()) -> dict:
    """The init fields of a dllm_core config dataclass, by name."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in exclude}


def build(cls, opts: dict, where: str, also_allowed=()):
    """``cls(**opts)`` for a dllm_core config dataclass: unknown keys, wrong types and the class's
    own range / choice checks become errors naming ``where.<option>`` and the allowed values."""
    fields = options_of(cls)
    unknown = sorted(set(opts) - set(fields))
    if unknown:
        raise ValueError(f"{where} has no option {unknown[0]!r}; allowed: {sorted([*fields, *also_allowed])}")
    kwargs = {k: check_value(v, str(fields[k].type), f"{where}.{k}") for k, v in opts.items()}
    try:
        return cls(**kwargs)
    except OptionError as e:  # dllm_core names its CLI flag; name the YAML key instead
        raise ValueError(e.under(where)) from None


@dataclass(frozen=True)
class AlgorithmOptions:
    """A parsed ``--dllm-algorithm-config`` for one algorithm: dllm_core ``DecodeOptions`` (sampler, ``steps``:
    the total over a response, proposal sampling, seed) + the cache of SGLang's block canvas or the policy
    over the whole response."""

    decode: DecodeOptions
    cache: CanvasCache = CanvasCache()  # SGLang's block canvas (exact: kr=1)
    policy: CachePolicy | None = None  # cache: prefix / dual / dllm / module.Class: over the whole response

    @property
    def sampler(self) -> Sampler:
        return self.decode.sampler

    @property
    def caching(self) -> bool:
        """Whether dLLM-Cache runs over the block (data-dependent: no CUDA graphs)."""
        return self.policy is None and not self.cache.exact

    def response(self, max_new_tokens: int | None, block: int) -> ResponsePlan:
        """A request's response under these options (``max_new_tokens`` in whole blocks of SGLang's block)."""
        names = {"gen_length": "max_new_tokens", "block_length": "block_size", "steps": "steps"}
        return self.decode.response(block if max_new_tokens is None else max_new_tokens, block, lambda n: names[n])

    @classmethod
    def parse(cls, algo: str, sampler_name: str | None, cfg: dict) -> "AlgorithmOptions":
        """``sampler_name``: the dllm_core sampler behind a named algorithm (its options are the
        YAML's top-level keys); None: the generic algorithm (``sampler: <spec>``, ``steps``)."""
        cfg = dict(cfg)
        for k in HOST_KEYS:
            cfg.pop(k, None)
        if RENAMED in cfg:
            old = cfg[RENAMED]
            spec = "canvas:" + ",".join(f"{k}={v}" for k, v in old.items()) if isinstance(old, dict) else "canvas:.."
            raise ValueError(f"{algo}.{RENAMED}: renamed in 0.2 to {algo}.{POLICY_KEY} with vLLM's spelling: "
                             f"cache: \"{spec}\" (dLLM-Cache over SGLang's block canvas)")
        cache = parse_policy(algo, cfg.pop(POLICY_KEY)) if POLICY_KEY in cfg else CanvasCache()
        decoding = {k: cfg.pop(k) for k in DECODING if k in cfg}
        if sampler_name is None:
            unknown = sorted(set(cfg) - {"sampler", "steps"})
            if unknown:
                allowed = ["sampler", "steps", POLICY_KEY, *DECODING, *HOST_KEYS]
                raise ValueError(f"{algo} has no option {unknown[0]!r}; allowed: {sorted(allowed)}")
            decoding.update(cfg)
        else:
            decoding["sampler"] = build(SAMPLERS[sampler_name], cfg, algo, [POLICY_KEY, *DECODING, *HOST_KEYS])
        decode = DecodeOptions.build(decoding, f"{algo}.", only=("sampler", "steps", *DECODING))
        if cache.refreshes_prefix:
            return cls(decode, policy=cache)
        return cls(decode, cache)
