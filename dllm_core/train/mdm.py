"""``dllm train-mdm``: SFT-style masked-diffusion training of a small LLaDA-architecture model.

Per example the prompt stays clean; every response token (answer, EOT and the EOS padding up to the
task's gen_length, as in LLaDA's SFT) is masked with probability t ~ U(eps, 1), and the loss is the
cross entropy on masked tokens weighted by 1/t, averaged over response tokens (LLaDA eq. 5). By
default the t of a batch's rows are drawn low-discrepancy (``--t-sampling stratified``: one uniform
offset + evenly spaced, each still U(eps, 1)); ``iid`` draws them independently."""
from __future__ import annotations

import copy
import json
import time

import torch
import torch.nn.functional as F

from ..models import LLaDAModelLM, load_model, save_model
from ..testing import llada_config
from .common import add_train_args, dtype_of, eval_fn, init_from, setup, step_generator, train_config
from .config import TrainConfig
from .data import ChatEncoder, draw, mdm_batch
from .loop import train

EPS = 1e-3
DEFAULTS = TrainConfig(out="models/llada-tasks")


def noise_levels(B: int, gen: torch.Generator, device, stratified: bool = True) -> torch.Tensor:
    """t ~ U(eps, 1) per row, [B, 1]; ``stratified``: one uniform offset with the rows spread evenly
    over [0, 1) (low-discrepancy: each t is still uniform, the batch's loss has lower variance)."""
    if stratified:
        u = (torch.rand(1, generator=gen, device=device) + torch.arange(B, device=device) / B) % 1
    else:
        u = torch.rand(B, generator=gen, device=device)
    return ((1 - EPS) * u + EPS)[:, None]


def mdm_loss(model: LLaDAModelLM, x: torch.Tensor, keep: torch.Tensor, pos: torch.Tensor, P: int, mask_id: int,
             gen: torch.Generator, stratified: bool = True, prompt_noise: float = 0.0) -> torch.Tensor:
    """x [B, T] clean canvas (response = x[:, P:]), keep [B, 1, 1, T] key mask -> scalar loss.

    SFT rows noise the response only; a ``prompt_noise`` fraction of rows (drawn per row) is noised
    whole, prompt included (LLaDA's pre-training loss). Each row's loss is normalised by the number of
    tokens it may noise: G for SFT rows (LLaDA eq. 5), its unpadded length for whole-noised rows."""
    B, T = x.shape
    t = noise_levels(B, gen, x.device, stratified)  # [B, 1]
    whole = torch.rand(B, 1, generator=gen, device=x.device) < prompt_noise  # [B, 1]
    col = torch.arange(T, device=x.device)[None]  # [1, T]
    noisable = keep[:, 0, 0] & ((col >= P) | whole)  # [B, T]
    masked = (torch.rand(B, T, generator=gen, device=x.device) < t) & noisable  # [B, T]
    first = 0 if prompt_noise > 0 else P  # positions whose logits are needed
    h, rope = model.embed(x.masked_fill(masked, mask_id)), model.rope(pos)
    for layer in model.layers:
        h = layer(h, rope, keep)
    logits = model.logits(h[:, first:])  # [B, T - first, V]
    ce = F.cross_entropy(logits.flatten(0, 1), x[:, first:].flatten(), reduction="none").view(B, -1)
    per_row = (ce * masked[:, first:] / t).sum(1) / noisable.sum(1)  # [B]
    return per_row.mean()


def build(cfg: TrainConfig, ids: dict) -> tuple[LLaDAModelLM, dict]:
    """Fresh LLaDA model (+ its config.json dict) with small-std init."""
    hf = llada_config(ids["raw"], dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                      n_kv_heads=cfg.n_kv_heads, ffn=cfg.ffn, max_len=cfg.max_len)
    model = LLaDAModelLM(LLaDAModelLM.parse_config(hf)).to(cfg.device)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    if cfg.init:
        init_from(model, cfg, load_model(cfg.init, cfg.device).state_dict())
    return model, hf


def cmd_train_mdm(a) -> int:
    from ..tasks.evaluate import run_mdm, task_config

    cfg = train_config(a)
    tok, ids = setup(cfg)
    model, hf = build(cfg, ids)
    tasks, sizes, enc = cfg.task_list(), cfg.batch_sizes, ChatEncoder(tok, ids["eot"])

    def loss_fn(step: int):
        gen, total, n = step_generator(cfg, step), 0.0, 0
        for task, b in zip(tasks, sizes):
            x, keep, pos, P = mdm_batch(enc, task, draw(task, b, cfg.seed, step), ids, cfg.device)
            loss = mdm_loss(model, x, keep, pos, P, ids["mask"], gen, cfg.t_sampling == "stratified",
                            cfg.prompt_noise)
            total = total + loss
            n += x.numel()
        return total / len(tasks), n

    evaluate = eval_fn(cfg, lambda t, exs: run_mdm(model, tok, t, exs, task_config(t), batch_size=16))
    t0 = time.perf_counter()
    summary = train(cfg, model, loss_fn, evaluate, desc="train-mdm")
    hf["torch_dtype"] = cfg.save_dtype
    save_model(copy.deepcopy(model).to(dtype_of(cfg)), cfg.out, hf)
    print(json.dumps({**summary, "wall_seconds": time.perf_counter() - t0, "out": cfg.out}))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train-mdm", help="train a small LLaDA-architecture masked-diffusion model on the task suite")
    add_train_args(p, DEFAULTS)
    p.set_defaults(func=cmd_train_mdm)
