"""Acceptance length and speedup of DFlash vs plain AR decoding, measured in the same run
(``dllm bench-dflash``)."""
from __future__ import annotations

import json
from dataclasses import replace

from .sampling import SamplingParams, add_sampling_args
from .speculative import SpecConfig, ar_generate, speculative_generate


def compare(target, drafter, prompts: list[list[int]], cfg: SpecConfig, warmup: bool = True) -> dict:
    """Decode every prompt with AR and with DFlash (interleaved, so machine noise hits both alike).

    mean_accept = tokens emitted by verification forwards / number of those forwards (tau, bonus included);
    speedup = AR seconds per token / DFlash seconds per token; identical = fraction of prompts whose outputs
    are token-identical (1.0 expected under greedy decoding)."""
    if not prompts:
        raise ValueError("compare: no prompts")
    if warmup:
        short = replace(cfg, max_new_tokens=min(cfg.max_new_tokens, 8))
        ar_generate(target, prompts[0], short)
        speculative_generate(target, drafter, prompts[0], short)
    ar_s = sp_s = 0.0
    ar_n = sp_n = same = 0
    lengths: list[int] = []
    for i, p in enumerate(prompts):
        c = replace(cfg, seed=cfg.seed + i)
        a = ar_generate(target, p, c)
        s = speculative_generate(target, drafter, p, c)
        ar_s, ar_n = ar_s + a.seconds, ar_n + len(a.tokens)
        sp_s, sp_n = sp_s + s.seconds, sp_n + len(s.tokens)
        same += a.tokens == s.tokens
        lengths += s.accept_lengths
    return {"prompts": len(prompts), "mean_accept": sum(lengths) / max(len(lengths), 1),
            "verify_steps": len(lengths), "ar_seconds": ar_s, "dflash_seconds": sp_s,
            "ar_tokens": ar_n, "dflash_tokens": sp_n,
            "speedup": (ar_s / max(ar_n, 1)) / (sp_s / max(sp_n, 1)), "identical": same / len(prompts)}


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
    for t in tasks:
        prompts = [encode_prompt(tok, ex.prompt, a.chat) for ex in t.examples(a.split, a.n, seed=a.seed)]
        rows[t.name] = compare(target, drafter, prompts, cfg)
    steps = sum(r["verify_steps"] for r in rows.values())
    total = {"mean_accept": sum(r["mean_accept"] * r["verify_steps"] for r in rows.values()) / max(steps, 1),
             "speedup": (sum(r["ar_seconds"] for r in rows.values()) / sum(r["ar_tokens"] for r in rows.values()))
             / (sum(r["dflash_seconds"] for r in rows.values()) / sum(r["dflash_tokens"] for r in rows.values())),
             "identical": sum(r["identical"] * r["prompts"] for r in rows.values())
             / sum(r["prompts"] for r in rows.values())}
    print(json.dumps({"block_size": a.block_size or drafter.cfg.block_size, "temperature": a.temperature,
                      "split": a.split, "tasks": rows, "all": total}, indent=2))
    return 0
