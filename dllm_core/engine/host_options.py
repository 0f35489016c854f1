"""A request's options on a paged host, checked once against what the host serves.

* ``Served``: the host's fixed shape (its canvas, a block-causal model's grid block) and the rules a request's
  ``DecodeOptions`` meet there (the response rule, chained canvases asked for by name only, streaming);
* ``FlatOptions``: options given as one flat mapping (a host's launch YAML): a named sampler's own options at the
  top level (or ``sampler`` + ``steps``), proposal sampling, ``cache`` - built by ``DecodeOptions.build``;
* ``read_mapping`` / ``build_config``: a config file and a config dataclass with errors naming the key.

A host supplies its vocabulary (``Served.prefix``, the ``where`` of every error); the rules live here.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import CachePolicy, host_cache, registry
from ..cache.canvas import CanvasCache
from ..options import OptionError, check_value, parse_spec
from ..sampling import SAMPLERS, Sampler
from .generate import block_mismatch, check_paged_block_causal
from .request import DecodeOptions, ResponsePlan, build_cached

DEFAULT_BLOCK = 32
DEFAULT_POLICY = "dual"  # a host's default: the whole response one canvas, Fast-dLLM's dual cache
DECODING = ("temperature", "top_p", "top_k", "seed")
POLICY_KEY = "cache"
BLOCK_CANVAS = ("canvas", "none")  # a block scheduler's own block canvas
NOT_ON_HOSTS = ("graphs", "blocks")  # embedded-engine knobs with no meaning on a block scheduler (its canvas: a block)
REQUEST_KEYS = tuple(k for k in DecodeOptions.keys() if k != "seed")  # a request's own options (its seed: the host's)
FLAT_REQUEST_KEYS = ("sampler", "steps", "block_length", "temperature", "top_p", "top_k")  # ... + cache, on a launch


@dataclass(frozen=True)
class Served:
    """What a paged host serves: ``canvas_length`` (None: not known in this process), a block-causal model's grid
    block ``block_causal`` (its canvas), the server's ``defaults``; ``prefix`` names a request option in the host's
    vocabulary (``extra_args.dllm_``), ``length`` its response-length field (``max_tokens``)."""

    canvas_length: int | None = None
    block_causal: int | None = None
    defaults: DecodeOptions = field(default_factory=lambda: DecodeOptions(cache=DEFAULT_POLICY))
    prefix: str = ""
    length: str = "max_tokens"
    canvas_flag: str = ""  # how the host serves a longer canvas (named in the chain error)

    def check(self, opts: DecodeOptions, where: str | None = None) -> DecodeOptions:
        """``opts`` checked against the served canvas and model (errors name ``where + option``)."""
        where = self.prefix if where is None else where
        try:
            cache = host_cache(opts.cache, f"{where}cache")
            if self.block_causal:
                check_paged_block_causal(self.block_causal, opts.block_length, cache)
            if opts.stream and not cache.refreshes_prefix:
                raise OptionError("stream", f"needs a cache that refreshes the prefix (prefix, dual, dllm), got "
                                            f"cache {opts.cache.name!r}")
            canvas = self.canvas_length
            if opts.block_length and canvas and canvas % opts.block_length:
                raise OptionError("block_length", f"{opts.block_length} must divide the served canvas_length {canvas}")
        except OptionError as e:
            raise ValueError(f"{where}{e.key} {e.rule}") from None
        return opts

    def plan(self, opts: DecodeOptions, max_tokens: int | None) -> ResponsePlan:
        """The response (``max_tokens``, default one canvas) in whole blocks (default block: 32, or the canvas when
        shorter). A response longer than the canvas is decoded as chained canvases only when asked for by name
        (``chain``: each canvas blind to the rest, lossy); a block-causal model's canvas is its grid block."""
        canvas = self.canvas_length
        try:
            plan = opts.response(max_tokens or canvas, min(DEFAULT_BLOCK, canvas),
                                 lambda n: self.length if n == "gen_length" else self.prefix + n)
        except OptionError as e:
            raise ValueError(str(e)) from None
        if plan.decoded > canvas and not opts.chain and not self.block_causal:
            raise ValueError(f"{self.length} {plan.length}: the response ({plan.decoded} positions in whole blocks) is "
                             f"longer than the served canvas_length {canvas}; it would be decoded as chained canvases, "
                             f"each blind to the rest (lossy): serve a longer canvas{self.canvas_flag} or ask for "
                             f"chained canvases ({self.prefix}chain: true)")
        return plan

    def admit(self, opts: DecodeOptions, max_tokens: int | None) -> None:
        """The admission check of a request's response (raises ValueError naming the option)."""
        canvas = self.canvas_length
        if opts.stream and opts.cache.spans_response and canvas and max_tokens and max_tokens > canvas:
            raise ValueError(f"{self.length} {max_tokens}: a streamed dLLM-Cache response must fit the served "
                             f"canvas_length {canvas} (its features span the response; cache {opts.cache.name})")
        if canvas:
            self.plan(opts, max_tokens)

    def streams(self, opts: DecodeOptions, cache: CachePolicy, plan: ResponsePlan) -> bool:
        """Whether a request emits each block when decoded: as asked, else when its policy refreshes the prefix and
        the response is one canvas (the next canvas is then the rest of the response)."""
        return opts.stream if opts.stream is not None else cache.refreshes_prefix and plan.decoded <= self.canvas_length


def request_options(raw, base: DecodeOptions, where: str, keys=REQUEST_KEYS, seed_field: str = "seed",
                    **sampling) -> DecodeOptions:
    """``base`` overridden by one request's own options ``raw`` (``keys``; errors name ``where + key``) and by its
    host's sampling parameters ``sampling`` (``temperature``, ``top_p``, ``top_k``; None: not set) as the proposal
    sampler's: the same option given both ways with different values is an error naming both. A request's seed is
    the host's own field (``seed_field``: ``ResponseSlots.admit(seed=...)``), not one of these options."""
    raw = dict(raw or {})
    if "seed" in raw:
        raise ValueError(f"{where}seed: a request's seed is its {seed_field}")
    for k, v in sampling.items():
        if v is not None and raw.setdefault(k, v) != v:
            raise ValueError(f"{k} {v} and {where}{k} {raw[k]} differ: send one of them")
    return build_cached(raw, where, base, keys)


def host_block_size(cfg: dict, trained: int | None, model: str, where: str, default: int = DEFAULT_BLOCK) -> int:
    """A block scheduler's block from its config's ``block_size`` (default: the checkpoint's ``trained`` block of a
    block-causal ``model``, else ``default``): an integer >= 1, and a block-causal model's own; errors name
    ``where``."""
    block = cfg.get("block_size", trained or default)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{where}: block_size must be an integer >= 1, got {block!r}")
    if trained is not None and block != trained:
        raise ValueError(f"{where}: block_size {block_mismatch(block, trained, model)}")
    return block


def read_mapping(path: str | None, flag: str) -> dict:
    """The YAML (or JSON) mapping at ``path`` ({} when none was given); errors name ``flag``. A float written without
    a dot (``1e-3``: JSON's and YAML 1.2's spelling, which PyYAML's YAML 1.1 reads as a string) is a number."""
    if path is None:
        return {}
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{flag}: {path} does not exist")
    try:
        cfg = yaml.load(p.read_text(), Loader) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{flag}: {path} is not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{flag}: {path} must hold a YAML mapping, got {type(cfg).__name__}")
    return cfg


def init_fields(cls, exclude=()) -> dict:
    """The init fields of a config dataclass, by name."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in exclude}


def build_config(cls, opts: dict, where: str, also_allowed=()):
    """``cls(**opts)`` for a config dataclass: unknown keys, wrong types and the class's own range / choice checks
    become errors naming ``where.<option>`` and the allowed values."""
    fields = init_fields(cls)
    unknown = sorted(set(opts) - set(fields))
    if unknown:
        raise ValueError(f"{where} has no option {unknown[0]!r}; allowed: {sorted([*fields, *also_allowed])}")
    kwargs = {k: check_value(v, str(fields[k].type), f"{where}.{k}") for k, v in opts.items()}
    try:
        return cls(**kwargs)
    except OptionError as e:  # the class names its CLI flag; name the key instead
        raise ValueError(e.under(where)) from None


def block_host_policy(value, where: str) -> CachePolicy:
    """``cache: <spec>`` on a block scheduler -> a policy over the request's whole response (one that refreshes the
    prefix, or ``module.Class``) or the scheduler's block canvas (``CanvasCache``: ``canvas`` / ``none``, with
    dLLM-Cache's options); errors name ``where`` and the allowed values."""
    spec = check_value(value, "str", where)
    name, _, rest = (s.strip() for s in spec.partition(":"))
    every = registry(spec, where)
    found = {n: c for n, c in every.items() if c.refreshes_prefix or n in BLOCK_CANVAS}
    if name not in found:
        raise ValueError(f"{where}: unknown policy {name!r}; allowed: {sorted(found)}")
    cls = CanvasCache if name in BLOCK_CANVAS else found[name]
    keys = [item.partition("=")[0].strip() for item in rest.split(",") if item.strip()]
    known = sorted(init_fields(cls, NOT_ON_HOSTS))
    extra = sorted(set(keys) - set(known))
    if extra:
        raise ValueError(f"{where}: {name} has no option {extra[0]!r}; allowed: {known}")
    try:
        pol = parse_spec(spec, found, where)
    except OptionError as e:
        raise ValueError(e.under(where)) from None
    return host_cache(pol, where)


def with_default_policy(cfg: dict, whole_response: bool) -> dict:
    """A flat mapping with the default cache of a model that serves the whole response as one canvas: defaults
    never decode a response as chained block canvases (the block canvas only when asked for by name)."""
    return {**cfg, POLICY_KEY: DEFAULT_POLICY} if whole_response and POLICY_KEY not in cfg else cfg


@dataclass(frozen=True)
class FlatOptions:
    """Options from one flat mapping: ``decode`` (sampler, ``steps``: the total over a response, proposal sampling,
    seed) + the cache of a block scheduler's block canvas or the ``policy`` over the whole response."""

    decode: DecodeOptions
    cache: CanvasCache = CanvasCache()  # the block canvas (exact: kr=1)
    policy: CachePolicy | None = None  # a policy that refreshes the prefix: over the whole response

    @property
    def sampler(self) -> Sampler:
        return self.decode.sampler

    @property
    def caching(self) -> bool:
        """Whether dLLM-Cache runs over the block (data-dependent rows: no CUDA graphs)."""
        return self.policy is None and not self.cache.exact

    def response(self, max_new_tokens: int | None, block: int, length: str = "max_new_tokens",
                 block_name: str = "block_size") -> ResponsePlan:
        """A request's response under these options (``max_new_tokens`` in whole blocks of ``block``)."""
        names = {"gen_length": length, "block_length": block_name, "steps": "steps"}
        return self.decode.response(block if max_new_tokens is None else max_new_tokens, block, lambda n: names[n])

    def request(self, raw, where: str, seed_field: str, **sampling) -> "FlatOptions":
        """These (a launch's) options overridden by one request's mapping ``raw`` (``FLAT_REQUEST_KEYS`` and
        ``cache``; errors name ``where + key``) and its host's sampling parameters (``request_options``). The cache
        must be one the launch serves: a policy over the whole response on a launch with one; otherwise the block
        canvas, and dLLM-Cache over it only on a launch with it (the launch turned CUDA graphs off for it)."""
        raw = dict(raw or {})
        spec = raw.pop(POLICY_KEY, None)
        decode = request_options(raw, self.decode, where, FLAT_REQUEST_KEYS, seed_field, **sampling)
        if spec is None:
            return self if decode == self.decode else dataclasses.replace(self, decode=decode)
        flag = f"{where}{POLICY_KEY}"
        pol = block_host_policy(spec, flag)
        if self.policy is not None and not pol.refreshes_prefix:
            raise ValueError(f"{flag} {spec!r}: this server decodes each response as one canvas (launched with cache "
                             f"{self.policy.name}); allowed: a policy that refreshes the prefix (prefix, dual, dllm, "
                             f"elastic, dpad; prefix:every=1 gives the vanilla loop's tokens)")
        if self.policy is None and pol.refreshes_prefix:
            raise ValueError(f"{flag} {spec!r}: this server decodes its scheduler's block canvas (launched with cache "
                             f"canvas); a policy over the whole response needs a launch with one; allowed: canvas, "
                             f"none")
        if self.policy is None and not pol.exact and not self.caching:
            raise ValueError(f"{flag} {spec!r}: dLLM-Cache over the block needs a launch with it (its CUDA graphs "
                             f"off); this server was launched with the exact block canvas; allowed: canvas, none")
        return FlatOptions(decode, policy=pol) if pol.refreshes_prefix else FlatOptions(decode, pol)

    @classmethod
    def parse(cls, where: str, sampler_name: str | None, cfg: dict, host_keys=()) -> "FlatOptions":
        """``sampler_name``: the sampler whose options are the mapping's top-level keys; None: ``sampler: <spec>``
        and ``steps``. ``host_keys``: keys the host reads itself (ignored here)."""
        cfg = {k: v for k, v in cfg.items() if k not in host_keys}
        cache = block_host_policy(cfg.pop(POLICY_KEY), f"{where}.{POLICY_KEY}") if POLICY_KEY in cfg else CanvasCache()
        decoding = {k: cfg.pop(k) for k in DECODING if k in cfg}
        if sampler_name is None:
            unknown = sorted(set(cfg) - {"sampler", "steps"})
            if unknown:
                allowed = ["sampler", "steps", POLICY_KEY, *DECODING, *host_keys]
                raise ValueError(f"{where} has no option {unknown[0]!r}; allowed: {sorted(allowed)}")
            decoding.update(cfg)
        else:
            decoding["sampler"] = build_config(SAMPLERS[sampler_name], cfg, where, [POLICY_KEY, *DECODING, *host_keys])
        decode = DecodeOptions.build(decoding, f"{where}.", only=("sampler", "steps", *DECODING))
        return cls(decode, policy=cache) if cache.refreshes_prefix else cls(decode, cache)
