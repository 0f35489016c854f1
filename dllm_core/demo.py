"""``dllm demo``: the main job on the embedded default - every sampler x cache policy on a
locally built checkpoint (or ``--model``), with NFE, work and speed relative to the vanilla loop
and agreement with it, all measured in one run."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

DEFAULT_SAMPLERS = ["low_confidence", "threshold:tau=0.9", "factor:f=1.0", "slowfast"]
DEFAULT_CACHES = ["none", "prefix", "dual", "dllm:kp=50,kr=7,rho=0.25"]
PROMPTS = ["What is 12 plus 30?", "Sort the list: 5 3 9 1", "Hello world!"]


def add_parser(sub) -> None:
    from .cli import add_generation_args

    d = sub.add_parser("demo", help="run every sampler x cache policy and print a comparison table")
    d.add_argument("--model", default=None, help="checkpoint dir (default: build tiny LLaDA and Dream)")
    d.add_argument("--samplers", default=",".join(DEFAULT_SAMPLERS).replace(",", ";"),
                   help="';'-separated sampler specs")
    d.add_argument("--caches", default=";".join(DEFAULT_CACHES), help="';'-separated cache specs")
    d.add_argument("--repeat", type=int, default=1, help="timed repetitions per policy (median)")
    add_generation_args(d)
    d.set_defaults(func=cmd_demo, gen_length=64, block_length=16, steps=64)


def run_table(model, prompts: list[list[int]], base_cfg, samplers, caches, repeat=1) -> list[dict]:
    """Generate with every (sampler, cache); ratios are against low_confidence + none of the same run."""
    from dataclasses import replace

    from . import generate

    def timed(cfg):
        runs = [generate(model, prompts, cfg) for _ in range(repeat)]
        return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]

    generate(model, prompts, replace(base_cfg, sampler="low_confidence", cache="none"))  # warm-up
    base = timed(replace(base_cfg, sampler="low_confidence", cache="none"))
    rows = []
    for s in samplers:
        for c in caches:
            r = timed(replace(base_cfg, sampler=s, cache=c))
            rows.append({"sampler": s, "cache": c, "nfe": sum(r.nfe) / len(r.nfe),
                         "nfe_per_token": sum(r.nfe) / r.tokens.numel() * len(r.nfe),
                         "work_ratio": r.counters.ratio(), "tokens_per_s": r.tokens_per_second,
                         "speedup": base.seconds / r.seconds,
                         "agreement": (r.tokens == base.tokens).float().mean().item(),
                         "cache_mib": r.counters.cache_bytes / 2**20})
    return rows


def markdown(rows: list[dict]) -> str:
    head = "| sampler | cache | NFE | NFE/token | work vs none | tok/s | speedup | agreement | cache MiB |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['sampler']} | {r['cache']} | {r['nfe']:.1f} | {r['nfe_per_token']:.3f} | "
                     f"{r['work_ratio']:.3f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['agreement']:.3f} | {r['cache_mib']:.2f} |")
    return "\n".join(lines)


def cmd_demo(a) -> int:
    from . import encode_prompt, load_model, load_tokenizer
    from .cli import decode, generation_config, stop_ids, torch_dtype
    from .testing import build_tiny_checkpoint

    base_cfg = generation_config(a)
    dirs = [Path(a.model)] if a.model else [build_tiny_checkpoint(Path(tempfile.mkdtemp()) / n, n, n_layers=4,
                                                                  dim=128, ffn=256) for n in ("llada", "dream")]
    for d in dirs:
        t0 = time.perf_counter()
        model, tok = load_model(d, a.device, torch_dtype(a.dtype)), load_tokenizer(d)
        prompts = [encode_prompt(tok, p, chat=bool(tok.chat_template)) for p in PROMPTS]
        print(f"\n## {type(model).__name__} from {d} (loaded in {time.perf_counter() - t0:.1f}s)")
        rows = run_table(model, prompts, base_cfg, a.samplers.split(";"), a.caches.split(";"), a.repeat)
        from . import generate
        res = generate(model, prompts, generation_config(a, tok))
        for p, ids in zip(PROMPTS, res.tokens.tolist()):
            print(f"> {p}\n  {decode(tok, ids, stop_ids(tok, model))!r}")
        print(markdown(rows))
    return 0
