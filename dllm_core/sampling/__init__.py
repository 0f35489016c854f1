"""Transfer rules ("samplers"), selectable by name: ``make_sampler("threshold:tau=0.9")``."""
from ..options import parse_spec
from .base import Sampler, TokenContext, confidence, propose
from .fixed import Entropy, LowConfidence, MaskGitPlus, Origin, RandomRemasking, TopKMargin
from .parallel import Factor, Threshold, factor_commit, threshold_commit
from .slowfast import SlowFast

SAMPLERS: dict[str, type[Sampler]] = {c.name: c for c in (
    LowConfidence, RandomRemasking, MaskGitPlus, TopKMargin, Entropy, Origin, Threshold, Factor, SlowFast)}


def make_sampler(spec: "str | Sampler") -> Sampler:
    """``name[:key=value,...]`` -> sampler; a bare name takes the defaults."""
    return spec if isinstance(spec, Sampler) else parse_spec(spec, SAMPLERS, "--sampler")


__all__ = ["SAMPLERS", "Sampler", "TokenContext", "confidence", "factor_commit", "make_sampler", "propose",
           "threshold_commit"]
