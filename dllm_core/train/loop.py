"""The shared training loop: AdamW, warmup + cosine LR, gradient clipping, a progress bar (``progress.py``),
and a resumable checkpoint (model + optimizer state + step, ``<out>/train_state.pt``, removed once the run finishes)
that makes a resumed run equal an uninterrupted one. Data-parallel under ``torchrun`` (``distributed.py``):
each rank runs ``loss_fn`` on its micro-batches, DDP averages the gradients, rank 0 logs and checkpoints."""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from ..progress import progress

from .config import TrainBase
from .distributed import World, no_sync

STATE = "train_state.pt"


def lr_at(cfg: TrainBase, step: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model: torch.nn.Module, cfg: TrainBase) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms / biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def mixed_precision(cfg: TrainBase):
    """``--autocast bfloat16``: the forward and loss under ``torch.autocast`` (weights, gradients and the optimizer
    stay float32); a no-op context otherwise."""
    return torch.autocast(cfg.device.split(":")[0], dtype=torch.bfloat16, enabled=cfg.autocast == "bfloat16")


def fingerprint(cfg: TrainBase) -> dict:
    """The settings a resumed run must share with its checkpoint: every field of the (dataclass) config
    except those its ``RUNTIME`` names (output dir, device, checkpoint/eval cadence, ...)."""
    return {k: v for k, v in asdict(cfg).items() if k not in cfg.RUNTIME}


def state_path(cfg: TrainBase) -> Path:
    return Path(cfg.out) / STATE


def save_state(path: Path, model, opt, step: int, cfg: TrainBase) -> None:
    """Atomic write of everything a resumed run needs."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "config": fingerprint(cfg)},
               tmp)
    os.replace(tmp, path)


def load_state(path: Path, model, opt, cfg: TrainBase) -> int:
    """Restore model + optimizer from ``path``; returns the step to continue from."""
    st = torch.load(path, map_location=cfg.device, weights_only=True)
    want = fingerprint(cfg)
    if st["config"] != want:
        diff = sorted(k for k in want if st["config"].get(k) != want[k])
        raise ValueError(f"--resume: {path} was written with different settings ({', '.join(diff)})")
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    return int(st["step"])


def check_resume(cfg: TrainBase) -> Path:
    """The checkpoint path; an existing one without ``--resume`` is an error (never overwritten silently)."""
    path = state_path(cfg)
    if path.is_file() and not cfg.resume:
        raise ValueError(f"--out {cfg.out} holds a checkpoint ({STATE}); pass --resume to continue it or use a new "
                         f"dir")
    return path


def train(cfg: TrainBase, model: torch.nn.Module, loss_fn: Callable[[int, int], tuple[torch.Tensor, int]],
          eval_fn: Callable[[], dict] | None = None, desc: str = "train", world: World = World(),
          step_module: torch.nn.Module | None = None) -> dict:
    """Run steps [start, cfg.steps): ``loss_fn(step, micro) -> (loss, tokens)`` for each of the config's
    ``grad_accum`` micro-batches (default 1) of this rank; the losses of all ranks and micro-batches sum to the
    step's loss (each normalised by the global batch). ``step_module``: the DDP-wrapped module the losses run
    through (gradient all-reduce on the last micro-batch only). Returns a summary dict (also appended to
    ``<out>/train_log.jsonl`` with every evaluation; rank 0 writes)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    opt, start, accum = make_optimizer(model, cfg), 0, getattr(cfg, "grad_accum", 1)
    path = check_resume(cfg)
    world.barrier()  # every rank has checked before rank 0 can write a new checkpoint
    if cfg.resume and path.is_file():
        start = load_state(path, model, opt, cfg)
    model.train()
    log = (out / "train_log.jsonl").open("a") if world.main else None
    t0, tokens, ema, done = time.perf_counter(), 0, None, start
    bar = progress(range(start, cfg.steps), initial=start, total=cfg.steps, desc=desc, disable=not world.main)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        val = 0.0
        for micro in range(accum):
            with no_sync(step_module, micro == accum - 1), mixed_precision(cfg):
                loss, n = loss_fn(step, micro)
                (loss * world.size).backward()  # DDP averages over ranks; the parts sum to the step's loss
            val, tokens = val + loss.item(), tokens + n
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        val = world.sum(val)
        ema = val if ema is None else 0.98 * ema + 0.02 * val
        bar.set_postfix(loss=f"{ema:.4f}", lr=f"{lr_at(cfg, step):.2e}",
                        tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        done = step + 1
        late = world.sum(float(cfg.time_limit > 0 and time.perf_counter() - t0 > cfg.time_limit)) > 0
        if world.main and (done % cfg.save_every == 0 or done == cfg.steps or late):
            save_state(path, model, opt, done, cfg)
        if world.main and eval_fn and cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps or late):
            model.eval()
            try:
                acc = eval_fn()
            except Exception as e:  # a failing evaluation must not cost the training run
                acc = {"eval_error": float("nan")}
                bar.write(f"step {done}: evaluation failed: {type(e).__name__}: {e}")
            model.train()
            bar.write(f"step {done}: loss {ema:.4f} " + " ".join(f"{k} {v:.3f}" for k, v in acc.items()))
            log.write(json.dumps({"step": done, "loss": ema, "step_loss": val, **acc}) + "\n")
            log.flush()
        if late and done < cfg.steps:
            if world.main:
                bar.write(f"--time-limit {cfg.time_limit:.0f}s reached at step {done}/{cfg.steps}; "
                          f"continue with --resume")
            break
    world.barrier()
    if done == cfg.steps and world.main:
        path.unlink(missing_ok=True)  # finished: the shipped weights are the artefact, not the optimizer state
    summary = {"steps": done, "planned_steps": cfg.steps, "start": start, "seconds": time.perf_counter() - t0,
               "loss_ema": ema, "tokens": int(world.sum(tokens))}
    if log is not None:
        log.write(json.dumps(summary) + "\n")
        log.close()
    model.eval()
    return summary
