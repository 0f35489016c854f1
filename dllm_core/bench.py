"""``dllm bench``: accuracy and speed of every (sampler, cache) combination, measured in one run.

The same test-split examples are decoded with the vanilla loop (``low_confidence`` + ``none``,
steps == gen_length) and with each requested policy pair. Per pair: exact-match accuracy per task,
NFE per generated token, tokens/s, speedup over the vanilla loop, token agreement with the vanilla
output and the fraction of layer work done (1.0 = recompute everything every step). Writes
``bench.md``, ``bench.json`` and ``bench.png`` (speedup vs accuracy) to ``--out``.

Generated tokens are canvas tokens (gen_length per row, EOS padding included); seconds are the
engine's decoding time (tokenization and model loading excluded). The units (``docs/benchmarks.md``, "Units"):
tokens per forward (per sequence), tokens/s, work fraction, and a pair's efficiency: its measured speedup over the
speedup its forwards and work predict (vanilla forwards / (its forwards x its work fraction)).

``--long 256`` / ``--long 512`` run the long-answer tasks on the shipped long-answer model, blocks of 32, the
questions after worked examples: prompts of about the length of GSM8K 5-shot as the papers use
(``tasks.LONG_FEW_SHOT``); ``--one-line`` asks them alone (``tasks.LONG_TASKS``). ``bench.md``
also holds the profile of every pair: the speedup split into fewer forwards (NFE) and cheaper forwards (cost per
forward against the vanilla loop's), and the vanilla loop's forward against a bare model forward of the same shape
(what the engine adds per step)."""
from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from .engine import GenerationConfig
from .tasks import LONG_FEW_SHOT, LONG_TASKS, Example, Task

VANILLA = ("low_confidence", "none")
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "llada-tasks"
LONG_MODEL = DEFAULT_MODEL.parent / "llada-long"
DEFAULT_TASKS = "arithmetic;sort;retrieval"
DEFAULT_SAMPLERS = "low_confidence;threshold:tau=0.9;factor:f=1.0;slowfast"
DEFAULT_CACHES = "none;prefix;dual;dllm:kp=50,kr=7,rho=0.25"
QUICK = {"n": 4, "tasks": "arithmetic;sort;retrieval:pairs=30"}
FULL_N = 100


@dataclass
class Workload:
    """Prompts decoded on one canvas (``cfg``); ``task`` / ``examples`` are set when outputs are scored."""

    name: str
    prompts: list[list[int]]
    cfg: GenerationConfig
    task: Task | None = None
    examples: list[Example] | None = None


def task_workloads(tok, tasks: list[Task], n: int, seed: int = 0) -> list[Workload]:
    """The first ``n`` test examples of each task on the task's canvas (vanilla schedule)."""
    from .tasks.evaluate import prompts_of, task_config

    out = []
    for t in tasks:
        exs = t.examples("test", n, seed)
        out.append(Workload(t.label, prompts_of(tok, exs), task_config(t, seed=seed), t, exs))
    return out


def _split(spec: str, option: str) -> list[str]:
    items = [s.strip() for s in spec.split(";") if s.strip()]
    if not items:
        raise ValueError(f"{option}: give at least one ';'-separated spec")
    return items


def combos(samplers: list[str], caches: list[str]) -> list[tuple[str, str]]:
    """The vanilla pair first, then every requested (sampler, cache) once."""
    out = [VANILLA]
    for s in samplers:
        out += [(s, c) for c in caches if (s, c) not in out]
    return out


def check_specs(samplers: list[str], caches: list[str], repeat: int = 1, batch_size: int = 1) -> None:
    """Fail on a bad spec or count before anything is loaded or decoded."""
    from .cache import make_cache
    from .sampling import make_sampler

    for s in samplers:
        make_sampler(s)
    for c in caches:
        make_cache(c)
    if repeat < 1 or batch_size < 1:
        raise ValueError(f"--repeat and --batch-size must be >= 1, got {repeat}, {batch_size}")


def run_grid(model, tok, workloads: list[Workload], samplers: list[str], caches: list[str], batch_size: int = 8,
             repeat: int = 1, progress: bool = True) -> list[dict]:
    """Decode every workload with every pair; one summary row per pair, the vanilla pair first, ratios against it.
    ``repeat`` rounds in ABBA order (every pair on a workload back to back, the order reversed every other round
    and workload), so a machine's load drifting during the run hits every pair alike; each pair's time is its
    median over the rounds."""
    from .progress import progress as progress_bar
    from .tasks.evaluate import generate_batched

    check_specs(samplers, caches, repeat, batch_size)
    for wl in workloads:  # warm-up (allocator, kernels) on the workload's shapes, with a sampler that ends fast
        generate_batched(model, wl.prompts[:batch_size], replace(wl.cfg, sampler="threshold:tau=0.5"), batch_size)
    pairs, runs = combos(samplers, caches), {}
    bar = progress_bar(total=repeat * len(pairs) * len(workloads), desc="bench", disable=not progress)
    for r in range(repeat):
        for j, wl in enumerate(workloads):
            for s, c in (pairs if (r + j) % 2 == 0 else pairs[::-1]):
                bar.set_postfix_str(f"{s} + {c} on {wl.name}")
                res = generate_batched(model, wl.prompts, replace(wl.cfg, sampler=s, cache=c), batch_size)
                runs.setdefault((s, c, wl.name), []).append(res)
                bar.update()
    bar.close()
    results = {key: sorted(rs, key=lambda x: x.seconds)[len(rs) // 2] for key, rs in runs.items()}
    return [summarize(model, tok, workloads, results, s, c, batch_size) for s, c in pairs]


def forwards(nfe: list[int], batch_size: int) -> int:
    """Model forwards of batched decoding: each batch steps until its slowest row is done."""
    return sum(max(nfe[i:i + batch_size]) for i in range(0, len(nfe), batch_size))


def summarize(model, tok, workloads: list[Workload], results: dict, s: str, c: str, batch_size: int = 8) -> dict:
    """One table row: accuracy per scored workload and totals over all workloads."""
    from .cli import decode, stop_ids

    stop = stop_ids(tok, model) if tok is not None else set()
    row = {"sampler": s, "cache": c, "accuracy": {}, "per_task": {}}
    tot = {"tokens": 0, "nfe": 0, "seconds": 0.0, "same": 0, "work": 0, "full": 0, "forwards": 0, "base_forwards": 0}
    for wl in workloads:
        r, base = results[s, c, wl.name], results[VANILLA + (wl.name,)]
        gen = len(r.tokens) * wl.cfg.gen_length
        same = sum(a == b for ra, rb in zip(r.tokens, base.tokens) for a, b in zip(ra, rb))
        fw = forwards(r.nfe, batch_size)
        task = {"seconds": r.seconds, "nfe_per_token": sum(r.nfe) / gen, "speedup": base.seconds / r.seconds,
                "agreement": same / gen, "forwards": fw, "ms_per_forward": 1e3 * r.seconds / fw}
        if wl.task is not None:
            ok = [wl.task.score(decode(tok, ids, stop), ex) for ids, ex in zip(r.tokens, wl.examples)]
            task["accuracy"] = row["accuracy"][wl.name] = sum(ok) / len(ok)
        row["per_task"][wl.name] = task
        for k, v in (("tokens", gen), ("nfe", sum(r.nfe)), ("seconds", r.seconds), ("same", same),
                     ("work", r.work), ("full", r.full_work), ("forwards", fw),
                     ("base_forwards", forwards(base.nfe, batch_size))):
            tot[k] += v
    base_s = sum(results[VANILLA + (wl.name,)].seconds for wl in workloads)
    acc = row["accuracy"]
    row.update(mean_accuracy=sum(acc.values()) / len(acc) if acc else None,
               nfe_per_token=tot["nfe"] / tot["tokens"], tokens_per_s=tot["tokens"] / tot["seconds"],
               seconds=tot["seconds"], speedup=base_s / tot["seconds"], agreement=tot["same"] / tot["tokens"],
               work=tot["work"] / max(tot["full"], 1), forwards=tot["forwards"],
               ms_per_forward=1e3 * tot["seconds"] / tot["forwards"], tokens_per_forward=tot["tokens"] / tot["nfe"])
    row["predicted"] = tot["base_forwards"] / (tot["forwards"] * max(row["work"], 1e-9))  # fewer x cheaper forwards
    row["efficiency"] = row["speedup"] / row["predicted"]
    return row


def prompt_tokens(prompts: list[list[int]]) -> dict[str, int]:
    """A workload's prompt lengths in tokens: p50, p90 and the longest."""
    n = sorted(map(len, prompts))
    return {"prompt_tokens_p50": n[len(n) // 2], "prompt_tokens_p90": n[min(len(n) - 1, int(0.9 * len(n)))],
            "prompt_tokens": n[-1]}


def settings_markdown(canvas: dict) -> str:
    """Each workload's setting, as the papers report it: shots, prompt tokens, answer canvas and block."""
    lines = ["| task | shots | prompt tokens p50 / p90 | canvas | block |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {c['shots']} | {c['prompt_tokens_p50']} / {c['prompt_tokens_p90']} | {c['gen_length']} | "
              f"{c['block_length']} |" for k, c in canvas.items()]
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """The bench table (accuracy columns only for scored tasks)."""
    names = list(rows[0]["accuracy"]) if rows else []
    head = ["sampler", "cache", *names] + (["mean acc"] if names else []) + \
        ["tok/forward", "tok/s", "speedup", "agreement", "work", "efficiency"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        acc = [f"{r['accuracy'][n]:.3f}" for n in names] + ([f"{r['mean_accuracy']:.3f}"] if names else [])
        lines.append("| " + " | ".join([f"`{r['sampler']}`", f"`{r['cache']}`", *acc, f"{r['tokens_per_forward']:.2f}",
                                        f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['agreement']:.3f}",
                                        f"{r['work']:.3f}", f"{r['efficiency']:.2f}"]) + " |")
    return "\n".join(lines)


def bare_forward_ms(model, workloads: list[Workload], batch_size: int, repeat: int = 5) -> float:
    """Mean milliseconds of one plain full-canvas model forward per batch over the workloads (median of
    ``repeat``): the compute floor of one vanilla step."""
    import time

    import torch

    from .engine import build_canvas

    total = 0.0
    for wl in workloads:
        prompts = wl.prompts[:batch_size]
        x, keep, pos, _ = build_canvas(prompts, wl.cfg, model.args.mask_token_id, 0, model.embed.weight.device)
        times = []
        with torch.inference_mode():
            for _ in range(repeat + 1):
                t0 = time.perf_counter()
                model(x, pos, keep)
                times.append(time.perf_counter() - t0)
        total += sorted(times[1:])[repeat // 2]
    return 1e3 * total / len(workloads)


def profile_markdown(rows: list[dict], bare_ms: float) -> str:
    """Where each pair's speedup comes from: speedup = NFE ratio x forward-cost ratio (both against the
    vanilla row, which is first); ``vanilla step / bare forward`` is the engine's per-step overhead."""
    van = rows[0]
    lines = [f"Vanilla step {van['ms_per_forward']:.1f} ms against a bare full-canvas forward of {bare_ms:.1f} ms "
             f"(engine + sampler overhead per step: {van['ms_per_forward'] / bare_ms - 1:+.0%}).", "",
             "| sampler | cache | forwards | fewer forwards | ms/forward | cheaper forwards | work | speedup | predicted "
             "| efficiency |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['sampler']}` | `{r['cache']}` | {r['forwards']} | {van['forwards'] / r['forwards']:.2f}x | "
                     f"{r['ms_per_forward']:.1f} | {van['ms_per_forward'] / r['ms_per_forward']:.2f}x | "
                     f"{r['work']:.3f} | {r['speedup']:.2f}x | {r['predicted']:.2f}x | {r['efficiency']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str | Path, title: str = "dllm bench") -> None:
    """Speedup (x) vs mean accuracy (y), colour = cache, marker = sampler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samplers = list(dict.fromkeys(r["sampler"] for r in rows))
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    markers, colors = "osD^vP*X", plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        y = r["mean_accuracy"] if r["mean_accuracy"] is not None else r["agreement"]
        ax.scatter(r["speedup"], y, marker=markers[samplers.index(r["sampler"]) % len(markers)],
                   color=colors(caches.index(r["cache"]) % 10), s=50)
    for i, s in enumerate(samplers):
        ax.scatter([], [], marker=markers[i % len(markers)], color="gray", label=s)
    for i, c in enumerate(caches):
        ax.scatter([], [], marker="s", color=colors(i % 10), label=c)
    ax.set_xlabel("speedup vs low_confidence + none (wall time)")
    ax.set_ylabel("mean exact match" if rows and rows[0]["mean_accuracy"] is not None else "agreement with vanilla")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="accuracy x speed of every sampler x cache pair on the task suite")
    b.add_argument("--model", default=None, help="diffusion checkpoint dir (default: the shipped models/llada-tasks; "
                                                 "with --long models/llada-long)")
    b.add_argument("--tasks", default=None, help=f"';'-separated task specs (default {DEFAULT_TASKS!r}; "
                                                  f"--quick: {QUICK['tasks']!r}; --long N: the long-answer tasks "
                                                  f"of canvas N)")
    b.add_argument("--long", type=int, default=None, help=f"one of {sorted(LONG_TASKS)}: the long-answer tasks on "
                                                          f"that canvas (blocks of 32), the papers' settings")
    b.add_argument("--one-line", action="store_true", help="with --long: the questions alone (default: after "
                                                           "worked examples, prompts of about GSM8K 5-shot's length)")
    b.add_argument("--samplers", default=DEFAULT_SAMPLERS, help="';'-separated sampler specs")
    b.add_argument("--caches", default=DEFAULT_CACHES, help="';'-separated cache specs")
    b.add_argument("--n", type=int, default=None, help=f"test examples per task (default {FULL_N}; "
                                                        f"--quick: {QUICK['n']})")
    b.add_argument("--batch-size", type=int, default=8)
    b.add_argument("--repeat", type=int, default=1, help="timed rounds, in ABBA order (each pair's median)")
    b.add_argument("--quick", action="store_true", help="few examples, short retrieval prompts (CI smoke run)")
    b.add_argument("--out", default="bench-out", help="directory for bench.md / bench.json / bench.png")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default="cpu")
    b.add_argument("--dtype", default="float32")
    b.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_bench)


def command(a, tasks: list[Task], n: int) -> str:
    """The explicit ``dllm bench`` command line equivalent to this run (quick defaults expanded)."""
    spec = ";".join(t.label for t in tasks)
    model = os.path.relpath(a.model) if Path(a.model).resolve().is_relative_to(Path.cwd()) else a.model
    threads = f" --threads {a.threads}" if a.threads else ""
    return (f"dllm bench --model {model}{threads} --tasks '{spec}' --samplers '{a.samplers}' --caches '{a.caches}' "
            f"--n {n} --batch-size {a.batch_size} --repeat {a.repeat} --seed {a.seed} --device {a.device} "
            f"--dtype {a.dtype} --out {a.out}")


def cmd_bench(a) -> int:
    import torch

    from . import load_model, load_tokenizer
    from .cli import torch_dtype
    from .tasks import parse_tasks

    if a.long is not None and a.long not in LONG_TASKS:
        raise ValueError(f"--long must be one of {sorted(LONG_TASKS)}, got {a.long}")
    if a.one_line and a.long is None:
        raise ValueError("--one-line goes with --long 256 or --long 512")
    long = (LONG_TASKS if a.one_line else LONG_FEW_SHOT).get(a.long)
    default = long if a.long else QUICK["tasks"] if a.quick else DEFAULT_TASKS
    tasks = parse_tasks(a.tasks or default)
    a.model = a.model or str(LONG_MODEL if a.long else DEFAULT_MODEL)
    n = a.n if a.n is not None else (QUICK["n"] if a.quick else FULL_N)
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    samplers, caches = _split(a.samplers, "--samplers"), _split(a.caches, "--caches")
    check_specs(samplers, caches, a.repeat, a.batch_size)
    if a.threads is not None:
        if a.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    model = load_model(a.model, a.device, torch_dtype(a.dtype))
    tok = load_tokenizer(a.model)
    torch.manual_seed(a.seed)
    wls = task_workloads(tok, tasks, n, a.seed)
    rows = run_grid(model, tok, wls, samplers, caches, a.batch_size, a.repeat, progress=not a.no_progress)
    bare = bare_forward_ms(model, wls, a.batch_size)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": command(a, tasks, n), "model": str(a.model), "device": a.device, "dtype": a.dtype,
            "torch": torch.__version__, "machine": platform.machine(), "threads": torch.get_num_threads(), "n": n,
            "batch_size": a.batch_size, "repeat": a.repeat, "seed": a.seed, "tasks": [t.label for t in tasks],
            "canvas": {w.name: {"gen_length": w.cfg.gen_length, "block_length": w.cfg.block_length,
                                "steps": w.cfg.steps, "shots": w.task.shots if w.task else 0,
                                **prompt_tokens(w.prompts)} for w in wls},
            "bare_forward_ms": bare}
    (out / "bench.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    table = markdown(rows)
    (out / "bench.md").write_text(settings_markdown(meta["canvas"]) + "\n\n" + table + "\n\n"
                                  + profile_markdown(rows, bare) + "\n")
    plot(rows, out / "bench.png", f"{Path(a.model).name}: {n} test examples/task")
    print(table)
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}, {out / 'bench.png'}", file=sys.stderr)
    return 0
