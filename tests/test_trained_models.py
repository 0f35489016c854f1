"""The shipped task models: real HF layouts, loadable by the project's loader / transformers, and
accurate on the test split (vanilla diffusion loop / greedy AR) - the acceptance bar is 90%."""
import json
from pathlib import Path

import pytest
import torch

from dllm_core.tasks import LONG_TASKS, Arithmetic, Sort

ROOT = Path(__file__).resolve().parents[1] / "models"
LLADA, DREAM, QWEN = ROOT / "llada-tasks", ROOT / "dream-tasks", ROOT / "qwen3-tasks"
LLADA2 = ROOT / "llada2-tasks"
LONG = ROOT / "llada-long"
N = 40  # test examples per task (the full 200-example numbers are in models/README.md)


def need(d):
    return pytest.mark.skipif(not (d / "config.json").is_file(), reason=f"{d} not shipped")


def test_shipped_size_budget():
    files = [f for f in ROOT.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 40 * 2**20  # the long-answers issue's bound for all models
    assert not [f for f in files if f.name == "train_state.pt"]  # no optimizer state shipped


@need(LLADA)
def test_llada_layout_and_accuracy(both_cores):
    from dllm_core import load_model
    from dllm_core.tasks.evaluate import evaluate

    cfg = json.loads((LLADA / "config.json").read_text())
    assert cfg["architectures"] == ["LLaDAModelLM"] and cfg["model_type"] == "llada"
    assert isinstance(load_model(LLADA), torch.nn.Module)
    runs = evaluate(LLADA, [Arithmetic(), Sort()], n=N, batch_size=N)
    for name, r in runs.items():
        assert r.accuracy >= 0.9, (name, r.accuracy, list(zip(r.texts, [e.answer for e in r.examples]))[:5])
        assert r.nfe == [r.task.gen_length] * N  # the vanilla loop: one token per step


@need(DREAM)
def test_dream_layout_and_accuracy(both_cores):
    """The Dream-architecture task model (shifted logits) with the embedded engine's vanilla loop."""
    from dllm_core import load_model
    from dllm_core.models import DreamModel
    from dllm_core.tasks.evaluate import evaluate

    cfg = json.loads((DREAM / "config.json").read_text())
    assert cfg["architectures"] == ["DreamModel"] and cfg["model_type"] == "Dream"
    assert cfg["torch_dtype"] == "bfloat16" and cfg["mask_token_id"] == 5
    model = load_model(DREAM)
    assert isinstance(model, DreamModel) and model.shift_logits
    assert sum(f.stat().st_size for f in DREAM.iterdir()) < 10 * 2**20
    runs = evaluate(DREAM, [Arithmetic(), Sort()], n=N, batch_size=N)
    for name, r in runs.items():
        assert r.accuracy >= 0.9, (name, r.accuracy, list(zip(r.texts, [e.answer for e in r.examples]))[:5])
        assert r.nfe == [r.task.gen_length] * N  # the vanilla loop: one token per step


@need(LLADA2)
def test_llada2_layout_and_accuracy(both_cores):
    """The LLaDA2-architecture task model (block-causal MoE, the published layout) with the vanilla loop:
    blocks on the position grid, so a prompt whose length is not a multiple of the block decodes one
    block more (steps / blocks fixed steps each)."""
    from dllm_core import load_model
    from dllm_core.models import LLaDA2MoeModelLM
    from dllm_core.tasks.evaluate import evaluate

    cfg = json.loads((LLADA2 / "config.json").read_text())
    assert cfg["architectures"] == ["LLaDA2MoeModelLM"] and cfg["model_type"] == "llada2_moe"
    model = load_model(LLADA2)
    assert isinstance(model, LLaDA2MoeModelLM) and model.block_causal == Arithmetic.block_length
    assert sum(f.stat().st_size for f in LLADA2.iterdir()) < 10 * 2**20
    runs = evaluate(LLADA2, [Arithmetic(), Sort()], n=N, batch_size=N)
    for name, r in runs.items():
        assert r.accuracy >= 0.9, (name, r.accuracy, list(zip(r.texts, [e.answer for e in r.examples]))[:5])
        assert set(r.nfe) <= {r.task.gen_length, r.task.gen_length + r.task.gen_length // 3}


@need(LONG)
def test_llada_long_solves_the_256_token_answers(both_cores):
    """The long-answer model (issue "Long answers") with the vanilla loop at the papers' setting: a 256-token
    canvas in blocks of 32, one token per step; a count of 48 numbers and a 20-day worked progression, on the first
    6 and 2 held-out examples (the suite's time budget: 35 s and 12 s on two cores; the 32-example figures and the
    512-token tasks are in models/README.md and ``dllm bench --long``)."""
    from dllm_core.tasks import parse_tasks
    from dllm_core.tasks.evaluate import evaluate

    count, progression = parse_tasks(LONG_TASKS[256])
    runs = {**evaluate(LONG, [count], n=6, batch_size=6),  # 6/6 (9/10 of 10); the bench's 32: 30/32 (models/README.md)
            **evaluate(LONG, [progression], n=2, batch_size=2)}  # 32/32 in the bench
    for name, r in runs.items():
        assert r.task.gen_length == 256 and r.task.block_length == 32
        assert r.accuracy >= 0.9, (name, r.accuracy, [t[-40:] for t, ok in zip(r.texts, r.correct) if not ok])
        assert r.nfe == [256] * len(r.examples)


@need(LONG)
def test_llada_long_retrieves_from_a_1000_token_prompt(both_cores):
    """Retrieval (issue "Long answers", item 2): the 4-digit value of one of 100 keys, looked up in a prompt of
    more than 1,000 tokens, by the shipped long-answer model with the vanilla loop (16 held-out examples: 16/16; the
    larger sample's figure: models/README.md)."""
    from dllm_core.tasks import Retrieval
    from dllm_core.tasks.evaluate import evaluate, prompts_of
    from dllm_core.tokenizer import load_tokenizer

    run = evaluate(LONG, [Retrieval()], n=16, batch_size=16)["retrieval"]
    assert min(len(p) for p in prompts_of(load_tokenizer(LONG), run.examples)) > 1000
    assert run.accuracy >= 0.9, (run.accuracy, [(t, e.answer) for t, e, ok in zip(run.texts, run.examples, run.correct)
                                                if not ok])


@need(QWEN)
def test_qwen3_layout_and_accuracy():
    from dllm_core.tasks.evaluate import evaluate

    cfg = json.loads((QWEN / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    gen = json.loads((QWEN / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == sorted([cfg["eos_token_id"], cfg["pad_token_id"]])
    assert (QWEN / "model.safetensors").is_file() and (QWEN / "tokenizer.json").is_file()
    runs = evaluate(QWEN, [Arithmetic(), Sort()], n=N, batch_size=N)
    for name, r in runs.items():
        assert r.accuracy >= 0.9, (name, r.accuracy, list(zip(r.texts, [e.answer for e in r.examples]))[:5])


@pytest.mark.slow
@need(QWEN)
def test_qwen3_serves_in_vllm_like_transformers():
    """vLLM loads the shipped Qwen3 checkpoint as a plain Qwen3ForCausalLM and its greedy tokens
    equal transformers' on test prompts (CPU harness of tests/vllm_harness)."""
    pytest.importorskip("vllm")
    from vllm_harness.jobs import finish_engine, start_engine

    from dllm_core.tasks.evaluate import load_ar, prompts_of, run_ar
    from dllm_core.tokenizer import load_tokenizer

    tok = load_tokenizer(QWEN)
    exs = Arithmetic().examples("test", 4) + Sort().examples("test", 4)
    prompts = prompts_of(tok, exs)
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 8, "seed": 0}
    job = {"model": str(QWEN), "engine": engine, "batches": [[
        {"prompt_token_ids": p, "params": {"max_tokens": 48, "temperature": 0.0}} for p in prompts]]}
    got = finish_engine(start_engine(job))["batches"][0]
    model = load_ar(QWEN)
    want = run_ar(model, tok, Arithmetic(), exs, batch_size=1, max_new_tokens=48).tokens
    assert [g[:len(w)] for g, w in zip(got, want)] == want
    assert all(g[len(w)] in (4, 1) for g, w in zip(got, want))  # stopped at EOT / EOS


TS_HEADS = ROOT / "tokenswift-qwen3-tasks"


@need(TS_HEADS)
def test_shipped_tokenswift_heads_are_lossless_and_accepted():
    """The shipped heads fit the shipped target; with the benchmark's settings (docs/benchmarks.md) a
    free-running generation is token-identical to AR and emits several tokens per verification."""
    from dllm_core.drafters.target import load_target
    from dllm_core.drafters.tokenswift import TokenSwiftConfig, autoregressive_generate, load_heads, \
        tokenswift_generate
    from dllm_core.tasks import make_task
    from dllm_core.tokenizer import encode_prompt, load_tokenizer
    from dllm_core.train.dflash import stop_ids

    target, tok = load_target(QWEN), load_tokenizer(QWEN)
    prompt = encode_prompt(tok, make_task("count:span=2000").examples("test", 1)[0].prompt, True)
    cfg = TokenSwiftConfig(max_new_tokens=400, banned_token_ids=tuple(stop_ids(tok, target.config)), max_nodes=10,
                           head_paths=1, head_topk=1, ngram_topk=1, ngram_n=8)
    ts = tokenswift_generate(target, load_heads(TS_HEADS), prompt, cfg)
    assert ts.tokens == autoregressive_generate(target, prompt, cfg).tokens
    assert ts.tokens_per_step > 2.0, ts.tokens_per_step
