"""SGLang's real server runtime serving LLaDA2 (SGLang's own ``LLaDA2MoeModelLM``, its config read through
our plugin, no remote code) on this CPU through ``tests/sglang_harness``: our ``DllmCore`` with LLaDA2.1
token editing answers concurrent requests of different prompt lengths with the embedded engine's tokens (SGLang's
own ``JointThreshold`` decodes the same, in-process: ``tests/test_sglang_llada2.py``) and reports the embedded
engine's logprobs; with SGLang's radix cache on (block-causal prompts are causal across blocks) requests after a
shared prefix prefill their own suffix only."""
import concurrent.futures as cf

import pytest
import torch
import yaml

pytest.importorskip("sglang.srt.dllm.algorithm")

from dllm_core import load_model  # noqa: E402
from dllm_core.engine import GenerationConfig, generate  # noqa: E402
from dllm_core.testing import build_tiny_checkpoint  # noqa: E402
from sglang_harness.server import SGLangServer  # noqa: E402

GEN, EOS, MASK = 16, 1, 5
PROMPTS = [[0, 7, 9, 11, 13], list(range(20, 31)), list(range(40, 57)), list(range(60, 68))]
_g = torch.Generator().manual_seed(0)
PREFIX = torch.randint(10, 100, (600,), generator=_g).tolist()  # a shared prompt prefix (75 grid blocks)
SHARED = [PREFIX + torch.randint(10, 100, (3 + i,), generator=_g).tolist() for i in range(8)]
SERVED = {  # --dllm-algorithm, its YAML (block_size: the checkpoint's), the embedded sampler
    "DllmCore-editing": ("DllmCore", {"sampler": "threshold:tau=0.5,edit=0.5,post_edit=4"},
                         "threshold:tau=0.5,edit=0.5,post_edit=4"),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("srv_llada2"), "llada2")


@pytest.mark.parametrize("name", list(SERVED))
def test_llada2_served_equals_the_embedded_engine(checkpoint, tmp_path, monkeypatch, name):
    algo, cfg, sampler = SERVED[name]
    (tmp_path / "algo.yaml").write_text(yaml.safe_dump(cfg))
    model = load_model(checkpoint)
    want = generate(model, PROMPTS, GenerationConfig(gen_length=GEN, block_length=8, steps=GEN, sampler=sampler))
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")  # --tp-size 2: one NUMA node here, a core per rank
    with SGLangServer(checkpoint, "--dtype", "float32", "--dllm-algorithm", algo, "--dllm-algorithm-config",
                      str(tmp_path / "algo.yaml"), "--tp-size", "2", log=tmp_path / "server.log") as srv:
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = [o["output_ids"] for o in pool.map(lambda p: srv.generate(p, GEN), PROMPTS)]
        # logprobs on the block canvas: each output token's and its step's top 2
        lp = srv.post("/generate", {"input_ids": PROMPTS[1], "sampling_params": {
            "max_new_tokens": GEN, "temperature": 0.0}, "return_logprob": True, "top_logprobs_num": 2})
        # the radix cache: 8 requests after a 600-token prefix, the first alone, then the rest at once
        shared = [o["meta_info"] | {"ids": o["output_ids"]} for o in [srv.generate(SHARED[0], GEN)] + list(
            cf.ThreadPoolExecutor(7).map(lambda p: srv.generate(p, GEN), SHARED[1:]))]
    for g, ref in zip(got, want.tokens.tolist()):
        stop = ref.index(EOS) + 1 if EOS in ref else GEN  # SGLang stops at EOS
        assert g == ref[:stop], (name, g, ref)
    assert not torch.equal(want.tokens, generate(model, PROMPTS, GenerationConfig(
        gen_length=GEN, block_length=8, steps=GEN, sampler="threshold:tau=0.5")).tokens)  # the editing shows
    # later requests prefill their own suffix only; the tokens are caching off's
    assert [m["cached_tokens"] for m in shared] == [0] + [600] * 7, [m["cached_tokens"] for m in shared]
    refs = generate(model, SHARED, GenerationConfig(gen_length=GEN, block_length=8, steps=GEN, sampler=sampler))
    for m, p, ref in zip(shared, SHARED, refs.tokens.tolist()):
        assert m["prompt_tokens"] == len(p) and m["ids"] == ref[:ref.index(EOS) + 1 if EOS in ref else GEN]
    status, body = lp
    assert status == 200, body
    one = generate(model, PROMPTS[1:2], GenerationConfig(gen_length=GEN, block_length=8, steps=GEN, sampler=sampler,
                                                         logprobs=2)).logprobs
    toks, top = body["meta_info"]["output_token_logprobs"], body["meta_info"]["output_top_logprobs"]
    assert body["output_ids"] == got[1] and len(toks) == len(top) == len(got[1]) > 8  # two blocks or more
    for j, ((v, t, *_), alts) in enumerate(zip(toks, top)):
        assert t == got[1][j] and v == pytest.approx(one.token[0, j].item(), abs=1e-4), j
        assert [a[1] for a in alts] == one.top_ids[0, j].tolist(), j
        assert [a[0] for a in alts] == pytest.approx(one.top[0, j].tolist(), abs=1e-4), j
