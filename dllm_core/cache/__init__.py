"""Cache policies (immutable; ``begin`` returns the per-request ``CacheState``), selectable by name:
``make_cache("dllm:kp=50,kr=7,rho=0.25")``."""
from ..options import parse_spec
from .base import Canvas, CachePolicy, CacheState, Counters
from .canvas import CanvasCache
from .dllm_cache import DLLMCache
from .fast_dllm import DualCache, PrefixCache

CACHES: dict[str, type[CachePolicy]] = {c.name: c for c in (CachePolicy, PrefixCache, DualCache, DLLMCache, CanvasCache)}


def make_cache(spec: "str | CachePolicy") -> CachePolicy:
    """``name[:key=value,...]`` -> a cache policy (none, prefix, dual, dllm, canvas)."""
    return spec if isinstance(spec, CachePolicy) else parse_spec(spec, CACHES, "--cache")


def host_cache(spec: "str | CachePolicy", option: str = "--cache") -> CachePolicy:
    """The policy a paged host engine runs for a cache option: Fast-dLLM's ``prefix`` / ``dual`` and
    dLLM-Cache (``dllm``) as they are (the prefix K/V live in the host's paged cache, recomputed in
    place at their refreshes), ``none`` / ``canvas:..`` as the block-canvas policy."""
    pol = spec if isinstance(spec, CachePolicy) else parse_spec(spec, CACHES, option)
    return pol if isinstance(pol, (PrefixCache, DLLMCache)) else CanvasCache.from_spec(pol, option)


__all__ = ["CACHES", "CachePolicy", "CacheState", "Canvas", "CanvasCache", "Counters", "DLLMCache", "DualCache", "PrefixCache", "host_cache", "make_cache"]
