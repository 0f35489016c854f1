"""What ``lm_eval --model dllm`` runs a checkpoint with: the embedded engine for masked-diffusion models
(``DiffusionBackend``) and greedy decoding, optionally with lossless DFlash / TokenSwift speculation, for causal
targets (``CausalBackend``). Both decode exactly as ``dllm eval`` does: token prompts in, each row cut at the
first EOS / EOT id and decoded without special tokens."""
from __future__ import annotations

from .config import HarnessConfig
from .likelihood import causal_loglikelihood, check_estimable, greedy_reproduces, mc_loglikelihood


class DiffusionBackend:
    """LLaDA / Dream / LLaDA2 checkpoints through the embedded engine (any sampler x cache policy)."""

    def __init__(self, cfg: HarnessConfig):
        from ..cli import stop_ids, torch_dtype
        from ..models import load_model
        from ..tokenizer import load_tokenizer

        self.cfg = cfg
        self.model = load_model(cfg.pretrained, cfg.device, torch_dtype(cfg.dtype))
        self.tok = load_tokenizer(cfg.pretrained)
        self.stop = stop_ids(self.tok, self.model)
        if self.model.block_causal:  # LLaDA2: block length / cache checked against the checkpoint up front
            from ..engine.generate import check_block_causal

            check_block_causal(self.model, cfg.generation)

    def generate(self, prompts: list[list[int]], overrides: dict) -> list[str]:
        """Texts of ``prompts`` decoded in batches of ``batch_size`` (``overrides``: temperature / top_p / top_k)."""
        from ..cli import decode
        from ..tasks.evaluate import generate_batched

        gen = self.cfg.generation_config(**overrides) if overrides else self.cfg.generation
        rows = generate_batched(self.model, prompts, gen, self.cfg.batch_size).tokens
        return [decode(self.tok, r, self.stop) for r in rows]

    def loglikelihood(self, prefix: list[int], target: list[int]) -> tuple[float, bool]:
        """LLaDA's Monte-Carlo estimate, and (``greedy_check``) whether greedy decoding reproduces ``target``."""
        c, mask_id = self.cfg, self.model.args.mask_token_id
        check_estimable(self.model)
        ll = mc_loglikelihood(self.model, prefix, target, mask_id, c.mc_num, c.mc_batch, c.cfg_scale, c.seed)
        return ll, bool(c.greedy_check and greedy_reproduces(self.model, prefix, target, mask_id, c.cfg_scale))


class CausalBackend:
    """Qwen3 (AR) targets: ``dllm eval``'s greedy decoding (left-padded batches), or one prompt at a time with
    DFlash / TokenSwift speculation, which is lossless: the same tokens as greedy decoding."""

    def __init__(self, cfg: HarnessConfig):
        from ..cli import torch_dtype
        from ..tasks.evaluate import load_ar, special_ids
        from ..tokenizer import load_tokenizer

        self.cfg = cfg
        self.tok = load_tokenizer(cfg.pretrained)
        ids = special_ids(self.tok)
        self.stop, self.pad = {ids["eos"], ids["eot"]}, ids["eos"]
        self.model = load_ar(cfg.pretrained, cfg.device, torch_dtype(cfg.dtype))
        self.drafter = self._load_drafter()

    def _load_drafter(self):
        c = self.cfg
        if c.spec == "dflash":
            from ..drafters import load_drafter

            return load_drafter(c.drafter, c.device).bind(self.model)
        if c.spec == "tokenswift":
            from ..drafters.tokenswift import load_heads
            from ..drafters.tokenswift.heads import check_compatible

            heads = load_heads(c.drafter, c.device)
            check_compatible(heads, self.model)
            return heads
        return None

    def generate(self, prompts: list[list[int]], overrides: dict) -> list[str]:
        """Greedy texts of ``prompts`` (``overrides`` may only ask for greedy decoding)."""
        from ..tasks.evaluate import ar_greedy

        if overrides.get("temperature", 0.0) > 0:
            raise ValueError(f"generation_kwargs: {self.cfg.pretrained} is a causal target, decoded greedily here "
                             f"(temperature 0), got temperature {overrides['temperature']}")
        if self.drafter is None:
            rows = ar_greedy(self.model, prompts, self.stop, self.pad, self.cfg.batch_size, self.cfg.gen_length)[0]
        else:
            rows = [self._speculate(p) for p in prompts]
        return [self.tok.decode(r, skip_special_tokens=True) for r in rows]

    def _speculate(self, prompt: list[int]) -> list[int]:
        """One prompt's greedy tokens through the drafter, cut before the first stop id."""
        stops, n = tuple(sorted(self.stop)), self.cfg.gen_length
        if self.cfg.spec == "dflash":
            from ..drafters import SpecConfig, speculative_generate

            toks = speculative_generate(self.model, self.drafter, prompt, SpecConfig(n, stop_token_ids=stops)).tokens
        else:
            from ..drafters.tokenswift import TokenSwiftConfig, tokenswift_generate

            toks = tokenswift_generate(self.model, self.drafter, prompt,
                                       TokenSwiftConfig(max_new_tokens=n, stop_token_ids=stops)).tokens
        return toks[:next((i for i, t in enumerate(toks) if t in self.stop), len(toks))]

    def loglikelihood(self, prefix: list[int], target: list[int]) -> tuple[float, bool]:
        """Exact teacher-forced log-likelihood and greedy match."""
        return causal_loglikelihood(self.model, prefix, target)


def load_backend(cfg: HarnessConfig):
    """The backend for ``cfg.pretrained``'s architecture; options that do not apply to it are errors."""
    from ..tasks.evaluate import is_ar

    if is_ar(cfg.pretrained):
        default = HarnessConfig(cfg.pretrained)
        set_ = [k for k in ("sampler", "cache", "block_length", "steps", "cfg_scale")
                if getattr(cfg, k) != getattr(default, k)]
        if set_:
            raise ValueError(f"{set_}: diffusion options; {cfg.pretrained} is a causal (AR) checkpoint, decoded "
                             f"greedily (speculation: spec=dflash|tokenswift,drafter=DIR)")
        return CausalBackend(cfg)
    if cfg.spec != "none":
        raise ValueError(f"spec={cfg.spec}: speculation drafts for causal (AR) targets; {cfg.pretrained} is a "
                         f"masked-diffusion checkpoint (choose its sampler / cache instead)")
    return DiffusionBackend(cfg)
