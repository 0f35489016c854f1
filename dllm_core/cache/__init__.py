"""Cache policies (immutable; ``begin`` returns the per-request ``CacheState``), selectable by name:
``make_cache("dllm:kp=50,kr=7,rho=0.25")``, or by import path: ``make_cache("mypkg.policies.MyPolicy:k=v")``
(a ``CachePolicy`` subclass defined outside this package serves in every engine)."""
import importlib

from ..options import parse_spec
from .base import Canvas, CachePolicy, CacheState, Counters
from .canvas import CanvasCache
from .dllm_cache import DLLMCache, LayerSchedule
from .dpad import DPadCache
from .elastic import ElasticCache
from .fast_dllm import DualCache, PrefixCache
from .host import HostPart, HostPlan, HostRequest, HostStep

CACHES: dict[str, type[CachePolicy]] = {c.name: c for c in (CachePolicy, PrefixCache, DualCache, DLLMCache, CanvasCache,
                                                             DPadCache, ElasticCache)}


def registry(spec: str, option: str = "--cache") -> dict[str, type[CachePolicy]]:
    """The policies a spec may name: the built-in ones, and ``module.Class`` (a ``CachePolicy`` subclass)."""
    name = spec.partition(":")[0].strip()
    if "." not in name or name in CACHES:
        return CACHES
    module, _, cls = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{option}: cannot import the policy {name!r}: {e}") from None
    if not (isinstance(found, type) and issubclass(found, CachePolicy)):
        raise ValueError(f"{option}: {name!r} is not a CachePolicy subclass")
    return {**CACHES, name: found}


def make_cache(spec: "str | CachePolicy", option: str = "--cache") -> CachePolicy:
    """``name[:key=value,...]`` -> a cache policy (none, prefix, dual, dllm, canvas, dpad, elastic, or
    ``module.Class``)."""
    return spec if isinstance(spec, CachePolicy) else parse_spec(spec, registry(spec, option), option)


def host_cache(spec: "str | CachePolicy", option: str = "--cache") -> CachePolicy:
    """The policy a paged host engine runs for a cache option: a policy that refreshes the prefix (Fast-dLLM's
    ``prefix`` / ``dual``, dLLM-Cache's ``dllm``, any ``LayerSchedule``, ``elastic``, ``dpad``) as it is (the prefix
    K/V live in the host's paged cache, recomputed in place at its refreshes), ``none`` / ``canvas:..`` as the
    block-canvas policy."""
    pol = make_cache(spec, option)
    return pol if pol.refreshes_prefix else CanvasCache.from_spec(pol, option)


__all__ = ["CACHES", "CachePolicy", "CacheState", "Canvas", "CanvasCache", "Counters", "DLLMCache", "DPadCache",
           "DualCache", "ElasticCache", "HostPart", "HostPlan", "HostRequest", "HostStep", "LayerSchedule",
           "PrefixCache", "host_cache", "make_cache", "registry"]
