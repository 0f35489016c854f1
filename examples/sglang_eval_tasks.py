"""Accuracy of a LLaDA / Dream checkpoint on a task's test split served by SGLang's dLLM algorithms
(our ``--dllm-algorithm`` classes with a ``cache:`` policy) vs the embedded engine with the same policy
(and the vanilla loop).

    # CPU: SGLang's model classes, KV pools and algorithm loops under the test stand-in for its scheduler
    python examples/sglang_eval_tasks.py --model models/llada-tasks --task arithmetic --n 200 \\
        --algorithm DllmCore --cache dual

    # GPU: a running SGLang server (its YAML must match --algorithm / --sampler / --tau / --cache)
    printf 'block_size: 8\\nsampler: low_confidence\\nsteps: 8\\ncache: dual\\n' > algo.yaml
    sglang serve --model-path models/llada-tasks --dtype float32 --dllm-algorithm DllmCore \\
        --dllm-algorithm-config algo.yaml --port 30000
    python examples/sglang_eval_tasks.py --url http://127.0.0.1:30000 --model models/llada-tasks \\
        --task arithmetic --n 200 --algorithm DllmCore --cache dual

With ``--url`` the SGLang answers come from that server (POST /generate, greedy, ``--batch`` requests in
flight); the server's algorithm config is the user's, and ``--algorithm/--sampler/--tau/--cache`` only
pick the embedded reference, so they must say what the server's YAML says. Prints one JSON object:
accuracies (SGLang, the embedded engine with the same policy, vanilla ``none``) and the agreement of
SGLang with that reference, on answers cut after their first EOS (SGLang stops there).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dllm_core import load_model, load_tokenizer
from dllm_core.cli import stop_ids
from dllm_core.tasks import make_task
from dllm_core.tasks.evaluate import accuracy, agreement, generate_batched, prompts_of, task_config


def run_sglang(args, task, prompts, mask_id: int) -> tuple[list[list[int]], float]:
    from sglang.srt.dllm.config import DllmConfig
    from sglang.srt.plugins import load_plugins

    from integrations.sglang import algorithm
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the CPU stand-in of the tests
    from sglang_cpu import BlockDriver, CpuModelRunner, load_sglang_model

    load_plugins()
    cls = getattr(algorithm, args.algorithm)
    cfg = {"cache": args.cache, **({"sampler": args.sampler, "steps": task.gen_length}
                                   if args.algorithm == "DllmCore" else {"tau": args.tau})}
    sg = load_sglang_model(args.model)
    max_len = max(map(len, prompts)) + task.gen_length + task.block_length
    out, t = [], time.perf_counter()
    for i in range(0, len(prompts), args.batch):
        chunk = prompts[i:i + args.batch]
        algo = cls(DllmConfig(cls.__name__, cfg, task.block_length, mask_id, len(chunk),
                              first_done_first_out_mode=True))
        out += BlockDriver(algo, CpuModelRunner(sg, max_len=max_len, max_reqs=len(chunk))).generate(
            chunk, task.gen_length, mask_id)
    return out, time.perf_counter() - t


def run_server(url: str, task, prompts, in_flight: int) -> tuple[list[list[int]], float]:
    """Each prompt through a running SGLang server's POST /generate (greedy), ``in_flight`` at a time."""
    from sglang_spec_bench import run  # examples/: the same HTTP client

    r = run(url, prompts, task.gen_length, in_flight)
    return r["answers"], r["seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--n", type=int, default=200, help="test examples")
    p.add_argument("--algorithm", default="DllmCore", choices=["DllmCore", "FastDllmThreshold"])
    p.add_argument("--sampler", default="low_confidence", help="DllmCore's sampler (steps: the block length)")
    p.add_argument("--tau", type=float, default=0.9, help="FastDllmThreshold's threshold")
    p.add_argument("--cache", default="dual", help="cache policy (dual | prefix | dllm:... | canvas)")
    p.add_argument("--batch", type=int, default=16, help="concurrent requests (a stand-in batch; in flight to --url)")
    p.add_argument("--url", help="a running SGLang server (http://host:port) instead of the CPU stand-in")
    p.add_argument("--out", help="also write the JSON result here")
    args = p.parse_args()

    task, tok = make_task(args.task), load_tokenizer(args.model)
    model = load_model(args.model, dtype=torch.float32)
    examples = task.examples("test", args.n)
    prompts, stop = prompts_of(tok, examples), stop_ids(tok, model)
    sampler = args.sampler if args.algorithm == "DllmCore" else f"threshold:tau={args.tau}"
    cache = "none" if args.cache == "canvas" else args.cache
    # a host request keeps its own dLLM-Cache step counter (an embedded batch shares one): unbatched rows
    ref = generate_batched(model, prompts, task_config(task, sampler, cache),
                           batch_size=1 if cache.startswith("dllm") else 32)
    van = generate_batched(model, prompts, task_config(task, sampler, "none"), batch_size=32)
    got, seconds = (run_server(args.url, task, prompts, args.batch) if args.url
                    else run_sglang(args, task, prompts, model.args.mask_token_id))
    eos = model.args.eos_token_id

    def cut(rows):  # up to and including the first EOS, where SGLang stops
        return [r[:r.index(eos) + 1] if eos in r else r for r in rows]

    def score(rows):
        return accuracy(task, tok, stop, examples, rows)

    result = {"model": args.model, "task": args.task, "n": len(examples), "algorithm": args.algorithm,
              "sglang": args.url or "CPU stand-in",
              "sampler": sampler, "cache": args.cache, "block_length": task.block_length,
              "accuracy": {"sglang": score(got), "reference": score(ref.tokens), "reference_vanilla": score(van.tokens)},
              "agreement_sglang_vs_reference": agreement(cut(got), cut(ref.tokens)),
              "seconds": {"sglang": round(seconds, 2), "reference": round(ref.seconds, 2)}}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
