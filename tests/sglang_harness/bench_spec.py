"""TEST-ONLY driver: the numbers of docs/benchmarks.md "DFlash and TokenSwift through SGLang (CPU)".

Launches the shipped Qwen3 task model on this CPU with the harness three times (plain, DFLASH with
models/dflash-qwen3-tasks, TOKENSWIFT with models/tokenswift-qwen3-tasks), one server at a time (an idle SGLang
scheduler polls a CPU core), and runs examples/sglang_spec_bench.py's measurement on each:

    python tests/sglang_harness/bench_spec.py --tasks "arithmetic;sort" --n 25 --max-new-tokens 256
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "examples")]

from server import SGLangServer  # noqa: E402
from sglang_spec_bench import measure, table, task_prompts  # noqa: E402

TARGET = ROOT / "models" / "qwen3-tasks"
FLAGS = {
    "ar": (),
    "dflash": ("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
               str(ROOT / "models" / "dflash-qwen3-tasks"), "--speculative-num-draft-tokens", "16",
               "--speculative-draft-attention-backend", "torch_native"),
    "tokenswift": ("--speculative-algorithm", "TOKENSWIFT", "--speculative-num-draft-tokens", "8",
                   "--speculative-draft-model-path", str(ROOT / "models" / "tokenswift-qwen3-tasks")),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="arithmetic;sort")
    p.add_argument("--n", type=int, default=25)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args()
    prompts = task_prompts(str(TARGET), a.tasks, a.n)
    runs = {}
    for name, flags in FLAGS.items():
        with SGLangServer(TARGET, *flags) as srv:
            runs[name] = measure(srv.url, prompts, a.max_new_tokens, a.concurrency)
    result = {"tasks": a.tasks, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
              "concurrency": a.concurrency, "servers": table(runs)}
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
