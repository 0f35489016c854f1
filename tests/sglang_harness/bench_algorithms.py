"""TEST-ONLY driver: the numbers of docs/benchmarks.md "Our algorithms vs SGLang's own, same runtime (CPU)".

Two SGLang servers on this CPU (the harness), both up at once, the shipped LLaDA2 task model on SGLang's own
LLaDA2 class: SGLang's ``JointThreshold`` (threshold 0.9, edit 0.9, 4 post-edit steps) and our ``DllmCore``
with the same rule (``threshold:tau=0.9,edit=0.9,post_edit=4``). Held-out arithmetic prompts, greedy, fp32;
requests/s at each concurrency, measured in rounds whose order alternates (ABBA: the machine's drift and whatever
one server's run leaves behind hit both alike); the ratio is the median of the rounds' paired ratios, answers
compared:

    python tests/sglang_harness/bench_algorithms.py --n 32 --concurrency 1,16 --rounds 8

``--in-process``: the algorithms' own time per step (``prepare_inputs`` + ``step``, the forward excluded) through
SGLang's FDFO loop in process (``tests/sglang_cpu.py``: SGLang's model class, runner stand-in), alternating rounds,
answers compared - what decides the servers' ratio, measured without the forward's noise.
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


def algorithm_time(prompts: list, concurrency: list[int], rounds: int, max_new_tokens: int) -> dict:
    """Per step, ms spent in each algorithm's ``prepare_inputs`` + ``step`` (median over rounds), in process."""
    import time

    import torch

    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from sglang_cpu import BlockDriver, CpuModelRunner, init_cpu_runtime, load_sglang_model

    torch.set_num_threads(1)
    init_cpu_runtime()
    from sglang.srt.dllm.algorithm import get_algorithm_cls
    from sglang.srt.dllm.config import DllmConfig

    from integrations.sglang.configs import register_configs
    from integrations.sglang.plugin import register

    register_configs()
    register()
    model, mask = load_sglang_model(MODEL), 5
    table = {}
    for c in concurrency:
        runs = {name: [] for name in ALGORITHMS}
        answers = {}
        for k in range(rounds):
            for name, (algo, cfg) in (list(ALGORITHMS.items()) if k % 2 == 0 else list(ALGORITHMS.items())[::-1]):
                a = get_algorithm_cls(algo)(DllmConfig(algo, cfg, 8, mask, c, first_done_first_out_mode=True))
                runner, spent = CpuModelRunner(model, max_len=256, max_reqs=c), [0.0, 0]
                BlockDriver(a, runner).generate(prompts[:1], max_new_tokens, mask)  # warm-up
                for attr in ("prepare_inputs", "step"):
                    def timed(*args, _f=getattr(a, attr), _step=attr == "step"):
                        t = time.perf_counter()
                        out = _f(*args)
                        spent[0] += time.perf_counter() - t
                        spent[1] += _step
                        return out
                    setattr(a, attr, timed)
                outs = []
                for i in range(0, len(prompts), c):
                    outs += BlockDriver(a, runner).generate(prompts[i:i + c], max_new_tokens, mask)
                runs[name].append(1e3 * spent[0] / spent[1])
                answers[name] = [list(map(int, o)) for o in outs]
        base = next(iter(answers.values()))
        table[c] = {name: {"algorithm_ms_per_step": round(statistics.median(ms), 3),
                           "identical_answers": sum(x == y for x, y in zip(answers[name], base))}
                    for name, ms in runs.items()}
    return {"model": str(MODEL.relative_to(ROOT)), "prompts": len(prompts), "rounds": rounds, "in_process": table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=32, help="held-out arithmetic examples")
    p.add_argument("--concurrency", default="1,16", help="requests in flight, comma-separated")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--in-process", action="store_true", help="the algorithms' own time per step, in process")
    p.add_argument("--out")
    a = p.parse_args()
    import yaml

    prompts = task_prompts(str(MODEL), "arithmetic", a.n)
    if a.in_process:
        result = algorithm_time(prompts, [int(x) for x in a.concurrency.split(",")], a.rounds, a.max_new_tokens)
        print(json.dumps(result, indent=2))
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=2))
        return
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
            for k in range(a.rounds):  # ABBA: each server runs first in half the rounds
                for name, srv in (list(servers.items()) if k % 2 == 0 else list(servers.items())[::-1]):
                    runs[name].append(run(srv.url, prompts, a.max_new_tokens, c))
            base = next(iter(runs.values()))[0]["answers"]
            result["table"][c] = {name: {"requests_per_s": round(statistics.median(len(prompts) / r["seconds"]
                                                                                     for r in rs), 2),
                                         "identical_answers": sum(x == y for x, y in zip(rs[0]["answers"], base))}
                                  for name, rs in runs.items()}
            theirs, ours = runs.values()  # per round: ours / theirs in requests/s
            ratios = sorted(t["seconds"] / o["seconds"] for t, o in zip(theirs, ours))
            result["table"][c]["ratio"] = round(statistics.median(ratios), 3)
            result["table"][c]["ratio_range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
        print(json.dumps(result, indent=2))
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=2))
    finally:
        for srv in servers.values():
            srv.__exit__(None, None, None)


if __name__ == "__main__":
    main()
