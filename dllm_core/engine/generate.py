"""The one decoding loop: semi-autoregressive blocks, a sampler deciding commits, a cache policy
producing hidden states. Batches of prompts of different lengths run left-padded in lock step
per block; each row reproduces its unbatched run (rows that finish a block early idle)."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ..cache import Canvas, CanvasCache, Counters
from ..models import DiffusionLM
from ..sampling import TokenContext
from .config import GenerationConfig
from .step import mask_in_prompt, plan_step, take_step


@dataclass
class GenerationResult:
    """tokens [B, gen_length] (the generated region), NFE per row, wall seconds, work counters."""

    tokens: torch.Tensor
    nfe: list[int]
    seconds: float
    counters: Counters
    prompt_lens: list[int]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens.numel() / max(self.seconds, 1e-9)


def build_canvas(prompts: list[list[int]], cfg: GenerationConfig, mask_id: int, pad_id: int, device):
    """Left-padded [prompt | masks] -> x [B, T], key mask [B, 1, 1, T], positions [B, T], P."""
    P = max(len(p) for p in prompts)
    x = torch.full((len(prompts), P + cfg.gen_length), pad_id, dtype=torch.long, device=device)
    keep = torch.ones_like(x, dtype=torch.bool)
    for i, p in enumerate(prompts):
        x[i, P - len(p):P] = torch.tensor(p, dtype=torch.long, device=device)
        keep[i, :P - len(p)] = False
    x[:, P:] = mask_id
    pos = (keep.cumsum(-1) - 1).clamp_min(0)
    return x, keep[:, None, None, :], pos, P


def _check(model: DiffusionLM, prompts, cfg: GenerationConfig) -> int:
    mask_id = cfg.mask_id if cfg.mask_id is not None else model.args.mask_token_id
    if mask_id is None:
        raise ValueError("mask_token_id: the model's config.json has none; pass mask_id explicitly")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("--prompt: every prompt needs at least one token")
    for p in prompts:
        if err := mask_in_prompt(p, mask_id):
            raise ValueError(f"--prompt: {err}")
    longest = max(len(p) for p in prompts)
    if longest + cfg.gen_length > model.args.max_seq_len:
        raise ValueError(f"--prompt: {longest} prompt tokens + --gen-length {cfg.gen_length} exceed the model's "
                         f"max_sequence_length {model.args.max_seq_len}")
    return mask_id


def _rows(fresh, active, cfg_rows):
    """Per-row policy inputs, duplicated for the unconditional CFG rows."""
    return (fresh.repeat(2, 1), active.repeat(2)) if cfg_rows else (fresh, active)


@torch.inference_mode()
def generate(model: DiffusionLM, prompts: list[list[int]] | list[int], cfg: GenerationConfig | None = None,
             **overrides) -> GenerationResult:
    """Denoise ``gen_length`` masks after each prompt (a list of token-id lists, or one list)."""
    cfg = replace(cfg or GenerationConfig(), **overrides) if overrides else (cfg or GenerationConfig())
    prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
    mask_id = _check(model, prompts, cfg)
    dev = model.embed.weight.device
    pad = model.args.pad_token_id if model.args.pad_token_id is not None else mask_id
    x, keep, pos, P = build_canvas(prompts, cfg, mask_id, pad, dev)
    B, T = x.shape
    gen = torch.Generator(dev).manual_seed(cfg.seed)
    tc = TokenContext(mask_id, cfg.temperature, cfg.top_p, cfg.top_k, model.args.eos_token_id, cfg.eot_id,
                      cfg.logits_eos_inf, cfg.confidence_eos_eot_inf, gen)
    cfg_rows = cfg.cfg_scale > 0
    rows = 2 * B if cfg_rows else B
    policy, sampler = cfg.cache, cfg.sampler
    canvas = Canvas(pos.repeat(2, 1) if cfg_rows else pos, keep.repeat(2, 1, 1, 1) if cfg_rows else keep,
                    P, cfg.block_length)
    cache = policy.begin(model, canvas)
    st = sampler.new_state(B, cfg.block_length, cfg.steps_per_block, dev)
    nfe = torch.zeros(B, dtype=torch.long, device=dev)
    prompt_pos = torch.zeros_like(x, dtype=torch.bool)
    prompt_pos[:, :P] = keep[:, 0, 0, :P]
    shift = int(model.shift_logits)
    t0 = time.perf_counter()
    try:
        for b in range(cfg.num_blocks):
            s, e = P + b * cfg.block_length, P + (b + 1) * cfg.block_length
            canvas.block = b
            sampler.begin_block(st, x[:, s:e] == mask_id)
            while not sampler.block_done(st, masked := x[:, s:e] == mask_id):
                plan = plan_step(sampler, st, masked)
                (flo, fhi), (lo, hi) = plan.focus, plan.window
                fresh = torch.stack([s + flo - shift, s + fhi], -1)  # [B, 2]
                xin = torch.cat([x, x.masked_fill(prompt_pos, mask_id)]) if cfg_rows else x
                h = cache.hidden(xin, (s + lo - shift, s + hi - shift), *_rows(fresh, plan.active, cfg_rows))
                logits = model.logits(h)
                if cfg_rows:  # classifier-free guidance: un + (scale + 1) * (cond - un)
                    cond, un = logits.chunk(2)
                    logits = un + (cfg.cfg_scale + 1) * (cond - un)
                x[:, s:e] = take_step(sampler, st, plan, logits, x[:, s:e], tc)[0]
                nfe += plan.active
    finally:
        cache.end()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return GenerationResult(x[:, P:].clone(), nfe.tolist(), seconds, cache.counters, [len(p) for p in prompts])


def generate_in_canvases(model: DiffusionLM, prompts: list[list[int]], cfg: GenerationConfig,
                         canvas_length: int) -> GenerationResult:
    """The embedded reference of a paged host that serves ``cfg`` in canvases of ``canvas_length``
    positions (vLLM's ``canvas_length``): with a Fast-dLLM / uncached policy each canvas is a
    generation of its own (its blocks decoded inside it) whose prompt is everything before it; the
    ``canvas`` policy models the canvases itself (its ``blocks`` x ``block_length`` must be the canvas).
    One canvas holding the whole response is ``generate`` itself."""
    if canvas_length < 1 or cfg.gen_length % canvas_length or canvas_length % cfg.block_length:
        raise ValueError(f"canvas_length {canvas_length} must divide gen_length {cfg.gen_length} and be a multiple "
                         f"of block_length {cfg.block_length}")
    n = cfg.gen_length // canvas_length
    if isinstance(cfg.cache, CanvasCache):
        if cfg.cache.blocks * cfg.block_length != canvas_length:
            raise ValueError(f"--cache canvas.blocks={cfg.cache.blocks} x block_length {cfg.block_length} is not the "
                             f"canvas_length {canvas_length}")
        return generate(model, prompts, cfg)
    if n == 1:
        return generate(model, prompts, cfg)
    sub = replace(cfg, gen_length=canvas_length, steps=cfg.steps // n)
    seqs, parts, nfe, seconds, counters = [list(p) for p in prompts], [], [0] * len(prompts), 0.0, Counters()
    for _ in range(n):
        r = generate(model, seqs, sub)
        parts.append(r.tokens)
        seqs = [s + t for s, t in zip(seqs, r.tokens.tolist())]
        nfe, seconds = [a + b for a, b in zip(nfe, r.nfe)], seconds + r.seconds
        for f in ("forwards", "token_layers", "v_only", "full_token_layers"):
            setattr(counters, f, getattr(counters, f) + getattr(r.counters, f))
        counters.cache_bytes = max(counters.cache_bytes, r.counters.cache_bytes)
    return GenerationResult(torch.cat(parts, 1), nfe, seconds, counters, [len(p) for p in prompts])
