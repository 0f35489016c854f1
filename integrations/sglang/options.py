"""``--dllm-algorithm-config`` YAML -> validated dllm_core objects.

One YAML mapping per launch. Keys:

* the sampler's own options, under dllm_core's names (SlowFast: ``min_conf, high, k, w_hist,
  var, k_fast, stat, fallback, slow_commit_high``; FastDllmThreshold: ``tau``; FastDllmFactor:
  ``f``; every sampler: ``confidence``) - or, for the generic ``DllmCore`` algorithm, ``sampler``:
  a dllm_core spec (``"low_confidence"``, ``"slowfast:k=6,high=0.9"``) plus ``steps`` (the total
  denoising steps over a response, as ``dllm generate --steps``, split over its blocks by fixed-schedule
  samplers; default one per position);
* ``temperature``, ``top_p``, ``top_k``, ``seed``: proposal sampling (default greedy);
* ``dllm_cache``: a mapping of dllm_core ``CanvasCache`` options (``kr, rho, select, metric,
  first_layer, seed``) - response-side dLLM-Cache over the current block (``kr > 1`` enables it);
* ``cache``: the cache policy, a dllm_core spec: ``canvas`` (= ``none``: SGLang's block canvas; the default of
  models that are not ours, e.g. LLaDA2, for which it is exact; ours default to ``dual``, ``DEFAULT_POLICY``), Fast-dLLM's ``prefix`` / ``dual`` (``dual:every=2``: also refresh every 2 steps) or dLLM-Cache
  ``dllm`` (``dllm:kp=4,kr=2,rho=0.25``: every ``DLLMCache`` option) with the embedded engine's semantics
  over the whole response (``response.py``; any dllm_core policy that refreshes the prefix, by name or
  ``module.Class``); exclusive with ``dllm_cache``;
* ``block_size``: read by SGLang itself (``DllmConfig``).

Every value is validated by constructing the dllm_core object, so a bad option fails at launch
(``configure_server_args``) with the option's name and its allowed values.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from dllm_core.cache import CachePolicy, registry
from dllm_core.cache.canvas import CanvasCache
from dllm_core.engine.request import DecodeOptions, ResponsePlan
from dllm_core.options import OptionError, check_value, parse_spec
from dllm_core.sampling import SAMPLERS, Sampler

DECODING = ("temperature", "top_p", "top_k", "seed")
HOST_KEYS = {"block_size"}  # SGLang's own DllmConfig reads these
CACHE_KEY = "dllm_cache"
POLICY_KEY = "cache"
BLOCK_CANVAS = ("canvas", "none")  # SGLang's own block-canvas semantics (dLLM-Cache over it: ``dllm_cache``)
NOT_IN_SGLANG = ("graphs", "blocks")  # reference-engine knobs with no meaning inside SGLang (its canvas is one block)


def parse_policy(algo: str, value) -> CachePolicy | None:
    """``cache: <spec>`` -> a policy over the request's whole response (one that refreshes the prefix: Fast-dLLM's,
    dLLM-Cache's, or ``module.Class``; None: SGLang's block canvas), by dllm_core's spec parser; errors name
    ``<algo>.cache`` and the allowed values."""
    where = f"{algo}.{POLICY_KEY}"
    spec = check_value(value, "str", where)
    name, _, rest = (s.strip() for s in spec.partition(":"))
    whole = {n: c for n, c in registry(spec, where).items() if c.refreshes_prefix}
    allowed = sorted([*BLOCK_CANVAS, *whole])
    if name in BLOCK_CANVAS and not rest:
        return None
    if name in BLOCK_CANVAS:
        raise ValueError(f"{where}: {name} takes no options (dLLM-Cache over SGLang's block: {CACHE_KEY}: "
                         f"{{kr: .., rho: ..}}), got {spec!r}")
    if name not in whole:
        raise ValueError(f"{where}: unknown policy {name!r}; allowed: {allowed}")
    keys = [item.partition("=")[0].strip() for item in rest.split(",") if item.strip()]
    known = sorted(options_of(whole[name], NOT_IN_SGLANG))
    extra = sorted(set(keys) - set(known))
    if extra:
        raise ValueError(f"{where}: {name} has no option {extra[0]!r}; allowed: {known}")
    try:
        return parse_spec(spec, whole, where)
    except OptionError as e:  # dllm_core names its CLI flag; name the YAML key instead
        raise ValueError(e.under(where)) from None


DEFAULT_POLICY = "dual"  # no `cache` / `dllm_cache` on our model classes: the whole response, Fast-dLLM's dual


def with_default_cache(cfg: dict, whole_response: bool) -> dict:
    """The YAML with the default cache policy of a model that serves the whole response as one canvas (our LLaDA /
    Dream classes): defaults never decode a response as chained block canvases; SGLang's block canvas only when
    asked for by name (``cache: canvas``)."""
    if whole_response and POLICY_KEY not in cfg and CACHE_KEY not in cfg:
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


def build(cls, opts: dict, where: str, also_allowed=(), exclude=()):
    """``cls(**opts)`` for a dllm_core config dataclass: unknown keys, wrong types and the class's
    own range / choice checks become errors naming ``where.<option>`` and the allowed values."""
    fields = options_of(cls, exclude)
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
    cache: CanvasCache | None = None  # None or exact (kr=1): plain forwards
    policy: CachePolicy | None = None  # cache: prefix / dual / dllm / module.Class: over the whole response

    @property
    def sampler(self) -> Sampler:
        return self.decode.sampler

    @property
    def caching(self) -> bool:
        """Whether the dLLM-Cache feature cache runs (data-dependent: no CUDA graphs)."""
        return self.cache is not None and not self.cache.exact

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
        cache = cfg.pop(CACHE_KEY, None)
        if cache is not None and not isinstance(cache, dict):
            allowed = sorted(options_of(CanvasCache, NOT_IN_SGLANG))
            raise ValueError(f"{algo}.{CACHE_KEY} must be a mapping of {allowed}")
        fast = parse_policy(algo, cfg.pop(POLICY_KEY)) if POLICY_KEY in cfg else None
        if fast is not None and cache is not None:
            raise ValueError(f"{algo}: {POLICY_KEY}: {fast.name} and {CACHE_KEY} exclude each other "
                             f"(dLLM-Cache runs over SGLang's block canvas)")
        decoding = {k: cfg.pop(k) for k in DECODING if k in cfg}
        if sampler_name is None:
            unknown = sorted(set(cfg) - {"sampler", "steps"})
            if unknown:
                allowed = ["sampler", "steps", CACHE_KEY, POLICY_KEY, *DECODING, *HOST_KEYS]
                raise ValueError(f"{algo} has no option {unknown[0]!r}; allowed: {sorted(allowed)}")
            decoding.update(cfg)
        else:
            decoding["sampler"] = build(SAMPLERS[sampler_name], cfg, algo, [CACHE_KEY, POLICY_KEY, *DECODING, *HOST_KEYS])
        decode = DecodeOptions.build(decoding, f"{algo}.", only=("sampler", "steps", *DECODING))
        block_cache = None if cache is None else build(CanvasCache, cache, f"{algo}.{CACHE_KEY}", exclude=NOT_IN_SGLANG)
        return cls(decode, block_cache, fast)
