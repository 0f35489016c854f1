"""``dllm demo``: the main job. With the shipped task model (``models/llada-tasks``) or ``--model``, it
shows a few generations on test-split prompts and the quick ``dllm bench`` table: accuracy per task,
NFE per token, speed and agreement relative to the vanilla loop for every sampler x cache policy, all
measured in one run. With the shipped long-answer model (``models/llada-long``) it then solves the
long-answer tasks (a 256-token canvas, blocks of 32; the count after worked examples, as the papers prompt) and
retrieval (a value looked up in a 1,000-token prompt)
and measures the papers' pairs there; with the shipped
LLaDA2 task model (``models/llada2-tasks``) it shows the block-causal MoE and its exact caches. Without a
trained model (or with ``--random``) it builds tiny random LLaDA and
Dream checkpoints and compares the policies on fixed prompts (agreement instead of accuracy)."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .bench import DEFAULT_CACHES, DEFAULT_MODEL, DEFAULT_SAMPLERS, LONG_MODEL, QUICK, Workload, markdown, run_grid, \
    task_workloads

SHORT_NOTE = ("Short answers (a few dozen tokens) on a tiny model: a cache's bookkeeping costs about what it saves, "
              "so a sampler alone is fastest here; caches pay on long responses and long prompts.")
PROMPTS = ["What is 12 plus 30?", "Sort the list: 5 3 9 1", "Hello world!"]
SHOW = 2  # generations shown per task
TASKS = "arithmetic;sort"  # the main part (models/llada-tasks); retrieval is the long part's (models/llada-long)
# the long part (models/llada-long): a 256-token count after 3 worked examples (about 800 prompt tokens, the papers'
# few-shot shape), a one-line progression, and retrieval in a 1,000-token prompt
LONG = {"tasks": "count:span=48,shots=3;progression:days=20;retrieval", "n": 2, "samplers": "threshold:tau=0.9;slowfast",
        "caches": "none;dual;dllm:kp=50,kr=7,rho=0.25"}
LLADA2_MODEL = Path(__file__).resolve().parents[1] / "models" / "llada2-tasks"
LLADA2 = {"n": 4, "samplers": "low_confidence;threshold:tau=0.9;slowfast", "caches": "none;prefix;dllm:kr=2"}


def add_parser(sub) -> None:
    from .cli import add_generation_args

    d = sub.add_parser("demo", help="generations of the shipped model and every sampler x cache policy compared")
    d.add_argument("--model", default=None, help=f"checkpoint dir (default: {DEFAULT_MODEL.name} when shipped, "
                                                 "else tiny random LLaDA and Dream)")
    d.add_argument("--random", action="store_true", help="use tiny random checkpoints even if a model is shipped")
    d.add_argument("--samplers", default=DEFAULT_SAMPLERS, help="';'-separated sampler specs")
    d.add_argument("--caches", default=DEFAULT_CACHES, help="';'-separated cache specs")
    d.add_argument("--tasks", default=TASKS, help="';'-separated task specs (trained model)")
    d.add_argument("--n", type=int, default=QUICK["n"], help="test examples per task (trained model)")
    d.add_argument("--repeat", type=int, default=1, help="timed repetitions per policy (median)")
    d.add_argument("--no-long", action="store_true", help="skip the long-answer part (models/llada-long)")
    d.add_argument("--no-llada2", action="store_true", help="skip the LLaDA2 part (models/llada2-tasks)")
    add_generation_args(d)  # canvas of the random-checkpoint comparison
    d.set_defaults(func=cmd_demo, gen_length=64, block_length=16, steps=64)


def short(text: str, keep: int = 60) -> str:
    """``text`` with its middle elided past ``2 * keep`` characters."""
    return text if len(text) <= 2 * keep else f"{text[:keep]} ... {text[-keep:]}"


def task_demo(a, d: Path, tasks: str, n: int, samplers: str, caches: str, title: str = "") -> None:
    """Generations on test prompts (vanilla loop) and the bench table of a task-suite model."""
    from . import load_model, load_tokenizer
    from .cli import decode, stop_ids, torch_dtype
    from .tasks import parse_tasks
    from .tasks.evaluate import generate_batched

    t0 = time.perf_counter()
    model, tok = load_model(d, a.device, torch_dtype(a.dtype)), load_tokenizer(d)
    print(f"## {title}{type(model).__name__} from {d} (loaded in {time.perf_counter() - t0:.1f}s)")
    wls = task_workloads(tok, parse_tasks(tasks), n, a.seed)
    stop = stop_ids(tok, model)
    for wl in wls:
        out = generate_batched(model, wl.prompts[:SHOW], wl.cfg)
        for ex, ids in zip(wl.examples, out.tokens):
            text = decode(tok, ids, stop)
            mark = "ok" if wl.task.score(text, ex) else "WRONG"
            print(f"> [{wl.name}, {len(ids)}-token canvas] {short(ex.prompt, 40)!r}\n  {short(text)!r}  [{mark}]")
    rows = run_grid(model, tok, wls, samplers.split(";"), caches.split(";"), repeat=a.repeat)
    print(markdown(rows))


def random_demo(a) -> None:
    """Policies compared on fixed prompts with tiny random LLaDA and Dream checkpoints."""
    from . import encode_prompt, load_model, load_tokenizer
    from .cli import generation_config, torch_dtype
    from .testing import build_tiny_checkpoint

    for n in ("llada", "dream"):
        d = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / n, n, n_layers=4, dim=128, ffn=256)
        model, tok = load_model(d, a.device, torch_dtype(a.dtype)), load_tokenizer(d)
        prompts = [encode_prompt(tok, p, chat=bool(tok.chat_template)) for p in PROMPTS]
        print(f"\n## {type(model).__name__} (random weights) from {d}")
        wl = Workload("prompts", prompts, generation_config(a, tok))
        rows = run_grid(model, tok, [wl], a.samplers.split(";"), a.caches.split(";"), batch_size=len(prompts),
                        repeat=a.repeat)
        print(markdown(rows))


def cmd_demo(a) -> int:
    from .cli import generation_config

    generation_config(a)  # validate the canvas options first
    d = Path(a.model) if a.model else DEFAULT_MODEL
    if a.random or (a.model is None and not (d / "config.json").is_file()):
        random_demo(a)
    else:
        task_demo(a, d, a.tasks, a.n, a.samplers, a.caches)
        if a.model is None:
            print(SHORT_NOTE)
        if a.model is None and not a.no_long and (LONG_MODEL / "config.json").is_file():
            print()
            task_demo(a, LONG_MODEL, LONG["tasks"], LONG["n"], LONG["samplers"], LONG["caches"],
                      "long answers (256-token canvas, blocks of 32; the count after 3 worked examples) and retrieval "
                      "in a 1,000-token prompt: ")
        if a.model is None and not a.no_llada2 and (LLADA2_MODEL / "config.json").is_file():
            print()
            task_demo(a, LLADA2_MODEL, TASKS, LLADA2["n"],
                      LLADA2["samplers"], LLADA2["caches"], "block-causal MoE (LLaDA2 layout): ")
    return 0
