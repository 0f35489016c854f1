"""vLLM's own quantization on a shipped model: online FP8 (one scale per output channel) on every linear layer,
quantized by vLLM while loading, decodes held-out examples as well as the unquantized embedded engine (within one
answer per task). ``tests/bench_quantized.py`` has the 40-example table (``docs/vllm.md``)."""
import pytest

pytest.importorskip("vllm")
from bench_quantized import MODELS, TASKS, VLLM_FP8, correct, vllm_answers, workload  # noqa: E402

N = 8  # held-out examples per task


def embedded(model: str, work: list[tuple]) -> list[list[int]]:
    """The embedded engine's vanilla loop over the same prompts (the model's own dtype)."""
    from dllm_core import load_model
    from dllm_core.tasks.evaluate import generate_batched, task_config

    m, out = load_model(MODELS / model), []
    for name in TASKS:
        rows = [w for w in work if w[1].name == name]
        out += [list(t) for t in generate_batched(m, [p for p, _, _ in rows], task_config(rows[0][1]),
                                                  batch_size=len(rows)).tokens]
    return out


@pytest.mark.skipif(not (MODELS / "llada-tasks" / "config.json").is_file(), reason="models/llada-tasks not shipped")
def test_fp8_weights_keep_the_answers():
    work = workload("llada-tasks", N)
    got = vllm_answers("llada-tasks", work, VLLM_FP8)
    assert got["weights"].get("torch.float8_e4m3fn", 0) > 2_000_000, got["weights"]  # every projection's weight
    quantized, plain = correct("llada-tasks", work, got["answers"]), correct("llada-tasks", work, embedded(
        "llada-tasks", work))
    assert all(quantized[t] >= plain[t] - 1 for t in TASKS) and plain["arithmetic"] >= N - 1, (quantized, plain)
