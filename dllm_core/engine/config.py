"""GenerationConfig: every knob of one generation, validated once in ``__post_init__``."""
from __future__ import annotations

from dataclasses import dataclass

from ..cache import CachePolicy, make_cache
from ..sampling import Sampler, make_sampler
from ..sampling.base import check_proposal


@dataclass(frozen=True)
class GenerationConfig:
    """Options of the reference engine. ``sampler`` / ``cache`` take a spec string
    (``"threshold:tau=0.9"``, ``"dllm:kp=50,kr=7"``) or an instance; ``steps`` is the total
    number of denoising steps for fixed-schedule samplers (ignored by variable-step ones)."""

    gen_length: int = 128
    block_length: int = 32
    steps: int = 128
    sampler: str | Sampler = "low_confidence"
    cache: str | CachePolicy = "none"
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    cfg_scale: float = 0.0
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    mask_id: int | None = None
    eot_id: int | None = None
    seed: int = 0

    def __post_init__(self):
        for n in ("gen_length", "block_length", "steps"):
            if getattr(self, n) < 1:
                raise ValueError(f"--{n.replace('_', '-')} must be >= 1, got {getattr(self, n)}")
        if self.gen_length % self.block_length:
            raise ValueError(f"--gen-length {self.gen_length} must be a multiple of --block-length "
                             f"{self.block_length}")
        object.__setattr__(self, "sampler", make_sampler(self.sampler))
        object.__setattr__(self, "cache", make_cache(self.cache))
        if self.sampler.fixed_steps and self.steps % self.num_blocks:
            raise ValueError(f"--steps {self.steps} must be a multiple of the number of blocks "
                             f"{self.num_blocks} (gen_length / block_length)")
        check_proposal(self.temperature, self.top_p, self.top_k, lambda n: "--" + n.replace("_", "-"))
        if self.cfg_scale < 0:
            raise ValueError(f"--cfg-scale must be >= 0, got {self.cfg_scale}")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks
