"""Speculative decoding through running SGLang servers vs the same target without speculation: tokens/s,
speedup, SGLang's own acceptance metrics and whether every greedy answer is identical.

    # GPU: the same target served plain and with a drafter, one server each
    sglang serve --model-path TARGET --port 30000
    sglang serve --model-path TARGET --speculative-algorithm DFLASH \\
        --speculative-draft-model-path DRAFTER --port 30001
    python examples/sglang_spec_bench.py --server ar=http://127.0.0.1:30000 \\
        --server dflash=http://127.0.0.1:30001 --target TARGET --tasks "arithmetic;sort" --n 50

The first ``--server`` is the baseline. Prompts are the task suite's test split (chat-encoded with the target's
tokenizer), sent ``--concurrency`` at a time; prints one JSON object (``--out`` also writes it).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time
import urllib.request


def generate(url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    req = urllib.request.Request(url.rstrip("/") + "/generate", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def run(url: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int) -> dict:
    """One pass over ``prompts``: answers, wall seconds, emitted tokens, verify steps (0 without speculation)."""
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(lambda p: generate(url, p, max_new_tokens), prompts))
    seconds = time.perf_counter() - t
    tokens = sum(len(o["output_ids"]) for o in out)
    verify = sum(o["meta_info"].get("spec_verify_ct") or 0 for o in out)
    return {"answers": [o["output_ids"] for o in out], "seconds": seconds, "tokens": tokens, "verify_steps": verify}


def task_prompts(target: str, tasks: str, n: int) -> list[list[int]]:
    from dllm_core import load_tokenizer
    from dllm_core.tasks import make_task
    from dllm_core.tasks.evaluate import prompts_of

    tok = load_tokenizer(target)
    return [p for spec in tasks.split(";") for p in prompts_of(tok, make_task(spec).examples("test", n))]


def measure(url: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int) -> dict:
    """``run`` after one warm-up request."""
    generate(url, prompts[0], 8)
    return run(url, prompts, max_new_tokens, concurrency)


def table(runs: dict[str, dict]) -> dict[str, dict]:
    """Per server: tokens/s, speedup (time per token) and identical answers against the first, and SGLang's
    mean accepted length per verify step (emitted tokens / ``spec_verify_ct``; None without speculation)."""
    base = next(iter(runs.values()))
    per_token = base["seconds"] / base["tokens"]
    return {name: {"tokens": r["tokens"], "seconds": round(r["seconds"], 3),
                   "tok_per_s": round(r["tokens"] / r["seconds"], 1),
                   "speedup": round(per_token / (r["seconds"] / r["tokens"]), 2),
                   "mean_accept_length": round(r["tokens"] / r["verify_steps"], 2) if r["verify_steps"] else None,
                   "identical_to_baseline": sum(a == b for a, b in zip(r["answers"], base["answers"]))}
            for name, r in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", required=True, metavar="NAME=URL", help="repeat; first: baseline")
    p.add_argument("--target", required=True, help="the target checkpoint (its tokenizer encodes the prompts)")
    p.add_argument("--tasks", default="arithmetic;sort")
    p.add_argument("--n", type=int, default=50, help="test examples per task")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args()
    bad = [s for s in a.server if "=" not in s]
    if bad:
        p.error(f"--server: expected NAME=URL, got {bad}")
    prompts = task_prompts(a.target, a.tasks, a.n)
    runs = {name: measure(url, prompts, a.max_new_tokens, a.concurrency)
            for name, url in (s.split("=", 1) for s in a.server)}
    result = {"prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "concurrency": a.concurrency,
              "servers": table(runs)}
    print(json.dumps(result, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
