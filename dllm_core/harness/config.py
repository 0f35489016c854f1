"""The ``--model_args`` of ``lm_eval --model dllm``: one frozen config, validated once.

Diffusion options are the embedded engine's own (``GenerationConfig``: the same sampler / cache spec strings
and the same errors as ``dllm generate`` / ``dllm eval``); the likelihood options are the LLaDA estimator's
(``likelihood.py``); ``spec`` / ``drafter`` select lossless speculation for causal (AR) targets."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from ..options import check_choice, check_min, check_value

SPECS = ("none", "dflash", "tokenswift")
IGNORED = ("max_batch_size", "trust_remote_code")  # lm-eval passes these; nothing here reads them


@dataclass(frozen=True)
class HarnessConfig:
    """``pretrained``: a local checkpoint directory (LLaDA / Dream / LLaDA2, or a Qwen3 AR target).
    Generation: ``sampler``, ``cache``, ``gen_length`` (the response canvas; AR targets: the most new tokens),
    ``block_length``, ``steps`` (None: one per position), ``cfg_scale``, ``batch_size``, ``seed``; ``threads``:
    torch's CPU threads (None: torch's choice; 1 is fastest for the tiny task models on a busy machine).
    Likelihood: ``mc_num`` Monte-Carlo samples in mini-batches of ``mc_batch`` rows (None: all at once),
    ``greedy_check`` (also decode the continuation greedily and report whether it is reproduced).
    Speculation (AR targets): ``spec`` in none / dflash / tokenswift with the ``drafter`` directory."""

    pretrained: str = ""
    sampler: str = "low_confidence"
    cache: str = "none"
    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None
    cfg_scale: float = 0.0
    batch_size: int = 8
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    threads: int | None = None
    mc_num: int = 128
    mc_batch: int | None = None
    greedy_check: bool = False
    spec: str = "none"
    drafter: str | None = None
    generation: object = field(init=False, repr=False, compare=False, default=None)  # GenerationConfig

    def __post_init__(self):
        for name in ("pretrained", "drafter"):  # directories may come as paths
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for f in fields(self):
            if f.init:
                object.__setattr__(self, f.name, check_value(getattr(self, f.name), f.type, f.name))
        if not self.pretrained:
            raise ValueError("pretrained: a local checkpoint directory is required (--model_args pretrained=DIR)")
        from ..cli import torch_dtype
        from ..models import check_device

        torch_dtype(self.dtype)
        check_device(self.device, "device")
        check_min(self.batch_size, 1, "batch_size")
        if self.threads is not None:
            check_min(self.threads, 1, "threads")
        self._check_likelihood()
        self._check_spec()
        object.__setattr__(self, "generation", self.generation_config())

    def _check_likelihood(self) -> None:
        check_min(self.mc_num, 1, "mc_num")
        if self.mc_batch is not None:
            check_min(self.mc_batch, 1, "mc_batch")
            if self.mc_num % self.mc_batch:
                raise ValueError(f"mc_num {self.mc_num} must be a multiple of mc_batch {self.mc_batch} "
                                 f"(whole mini-batches of Monte-Carlo samples)")

    def _check_spec(self) -> None:
        check_choice(self.spec, SPECS, "spec")
        if (self.spec == "none") != (self.drafter is None):
            raise ValueError(f"spec={self.spec} with drafter={self.drafter}: spec dflash / tokenswift needs the "
                             f"drafter's directory, and a drafter needs spec dflash or tokenswift")

    def generation_config(self, **overrides):
        """The engine's ``GenerationConfig`` for these options (``overrides``: a request's temperature / top_p /
        top_k); its errors are the engine's, word for word."""
        from ..engine import GenerationConfig

        kw = dict(gen_length=self.gen_length, block_length=self.block_length, steps=self.steps, sampler=self.sampler,
                  cache=self.cache, cfg_scale=self.cfg_scale, seed=self.seed)
        return GenerationConfig(**{**kw, **overrides})

    @classmethod
    def from_model_args(cls, args: dict) -> HarnessConfig:
        """From lm-eval's parsed ``--model_args`` (plus its ``batch_size`` / ``device``): unknown keys are an
        error naming the allowed ones; ``None`` values (lm-eval's unset) keep the defaults."""
        names = [f.name for f in fields(cls) if f.init]
        unknown = sorted(set(args) - set(names) - set(IGNORED))
        if unknown:
            raise ValueError(f"--model_args: unknown option(s) {unknown}; allowed: {sorted(names)}")
        kw = {k: v for k, v in args.items() if k in names and v is not None}
        if isinstance(kw.get("batch_size"), str) and kw["batch_size"].isdigit():  # lm-eval's --batch_size is a str
            kw["batch_size"] = int(kw["batch_size"])
        return cls(**kw)

    def model_info(self) -> dict:
        """What lm-eval records in its results' ``config``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}
