"""Quantized weights through each host's own quantization: a shipped task model served by vLLM (online FP8, one
scale per output channel) and by SGLang (BitsAndBytes NF4, quantized while loading), against the same host
unquantized, on held-out arithmetic and sort examples decoded by the vanilla loop (``low_confidence``, one token a
step, 24-token answers in blocks of 8). Both hosts serve bf16 activations.

    .venv/bin/python tests/bench_quantized.py --n 40 --out quantized.json

Prints one row per (host, model): correct answers unquantized and quantized, and how many answers are identical.
``tests/test_quantized.py`` runs the quantized half on fewer examples.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
for p in (TESTS, TESTS / "sglang_harness"):
    if str(p) not in sys.path:
        sys.path.append(str(p))

MODELS = ROOT / "models"
TASKS = ("arithmetic", "sort")
# vLLM (CPU build): online FP8 on every linear layer; LLaDA2's routed experts stay bf16 (the CPU build has no FP8
# or INT8 MoE kernel, docs/vllm.md)
VLLM_FP8 = {"quantization": "online", "quantization_config": {"linear": "fp8_per_channel_static"}}
SGLANG_NF4 = ("--quantization", "bitsandbytes", "--load-format", "bitsandbytes")
VLLM_MODELS = ("llada-tasks", "dream-tasks", "llada2-tasks")
SGLANG_MODELS = ("llada-tasks", "dream-tasks")  # SGLang's own LLaDA2 class has no BitsAndBytes mapping


def workload(model: str, n: int) -> list[tuple]:
    """(prompt ids, task, example) for the first ``n`` held-out examples of each task."""
    from dllm_core import load_tokenizer
    from dllm_core.tasks import make_task
    from dllm_core.tasks.evaluate import prompts_of

    tok = load_tokenizer(MODELS / model)
    out = []
    for name in TASKS:
        task = make_task(name)
        examples = task.examples("test", n)
        out += [(p, task, e) for p, e in zip(prompts_of(tok, examples), examples)]
    return out


def correct(model: str, work: list[tuple], answers: list[list[int]]) -> dict[str, int]:
    """Correct answers per task (decoded up to the model's stop tokens)."""
    from dllm_core import load_model, load_tokenizer
    from dllm_core.cli import decode, stop_ids

    tok = load_tokenizer(MODELS / model)
    stop = stop_ids(tok, load_model(MODELS / model))
    out = dict.fromkeys(TASKS, 0)
    for a, (_, task, ex) in zip(answers, work):
        out[task.name] += task.score(decode(tok, a, stop), ex)
    return out


def vllm_jobs(model: str, work: list[tuple], quantized: dict | None) -> dict:
    """One engine job (``vllm_harness/engine_driver.py``): every request at once, the weights' dtypes reported."""
    from vllm_harness.jobs import ENGINE

    block = 8
    canvas = block if model.startswith("llada2") else work[0][1].gen_length  # LLaDA2: one block per canvas
    engine = {**ENGINE, "dtype": "bfloat16", "max_model_len": 512,
              "diffusion_config": {"canvas_length": canvas}, **(quantized or {})}
    batch = [{"prompt_token_ids": p, "params": {"max_tokens": t.gen_length, "temperature": 0, "extra_args": {
        "dllm_sampler": "low_confidence", "dllm_steps": t.gen_length, "dllm_block_length": block}}}
        for p, t, _ in work]
    return {"model": str(MODELS / model), "engine": engine, "batches": [batch],
            "report": {"fn": "reports.engine_reports:weight_dtypes"}}


def vllm_answers(model: str, work: list[tuple], quantized: dict | None) -> dict:
    """{answers, seconds, weights} of one vLLM engine over the workload."""
    from vllm_harness.jobs import run_engine

    r = run_engine(vllm_jobs(model, work, quantized))
    return {"answers": r["batches"][0], "seconds": r["seconds"]["generate"], "weights": r["report"]}


def sglang_flags(tmp: Path, quantized: bool) -> list[str]:
    """DllmCore with the vanilla loop over the whole response (``dual:every=1`` refreshes every step: exact)."""
    cfg = tmp / "algo.yaml"
    cfg.write_text(json.dumps({"block_size": 8, "sampler": "low_confidence", "cache": "dual:every=1"}))
    return ["--dtype", "bfloat16", "--dllm-algorithm", "DllmCore", "--dllm-algorithm-config", str(cfg),
            *(SGLANG_NF4 if quantized else ())]


def sglang_answers(model: str, work: list[tuple], quantized: bool, tmp: Path, also=None) -> dict:
    """{answers, seconds, log} of one SGLang server over the workload, 16 requests in flight; ``also(server)``
    runs after them, its result under "also"."""
    from server import SGLangServer

    with SGLangServer(MODELS / model, *sglang_flags(tmp, quantized), log=tmp / f"{model}-{quantized}.log") as srv:
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda w: srv.generate(w[0], w[1].gen_length)["output_ids"], work))
        seconds = time.perf_counter() - t0
        return {"answers": answers, "seconds": seconds, "also": also and also(srv), "log": srv.log()}


def row(host: str, model: str, method: str, work: list[tuple], plain: dict, quant: dict) -> dict:
    same = sum(a == b for a, b in zip(plain["answers"], quant["answers"]))
    return {"host": host, "model": model, "method": method, "n": len(work) // len(TASKS),
            "unquantized": correct(model, work, plain["answers"]), "quantized": correct(model, work, quant["answers"]),
            "identical_answers": same, "seconds": {"unquantized": plain["seconds"], "quantized": quant["seconds"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40, help="held-out examples per task")
    ap.add_argument("--out", type=Path, help="write the rows as JSON")
    ap.add_argument("--tmp", type=Path, default=Path("/tmp/bench_quantized"))
    args = ap.parse_args()
    args.tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in VLLM_MODELS:
        work = workload(model, args.n)
        plain, quant = vllm_answers(model, work, None), vllm_answers(model, work, VLLM_FP8)
        rows.append(row("vllm", model, "online fp8 (linear, per channel)", work, plain, quant))
        print(json.dumps(rows[-1]), flush=True)
    for model in SGLANG_MODELS:
        work = workload(model, args.n)
        plain, quant = (sglang_answers(model, work, q, args.tmp) for q in (False, True))
        rows.append(row("sglang", model, "bitsandbytes nf4", work, plain, quant))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
