"""TEST-ONLY driver: the numbers of docs/benchmarks.md "DFlash and TokenSwift through SGLang (CPU)".

Launches the shipped Qwen3 task model on this CPU with the harness three times (plain, DFLASH with
models/dflash-qwen3-tasks, TOKENSWIFT with models/tokenswift-qwen3-tasks), one server at a time (an idle SGLang
scheduler polls a CPU core), and runs examples/sglang_spec_bench.py's measurement on each:

    python tests/sglang_harness/bench_spec.py --tasks "arithmetic;sort" --n 25 --max-new-tokens 256

``--dtype`` is passed to every server (default: SGLang's ``auto``, the checkpoint's bfloat16); ``--servers`` picks
a subset (the first is the baseline). docs/dflash.md "Dtypes and exactness" counts bfloat16's answers with:

    python tests/sglang_harness/bench_spec.py --tasks "arithmetic;sort;count" --n 8 --max-new-tokens 256 \
        --dtype bfloat16 --servers ar,dflash

``adaptive-held-0`` and ``tokenswift-held-0`` are the adaptive DFLASH and TOKENSWIFT servers held at k = 0
(``held_at_0.json``): the speculative server's own cost, which no draft length recovers. ``--rounds R`` measures
docs/benchmarks.md "Speculation that never loses: SGLang (CPU)" instead: the servers run side by side (an idle one
sleeps), and at each number of requests in flight (``--concurrency 1,4,16,64``: the prompts sent that many at a time)
every server takes a warm-up pass (the adaptive one measures its lengths at that batch size, as a running server has)
and then R rounds, in ABBA order (the servers in turn, reversed every other round): requests/s (median over rounds), the
median over rounds of each server's ratio to the first in the same round (its range, a distribution-free 95 % interval
for that median - ``dllm_core.drafters.bench.median_interval`` - and each round's), the same per CPU second of each
server's scheduler process (the process that runs every forward: on a shared machine other processes' load inflates wall
time, not this), and answers identical to the first's in every round:

    python tests/sglang_harness/bench_spec.py --servers ar,dflash,adaptive --dtype float32 --rounds 2 \
        --max-running-requests 64 --tasks "arithmetic;sort" --n 32 --max-new-tokens 24 --concurrency 1,4,16,64

One server process can run steadily a few per cent faster than another of the same code (two TOKENSWIFT servers held at
k = 0, one with stop 71's k = 0 scheduler hooks (not kept) and one without, measured 0.97x and 1.02x of each other with
their start order swapped), which rounds against the same servers do not average out: ``--sessions S`` shares the rounds
out over S sets of fresh servers (the start order reversed every other session, rotated every two), every server with
PYTHONHASHSEED=0; ``ar-b`` is a second plain server, the A/A control whose ratio to ``ar`` shows the resolution:

    python tests/sglang_harness/bench_spec.py --servers ar,ar-b,tokenswift-adaptive,tokenswift-held-0 \
        --dtype float32 --rounds 20 --sessions 2 --max-running-requests 64 --tasks "arithmetic;sort" --n 32 \
        --max-new-tokens 24 --concurrency 1
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "examples")]

from server import SGLangServer  # noqa: E402
from dllm_core.drafters.bench import median_interval, session_order  # noqa: E402
from sglang_spec_bench import measure, run, table, task_prompts  # noqa: E402

TARGET = ROOT / "models" / "qwen3-tasks"
FLAGS = {
    "ar": (),
    "dflash": ("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
               str(ROOT / "models" / "dflash-qwen3-tasks"), "--speculative-num-draft-tokens", "16",
               "--speculative-draft-attention-backend", "torch_native"),
    "adaptive": ("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                 str(ROOT / "models" / "dflash-qwen3-tasks"), "--speculative-num-draft-tokens", "16",
                 "--speculative-draft-attention-backend", "torch_native", "--speculative-adaptive"),
    "tokenswift": ("--speculative-algorithm", "TOKENSWIFT", "--speculative-num-draft-tokens", "8",
                   "--speculative-draft-model-path", str(ROOT / "models" / "tokenswift-qwen3-tasks")),
}
FLAGS["tokenswift-adaptive"] = FLAGS["tokenswift"] + ("--speculative-adaptive",)
# plain decoding in SGLang's synchronous loop: on a CPU every speculative server runs it (SGLang turns overlap
# scheduling off for speculative decoding on a CPU), plain decoding's default is the overlap loop
FLAGS["ar-sync"] = ("--disable-overlap-schedule",)
FLAGS["ar-b"] = ()  # a second plain server: the A/A control, whose ratio to ``ar`` shows the driver's resolution
# the adaptive servers held at k = 0 (a plain step every step): what the speculative server costs without drafts
HELD = ("--speculative-adaptive-config", str(HERE / "held_at_0.json"))
FLAGS["adaptive-held-0"] = FLAGS["adaptive"] + HELD
FLAGS["tokenswift-held-0"] = FLAGS["tokenswift-adaptive"] + HELD


def scheduler_cpu_seconds(srv: SGLangServer) -> float:
    """CPU seconds its scheduler process has used (it computes every forward on this CPU: a measure of a pass that
    other processes' load on a shared machine does not inflate, unlike its wall time)."""
    tick = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if "(sglang::schedul" in stat and int(fields[1]) == srv.proc.pid:  # (comm is cut at 15 characters)
            return (int(fields[11]) + int(fields[12])) / tick
    raise RuntimeError("no scheduler process under the server")


def timed(srv: SGLangServer, prompts, max_new: int, c: int) -> dict:
    cpu = scheduler_cpu_seconds(srv)
    r = run(srv.url, prompts, max_new, c)
    return {**r, "cpu_seconds": scheduler_cpu_seconds(srv) - cpu}


def rounds(names: list[str], prompts, max_new: int, concurrency: list[int], n_rounds: int, flags,
           sessions: int = 1) -> dict:
    """The paired rounds (module docstring), all servers up at once, shared out over ``sessions`` sets of fresh
    servers (their start order reversed every other session and rotated every two)."""
    passes: dict[int, list] = {c: [] for c in concurrency}
    for k in range(sessions):
        with contextlib.ExitStack() as stack:
            srvs = {name: stack.enter_context(SGLangServer(TARGET, *flags, *FLAGS[name]))
                    for name in session_order(names, k)}
            for c in concurrency:
                for name in names:
                    run(srvs[name].url, prompts, max_new, c)  # warm-up pass
                for _ in range(n_rounds * (k + 1) // sessions - n_rounds * k // sessions):
                    order = names if len(passes[c]) % 2 == 0 else names[::-1]
                    passes[c].append({name: timed(srvs[name], prompts, max_new, c) for name in order})
        print(f"session {k + 1} of {sessions} done", file=sys.stderr, flush=True)
    out = {c: cells(names, passes[c], len(prompts)) for c in concurrency}
    for c in concurrency:
        print(json.dumps({c: out[c]}), flush=True)
    return out


def cells(names: list[str], passes: list[dict], n: int) -> dict:
    """Each server's cell over the rounds ``passes`` ({server: its pass}), against the first server's."""
    ratios = {name: sorted(p[names[0]]["seconds"] / p[name]["seconds"] for p in passes) for name in names}
    cpu = {name: statistics.median(p[names[0]]["cpu_seconds"] / p[name]["cpu_seconds"] for p in passes)
           for name in names}
    return {name: {
        "requests_per_s": round(statistics.median(n / p[name]["seconds"] for p in passes), 2),
        "vs_first": round(statistics.median(ratios[name]), 3),
        "vs_first_range": [round(ratios[name][0], 3), round(ratios[name][-1], 3)],
        "vs_first_interval": [round(x, 3) for x in median_interval(ratios[name])],
        "vs_first_rounds": [round(p[names[0]]["seconds"] / p[name]["seconds"], 3) for p in passes],
        "requests_per_cpu_s": round(statistics.median(n / p[name]["cpu_seconds"] for p in passes), 2),
        "vs_first_cpu": round(cpu[name], 3),
        "identical": min(sum(a == b for a, b in zip(p[name]["answers"], p[names[0]]["answers"])) for p in passes),
        "tokens_per_verify": round(sum(p[name]["tokens"] for p in passes)
                                   / sum(p[name]["verify_steps"] for p in passes), 2)
        if passes[0][name]["verify_steps"] else None}
        for name in names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="arithmetic;sort")
    p.add_argument("--n", type=int, default=25)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", default="1", help="requests in flight (several, comma-separated: --rounds)")
    p.add_argument("--rounds", type=int, default=0, help="paired rounds (module docstring); 0: one pass each")
    p.add_argument("--sessions", type=int, default=1, help="sets of fresh servers the rounds are shared out over")
    p.add_argument("--max-running-requests", type=int, help="every server's (SGLang's default: 48 with speculation)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--servers", default=",".join(FLAGS), help=f"comma-separated subset of {list(FLAGS)}")
    p.add_argument("--out")
    a = p.parse_args()
    names = a.servers.split(",")
    if not names or set(names) - set(FLAGS):
        p.error(f"--servers: expected names from {list(FLAGS)}, got {a.servers!r}")
    prompts = task_prompts(str(TARGET), a.tasks, a.n)
    flags = (() if a.dtype == "auto" else ("--dtype", a.dtype)) + (
        () if a.max_running_requests is None else ("--max-running-requests", str(a.max_running_requests),
                                                   "--max-total-tokens", str(max(16384, 512 * a.max_running_requests))))
    conc = [int(c) for c in a.concurrency.split(",")]
    result = {"tasks": a.tasks, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "dtype": a.dtype}
    if a.rounds and not 1 <= a.sessions <= a.rounds:
        p.error(f"--sessions: 1 to --rounds ({a.rounds}), got {a.sessions}")
    if a.rounds:
        os.environ.setdefault("PYTHONHASHSEED", "0")  # the servers' string hashes alike (harness_env copies it)
        result.update(rounds=a.rounds, sessions=a.sessions,
                      table=rounds(names, prompts, a.max_new_tokens, conc, a.rounds, flags, a.sessions))
    else:
        if len(conc) != 1:
            p.error("--concurrency: one value without --rounds")
        runs = {}
        for name in names:
            with SGLangServer(TARGET, *flags, *FLAGS[name]) as srv:
                runs[name] = measure(srv.url, prompts, a.max_new_tokens, conc[0])
        result.update(concurrency=conc[0], servers=table(runs))
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
