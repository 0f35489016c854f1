"""TEST-ONLY driver: the numbers of docs/benchmarks.md "Our algorithms vs SGLang's own, same runtime (CPU)".

Two SGLang servers on this CPU (the harness), both up at once, the shipped LLaDA2 task model on SGLang's own
LLaDA2 class: SGLang's ``JointThreshold`` (threshold 0.9, edit 0.9, 4 post-edit steps) and our ``DllmCore``
with the same rule (``threshold:tau=0.9,edit=0.9,post_edit=4``). Held-out arithmetic prompts, greedy, fp32;
requests/s at each concurrency, measured in alternating rounds (median of ``--rounds``), answers compared:

    python tests/sglang_harness/bench_algorithms.py --n 32 --concurrency 1,16 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "examples")]

from server import SGLangServer  # noqa: E402
from sglang_spec_bench import generate, run, task_prompts  # noqa: E402

MODEL = ROOT / "models" / "llada2-tasks"
ALGORITHMS = {"sglang JointThreshold": ("JointThreshold", {"threshold": 0.9, "edit_threshold": 0.9,
                                                           "max_post_edit_steps": 4}),
              "ours DllmCore": ("DllmCore", {"sampler": "threshold:tau=0.9,edit=0.9,post_edit=4"})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=32, help="held-out arithmetic examples")
    p.add_argument("--concurrency", default="1,16", help="requests in flight, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--out")
    a = p.parse_args()
    import yaml

    prompts = task_prompts(str(MODEL), "arithmetic", a.n)
    tmp = Path(tempfile.mkdtemp())
    servers = {}
    try:
        for name, (algo, cfg) in ALGORITHMS.items():
            (tmp / f"{algo}.yaml").write_text(yaml.safe_dump(cfg))
            servers[name] = SGLangServer(MODEL, "--dtype", "float32", "--dllm-algorithm", algo,
                                         "--dllm-algorithm-config", str(tmp / f"{algo}.yaml"),
                                         "--max-running-requests", "16").__enter__()
        for srv in servers.values():
            generate(srv.url, prompts[0], 8)  # warm-up
        result = {"model": str(MODEL.relative_to(ROOT)), "prompts": len(prompts), "rounds": a.rounds, "table": {}}
        for c in (int(x) for x in a.concurrency.split(",")):
            runs = {name: [] for name in servers}
            for _ in range(a.rounds):  # alternating: the machine's load drifts over both alike
                for name, srv in servers.items():
                    runs[name].append(run(srv.url, prompts, a.max_new_tokens, c))
            base = next(iter(runs.values()))[0]["answers"]
            result["table"][c] = {name: {"requests_per_s": round(statistics.median(len(prompts) / r["seconds"]
                                                                                     for r in rs), 2),
                                         "identical_answers": sum(x == y for x, y in zip(rs[0]["answers"], base))}
                                  for name, rs in runs.items()}
            names = list(runs)
            result["table"][c]["ratio"] = round(result["table"][c][names[1]]["requests_per_s"]
                                                / result["table"][c][names[0]]["requests_per_s"], 3)
        print(json.dumps(result, indent=2))
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=2))
    finally:
        for srv in servers.values():
            srv.__exit__(None, None, None)


if __name__ == "__main__":
    main()
