"""``dllm bench-long``: ultra-long generation with TokenSwift vs plain AR decoding, measured in one run.

For one prompt (a long free-running task prompt by default) it generates ``max(--lengths)`` tokens with
AR and with TokenSwift (each draft mode asked for), without and with the contextual penalty, and reports
acceptance rate alpha, tokens per verification / per target forward, wall-clock speedup at every length
of ``--lengths`` (time to the L-th token, AR / TokenSwift; the decoders run in this process in turns, step
by step, each timed on its own steps, so load changes of a shared machine hit both alike), whether the outputs
are token-identical, and Distinct-n of the text with and without the penalty. ``--doc`` writes a markdown
report with the table and a PNG plot of speedup vs generated length (matplotlib, Agg backend).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..sampling import SamplingParams, add_sampling_args
from .config import DRAFTS, TokenSwiftConfig
from .generate import (LongResult, autoregressive_generate, iter_autoregressive, iter_tokenswift,
                       tokenswift_generate)


def distinct_n(tokens: list[int], n: int) -> float:
    """Distinct-n: unique n-grams / all n-grams of the token sequence (1.0 = no repetition)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / max(len(grams), 1)


def _distinct(tokens: list[int]) -> dict:
    return {f"distinct_{n}": round(distinct_n(tokens, n), 4) for n in (1, 2, 3, 4)}


def race(decoders: list) -> list[LongResult]:
    """Advance step iterators (``iter_autoregressive`` / ``iter_tokenswift``) in turns, always the one with
    the fewest tokens out, until all finish: every decoder meets the same machine load at the same point of
    its generation, and each one's clock counts only its own steps. -> the final results, in order."""
    last: list[LongResult | None] = [None] * len(decoders)
    live = dict(enumerate(decoders))
    while live:
        i = min(live, key=lambda j: (len(last[j].tokens) if last[j] is not None else -1, j))
        try:
            last[i] = next(live[i])
        except StopIteration:
            del live[i]
    return last


def compare_long(target, heads, prompt: list[int], cfg: TokenSwiftConfig, lengths: list[int],
                 drafts: tuple[str, ...] = ("shared",), penalties: tuple[float, ...] = (1.0,), repeats: int = 1,
                 warmup: int = 64, progress=None) -> dict:
    """AR and TokenSwift on ``prompt`` for every penalty (and draft mode), raced step by step (``race``); see
    the module docstring. With ``repeats`` > 1, times are per-length medians over the repeats."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths must be positive ints, got {lengths}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    cfg = replace(cfg, max_new_tokens=max(lengths))
    if warmup:
        short = replace(cfg, max_new_tokens=warmup)
        autoregressive_generate(target, prompt, short)
        for d in drafts:
            tokenswift_generate(target, heads, prompt, replace(short, draft=d))
    rows = []
    for pen in penalties:
        c = replace(cfg, penalty=pen)
        ars, tss = [], {d: [] for d in drafts}
        for r in range(repeats):
            out = race([iter_autoregressive(target, prompt, c)]
                       + [iter_tokenswift(target, heads, prompt, replace(c, draft=d)) for d in drafts])
            ars.append(out[0])
            for d, res in zip(drafts, out[1:]):
                tss[d].append(res)
            if progress:
                progress(f"penalty={pen} #{r}: AR {len(out[0].tokens)} tokens in {out[0].seconds:.1f}s; "
                         + "; ".join(f"TokenSwift {d} {res.seconds:.1f}s alpha {res.alpha:.3f}"
                                     for d, res in zip(drafts, out[1:])))
        rows += [_row(ars, tss[d], d, pen, lengths) for d in drafts]
    return {"prompt_tokens": len(prompt), "lengths": sorted(lengths), "repeats": repeats, "rows": rows}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def _row(ars: list[LongResult], tss: list[LongResult], draft: str, penalty: float, lengths: list[int]) -> dict:
    ts = tss[0]
    n = min(len(r.tokens) for r in ars + tss)
    at = sorted(L for L in lengths if L <= n)
    ar_at = {L: _median([r.seconds_at(L) for r in ars]) for L in at}
    ts_at = {L: _median([r.seconds_at(L) for r in tss]) for L in at}
    return {"draft": draft, "penalty": penalty, "tokens": len(ts.tokens),
            "identical": all(r.tokens == ars[0].tokens for r in ars + tss),
            "alpha": round(ts.alpha, 4), "draft_depth": ts.draft_depth,
            "tokens_per_verify": round(ts.tokens_per_step, 3), "tokens_per_forward": round(ts.tokens_per_forward, 3),
            "ar_seconds": round(_median([r.seconds for r in ars]), 2),
            "tokenswift_seconds": round(_median([r.seconds for r in tss]), 2),
            "ar_seconds_at": {L: round(v, 2) for L, v in ar_at.items()},
            "tokenswift_seconds_at": {L: round(v, 2) for L, v in ts_at.items()},
            "speedup": {L: round(ar_at[L] / ts_at[L], 3) for L in at}, "rebuilds": ts.rebuilds, **_distinct(ts.tokens)}


def markdown(report: dict, command: str, plot: str | None) -> str:
    """The report as markdown: settings, one table row per (draft, penalty), speedup per length."""
    lengths = report["lengths"]
    head = ("| draft | penalty | identical to AR | alpha | tokens / verify | tokens / target forward | "
            + " | ".join(f"speedup @{L}" for L in lengths) + " | Distinct-2 | Distinct-4 |")
    sep = "|" + "---|" * (8 + len(lengths))
    lines = [f"Command: `{command}`", "", head, sep]
    for r in report["rows"]:
        sp = " | ".join(f"{r['speedup'].get(L, float('nan')):.2f}x" for L in lengths)
        lines.append(f"| {r['draft']} | {r['penalty']} | {'yes' if r['identical'] else 'NO'} | {r['alpha']:.3f} | "
                     f"{r['tokens_per_verify']:.2f} | {r['tokens_per_forward']:.2f} | {sp} | "
                     f"{r['distinct_2']:.3f} | {r['distinct_4']:.3f} |")
    if plot:
        lines += ["", f"![speedup vs generated length]({plot})"]
    return "\n".join(lines) + "\n"


def plot_speedup(report: dict, path: str | Path) -> Path:
    """PNG of speedup vs generated length, one line per (draft, penalty)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in report["rows"]:
        xs = sorted(int(k) for k in r["speedup"])
        ax.plot(xs, [r["speedup"][k] for k in xs], marker="o", label=f"{r['draft']}, penalty {r['penalty']}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("speedup vs AR (wall clock)")
    ax.set_title("TokenSwift on this CPU")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def add_parser(sub) -> None:
    p = sub.add_parser("bench-long", help="TokenSwift vs AR on an ultra-long generation: alpha, speedup vs length")
    p.add_argument("--target", required=True, help="local transformers causal LM directory (with tokenizer)")
    p.add_argument("--heads", required=True, help="TokenSwift heads directory (dllm train-tokenswift)")
    p.add_argument("--prompt", default=None, help="prompt text (default: the first test example of --task)")
    p.add_argument("--task", default="count:span=2000", help="task spec whose test prompt is used")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    p.add_argument("--lengths", default="1000,2000,4000,8000", help="comma-separated generated lengths")
    p.add_argument("--draft", default="shared", help=f"draft mode(s), comma-separated: {', '.join(DRAFTS)}")
    p.add_argument("--penalties", default="1.0,1.2", help="comma-separated penalty factors theta (1.0 = off)")
    p.add_argument("--penalty-window", type=int, default=1024)
    p.add_argument("--keep-stop", action="store_true", help="stop at EOS/EOT (default: ban them, free-running)")
    d = TokenSwiftConfig()
    for name in ("head_topk", "head_paths", "ngram_n", "ngram_topk", "max_nodes", "budget", "sinks"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--rebuild-every", type=int, default=None)
    add_sampling_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="alternate AR/TokenSwift runs; report medians")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadiest on a shared CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    p.add_argument("--doc", default=None, help="write a markdown report (table + plot) to this path")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --doc)")
    p.set_defaults(func=cmd_bench_long)


def _ints(s: str, option: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated ints, got {s!r}") from None


def _floats(s: str, option: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated numbers, got {s!r}") from None


def cmd_bench_long(a) -> int:
    import shlex
    import sys

    import torch

    from ...tasks import make_task
    from ...tokenizer import encode_prompt, load_tokenizer
    from ...train.dflash import stop_ids
    from ..target import load_target
    from .heads import load_heads

    lengths = _ints(a.lengths, "--lengths")
    drafts = tuple(x.strip() for x in a.draft.split(",") if x.strip())
    bad = [x for x in drafts if x not in DRAFTS]
    if bad or not drafts:
        raise ValueError(f"--draft must be among {list(DRAFTS)}, got {a.draft!r}")
    penalties = tuple(_floats(a.penalties, "--penalties"))
    if a.threads:
        torch.set_num_threads(a.threads)
    target = load_target(a.target, a.device)
    tok = load_tokenizer(a.target)
    heads = load_heads(a.heads, a.device)
    text = a.prompt if a.prompt is not None else make_task(a.task).examples("test", 1)[0].prompt
    prompt = encode_prompt(tok, text, a.chat)
    stops = tuple(stop_ids(tok, target.config))
    cfg = TokenSwiftConfig(max_new_tokens=max(lengths), head_topk=a.head_topk, head_paths=a.head_paths,
                           ngram_n=a.ngram_n, ngram_topk=a.ngram_topk, max_nodes=a.max_nodes, budget=a.budget,
                           sinks=a.sinks, rebuild_every=a.rebuild_every, penalty=1.0,
                           penalty_window=a.penalty_window, sampling=SamplingParams.from_args(a),
                           stop_token_ids=stops if a.keep_stop else (),
                           banned_token_ids=() if a.keep_stop else stops, seed=a.seed)
    for d in drafts:
        replace(cfg, draft=d)  # validate every mode's settings before the long runs
    report = compare_long(target, heads, prompt, cfg, lengths, drafts, penalties, a.repeats,
                          progress=lambda m: print(m, file=sys.stderr, flush=True))
    report.update({"prompt": text, "threads": torch.get_num_threads(), "settings": {
        k: getattr(cfg, k) for k in ("head_topk", "head_paths", "ngram_n", "ngram_topk", "max_nodes", "budget",
                                     "sinks", "penalty_window")}, "temperature": a.temperature})
    print(json.dumps(report, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    if a.doc:
        plot = Path(a.plot) if a.plot else Path(a.doc).with_name("tokenswift_speedup.png")
        plot_speedup(report, plot)
        rel = plot.name if plot.parent == Path(a.doc).parent else str(plot)
        command = "dllm " + " ".join(shlex.quote(x) for x in sys.argv[1:])
        Path(a.doc).write_text(markdown(report, command, rel))
    return 0
