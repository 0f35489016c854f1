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


__all__ = ["CACHES", "CachePolicy", "CacheState", "Canvas", "CanvasCache", "Counters", "DLLMCache", "DualCache", "PrefixCache", "make_cache"]
