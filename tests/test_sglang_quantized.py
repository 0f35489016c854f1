"""SGLang's own quantization on a shipped model: BitsAndBytes NF4, quantized by SGLang's loader while loading our
model class (its projections' quant states filed on the fused parameters), decodes held-out examples as well as the
unquantized embedded engine (within one answer per task), and dLLM-Cache serves on the quantized weights.
``tests/bench_quantized.py`` has the 40-example table (``integrations/sglang/README.md``)."""
import pytest

pytest.importorskip("sglang")
pytest.importorskip("bitsandbytes")
from bench_quantized import MODELS, TASKS, correct, sglang_answers, workload  # noqa: E402
from test_vllm_quantized import embedded  # noqa: E402

N = 4  # held-out examples per task (a launch with BitsAndBytes costs about 28 s here, most of it imports)
MODEL = "dream-tasks"


@pytest.mark.skipif(not (MODELS / MODEL / "config.json").is_file(), reason=f"models/{MODEL} not shipped")
def test_nf4_weights_keep_the_answers(tmp_path):
    work = workload(MODEL, N)
    dllm = {"custom_params": {"dllm": {"cache": "dllm:kp=4,kr=2,rho=0.25"}}}  # V-verify through the packed NF4 QKV
    got = sglang_answers(MODEL, work, True, tmp_path, also=lambda srv: [srv.generate(
        p, t.gen_length, **dllm)["output_ids"] for p, t, _ in work[:1] + work[N:N + 1]])
    assert "Loading weights with BitsAndBytes quantization" in got["log"]
    assert correct(MODEL, work[:1] + work[N:N + 1], got["also"]) == correct(MODEL, work[:1] + work[N:N + 1],
                                                                           [got["answers"][0], got["answers"][N]])
    quantized, plain = correct(MODEL, work, got["answers"]), correct(MODEL, work, embedded(MODEL, work))
    assert all(quantized[t] >= plain[t] - 1 for t in TASKS) and plain["arithmetic"] >= N - 1, (quantized, plain)
