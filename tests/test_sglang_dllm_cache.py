"""dLLM-Cache (``cache: dllm`` in ``--dllm-algorithm-config``) in SGLang equals the embedded engine with the
same policy, token for token.

On the CPU stand-in (``tests/sglang_cpu.py``), several prompts of different lengths decode
concurrently through SGLang's block scheduler (``response.py``: the per-request canvas, SGLang's block a
window onto it); every step runs each request's whole sequence, per layer recomputing what
``DLLMCache.recomputes`` says at the request's own step counter. Each output equals the UNBATCHED
``generate(model, [prompt], GenerationConfig(..., cache="dllm:..."))`` (the embedded engine shares one
step counter across a batch's rows). The same for ``elastic`` (the executor's drift probe after each layer) and
``dpad`` (each request's forward over the positions its plan keeps: DPad's suffix dropout).
"""
import pytest
import torch

pytest.importorskip("sglang.srt.dllm.algorithm")

from dllm_core import load_model  # noqa: E402
from dllm_core.engine import GenerationConfig, generate  # noqa: E402
from dllm_core.engine.responses import ResponseLifecycle  # noqa: E402
from dllm_core.testing import build_tiny_checkpoint  # noqa: E402
from integrations.sglang.algorithm import DllmCore, FastDllmThreshold, SlowFast  # noqa: E402
from sglang_cpu import BlockDriver, CpuModelRunner, load_sglang_model  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

L, GEN = 8, 24
PROMPTS = [[20 + i for i in range(5)], [40 + 3 * i for i in range(L)], [60 + i for i in range(13)]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    load_plugins()
    out = {}
    for a in ("llada", "dream"):
        d = build_tiny_checkpoint(tmp_path_factory.mktemp(f"sg_dc_{a}"), a)
        out[a] = (load_sglang_model(d), load_model(d))
    return out


def serve(sg, mask, cls, cfg, cache, fdfo):
    algo = cls(DllmConfig(cls.__name__, {**cfg, "cache": cache}, L, mask, 8, first_done_first_out_mode=fdfo))
    return BlockDriver(algo, CpuModelRunner(sg, max_len=64, max_reqs=len(PROMPTS))).generate(PROMPTS, GEN, mask)


def reference(ref, spec, steps, cache):
    cfg = GenerationConfig(gen_length=GEN, block_length=L, steps=steps, sampler=spec, cache=cache)
    return [generate(ref, [p], cfg).tokens[0].tolist() for p in PROMPTS]


THRESHOLD = (FastDllmThreshold, {"tau": 0.7}, "threshold:tau=0.7", GEN)
ELASTIC = "elastic:gamma=0.997,window=4,probe=1"  # a tiny model drifts little: some tests fail at 0.997
LOWCONF = (DllmCore, {"sampler": "low_confidence", "steps": 12}, "low_confidence", 12)
# (algorithm, YAML, reference sampler, reference steps, cache, FDFO)
CASES = [(*THRESHOLD, "dllm:kp=3,kr=2,rho=0.5", True),
         (*LOWCONF, "dllm:kp=3,kr=2,rho=0.5", False),
         (*THRESHOLD, "dllm:kp=3,kr=2,rho=0.5,first_layer=false,select=key", False),
         (*LOWCONF, "dllm:kp=2,kr=3,rho=0.25,per_block=true", True),
         (*THRESHOLD, "dllm:kp=6,kr=3,rho=0.5,unit=tokens,first_layer_prompt=false", True),
         (*THRESHOLD, ELASTIC, True),  # Elastic-Cache-style: query rows, every position from a failing drift test
         (*LOWCONF, ELASTIC, False),
         (*THRESHOLD, "dpad:window=8,decay=none,tail=2", True),  # DPad: suffix positions out of the forward
         (*LOWCONF, "dpad:cache=prefix,window=12,seed=3", False),  # Gaussian: keeps 3 of 12, then 4 of 8
         (*THRESHOLD, "dpad:cache=none,window=4,decay=none", False)]


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("cls,cfg,spec,steps,cache,fdfo", CASES, ids=[f"{c[0].__name__}-{c[4]}" for c in CASES])
def test_matches_embedded_engine(models, arch, cls, cfg, spec, steps, cache, fdfo):
    sg, ref = models[arch]
    mask = ref.args.mask_token_id
    assert serve(sg, mask, cls, cfg, cache, fdfo) == reference(ref, spec, steps, cache)


@pytest.mark.parametrize("case", [3, 6, 7, 9])
@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_work_counters_equal_the_embedded_engine(models, arch, case):
    """Each request's work equals the unbatched embedded run's (``Counters``): one forward per step, the
    rows the executor ran through the full layer summed over the layers (its ``tally``: prompt / response
    parts as ``recomputes`` says, the V-verify picks), (P + G) x n_layers per step as the uncached
    baseline. Prompt prefills run no layer and are not counted: no term differs."""
    sg, ref = models[arch]
    cls, cfg, spec, steps, cache, fdfo = CASES[case]
    mask = ref.args.mask_token_id
    algo = cls(DllmConfig(cls.__name__, {**cfg, "cache": cache}, L, mask, 8, first_done_first_out_mode=fdfo))
    driver = BlockDriver(algo, CpuModelRunner(sg, max_len=64, max_reqs=len(PROMPTS)))
    driver.generate(PROMPTS, GEN, mask)
    for p, row in zip(PROMPTS, driver.rows):
        c = generate(ref, [p], GenerationConfig(gen_length=GEN, block_length=L, steps=steps, sampler=spec,
                                                cache=cache)).counters
        rid = algo.whole.lc.responses[row.slot].rid
        assert algo.whole.core.work(rid) == {"forwards": c.forwards, "token_layers": c.token_layers,
                                       "full_token_layers": c.full_token_layers}, p
        assert c.token_layers < c.full_token_layers


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_exact_mode_is_uncached(models, arch):
    """``kp=1,kr=1`` recomputes every layer at every step: the uncached output; a live cache differs."""
    sg, ref = models[arch]
    mask = ref.args.mask_token_id
    cfg, spec = {"k": 3, "min_conf": 0.2}, "slowfast:k=3,min_conf=0.2"
    want = reference(ref, spec, GEN, "none")
    assert serve(sg, mask, SlowFast, cfg, "dllm:kp=1,kr=1", False) == want
    assert serve(sg, mask, SlowFast, cfg, "dllm:kp=3,kr=2,rho=0.5", True) != want
    assert serve(sg, mask, SlowFast, cfg, "elastic:gamma=1", True) == want
    assert serve(sg, mask, SlowFast, cfg, ELASTIC, False) != want
    assert serve(sg, mask, SlowFast, cfg, "dpad:cache=none,window=24,decay=none", True) == want
    assert serve(sg, mask, SlowFast, cfg, "dpad:cache=none,window=4,decay=none", False) != want


def test_random_select_and_prompt_kv_in_pool(models):
    """``select=random`` draws from each request's own generator (seeded like the embedded state), so it
    matches too; every decoded request gives its features back, and SGLang's KV pool holds each prompt's
    K/V as last recomputed (the prompt features of every layer)."""
    sg, ref = models["llada"]
    mask, cache = ref.args.mask_token_id, "dllm:kp=3,kr=2,rho=0.5,select=random,seed=7"
    runner = CpuModelRunner(sg, max_len=64, max_reqs=len(PROMPTS))
    algo = FastDllmThreshold(DllmConfig("FastDllmThreshold", {"tau": 0.7, "cache": cache}, L, mask, 8))
    seen, release = [], ResponseLifecycle.release
    ResponseLifecycle.release = lambda lc, slot: (
        (r := lc.responses.get(slot)) is not None and r.feats is not None and seen.append(
            (r.slot, r.P, *(r.feats.stores["prompt"].bufs[j][:, 0].clone() for j in (0, 1)))), release(lc, slot))[1]
    try:
        out = BlockDriver(algo, runner).generate(PROMPTS, GEN, mask)
    finally:
        ResponseLifecycle.release = release
    assert out == reference(ref, "threshold:tau=0.7", GEN, cache)
    assert sorted(P for _, P, _, _ in seen) == sorted(map(len, PROMPTS))
    assert all(r.feats is None for r in algo.whole.lc.responses.values())
    pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    for slot, P, k, v in seen:
        loc = r2t[slot, :P].long()
        for i in range(ref.args.n_layers):
            assert torch.equal(pool.get_key_buffer(i)[loc].flatten(1), k[i])
            assert torch.equal(pool.get_value_buffer(i)[loc].flatten(1), v[i])


def test_launch_keeps_graphs_and_turns_off_radix_cache(tmp_path, caplog):
    from types import SimpleNamespace

    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    model = build_tiny_checkpoint(tmp_path / "m", "llada")
    (tmp_path / "algo.yaml").write_text(f"block_size: {L}\ncache: 'dllm:kp=4,kr=2,rho=0.25'\n")
    sa = ServerArgs(model_path=str(model), dllm_algorithm="DllmCore", device="cpu",
                    dllm_algorithm_config=str(tmp_path / "algo.yaml"))
    sa.resolve_once()
    view = resolving_view(sa)
    assert view.disable_radix_cache and "cache dllm rewrites each request's prefix K/V in place" in caplog.text
    assert view.cuda_graph_config.decode.backend != Backend.DISABLED  # cached forwards: eager, one by one
    cfg = DllmConfig.from_server_args(sa)
    assert (cfg.options().policy.kp, cfg.options().policy.kr, cfg.options().policy.rho) == (4, 2, 0.25)
    req = SimpleNamespace(origin_input_ids=[20, 21], sampling_params=SamplingParams(max_new_tokens=0))
    assert cfg.validate_request(req) == "DllmCore: max_new_tokens must be >= 1, got 0"
