"""CLI options and setup shared by the trainers: ``dllm train-mdm`` / ``train-ar`` (``add_train_args``), the
drafter trainers (``add_config_args``: one flag per config field) and all of them (``set_threads``)."""
from __future__ import annotations

import argparse
import typing
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .config import TrainConfig
from .tokenizer import build_task_tokenizer


def add_train_args(p: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    d = defaults
    p.add_argument("--out", required=True, help="output checkpoint dir (HF layout + tokenizer)")
    p.add_argument("--tasks", default=d.tasks, help="';'-separated task specs trained on")
    p.add_argument("--batch", default=d.batch, help="examples of each task per step, comma-separated")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (1 is fastest on a busy shared machine; default: torch's choice)")
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--layers", type=int, default=d.n_layers)
    p.add_argument("--heads", type=int, default=d.n_heads)
    p.add_argument("--kv-heads", type=int, default=d.n_kv_heads)
    p.add_argument("--ffn", type=int, default=d.ffn)
    p.add_argument("--max-len", type=int, default=d.max_len, help="max sequence length of the model")
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between resumable checkpoints")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between test evaluations (0: off)")
    p.add_argument("--eval-n", type=int, default=d.eval_n, help="test examples per task at each evaluation")
    p.add_argument("--eval-tasks", default=None, help="';'-separated task specs evaluated at each evaluation "
                                                       "(default: the test variants of the trained tasks)")
    p.add_argument("--save-dtype", default=d.save_dtype, help="bfloat16 or float32 weights on disk")
    p.add_argument("--resume", action="store_true", help="continue from <out>/train_state.pt")
    p.add_argument("--init", default=None, help="start from the weights of this checkpoint dir (same sizes and "
                                                 "tokenizer): fine-tuning / continuing a finished run")
    p.add_argument("--t-sampling", default=d.t_sampling,
                   help="masked-diffusion noise levels per batch: stratified (low-discrepancy) or iid")
    p.add_argument("--prompt-noise", type=float, default=d.prompt_noise,
                   help="masked diffusion: fraction of rows whose prompt is noised too, loss on every masked "
                        "token (LLaDA's pre-training objective mixed into SFT); 0 = pure SFT")
    p.add_argument("--block-noise", type=float, default=d.block_noise,
                   help="masked diffusion: fraction of rows noised as the semi-autoregressive decoder sees them "
                        "(Blockwise SFT): clean blocks, one partly masked block scored, the rest masked; 0 = off")
    p.add_argument("--suffix-noise", type=float, default=d.suffix_noise,
                   help="masked diffusion: fraction of the --block-noise rows whose scored block is masked from a "
                        "uniform cut point to its end (a left-to-right decoder's state: the answer's end must be "
                        "read from the prompt, not from visible padding); 0 = off")
    p.add_argument("--end-noise", type=float, default=d.end_noise,
                   help="masked diffusion: fraction of the --block-noise rows whose block is the one holding the "
                        "answer's end (EOT) instead of a uniform one; 0 = off")
    p.add_argument("--creep-noise", type=float, default=d.creep_noise,
                   help="masked diffusion: fraction of the --block-noise rows (besides the --suffix-noise ones) whose "
                        "scored block is masked from its start to a uniform cut, the rest visible (the vanilla "
                        "decoder commits an answer's trailing padding first); 0 = off")
    p.add_argument("--edit-noise", type=float, default=d.edit_noise,
                   help="masked diffusion: fraction of the visible response tokens replaced by other tokens of the "
                        "response, every visible token scored (LLaDA2.1's token-to-token term for editing); 0 = off")
    p.add_argument("--autocast", default=d.autocast, help="none or bfloat16: the forward and loss in bf16 under "
                                                           "torch.autocast (fp32 weights and optimizer)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds: stop early once exceeded, saving the model and a resumable checkpoint (0: none)")


def add_config_args(p: argparse.ArgumentParser, defaults, skip: tuple[str, ...] = (),
                    help: dict[str, str] | None = None) -> None:
    """One ``--field-name`` option per field of the dataclass config ``defaults`` (its values are the defaults)
    except ``skip``; a bool field becomes a switch flipping its default (``--x`` / ``--no-x``)."""
    hints = typing.get_type_hints(type(defaults))
    for name, val in asdict(defaults).items():
        if name in skip:
            continue
        flag, h = "--" + name.replace("_", "-"), (help or {}).get(name)
        if isinstance(val, bool):
            p.add_argument("--no-" + flag[2:] if val else flag, action="store_false" if val else "store_true",
                           dest=name, help=h)
        else:  # `int | None` -> int
            kind = next((t for t in typing.get_args(hints[name]) if t is not type(None)), hints[name])
            p.add_argument(flag, type=kind, default=val, help=h)


def set_threads(n: int | None) -> None:
    """``--threads``: torch's CPU threads (None: torch's choice)."""
    if n is not None:
        if n < 1:
            raise ValueError(f"--threads must be >= 1, got {n}")
        torch.set_num_threads(n)


def train_config(a: argparse.Namespace) -> TrainConfig:
    set_threads(a.threads)
    return TrainConfig(out=a.out, tasks=a.tasks, batch=a.batch, steps=a.steps, lr=a.lr, warmup=a.warmup,
                       weight_decay=a.weight_decay, seed=a.seed, device=a.device, dim=a.dim, n_layers=a.layers,
                       n_heads=a.heads, n_kv_heads=a.kv_heads, ffn=a.ffn, max_len=a.max_len,
                       save_every=a.save_every, eval_every=a.eval_every, eval_n=a.eval_n,
                       eval_tasks=a.eval_tasks,
                       save_dtype=a.save_dtype, resume=a.resume, time_limit=a.time_limit, autocast=a.autocast,
                       init=a.init, t_sampling=a.t_sampling,
                       prompt_noise=a.prompt_noise, block_noise=a.block_noise, edit_noise=a.edit_noise,
                       suffix_noise=a.suffix_noise, end_noise=a.end_noise, creep_noise=a.creep_noise)


def setup(cfg: TrainConfig):
    """Tokenizer written into ``cfg.out`` and loaded back; seeds set. -> (tok, special ids incl. vocab)."""
    from ..models import check_device
    from ..tasks.evaluate import special_ids
    from ..tokenizer import load_tokenizer

    check_device(cfg.device)
    torch.manual_seed(cfg.seed)
    raw = build_task_tokenizer(cfg.out, cfg.vocab_size, cfg.seed)
    if cfg.init and (Path(cfg.init) / "tokenizer.json").read_bytes() != (Path(cfg.out) / "tokenizer.json").read_bytes():
        raise ValueError(f"--init {cfg.init}: its tokenizer differs from the one this run builds (seed/vocab size)")
    tok = load_tokenizer(cfg.out)
    return tok, {**special_ids(tok), "vocab_size": raw["vocab_size"], "raw": raw}


def init_from(model: torch.nn.Module, cfg: TrainConfig, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (names of ``model.state_dict()``) into ``model``; sizes must match exactly."""
    own = model.state_dict()
    bad = sorted(k for k in own if k not in state or state[k].shape != own[k].shape)
    if bad or set(state) - set(own):
        raise ValueError(f"--init {cfg.init}: weights do not match the configured model (e.g. {bad[:3]}); "
                         f"use the same --dim/--layers/--heads/--kv-heads/--ffn")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k].to(v.dtype))


def step_generator(cfg: TrainConfig, step: int) -> torch.Generator:
    """Masking / noise randomness of one step (a function of seed and step only)."""
    return torch.Generator(cfg.device).manual_seed(cfg.seed * 1_000_003 + step)


def eval_fn(cfg: TrainConfig, run):
    """Accuracy on the first ``eval_n`` test examples of each task (``--eval-tasks``, else the trained ones);
    ``run(task, examples)`` -> TaskRun."""
    from .data import stream_keys

    if cfg.eval_tasks is not None:
        tasks = [t.test_variant() for t in cfg.eval_task_list()]
    else:  # the test distribution of each trained task (count: at most 100 numbers, a longer span takes minutes)
        tasks = [t.test_variant() for t in cfg.task_list()]
        tasks = [replace(t, span=min(t.span, 100)) if t.name == "count" else t for t in tasks]

    def fn() -> dict:
        return {k: run(t, t.examples("test", cfg.eval_n)).accuracy for t, k in zip(tasks, stream_keys(tasks))}
    return fn


def dtype_of(cfg: TrainConfig) -> torch.dtype:
    return getattr(torch, cfg.save_dtype)


def out_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.out)
