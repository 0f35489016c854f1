"""TEST-ONLY driver: the numbers of docs/benchmarks.md "Per-step profile": where a denoising step's time goes in the
embedded engine, vLLM (its offline ``LLM`` under ``tests/vllm_harness``) and SGLang (its model classes and our
algorithm in process, ``tests/sglang_cpu.py``): the model's forward, our planning and sampling (``ResponseSlots``),
and the rest of the host's step. Same model (``models/llada-tasks``), held-out prompts and options (threshold 0.9,
Fast-dLLM dual cache, blocks of 8, 32 tokens), fp32, 1 and 16 requests in flight:

    python tests/step_profile.py --n 16 --out profile.json

Times are seconds per step (one forward of the batch) from one run; ``outside`` = step - forward.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = ROOT / "models" / "llada-tasks"
GEN, BLOCK, SAMPLER, CACHE = 32, 8, "threshold:tau=0.9", "dual"


class Clock:
    """Seconds spent inside wrapped callables, by key (a callable wrapped under a key already running counts once)."""

    def __init__(self):
        self.seconds, self.calls, self.depth = defaultdict(float), defaultdict(int), defaultdict(int)

    def wrap(self, owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **kw):
            self.depth[key] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.depth[key] -= 1
                if not self.depth[key]:
                    self.seconds[key] += time.perf_counter() - t
                    self.calls[key] += 1
        setattr(owner, name, timed)

    def report(self, steps: int, total: float) -> dict:
        out = {"steps": steps, "step_ms": 1e3 * total / steps}
        for k, s in self.seconds.items():
            out[f"{k}_ms"] = 1e3 * s / steps
        out["outside_forward_ms"] = out["step_ms"] - out.get("forward_ms", 0.0)
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def prompts(n: int) -> list[list[int]]:
    sys.path.insert(0, str(ROOT / "examples"))
    from sglang_spec_bench import task_prompts

    return task_prompts(str(MODEL), "arithmetic", n)


def embedded(ps: list[list[int]], in_flight: int) -> dict:
    """The embedded engine: batches of ``in_flight`` prompts; forward = the model's layers and LM head."""
    import torch

    from dllm_core import load_model
    from dllm_core.engine import GenerationConfig, generate

    model = load_model(str(MODEL), dtype=torch.float32)
    cfg = GenerationConfig(gen_length=GEN, block_length=BLOCK, sampler=SAMPLER, cache=CACHE)
    generate(model, ps[:1], cfg)  # warm-up
    clock = Clock()
    for layer in model.layers:
        clock.wrap(layer, "forward", "forward")
    clock.wrap(model, "logits", "forward")
    t, steps = time.perf_counter(), 0
    for i in range(0, len(ps), in_flight):
        steps += generate(model, ps[i:i + in_flight], cfg).counters.forwards
    return clock.report(steps, time.perf_counter() - t)


def sglang(ps: list[list[int]], in_flight: int) -> dict:
    """SGLang's model class and our algorithm in process (the CPU stand-in for its scheduler): forward = the model
    runner's forward (our whole-response planning inside it included); ours = the algorithm's prepare_inputs +
    step (the core's begin / plan / take)."""
    sys.path.insert(0, str(HERE))
    from sglang_cpu import BlockDriver, CpuModelRunner, init_cpu_runtime, load_sglang_model

    init_cpu_runtime()
    from sglang.srt.dllm.config import DllmConfig
    from sglang.srt.plugins import load_plugins

    load_plugins()  # our configs and model classes (the entry point)

    from integrations.sglang.algorithm import DllmCore

    sg = load_sglang_model(str(MODEL))
    mask = sg.args.mask_token_id
    algo = DllmCore(DllmConfig("DllmCore", {"sampler": SAMPLER, "cache": CACHE}, BLOCK, mask, in_flight))
    runner = CpuModelRunner(sg, max_len=max(map(len, ps)) + GEN + BLOCK, max_reqs=in_flight)
    BlockDriver(algo, runner).generate(ps[:1], GEN, mask)  # warm-up
    clock = Clock()
    clock.wrap(runner, "forward", "forward")
    clock.wrap(algo, "prepare_inputs", "ours")
    clock.wrap(algo, "step", "ours")
    t = time.perf_counter()
    for i in range(0, len(ps), in_flight):
        BlockDriver(algo, runner).generate(ps[i:i + in_flight], GEN, mask)
    return clock.report(clock.calls["forward"], time.perf_counter() - t)


def vllm(ps: list[list[int]], in_flight: int) -> dict:
    """vLLM's offline engine (in process, the harness): step = execute_model + sample_tokens of its model runner;
    forward = our model's forward + logits; ours = the ModelState's plan (prepare_attn) + our sampler."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", DLLM_STEP_PROFILE="1",
               PYTHONPATH=os.pathsep.join([str(HERE / "vllm_harness"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    job = {"ps": ps, "in_flight": in_flight}
    out = subprocess.run([sys.executable, __file__, "--vllm-child"], input=json.dumps(job), text=True,
                         capture_output=True, env=env, cwd=ROOT, timeout=1800)
    line = [x for x in out.stdout.splitlines() if x.startswith("PROFILE ")]
    if not line:
        raise RuntimeError(f"vLLM profile run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[-1][len("PROFILE "):])


def vllm_child() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from integrations.vllm.model import DllmForDiffusion
    from integrations.vllm.sampler import DllmSampler
    from integrations.vllm.state import DllmModelState

    llm = LLM(model=str(MODEL), tokenizer=str(MODEL), dtype="float32", max_model_len=256, seed=0,
              max_num_seqs=job["in_flight"], additional_config={"dllm": {"sampler": SAMPLER, "cache": CACHE,
                                                                           "block_length": BLOCK}})
    sp = SamplingParams(max_tokens=GEN)
    llm.generate([{"prompt_token_ids": job["ps"][0]}], sp, use_tqdm=False)  # warm-up
    clock = Clock()
    for owner, name, key in ((GPUModelRunner, "execute_model", "step"), (GPUModelRunner, "sample_tokens", "step"),
                             (DllmForDiffusion, "forward", "forward"), (DllmForDiffusion, "compute_logits", "forward"),
                             (DllmModelState, "prepare_attn", "ours"), (DllmSampler, "__call__", "ours")):
        clock.wrap(owner, name, key)
    ps, k = job["ps"], job["in_flight"]
    t = time.perf_counter()
    for i in range(0, len(ps), k):
        llm.generate([{"prompt_token_ids": p} for p in ps[i:i + k]], sp, use_tqdm=False)
    total = time.perf_counter() - t
    steps = clock.calls["step"] // 2  # execute_model + sample_tokens per step
    rep = clock.report(steps, clock.seconds.pop("step"))
    rep["wall_ms_per_step"] = round(1e3 * total / steps, 3)
    print("PROFILE " + json.dumps(rep), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=16, help="held-out arithmetic prompts")
    p.add_argument("--in-flight", default="1,16")
    p.add_argument("--engines", default="embedded,sglang,vllm")
    p.add_argument("--out")
    p.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.vllm_child:
        return vllm_child()
    import torch

    torch.set_num_threads(1)
    ps = prompts(a.n)
    result = {"model": str(MODEL.relative_to(ROOT)), "prompts": len(ps), "gen": GEN, "block": BLOCK,
              "sampler": SAMPLER, "cache": CACHE, "table": {}}
    for k in map(int, a.in_flight.split(",")):
        for engine in a.engines.split(","):
            result["table"][f"{engine} @ {k}"] = globals()[engine](ps, k)
            print(engine, k, result["table"][f"{engine} @ {k}"], flush=True)
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
