"""TEST-ONLY driver: the numbers of docs/benchmarks.md "Under load: dLLM policies beside an AR model (CPU)".

The shipped task models of the same size on the same held-out prompts (``arithmetic;sort``, 24-token canvases in
blocks of 8, greedy, fp32): the diffusion model ``models/llada-tasks`` through SGLang's real server (the CPU
harness) with our ``DllmCore`` algorithm - the vanilla loop (``low_confidence``, one token per step, every position
recomputed at every step: ``dual:every=1``, the vanilla loop's exact mode on a host), Fast-dLLM
(``threshold:tau=0.9`` + ``dual``) and the Elastic-Cache-style refresh (``elastic:gamma=0.7``) - beside the AR model
``models/qwen3-tasks`` served plain and with its DFlash drafter. The servers (``--servers``) are up at once (an idle
one sleeps); at each number of requests in flight
(``--concurrency``: the prompts sent that many at a time) every server takes a warm-up pass, then ``--rounds``
timed passes in ABBA order. Reported per server: requests/s and answer tokens/s (median over rounds), CPU seconds
of its scheduler per request (the process that runs every forward: other processes' load does not inflate it),
and exact-match accuracy; per diffusion policy also the embedded engine's requests/s with batches of that many
requests (``dllm_core``'s static batches: no scheduler):

    python tests/sglang_harness/bench_load.py --n 32 --concurrency 1,8,32,64 --rounds 2 --out load.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "examples")]

from bench_spec import FLAGS, scheduler_cpu_seconds  # noqa: E402
from server import SGLangServer  # noqa: E402
from sglang_spec_bench import run  # noqa: E402

DLLM, AR = ROOT / "models" / "llada-tasks", ROOT / "models" / "qwen3-tasks"
BLOCK = 8
# the vanilla loop: every position recomputed at every step (``dual:every=1``, Fast-dLLM's exact mode; ``none`` on a
# host is SGLang's block canvas, whose prompt K/V are computed without the response)
POLICIES = {"dLLM vanilla": {"sampler": "low_confidence", "cache": "dual:every=1"},
            "dLLM threshold + dual": {"sampler": "threshold:tau=0.9", "cache": "dual"},
            "dLLM threshold + elastic": {"sampler": "threshold:tau=0.9", "cache": "elastic:gamma=0.7"}}
AR_SERVERS = {"AR": FLAGS["ar"], "AR + DFlash": FLAGS["dflash"]}


def workload(model_dir: Path, tasks: str, n: int):
    """(prompts, scorer) of the held-out examples with this model's tokenizer: scorer(rows) -> accuracy."""
    from dllm_core import load_tokenizer
    from dllm_core.tasks import make_task
    from dllm_core.tasks.evaluate import prompts_of, special_ids

    tok = load_tokenizer(model_dir)
    stop = {special_ids(tok)[k] for k in ("eos", "eot")}
    items = [(t, ex) for spec in tasks.split(";") for t in [make_task(spec)] for ex in t.examples("test", n)]
    prompts = prompts_of(tok, [ex for _, ex in items])
    text = lambda r: tok.decode(r[:next((j for j, t in enumerate(r) if t in stop), len(r))], skip_special_tokens=True)
    score = lambda rows: sum(t.score(text(r), ex) for (t, ex), r in zip(items, rows)) / len(rows)
    return prompts, score


def embedded(prompts, score, policies: dict, concurrency: list[int], rounds: int, gen: int) -> dict:
    """Requests/s of the embedded engine per policy, batches of ``c`` requests (median over rounds)."""
    import torch

    from dllm_core import GenerationConfig, load_model
    from dllm_core.tasks.evaluate import generate_batched

    torch.set_num_threads(1)
    model, out = load_model(DLLM, dtype=torch.float32), {}
    for c in concurrency:
        for name, pol in policies.items():
            cfg = GenerationConfig(gen_length=gen, block_length=BLOCK, steps=gen, **pol)
            generate_batched(model, prompts[:c], cfg, c)  # warm-up at this batch size
            runs = []
            for _ in range(rounds):
                t = time.perf_counter()
                res = generate_batched(model, prompts, cfg, c)
                runs.append(time.perf_counter() - t)
            out.setdefault(c, {})[name] = {"requests_per_s": round(len(prompts) / statistics.median(runs), 2),
                                           "accuracy": round(score(res.tokens), 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="arithmetic;sort")
    p.add_argument("--n", type=int, default=32, help="held-out examples per task")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=24, help="the canvas (whole blocks of 8)")
    p.add_argument("--servers", default=";".join([*POLICIES, *AR_SERVERS]), help="';'-separated names of the servers")
    p.add_argument("--out")
    a = p.parse_args()
    import yaml

    names = a.servers.split(";")
    if set(names) - {*POLICIES, *AR_SERVERS}:
        p.error(f"--servers: unknown {sorted(set(names) - {*POLICIES, *AR_SERVERS})}; allowed: "
                f"{[*POLICIES, *AR_SERVERS]}")
    policies = {k: v for k, v in POLICIES.items() if k in names}
    conc = [int(x) for x in a.concurrency.split(",")]
    work = {"dllm": workload(DLLM, a.tasks, a.n), "ar": workload(AR, a.tasks, a.n)}
    tmp, servers = Path(tempfile.mkdtemp()), {}
    try:
        for i, (name, pol) in enumerate(policies.items()):
            (tmp / f"{i}.yaml").write_text(yaml.safe_dump({"block_size": BLOCK, **pol}))
            servers[name] = ("dllm", SGLangServer(DLLM, "--dtype", "float32", "--dllm-algorithm", "DllmCore",
                                                  "--dllm-algorithm-config", str(tmp / f"{i}.yaml"),
                                                  "--max-running-requests", str(max(conc))).__enter__())
        for name, flags in ((k, v) for k, v in AR_SERVERS.items() if k in names):
            servers[name] = ("ar", SGLangServer(AR, "--dtype", "float32", "--max-running-requests", str(max(conc)),
                                                *flags).__enter__())
        result = {"tasks": a.tasks, "prompts": len(work["dllm"][0]), "rounds": a.rounds, "servers": {}}
        for c in conc:
            runs = {name: [] for name in servers}
            for name, (kind, srv) in servers.items():  # warm-up pass at this concurrency
                run(srv.url, work[kind][0], a.max_new_tokens, c)
            for k in range(a.rounds):
                order = list(servers.items()) if k % 2 == 0 else list(servers.items())[::-1]
                for name, (kind, srv) in order:
                    cpu = scheduler_cpu_seconds(srv)
                    r = run(srv.url, work[kind][0], a.max_new_tokens, c)
                    runs[name].append({**r, "cpu": scheduler_cpu_seconds(srv) - cpu})
            for name, rs in runs.items():
                kind, n = servers[name][0], len(work[servers[name][0]][0])
                result["servers"].setdefault(name, {})[c] = {
                    "requests_per_s": round(statistics.median(n / r["seconds"] for r in rs), 2),
                    "tokens_per_s": round(statistics.median(r["tokens"] / r["seconds"] for r in rs), 1),
                    "cpu_ms_per_request": round(1e3 * statistics.median(r["cpu"] for r in rs) / n, 1),
                    "accuracy": round(work[kind][1](rs[0]["answers"]), 3)}
            print(json.dumps({c: {s: v[c] for s, v in result["servers"].items()}}), flush=True)
    finally:
        for _, srv in servers.values():
            srv.__exit__(None, None, None)
    result["embedded"] = embedded(*work["dllm"], policies, conc, a.rounds, a.max_new_tokens)
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
