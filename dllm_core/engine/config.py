"""GenerationConfig: every knob of one generation, validated once in ``__post_init__``."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..cache import CachePolicy
from ..options import OptionError
from ..sampling import Sampler
from .request import DecodeOptions, ResponsePlan, response_plan


MAX_LOGPROBS = 20  # top alternatives per token, at most (OpenAI's bound)


def flag(name: str) -> str:
    """An option's CLI spelling (``--gen-length``)."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class GenerationConfig:
    """Options of the reference engine. ``sampler`` / ``cache`` take a spec string
    (``"threshold:tau=0.9"``, ``"dllm:kp=50,kr=7"``) or an instance; ``steps`` is the total number of
    denoising steps over the response for fixed-schedule samplers (None: one per decoded position;
    ignored by variable-step ones). A ``gen_length`` that is not whole blocks is decoded in the blocks
    covering it and cut (``engine.request.response_plan``, the rule of every engine)."""

    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None
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
    logprobs: int | None = None  # None: none; k >= 0: each token's log-probability and its top k alternatives

    def __post_init__(self):
        try:
            opts = DecodeOptions(self.sampler, self.cache, temperature=self.temperature, top_p=self.top_p,
                                 top_k=self.top_k)
        except OptionError as e:  # spec errors already name --sampler / --cache; the rest get their flag
            raise ValueError(str(e) if str(e).startswith("--") else f"{flag(e.key)} {e.rule}") from None
        object.__setattr__(self, "sampler", opts.sampler)
        object.__setattr__(self, "cache", opts.cache)
        object.__setattr__(self, "plan", response_plan(self.gen_length, self.block_length, self.steps,
                                                       opts.sampler.fixed_steps, flag))
        if self.cfg_scale < 0:
            raise ValueError(f"--cfg-scale must be >= 0, got {self.cfg_scale}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"--logprobs must be an integer in [0, {MAX_LOGPROBS}] (the top alternatives per token), "
                             f"got {self.logprobs!r}")

    plan: ResponsePlan = field(init=False, repr=False, compare=False, default=None)  # set in __post_init__

    @property
    def decoded_length(self) -> int:
        """Positions decoded: ``gen_length`` in whole blocks."""
        return self.plan.decoded

    @property
    def num_blocks(self) -> int:
        return self.plan.blocks

    @property
    def steps_per_block(self) -> int:
        return self.plan.steps_per_block
