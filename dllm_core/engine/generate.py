"""The one decoding loop: semi-autoregressive blocks, a sampler deciding commits, a cache policy
producing hidden states. Batches of prompts of different lengths run left-padded in lock step
per block; each row reproduces its unbatched run (rows that finish a block early idle)."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ..cache import CachePolicy, Canvas, CanvasCache, Counters, PrefixCache
from ..models import DiffusionLM
from ..options import OptionError
from ..sampling import TokenContext
from .config import GenerationConfig
from .logprobs import Logprobs
from .step import mask_in_prompt, plan_step, take_step

BLOCK_CAUSAL_CACHES = ("none", "prefix", "dual", "canvas", "dllm")  # dllm: inside the block (CanvasCache)


@dataclass
class GenerationResult:
    """tokens [B, gen_length] (the generated region), NFE per row, wall seconds, work counters; ``logprobs``: the
    tokens' log-probabilities and top alternatives (``GenerationConfig.logprobs``; ``engine.logprobs``)."""

    tokens: torch.Tensor
    nfe: list[int]
    seconds: float
    counters: Counters
    prompt_lens: list[int]
    logprobs: Logprobs | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens.numel() / max(self.seconds, 1e-9)


def build_canvas(prompts: list[list[int]], cfg: GenerationConfig, mask_id: int, pad_id: int, device):
    """Left-padded [prompt | masks of the decoded length] -> x [B, T], key mask [B, 1, 1, T], positions [B, T], P."""
    P = max(len(p) for p in prompts)
    x = torch.full((len(prompts), P + cfg.decoded_length), pad_id, dtype=torch.long, device=device)
    keep = torch.ones_like(x, dtype=torch.bool)
    for i, p in enumerate(prompts):
        x[i, P - len(p):P] = torch.tensor(p, dtype=torch.long, device=device)
        keep[i, :P - len(p)] = False
    x[:, P:] = mask_id
    pos = (keep.cumsum(-1) - 1).clamp_min(0)
    return x, keep[:, None, None, :], pos, P


def build_block_canvas(prompts: list[list[int]], cfg: GenerationConfig, mask_id: int, pad_id: int, device):
    """The canvas of a block-causal model (LLaDA2): blocks lie on each row's absolute position grid (the
    prompt's last partial block is decoded with it, as LLaDA2 was trained), so rows are left-padded by
    whole blocks until their first decoded blocks share columns. Every row decodes the blocks that hold
    its ``gen_length`` positions (the last one whole, its tail cut from the result); a row needing one
    block fewer than the batch has padding there (nothing to decode).
    -> x [B, T], keep [B, T], positions [B, T], first decoded column, blocks, response start per row [B]."""
    bl, G = cfg.block_length, cfg.gen_length
    first = [len(p) // bl for p in prompts]  # each row's first decoded block
    F, n_blocks = max(first), max(-(-(len(p) + G) // bl) - f for p, f in zip(prompts, first))
    T = (F + n_blocks) * bl
    x = torch.full((len(prompts), T), pad_id, dtype=torch.long, device=device)
    keep = torch.zeros_like(x, dtype=torch.bool)
    starts = []
    for i, (p, f) in enumerate(zip(prompts, first)):
        off = (F - f) * bl
        end = off + -(-(len(p) + G) // bl) * bl
        x[i, off:off + len(p)] = torch.tensor(p, dtype=torch.long, device=device)
        x[i, off + len(p):end] = mask_id
        keep[i, off:end] = True
        starts.append(off + len(p))
    pos = (keep.cumsum(-1) - 1).clamp_min(0)
    return x, keep, pos, F * bl, n_blocks, torch.tensor(starts, device=device)


def block_causal_mask(keep: torch.Tensor, pos: torch.Tensor, block: int) -> torch.Tensor:
    """keep/pos [B, T] -> [B, 1, T, T] bool: a query sees the kept keys of its own block and of earlier
    blocks of its row's position grid (LLaDA2's training mask)."""
    blk = pos // block
    return (keep[:, None, :] & (blk[:, None, :] <= blk[:, :, None]))[:, None]


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
    need = longest + cfg.decoded_length
    if model.block_causal:  # the last block is decoded whole
        check_block_causal(model, cfg)
        need = -(-need // cfg.block_length) * cfg.block_length
    if need > model.args.max_seq_len:
        raise ValueError(f"--prompt: {longest} prompt tokens + --gen-length {cfg.gen_length} exceed the model's "
                         f"max_sequence_length {model.args.max_seq_len}")
    return mask_id


def block_mismatch(block: int, trained: int, model: str = "the model") -> str:
    """The error text of a block that is not a block-causal checkpoint's own (every engine's and host's)."""
    return (f"{block} does not match the checkpoint's block_size {trained} ({model} attends block-causally over "
            f"blocks of {trained})")


def check_block_causal(model: DiffusionLM, cfg: GenerationConfig) -> None:
    """A block-causal model decodes blocks of its training block size, with a policy that keeps its mask."""
    if cfg.block_length != model.block_causal:
        raise ValueError(f"--block-length {block_mismatch(cfg.block_length, model.block_causal, type(model).__name__)}")
    if cfg.cache.name not in BLOCK_CAUSAL_CACHES:
        raise ValueError(f"--cache {cfg.cache.name} is not available for the block-causal "
                         f"{type(model).__name__}; allowed: {list(BLOCK_CAUSAL_CACHES)}")
    if isinstance(cfg.cache, CanvasCache) and cfg.cache.blocks != 1:
        raise ValueError(f"--cache canvas.blocks={cfg.cache.blocks}: a block-causal {type(model).__name__} "
                         f"decodes one block per canvas (blocks=1)")


PAGED_BLOCK_CAUSAL_CACHES = ("none", "prefix", "dual")  # a paged host keeps earlier blocks' K/V: all exact there


def grid_canvas_width(n_tokens: int, block: int) -> int:
    """A paged host's next canvas for a block-causal model holding ``n_tokens`` tokens: the positions to the end
    of the grid block that holds position ``n_tokens`` (after a prompt, its tail block decoded with the first
    answer tokens, as ``build_block_canvas`` lays it out; then whole blocks)."""
    return block - n_tokens % block


def check_paged_block_causal(block_size: int, block_length: int | None, cache: CachePolicy) -> None:
    """The options a paged host serves a block-causal model with: blocks of its training size and a cache that
    keeps the block-causal prefix exact (the paged K/V of earlier blocks are final)."""
    if block_length is not None and block_length != block_size:
        raise OptionError("block_length", block_mismatch(block_length, block_size))
    if not ((isinstance(cache, PrefixCache) and cache.name in PAGED_BLOCK_CAUSAL_CACHES)
            or (isinstance(cache, CanvasCache) and cache.exact)):  # none: exact canvas
        raise OptionError("cache", f"{cache.name} is not served for a block-causal model; allowed: "
                                   f"{list(PAGED_BLOCK_CAUSAL_CACHES)}")


def prefix_pages_error(page: int, block: int) -> str | None:
    """Why a paged host's prefix cache of ``page``-token pages would not be exact for a block-causal model of grid
    ``block``, or None: a cached page must hold whole grid blocks (a block's K/V depend on all of its tokens)."""
    if page % block:
        return f"a prefix-cached page of a block-causal model holds whole grid blocks; allowed: multiples of {block}"
    return None


def block_causal_policy(cfg: GenerationConfig) -> GenerationConfig:
    """On a block-causal model dLLM-Cache runs inside the block: a ``dllm`` spec becomes the canvas
    policy with its response-side knobs (the prefix is exact: nothing to refresh)."""
    return replace(cfg, cache=CanvasCache.from_spec(cfg.cache)) if cfg.cache.name == "dllm" else cfg


def _canvas(model: DiffusionLM, prompts, cfg: GenerationConfig, mask_id: int, dev):
    """-> x [B, T], attention mask, positions [B, T], first decoded column, blocks, answer start per row [B]:
    the left-padded canvas (bidirectional models) or the block grid (block-causal ones)."""
    pad = model.args.pad_token_id if model.args.pad_token_id is not None else mask_id
    if model.block_causal:
        x, keep, pos, s0, n_blocks, starts = build_block_canvas(prompts, cfg, mask_id, pad, dev)
        return x, block_causal_mask(keep, pos, cfg.block_length), pos, s0, n_blocks, starts
    x, keep, pos, P = build_canvas(prompts, cfg, mask_id, pad, dev)
    return x, keep, pos, P, cfg.num_blocks, torch.full((len(prompts),), P, device=dev)


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
    if model.block_causal:
        cfg = block_causal_policy(cfg)
    dev = model.embed.weight.device
    x, keep, pos, P, n_blocks, starts = _canvas(model, prompts, cfg, mask_id, dev)
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
    col, lens = torch.arange(T, device=dev), torch.tensor([len(p) for p in prompts], device=dev)
    prompt_pos = (col < starts[:, None]) & (col >= (starts - lens)[:, None])  # [B, T]
    shift = int(model.shift_logits)
    lp = None if cfg.logprobs is None else Logprobs.empty(B, T, cfg.logprobs, dev)
    t0 = time.perf_counter()
    try:
        for b in range(n_blocks):
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
                new = take_step(sampler, st, plan, logits, x[:, s:e], tc)[0]
                if lp is not None:
                    lp.record(logits, x[:, s + lo:s + hi], new[:, lo:hi], s + lo)
                x[:, s:e] = new
                nfe += plan.active
    finally:
        cache.end()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    cols = starts[:, None] + torch.arange(cfg.gen_length, device=dev)  # [B, G]
    return GenerationResult(x.gather(1, cols), nfe.tolist(), seconds, cache.counters, [len(p) for p in prompts],
                            None if lp is None else lp.gather(cols))


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
    lps = []
    for _ in range(n):
        r = generate(model, seqs, sub)
        parts.append(r.tokens)
        lps.append(r.logprobs)
        seqs = [s + t for s, t in zip(seqs, r.tokens.tolist())]
        nfe, seconds = [a + b for a, b in zip(nfe, r.nfe)], seconds + r.seconds
        for f in ("forwards", "token_layers", "v_only", "full_token_layers"):
            setattr(counters, f, getattr(counters, f) + getattr(r.counters, f))
        counters.cache_bytes = max(counters.cache_bytes, r.counters.cache_bytes)
    return GenerationResult(torch.cat(parts, 1), nfe, seconds, counters, [len(p) for p in prompts],
                            None if cfg.logprobs is None else Logprobs.cat(lps))
