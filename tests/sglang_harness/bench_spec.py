"""TEST-ONLY driver: the numbers of docs/benchmarks.md "DFlash and TokenSwift through SGLang (CPU)".

Launches the shipped Qwen3 task model on this CPU with the harness three times (plain, DFLASH with
models/dflash-qwen3-tasks, TOKENSWIFT with models/tokenswift-qwen3-tasks), one server at a time (an idle SGLang
scheduler polls a CPU core), and runs examples/sglang_spec_bench.py's measurement on each:

    python tests/sglang_harness/bench_spec.py --tasks "arithmetic;sort" --n 25 --max-new-tokens 256

``--dtype`` is passed to every server (default: SGLang's ``auto``, the checkpoint's bfloat16); ``--servers`` picks
a subset (the first is the baseline). docs/dflash.md "Dtypes and exactness" counts bfloat16's answers with:

    python tests/sglang_harness/bench_spec.py --tasks "arithmetic;sort;count" --n 8 --max-new-tokens 256 \
        --dtype bfloat16 --servers ar,dflash
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
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--servers", default=",".join(FLAGS), help=f"comma-separated subset of {list(FLAGS)}")
    p.add_argument("--out")
    a = p.parse_args()
    names = a.servers.split(",")
    if not names or set(names) - set(FLAGS):
        p.error(f"--servers: expected names from {list(FLAGS)}, got {a.servers!r}")
    prompts = task_prompts(str(TARGET), a.tasks, a.n)
    dtype = () if a.dtype == "auto" else ("--dtype", a.dtype)
    runs = {}
    for name in names:
        with SGLangServer(TARGET, *dtype, *FLAGS[name]) as srv:
            runs[name] = measure(srv.url, prompts, a.max_new_tokens, a.concurrency)
    result = {"tasks": a.tasks, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
              "concurrency": a.concurrency, "dtype": a.dtype, "servers": table(runs)}
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
