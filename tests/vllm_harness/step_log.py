"""TEST-ONLY diagnosis: where one of bench_spec.py's vLLM engines spends a pass, step by step (docs/benchmarks.md
"Speculation that never loses: vLLM (CPU)", stop 69).

One engine of ``bench_spec.py``'s modes in this process (run it pinned, as the driver pins its engines), warmed as the
driver warms it at 64 in flight after 1, 4 and 16 (``--warm`` passes at each, then one at ``--concurrency``), then
``--passes`` timed passes at ``--concurrency``. Each scheduler step is logged (requests, scheduled tokens, seconds
since the previous step ended) and, for an adaptive engine, the draft length the policy chose with its rates, and the
seconds its ``DraftLengths`` took. Printed: each pass's seconds and the steps' seconds per (batch bucket, drafts per
request); ``--out``: the log as JSON.

    M=glibc.malloc; GLIBC_TUNABLES=$M.mmap_threshold=1073741824:$M.trim_threshold=4294967296:$M.top_pad=268435456 \\
        VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=1 PYTHONHASHSEED=0 \\
        taskset -c 1 python tests/vllm_harness/step_log.py adaptive --concurrency 64 --passes 6

(``GLIBC_TUNABLES``: the driver's ``MALLOC``, read by glibc as the process starts; without it a step's allocations
churn pages and the steps' times, the policy's measurements with them, differ between engines.)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from bench_spec import MODES, engine_kwargs, prompts  # noqa: E402
from dllm_core.drafters import adaptive  # noqa: E402


def instrument(steps: list, policy: dict) -> None:
    """Log every scheduler step (vLLM's ``Scheduler.update_from_output``) and the adaptive policy's choices."""
    from vllm.v1.core.sched.scheduler import Scheduler

    update, choose, done = Scheduler.update_from_output, adaptive.DraftLengths.__getitem__, adaptive.DraftLengths.done

    def logged_update(self, out, result):
        steps.append({"t": time.perf_counter(), "requests": len(out.num_scheduled_tokens),
                      "tokens": out.total_num_scheduled_tokens})
        return update(self, out, result)

    def logged_choose(self, batch):
        t = time.perf_counter()
        k = choose(self, batch)
        policy["seconds"] += time.perf_counter() - t
        policy["choices"].append({"batch": batch, "k": k, "rates": {str(j): round(r, 2) for j, r in
                                                                      self.lengths.rates(batch).items()}})
        return k

    def timed_done(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return done(self, *args, **kwargs)
        finally:
            policy["seconds"] += time.perf_counter() - t

    Scheduler.update_from_output = logged_update
    adaptive.DraftLengths.__getitem__, adaptive.DraftLengths.done = logged_choose, timed_done


def per_step(steps: list[dict]) -> dict[str, list[float]]:
    """Seconds of the steps per key: "prefill" (the step that runs the prompts, with the gap before it) or
    "bucket/drafts" (the batch's power-of-two bucket, the drafts per request scheduled) -> [steps, seconds]."""
    out = defaultdict(lambda: [0, 0.0])
    for prev, s in zip(steps, steps[1:]):
        n, tok = s["requests"], s["tokens"]
        key = "prefill" if tok > 16 * n else f"{1 << (n.bit_length() - 1)}/{tok // n - 1}"
        out[key][0] += 1
        out[key][1] += s["t"] - prev["t"]
    return {k: [v[0], round(v[1], 4)] for k, v in sorted(out.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=MODES)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--warm", default="1,1,1",
                   help="passes before, at 1, 4 and 16 in flight (as many as the driver's rounds there: 9,13,24)")
    p.add_argument("--tasks", default="arithmetic;sort")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--out")
    a = p.parse_args()
    steps, policy = [], {"seconds": 0.0, "choices": []}
    instrument(steps, policy)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm, ps = LLM(**engine_kwargs(a.mode, max(64, a.concurrency))), prompts(a.tasks, a.n)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_new_tokens)

    def one_pass(c: int) -> float:
        t = time.perf_counter()
        for i in range(0, len(ps), c):
            llm.generate([TokensPrompt(prompt_token_ids=q) for q in ps[i:i + c]], sp, use_tqdm=False)
        return time.perf_counter() - t

    for c, n in zip((1, 4, 16), (int(w) for w in a.warm.split(","))):  # the driver's: each number in flight before
        for _ in range(n if c < a.concurrency else 0):
            one_pass(c)
    one_pass(a.concurrency)  # (its warm-up pass)
    steps.clear()
    policy.update(seconds=0.0, choices=[])
    passes = [round(one_pass(a.concurrency), 3) for _ in range(a.passes)]
    result = {"mode": a.mode, "concurrency": a.concurrency, "passes": passes, "steps": len(steps),
              "policy_seconds": round(policy["seconds"], 4), "per_step": per_step(steps)}
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps({**result, "log": steps, "choices": policy["choices"]}))


if __name__ == "__main__":
    main()
