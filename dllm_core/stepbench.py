"""``dllm bench-step``: time per denoising step, work ratio and memory per cache policy on a model of
real size with random weights (e.g. LLaDA-8B shaped, bf16 on a GPU). Fixed schedules, so every policy
runs the same number of steps; only speed and memory are measured (random weights have no accuracy)."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

# LLaDA-8B-Instruct config.json (sizes from the spec)
LLADA_8B = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32,
            "n_kv_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464, "embedding_size": 126464,
            "max_sequence_length": 4096, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "weight_tying": False,
            "include_bias": False, "block_type": "llama", "mask_token_id": 126336, "eos_token_id": 126081,
            "pad_token_id": 126081, "bos_token_id": 126080}
CONFIGS = {"llada-8b": LLADA_8B}


def random_model(cfg: dict, device, dtype, seed: int = 0):
    """Model of ``cfg``'s architecture with N(0, 0.02) weights, built directly on ``device``."""
    from .models.loader import model_class

    cls = model_class(cfg)
    with torch.device("meta"):
        model = cls(cls.parse_config(cfg))
    model = model.to_empty(device=device).to(dtype)
    g = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.fill_(1.0) if n.endswith("norm.weight") else p.normal_(0, 0.02, generator=g)
    model.rotary = type(model.rotary)(model.args.head_dim, model.args.rope_theta).to(device)
    return model.eval().requires_grad_(False)


def add_parser(sub) -> None:
    p = sub.add_parser("bench-step", help="per-step time / work / memory of each cache policy at real model size")
    p.add_argument("--config", default="llada-8b", help=f"{sorted(CONFIGS)} or a config.json path")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--prompt", default="512,2048", help="prompt lengths")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--sampler", default="low_confidence")
    p.add_argument("--caches", default="none;prefix;dual;dllm:kp=50,kr=7,rho=0.25")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None, help="write results.json and table.md here")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="memory bytes/s of the floor (H200: 4.8e12)")
    p.add_argument("--peak", type=float, default=989e12, help="dense FLOP/s of the floor (H200 bf16: 989e12)")
    p.add_argument("--profile", default=None, help="a cache spec: profile its timed request at the first batch and "
                   "prompt (the top kernels by device time)")
    p.set_defaults(func=cmd_bench_step)


def floor_ms(model, B: int, T: int, work: float, cache_bytes: int, bandwidth: float, peak: float) -> float:
    """The least time one step can take (a roofline): max(bytes read / bandwidth, FLOPs / peak). Bytes: every weight
    but the embedding once, and the policy's cache once; FLOPs: 2 x those weights x the positions the step runs
    (``work`` x B x T) plus attention (4 x positions x T x dim per layer)."""
    a, kept = model.args, [p for n, p in model.named_parameters() if "embed" not in n]
    weights, params = sum(p.numel() * p.element_size() for p in kept), sum(p.numel() for p in kept)
    rows = work * B * T
    flops = 2 * params * rows + 4 * rows * T * a.dim * a.n_layers
    return 1e3 * max((weights + cache_bytes) / bandwidth, flops / peak)


def measure(model, B: int, P: int, base, caches: list[str], device, bandwidth: float = 4.8e12, peak: float = 989e12,
            profile: str | None = None) -> list[dict]:
    from . import generate

    g = torch.Generator().manual_seed(P)
    prompts = torch.randint(0, model.args.mask_token_id - 1, (B, P), generator=g).tolist()
    rows = []
    for spec in caches:
        cfg = replace(base, cache=spec)
        generate(model, prompts, replace(cfg, steps=2 * base.num_blocks))  # warm-up: every shape the timed run uses
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        r = generate(model, prompts, cfg) if spec != profile else profiled(model, prompts, cfg)
        extra = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else 0
        nfe, c = max(r.nfe), r.counters
        fl = floor_ms(model, B, P + base.gen_length, c.ratio(), c.cache_bytes, bandwidth, peak)
        rows.append({"batch": B, "prompt": P, "cache": spec, "nfe": nfe, "ms_per_step": 1e3 * r.seconds / nfe,
                     "work_ratio": c.ratio(), "cache_mib": c.cache_bytes / 2**20, "peak_extra_mib": extra / 2**20,
                     "tokens_per_s": r.tokens_per_second, "floor_ms": fl, "efficiency": fl / (1e3 * r.seconds / nfe)})
    none = {(r["batch"], r["prompt"]): r["ms_per_step"] for r in rows if r["cache"] == "none"}
    for r in rows:
        r["speedup"] = none.get((r["batch"], r["prompt"]), float("nan")) / r["ms_per_step"]
    return rows


def profiled(model, prompts, cfg):
    """``generate`` under the torch profiler; prints the top kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    from . import generate

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = generate(model, prompts, cfg)
    print(f"profile of {cfg.cache} (batch {len(prompts)}):")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    return r


def table(rows: list[dict]) -> str:
    out = ["| batch | prompt | cache | NFE | ms/step | speedup vs none | work vs none | floor ms | efficiency "
           "| cache MiB | peak extra MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['batch']} | {r['prompt']} | {r['cache']} | {r['nfe']} | {r['ms_per_step']:.1f} | "
            f"{r['speedup']:.2f}x | {r['work_ratio']:.3f} | {r['floor_ms']:.2f} | {r['efficiency']:.2f} | "
            f"{r['cache_mib']:.0f} | {r['peak_extra_mib']:.0f} |" for r in rows]
    return "\n".join(out)


def cmd_bench_step(a) -> int:
    from .cli import torch_dtype
    from .engine import GenerationConfig

    cfg = CONFIGS.get(a.config) or json.loads(Path(a.config).read_text())
    device = torch.device(a.device)
    t0 = time.perf_counter()
    model = random_model(cfg, device, torch_dtype(a.dtype))
    print(f"built {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params) "
          f"in {time.perf_counter() - t0:.1f}s on {device}", flush=True)
    base = GenerationConfig(gen_length=a.gen_length, block_length=a.block_length, steps=a.steps, sampler=a.sampler)
    rows = []
    for B in map(int, a.batch.split(",")):
        for P in map(int, a.prompt.split(",")):
            rows += measure(model, B, P, base, a.caches.split(";"), device, a.bandwidth, a.peak,
                            a.profile if not rows else None)
            print(table(rows[-len(a.caches.split(';')):]), flush=True)
    md = table(rows)
    print("\n" + md)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "results.json").write_text(json.dumps(rows, indent=1))
        Path(a.out, "table.md").write_text(md + "\n")
    return 0
