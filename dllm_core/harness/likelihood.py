"""Log-likelihood of a continuation given a context: LLaDA's Monte-Carlo estimate for masked-diffusion models
(LLaDA, Dream), exact teacher forcing for causal (AR) targets.

The estimate (LLaDA, Nie et al. 2025, arXiv:2502.09992, as its evaluation code computes it:
``get_log_likelihood.py`` / ``eval_llada.py`` of github.com/ML-GSAI/LLaDA). With the continuation r of
L tokens after the prompt p and N = ``mc_num`` samples in mini-batches of b rows:

    for each mini-batch draw k ~ U{1..L}; row i masks l_i of the L continuation positions, chosen uniformly at
    random, where l_i = round(k + i L / b) wrapped into 1..L (the b counts spread evenly over 1..L);
    sample loss  = (L / l_i) * sum over the masked positions j of -log p_theta(r_j | p, masked r)
    estimate     = -(sum of the N sample losses) / N

Each l_i is uniform on 1..L, so the estimate is the expectation the paper bounds the conditional
log-likelihood with; spreading the b counts of a mini-batch over 1..L only lowers its variance. The prompt is
never masked. ``cfg_scale`` > 0 applies LLaDA's unsupervised classifier-free guidance to the logits (the
unconditional rows have the prompt masked). Dream reads its predictions one row to the left.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engine import GenerationConfig, generate
from ..models import DiffusionLM


def mask_counts(L: int, b: int, gen: torch.Generator) -> torch.Tensor:
    """Masked-token counts of one mini-batch of ``b`` samples [b] in 1..L: a uniform start k, then b counts
    spread evenly from it (wrapped), as LLaDA's ``forward_process``."""
    k = int(torch.randint(1, L + 1, (), generator=gen))
    x = torch.round(torch.linspace(float(k), k + (b - 1) * (L / b), b)).long()
    return (x - 1) % L + 1


def mask_rows(counts: torch.Tensor, L: int, gen: torch.Generator) -> torch.Tensor:
    """[b, L] bool: row i masks a uniformly random subset of ``counts[i]`` of the L positions."""
    ranks = torch.rand(len(counts), L, generator=gen).argsort(-1)  # a random permutation per row
    return ranks < counts[:, None]


def diffusion_logits(model: DiffusionLM, x: torch.Tensor, prompt_len: int, mask_id: int,
                     cfg_scale: float = 0.0) -> torch.Tensor:
    """x [B, T] -> float32 logits [B, T, V] whose row t predicts token t (Dream's shift undone), with
    classifier-free guidance when ``cfg_scale`` > 0."""
    B, T = x.shape
    if cfg_scale > 0:
        un = x.clone()
        un[:, :prompt_len] = mask_id
        x = torch.cat([x, un])
    pos = torch.arange(T, device=x.device).expand(x.shape[0], T)
    logits = model(x, pos, None)
    if cfg_scale > 0:
        cond, un = logits.chunk(2)
        logits = un + (cfg_scale + 1) * (cond - un)
    if model.shift_logits:  # row t - 1 predicts token t (row 0 is never read: the prompt is not empty)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
    return logits


def check_estimable(model) -> None:
    """The estimate is defined for bidirectional masked-diffusion models only."""
    if not isinstance(model, DiffusionLM) or model.block_causal:
        raise NotImplementedError(
            f"loglikelihood: LLaDA's Monte-Carlo estimate (random masks over the whole continuation, one "
            f"bidirectional forward) is defined for bidirectional masked-diffusion models (LLaDA, Dream); "
            f"{type(model).__name__} attends block-causally over blocks of {getattr(model, 'block_causal', '?')}, "
            f"so a continuation's likelihood is not that estimate")


@torch.inference_mode()
def mc_loglikelihood(model: DiffusionLM, prefix: list[int], target: list[int], mask_id: int, mc_num: int = 128,
                     mc_batch: int | None = None, cfg_scale: float = 0.0, seed: int = 0) -> float:
    """LLaDA's Monte-Carlo estimate of log p(target | prefix) (module docstring): ``mc_num`` samples in
    mini-batches of ``mc_batch`` rows (None: one batch); ``seed`` fixes the masks (a CPU generator, so every
    device draws the same ones)."""
    check_estimable(model)
    if not prefix or not target:
        raise ValueError("loglikelihood: the context and the continuation each need at least one token")
    b = mc_batch or mc_num
    if mc_num % b:
        raise ValueError(f"mc_num {mc_num} must be a multiple of mc_batch {b}")
    P, L, dev = len(prefix), len(target), model.embed.weight.device
    seq = torch.tensor(prefix + target, device=dev)
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(mc_num // b):
        counts = mask_counts(L, b, gen)
        hide = mask_rows(counts, L, gen).to(dev)  # [b, L]
        x = seq.repeat(b, 1)
        x[:, P:] = x[:, P:].masked_fill(hide, mask_id)
        logits = diffusion_logits(model, x, P, mask_id, cfg_scale)[:, P:]  # [b, L, V]
        ce = F.cross_entropy(logits[hide], seq[P:].expand(b, L)[hide], reduction="none")
        weight = (L / counts.to(dev, torch.float32))[:, None].expand(b, L)[hide]
        total += float((ce * weight).sum())
    return -total / mc_num


def greedy_reproduces(model: DiffusionLM, prefix: list[int], target: list[int], mask_id: int,
                      cfg_scale: float = 0.0) -> bool:
    """Whether decoding the continuation's L positions one token per step, most confident first (the
    ``low_confidence`` loop over one block of L), gives exactly ``target`` (LLaDA's ``suffix_greedy_prediction``)."""
    L = len(target)
    cfg = GenerationConfig(gen_length=L, block_length=L, steps=L, cfg_scale=cfg_scale, mask_id=mask_id)
    return generate(model, [prefix], cfg).tokens[0].tolist() == list(target)


@torch.inference_mode()
def causal_loglikelihood(model, prefix: list[int], target: list[int]) -> tuple[float, bool]:
    """Exact log p(target | prefix) of a transformers causal LM (teacher forcing), and whether greedy decoding
    reproduces ``target``."""
    if not prefix or not target:
        raise ValueError("loglikelihood: the context and the continuation each need at least one token")
    ids = torch.tensor([prefix + target], device=model.device)
    logp = model(ids).logits[0, len(prefix) - 1:-1].float().log_softmax(-1)  # [L, V]
    tgt = ids[0, len(prefix):]
    return float(logp.gather(-1, tgt[:, None]).sum()), bool((logp.argmax(-1) == tgt).all())
