"""SGLang's radix cache on a block-causal model (LLaDA2): requests that share a few-shot prefix, served by one
server with the radix cache on and one with it off (``--disable-radix-cache``), the same requests in the same
order. Reports requests/s of each server (all requests, ``--in-flight`` at a time; one run each, the ratio from
the same run), the prompt tokens each served from its cache (SGLang's ``cached_tokens``), whether the answers are
identical, and the accuracy.

    .venv/bin/python tests/sglang_harness/bench_radix.py --n 32 --shots 10 --in-flight 8 --out radix.json

The prefix: ``--shots`` worked arithmetic examples from the train split as earlier chat turns (the same for every
request, as an evaluation harness fixes its exemplars), then the request's own test question.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE)]

from server import SGLangServer  # noqa: E402

MODEL = ROOT / "models" / "llada2-tasks"


def workload(n: int, shots: int):
    """(prompts, task, examples): ``n`` test questions after the same ``shots`` worked examples."""
    from dllm_core import load_tokenizer
    from dllm_core.tasks import Arithmetic
    from dllm_core.tasks.evaluate import prompts_of

    task = Arithmetic(shots=shots, shot_format="turns")
    examples = task.examples("test", n)
    shared = examples[0].turns
    examples = [replace(e, turns=shared) for e in examples]
    return prompts_of(load_tokenizer(MODEL), examples), task, examples


def serve(prompts: list[list[int]], gen: int, in_flight: int, radix: bool, tmp: Path) -> dict:
    """One server over every prompt, ``in_flight`` at a time -> answers, cached tokens, seconds, requests/s."""
    cfg = tmp / "algo.yaml"
    cfg.write_text(json.dumps({"sampler": "low_confidence"}))  # LLaDA2's block canvas, one token a step
    flags = ["--dtype", "float32", "--dllm-algorithm", "DllmCore", "--dllm-algorithm-config", str(cfg),
             *(() if radix else ("--disable-radix-cache",))]
    with SGLangServer(MODEL, *flags, log=tmp / f"radix-{radix}.log") as srv:
        srv.generate(prompts[0][:8], 8)  # warm-up: an unrelated short prompt (nothing of the prefix cached)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(in_flight) as pool:
            outs = list(pool.map(lambda p: srv.generate(p, gen), prompts))
        seconds = time.perf_counter() - t0
    return {"answers": [o["output_ids"] for o in outs], "cached": [o["meta_info"]["cached_tokens"] for o in outs],
            "seconds": seconds, "requests_per_s": len(prompts) / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="requests (test questions)")
    ap.add_argument("--shots", type=int, default=10, help="worked examples in the shared prefix")
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from dllm_core import load_model, load_tokenizer
    from dllm_core.cli import stop_ids
    from dllm_core.tasks.evaluate import accuracy

    prompts, task, examples = workload(args.n, args.shots)
    tok = load_tokenizer(MODEL)
    stop = stop_ids(tok, load_model(MODEL))
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: serve(prompts, task.gen_length, args.in_flight, radix, Path(tmp))
                for name, radix in (("radix_off", False), ("radix_on", True))}
    out = {"model": str(MODEL.relative_to(ROOT)), "requests": args.n, "shots": args.shots,
           "in_flight": args.in_flight, "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
           "identical_answers": runs["radix_on"]["answers"] == runs["radix_off"]["answers"],
           "speedup": runs["radix_on"]["requests_per_s"] / runs["radix_off"]["requests_per_s"]}
    for name, r in runs.items():
        out[name] = {"requests_per_s": r["requests_per_s"], "seconds": r["seconds"],
                     "cached_tokens": sum(r["cached"]), "prompt_tokens": sum(map(len, prompts)),
                     "accuracy": accuracy(task, tok, stop, examples, r["answers"])}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
