"""Exact-match accuracy of a checkpoint on the task suite's test split, and ``dllm eval``.

A masked-diffusion checkpoint (LLaDA / Dream layout) is decoded by the embedded engine with any
sampler / cache policy; a ``Qwen3ForCausalLM`` (AR) checkpoint greedily with ``transformers``."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import Example, Task

AR_ARCHS = ("Qwen3ForCausalLM",)


@dataclass
class TaskRun:
    """Outputs of one task: generated texts, correctness, NFE per row, token ids, seconds."""

    task: Task
    examples: list[Example]
    texts: list[str]
    correct: list[bool]
    nfe: list[int]
    tokens: list[list[int]]
    seconds: float

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / max(len(self.correct), 1)


def special_ids(tok) -> dict[str, int]:
    """eos / eot / mask / bos ids of a task-suite (LLaDA-flavoured) tokenizer."""
    from ..tokenizer import special_id

    names = {"eos": "<|endoftext|>", "eot": "<|eot_id|>", "mask": "<|mdm_mask|>", "bos": "<|startoftext|>"}
    ids = {k: special_id(tok, v) for k, v in names.items()}
    missing = [names[k] for k, v in ids.items() if v is None]
    if missing:
        raise ValueError(f"--model: the tokenizer lacks the special tokens {missing}")
    return ids


def is_ar(model_dir: str | Path) -> bool:
    from ..models import read_config

    return any(a in AR_ARCHS for a in read_config(model_dir).get("architectures") or [])


def prompts_of(tok, examples: list[Example]) -> list[list[int]]:
    from ..tokenizer import encode_prompt

    return [encode_prompt(tok, ex.prompt, chat=True, turns=ex.turns) for ex in examples]


def task_config(task: Task, sampler: str = "low_confidence", cache: str = "none", **kw):
    """The task's canvas with the vanilla schedule (steps == gen_length) unless overridden."""
    from ..engine import GenerationConfig

    kw.setdefault("steps", task.gen_length)
    return GenerationConfig(gen_length=task.gen_length, block_length=task.block_length, sampler=sampler,
                            cache=cache, **kw)


@dataclass
class Batched:
    """Concatenated results of decoding prompts in batches: tokens (generated region) per row, NFE
    per row, summed engine seconds, and layer-position work done vs. what ``none`` would do."""

    tokens: list[list[int]]
    nfe: list[int]
    seconds: float
    work: int
    full_work: int


def generate_batched(model, prompts: list[list[int]], cfg, batch_size: int = 8,
                     canvas_length: int | None = None) -> Batched:
    """``generate`` over consecutive chunks of ``batch_size`` prompts (``canvas_length``: as a paged
    host serving canvases of that length, ``generate_in_canvases``)."""
    from ..engine import generate_in_canvases

    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    out = Batched([], [], 0.0, 0, 0)
    for i in range(0, len(prompts), batch_size):
        res = generate_in_canvases(model, prompts[i:i + batch_size], cfg, canvas_length or cfg.gen_length)
        out.tokens += res.tokens.tolist()
        out.nfe += res.nfe
        out.seconds += res.seconds
        out.work += res.counters.token_layers
        out.full_work += res.counters.full_token_layers
    return out


def accuracy(task: Task, tok, stop, examples: list[Example], rows: list[list[int]]) -> float:
    """Exact-match accuracy of generated token rows (decoded up to ``stop``) on ``examples``."""
    from ..cli import decode

    return sum(task.score(decode(tok, r, stop), e) for r, e in zip(rows, examples)) / max(len(examples), 1)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two engines' outputs agree: share of equal tokens and of identical rows."""
    toks = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / max(sum(map(len, a)), 1)
    return {"tokens": round(toks, 4), "rows": round(sum(ra == rb for ra, rb in zip(a, b)) / max(len(a), 1), 4)}


def run_mdm(model, tok, task: Task, examples: list[Example], cfg, batch_size: int = 8) -> TaskRun:
    """Decode ``examples`` in batches with the embedded engine and score them."""
    from ..cli import decode, stop_ids

    stop = stop_ids(tok, model)
    b = generate_batched(model, prompts_of(tok, examples), cfg, batch_size)
    texts = [decode(tok, r, stop) for r in b.tokens]
    return TaskRun(task, examples, texts, [task.score(t, e) for t, e in zip(texts, examples)], b.nfe, b.tokens,
                   b.seconds)


@torch.inference_mode()
def ar_greedy(model, prompts: list[list[int]], stop: set[int], pad_id: int, batch_size: int = 8,
              max_new_tokens: int = 32) -> tuple[list[list[int]], float]:
    """Greedy AR decoding of token prompts (left-padded batches, KV cache) -> each row's tokens before its
    first ``stop`` id, and the seconds spent in ``generate``."""
    dev, rows, secs = model.device, [], 0.0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        P = max(len(p) for p in chunk)
        x = torch.tensor([[pad_id] * (P - len(p)) + p for p in chunk], device=dev)
        att = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in chunk], device=dev)
        t0 = time.perf_counter()
        out = model.generate(input_ids=x, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=sorted(stop), pad_token_id=pad_id)
        secs += time.perf_counter() - t0
        for r in out[:, P:].tolist():
            rows.append(r[:next((j for j, t in enumerate(r) if t in stop), len(r))])
    return rows, secs


def run_ar(model, tok, task: Task, examples: list[Example], batch_size: int = 8,
           max_new_tokens: int | None = None) -> TaskRun:
    """Greedy AR decoding (``ar_greedy``) up to EOT / EOS, then scoring."""
    ids = special_ids(tok)
    toks, secs = ar_greedy(model, prompts_of(tok, examples), {ids["eos"], ids["eot"]}, ids["eos"], batch_size,
                           max_new_tokens or task.gen_length)
    texts = [tok.decode(t, skip_special_tokens=True) for t in toks]
    return TaskRun(task, examples, texts, [task.score(t, e) for t, e in zip(texts, examples)],
                   [len(t) + 1 for t in toks], toks, secs)


def load_ar(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A local Qwen3 causal LM (never downloads); a device this machine lacks is an error naming the available ones."""
    from transformers import AutoModelForCausalLM

    from ..models import check_device

    device = check_device(device)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True).to(device).eval()


def evaluate(model_dir: str | Path, tasks: list[Task], n: int, batch_size: int = 8, device: str = "cpu",
             sampler: str = "low_confidence", cache: str = "none", seed: int = 0) -> dict[str, TaskRun]:
    """Accuracy of the checkpoint on the first ``n`` test examples of each task (vanilla loop for
    diffusion models, greedy for AR ones), keyed by ``task.label``."""
    from ..models import load_model
    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    ar = is_ar(model_dir)
    model = load_ar(model_dir, device) if ar else load_model(model_dir, device)
    out = {}
    for task in tasks:
        exs = task.examples("test", n, seed)
        out[task.label] = (run_ar(model, tok, task, exs, batch_size) if ar else
                          run_mdm(model, tok, task, exs, task_config(task, sampler, cache), batch_size))
    return out


def add_parser(sub) -> None:
    from . import DEFAULT_TASKS

    e = sub.add_parser("eval", help="exact-match accuracy of a checkpoint (LLaDA/Dream or Qwen3 AR) on the "
                                    "task suite's test split")
    e.add_argument("--model", required=True, help="checkpoint dir (models/llada-tasks, models/qwen3-tasks, ...)")
    e.add_argument("--tasks", default=";".join(DEFAULT_TASKS), help="';'-separated task specs")
    e.add_argument("--n", type=int, default=200, help="test examples per task")
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--sampler", default="low_confidence", help="diffusion models only")
    e.add_argument("--cache", default="none", help="diffusion models only")
    e.add_argument("--device", default="cpu")
    e.add_argument("--seed", type=int, default=0, help="which test examples (the split never changes)")
    e.add_argument("--show", type=int, default=0, help="print this many generations per task")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)


def cmd_eval(a) -> int:
    from . import parse_tasks

    if a.n < 1 or a.batch_size < 1:
        raise ValueError(f"--n and --batch-size must be >= 1, got {a.n}, {a.batch_size}")
    runs = evaluate(a.model, parse_tasks(a.tasks), a.n, a.batch_size, a.device, a.sampler, a.cache, a.seed)
    res = {k: {"accuracy": r.accuracy, "n": len(r.correct), "seconds": r.seconds} for k, r in runs.items()}
    if a.json:
        print(json.dumps({"model": str(a.model), "results": res}))
        return 0
    for k, r in runs.items():
        for ex, t, ok in list(zip(r.examples, r.texts, r.correct))[:a.show]:
            print(f"[{k}] {'OK ' if ok else 'BAD'} {ex.prompt[-80:]!r} -> {t!r} (want {ex.answer!r})")
        print(f"{k}: {r.accuracy:.3f} exact match on {len(r.correct)} test examples ({r.seconds:.1f}s)")
    return 0
