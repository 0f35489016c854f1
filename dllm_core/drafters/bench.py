"""Acceptance length and speedup of DFlash vs plain AR decoding, measured in the same run
(``dllm bench-dflash``)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

from .adaptive import AdaptiveDraft, DraftLength
from .sampling import SamplingParams, add_sampling_args
from .speculative import SpecConfig, ar_generate, speculative_generate


def median_interval(values, level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of independent paired-round ``values`` (ratios to a baseline):
    the order statistics x_(j) and x_(n+1-j), j the largest with 2 P(Binomial(n, 1/2) < j) <= 1 - ``level``; with
    fewer than 6 rounds (no such j at 95 %) the range, which then covers the median with less than ``level``."""
    xs, n = sorted(values), len(values)
    if not n:
        raise ValueError("median_interval: no values")
    j, tail = 0, 0.0  # tail: P(B <= j - 1) ... P(B <= j), B ~ Binomial(n, 1/2)
    while True:
        tail += math.comb(n, j) / 2 ** n
        if 2 * tail > 1 - level:
            break
        j += 1
    return (xs[j - 1], xs[n - j]) if j else (xs[0], xs[-1])


def session_order(names, k: int) -> list:
    """The start order of session ``k``'s fresh servers / engines in the benchmark drivers: ``names`` rotated every two
    sessions and reversed in odd ones, so each one's place in the order is the same on average over sessions."""
    turn = list(names[k // 2 % len(names):]) + list(names[:k // 2 % len(names)])
    return turn[::-1] if k % 2 else turn


def compare(target, drafter, prompts: list[list[int]], cfg: SpecConfig, warmup: bool = True,
            lengths: DraftLength | None = None) -> dict:
    """Decode every prompt with AR and with DFlash (interleaved, so machine noise hits both alike); with ``lengths``
    also with DFlash at the adaptive draft length (an engine's ``DraftLength``: kept over all the prompts).

    mean_accept = tokens emitted by verification forwards / number of those forwards (tau, bonus included);
    speedup = AR seconds per token / DFlash seconds per token; identical = fraction of prompts whose outputs
    are token-identical (1.0 expected under greedy decoding)."""
    if not prompts:
        raise ValueError("compare: no prompts")
    if warmup:
        short = replace(cfg, max_new_tokens=min(cfg.max_new_tokens, 8))
        ar_generate(target, prompts[0], short)
        speculative_generate(target, drafter, prompts[0], short)
    secs, toks = {"ar": 0.0, "dflash": 0.0, "adaptive": 0.0}, {"ar": 0, "dflash": 0, "adaptive": 0}
    same = {"dflash": 0, "adaptive": 0}
    lengths_seen: list[int] = []
    for i, p in enumerate(prompts):
        c = replace(cfg, seed=cfg.seed + i)
        runs = {"ar": ar_generate(target, p, c), "dflash": speculative_generate(target, drafter, p, c)}
        if lengths is not None:
            runs["adaptive"] = speculative_generate(target, drafter, p, c, lengths)
        for name, r in runs.items():
            secs[name], toks[name] = secs[name] + r.seconds, toks[name] + len(r.tokens)
            if name != "ar":
                same[name] += r.tokens == runs["ar"].tokens
        lengths_seen += runs["dflash"].accept_lengths
    per_token = {k: secs[k] / max(toks[k], 1) for k in secs}
    out = {"prompts": len(prompts), "mean_accept": sum(lengths_seen) / max(len(lengths_seen), 1),
           "verify_steps": len(lengths_seen), "ar_seconds": secs["ar"], "dflash_seconds": secs["dflash"],
           "ar_tokens": toks["ar"], "dflash_tokens": toks["dflash"],
           "speedup": per_token["ar"] / per_token["dflash"], "identical": same["dflash"] / len(prompts)}
    if lengths is not None:
        out.update(adaptive_seconds=secs["adaptive"], adaptive_tokens=toks["adaptive"],
                   adaptive_speedup=per_token["ar"] / per_token["adaptive"],
                   adaptive_identical=same["adaptive"] / len(prompts),
                   adaptive_rates={k: round(v, 2) for k, v in lengths.rates(1).items()})
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("bench-dflash", help="DFlash acceptance length + speedup vs AR on a task-suite split")
    p.add_argument("--target", required=True, help="local transformers causal LM directory (with tokenizer)")
    p.add_argument("--drafter", required=True, help="DFlash drafter directory")
    p.add_argument("--tasks", default="arithmetic;sort;retrieval:min_pairs=4", help="';'-separated task specs")
    p.add_argument("--split", default="test", help="train or test")
    p.add_argument("--n", type=int, default=50, help="prompts per task")
    p.add_argument("--block-size", type=int, default=None, help="verified tokens per step (default: drafter's)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    add_sampling_args(p)
    p.add_argument("--sample-draft", action="store_true", help="sample drafts from q (default: greedy drafter)")
    p.add_argument("--adaptive", action="store_true", help="also DFlash at the adaptive draft length (adaptive.py)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(a) -> int:
    from ..tasks import parse_tasks
    from ..tokenizer import encode_prompt, load_tokenizer
    from ..train.common import set_threads
    from ..train.dflash import stop_ids
    from .dflash import load_drafter
    from .target import load_target

    set_threads(a.threads)
    tasks = parse_tasks(a.tasks)
    target = load_target(a.target, a.device)
    tok = load_tokenizer(a.target)
    drafter = load_drafter(a.drafter, a.device).bind(target)
    cfg = SpecConfig(a.max_new_tokens, a.block_size, SamplingParams.from_args(a), not a.sample_draft,
                     tuple(stop_ids(tok, target.config)), a.seed)
    rows = {}
    lengths = AdaptiveDraft((a.block_size or drafter.cfg.block_size) - 1).new() if a.adaptive else None  # all tasks
    for t in tasks:
        prompts = [encode_prompt(tok, ex.prompt, a.chat) for ex in t.examples(a.split, a.n, seed=a.seed)]
        rows[t.name] = compare(target, drafter, prompts, cfg, lengths=lengths)
    steps = sum(r["verify_steps"] for r in rows.values())

    def per_token(name: str) -> float:  # seconds per token of one decoder over every task
        return sum(r[f"{name}_seconds"] for r in rows.values()) / sum(r[f"{name}_tokens"] for r in rows.values())

    total = {"mean_accept": sum(r["mean_accept"] * r["verify_steps"] for r in rows.values()) / max(steps, 1),
             "speedup": per_token("ar") / per_token("dflash"),
             "identical": sum(r["identical"] * r["prompts"] for r in rows.values())
             / sum(r["prompts"] for r in rows.values())}
    if a.adaptive:
        total["adaptive_speedup"] = per_token("ar") / per_token("adaptive")
    print(json.dumps({"block_size": a.block_size or drafter.cfg.block_size, "temperature": a.temperature,
                      "split": a.split, "tasks": rows, "all": total}, indent=2))
    return 0
