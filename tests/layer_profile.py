"""TEST-ONLY driver: the numbers of docs/benchmarks.md "Where dLLM-Cache's step goes on this CPU": a cached policy's
decoding split by layer phase against the vanilla loop's, on the same held-out few-shot prompts (``models/llada-long``,
``count`` after 3 worked examples, gen 256, blocks of 32, ``low_confidence``, fp32, one batch), and torch SDPA's cost
per query row at the canvas's shape:

    python tests/layer_profile.py --out layer_profile.json

Phases (seconds over the whole decoding): ``qkv`` (norm, projections, RoPE), ``attend`` (SDPA and the output
projection), ``ffn``, ``verify`` (V-verify's projections and pick, the recomputed rows' mask) and ``rest`` (the layer's
other ops: the executor's gathers, scatters and assembly; the vanilla block's residual adds). Each phase's ratio is the
vanilla loop's seconds over the policy's; the work fraction predicts 1 / work for all of them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from step_profile import Clock  # noqa: E402

CACHE = "dllm:kp=64,kr=4,rho=0.5,unit=tokens,first_layer_prompt=false"
PHASES = ("qkv", "attend", "ffn", "verify", "rest")


@contextlib.contextmanager
def clocked():
    """A ``Clock`` over the layer phases of every engine path (the originals restored after)."""
    from dllm_core.cache import dllm_cache, executor
    from dllm_core.models.layers import Block

    spots = [(Block, "qkv", "qkv"), (Block, "attend", "attend"), (Block, "ffn", "ffn"), (Block, "forward", "layer"),
             (executor, "recompute_mask", "verify"), (dllm_cache, "cached_layer", "layer")]
    saved = [(o, n, getattr(o, n)) for o, n, _ in spots]
    clock = Clock()
    for o, n, k in spots:
        clock.wrap(o, n, k)
    try:
        yield clock
    finally:
        for o, n, f in saved:
            setattr(o, n, f)


def decode(model, prompts, cfg) -> dict:
    from dllm_core.tasks.evaluate import generate_batched

    with clocked() as clock:
        t = time.perf_counter()
        res = generate_batched(model, prompts, cfg, len(prompts))
        total = time.perf_counter() - t
    s = clock.seconds
    out = {p: s[p] for p in PHASES[:4]}
    out["rest"] = s["layer"] - sum(out.values())
    out["outside_layers"] = total - s["layer"]
    return {"seconds": round(total, 3), "work": round(res.work / res.full_work, 4), "forwards": res.nfe,
            "phases": {k: round(v, 3) for k, v in out.items()}}


def sdpa_per_query(B: int, H: int, D: int, T: int, counts: list[int], reps: int = 10) -> dict:
    """Milliseconds per query row of torch SDPA (B rows x H heads, T keys, a key mask) at each query count: the
    fastest of ``reps`` calls."""
    import torch
    import torch.nn.functional as F

    k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    mask[1:, ..., :T // 20] = False  # left padding, as a batch of prompts of several lengths
    out = {}
    for n in counts:
        q = torch.randn(B, H, n, D)
        best = float("inf")
        for _ in range(reps + 2):
            t = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            best = min(best, time.perf_counter() - t)
        out[n] = round(1e3 * best / n, 5)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default=CACHE)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out")
    a = p.parse_args()
    import torch

    from dllm_core import load_model, load_tokenizer
    from dllm_core.bench import LONG_MODEL, task_workloads
    from dllm_core.tasks import LONG_FEW_SHOT, parse_tasks

    torch.set_num_threads(a.threads)
    model, tok = load_model(str(LONG_MODEL), dtype=torch.float32), load_tokenizer(str(LONG_MODEL))
    wl = task_workloads(tok, parse_tasks(LONG_FEW_SHOT[256]), a.batch, a.seed)[0]
    prompts = wl.prompts[:a.batch]
    decode(model, prompts, replace(wl.cfg, sampler="threshold:tau=0.5"))  # warm-up
    runs = {c: decode(model, prompts, replace(wl.cfg, sampler="low_confidence", cache=c)) for c in ("none", a.cache)}
    base, ours = runs["none"], runs[a.cache]
    ratios = {ph: round(base["phases"][ph] / ours["phases"][ph], 2) for ph in PHASES if ours["phases"][ph] > 0}
    T = max(map(len, prompts)) + wl.cfg.gen_length
    args = model.args
    result = {"model": "models/llada-long", "task": wl.name, "prompts": len(prompts), "canvas": T, "cache": a.cache,
              "threads": a.threads, "runs": runs, "speedup": round(base["seconds"] / ours["seconds"], 2),
              "predicted": round(1 / ours["work"], 2), "phase_ratios": ratios,
              "sdpa_ms_per_query": sdpa_per_query(a.batch, args.n_heads, args.head_dim, T, [64, 128, 192, 256, 512,
                                                                                               768, T])}
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
