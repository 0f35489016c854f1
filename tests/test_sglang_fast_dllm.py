"""Fast-dLLM's ``prefix`` / ``dual`` caches in SGLang (``cache:`` in ``--dllm-algorithm-config``) equal the
embedded engine with the same policy, token for token.

On the CPU stand-in (``tests/sglang_cpu.py``): SGLang's model classes loaded by its model loader,
its real KV pools (the prompt's K/V rewritten in place at every refresh), the algorithms' real ``run``
loops (synchronous and FDFO) and SGLang's block layout (blocks aligned to multiples of ``block_size``
from position 0, full prompt blocks prefilled block-causally, the first denoised block holding the
prompt tail). Several prompts of different lengths (inside one block, whole blocks, straddling blocks)
decode concurrently; each equals ``generate(model, [prompt], GenerationConfig(..., cache=...))``.
"""
import json
import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.dllm.algorithm")

from dllm_core import load_model  # noqa: E402
from dllm_core.engine import GenerationConfig, generate  # noqa: E402
from dllm_core.testing import build_tiny_checkpoint  # noqa: E402
from integrations.sglang.algorithm import DllmCore, FastDllmFactor, FastDllmThreshold, SlowFast  # noqa: E402
from dllm_core.engine.responses import ForwardPlan  # noqa: E402
from integrations.sglang.response import ResponseForward  # noqa: E402
from integrations.sglang.plugin import add_request_info  # noqa: E402
from sglang_cpu import BlockDriver, CpuModelRunner, load_sglang_model  # noqa: E402
from sglang.srt.arg_groups.overrides import resolving_view  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402
from sglang.srt.model_executor.cuda_graph_config import Backend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

L, GEN = 8, 24
PROMPTS = [[20 + i for i in range(5)], [40 + 3 * i for i in range(L)], [60 + i for i in range(13)],
           [90 - 2 * i for i in range(2 * L)]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    load_plugins()
    return {a: build_tiny_checkpoint(tmp_path_factory.mktemp(f"sg_fd_{a}"), a) for a in ("llada", "dream")}


@pytest.fixture(scope="module")
def models(ckpt):
    return {a: (load_sglang_model(d), load_model(d)) for a, d in ckpt.items()}


# (algorithm, YAML, reference sampler, reference steps, cache, FDFO)
CASES = [(FastDllmThreshold, {"tau": 0.7}, "threshold:tau=0.7", GEN, "dual", True),
         (FastDllmThreshold, {"tau": 0.7}, "threshold:tau=0.7", GEN, "prefix", False),
         (DllmCore, {"sampler": "low_confidence", "steps": 12}, "low_confidence", 12, "dual", False),
         (DllmCore, {"sampler": "low_confidence", "steps": 12}, "low_confidence", 12, "prefix", True),
         (SlowFast, {"k": 3, "min_conf": 0.2}, "slowfast:k=3,min_conf=0.2", GEN, "dual", True),
         (SlowFast, {"k": 3, "min_conf": 0.2}, "slowfast:k=3,min_conf=0.2", GEN, "prefix", False),
         (FastDllmFactor, {"f": 1.5}, "factor:f=1.5", GEN, "dual", False),
         (FastDllmFactor, {"f": 1.5}, "factor:f=1.5", GEN, "prefix", True),
         (FastDllmThreshold, {"tau": 0.7}, "threshold:tau=0.7", GEN, "dual:every=2", False)]
IDS = [f"{c[0].__name__}-{c[4]}-{'fdfo' if c[5] else 'sync'}" for c in CASES]


def serve(sg, mask, cls, cfg, cache, fdfo, prompts=PROMPTS, gen=GEN):
    algo = serve.algo = cls(DllmConfig(cls.__name__, {**cfg, "cache": cache}, L, mask, 8, first_done_first_out_mode=fdfo))
    return BlockDriver(algo, CpuModelRunner(sg, max_len=64, max_reqs=len(prompts))).generate(prompts, gen, mask)


def recomputed(r) -> tuple[int, int]:
    """The positions [lo, hi) a step of a row plan recomputes in every layer (prefix / dual)."""
    P, part = r.resp.P, r.plan.cover("response", r.resp.P, r.resp.end)
    return (r.plan.run_from if r.plan.run_from < P else P + part.always[0]), P + part.always[1]


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("cls,cfg,spec,steps,cache,fdfo", CASES, ids=IDS)
def test_matches_embedded_engine(models, arch, cls, cfg, spec, steps, cache, fdfo):
    """Four concurrent prompts (5, 8, 13, 16 tokens; blocks of 8), 3 blocks each: every output equals
    the embedded engine's unbatched run with the same sampler and cache policy."""
    sg, ref = models[arch]
    mask = ref.args.mask_token_id
    out = serve(sg, mask, cls, cfg, cache, fdfo)
    for p, got in zip(PROMPTS, out):
        want = generate(ref, [p], GenerationConfig(gen_length=GEN, block_length=L, steps=steps, sampler=spec,
                                                   cache=cache))
        assert got == want.tokens[0].tolist(), p
    assert all(r.feats is None for r in serve.algo.whole.lc.responses.values())  # every response gave its features back


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_rows_each_step_recomputes(models, arch, cache):
    """Each forward runs the policy's rows of the embedded loop: the whole sequence at a refresh (every
    block's first step), otherwise the block (dual; Dream: from the row left of it, the prompt's last
    row in block 0) or the block and the masked suffix (prefix). The dual cache is live: its output is
    not the uncached one."""
    sg, ref = models[arch]
    mask, shift = ref.args.mask_token_id, int(ref.shift_logits)
    seen, orig = [], ForwardPlan.hidden
    ForwardPlan.hidden = lambda plan, *a: (seen.extend((r.resp.P, r.start, *recomputed(r)) for r in plan.rows
                                                       if r is not None), orig(plan, *a))[1]
    try:
        out = serve(sg, mask, FastDllmThreshold, {"tau": 0.7}, cache, False)
    finally:
        ForwardPlan.hidden = orig
    starts = set()
    for P, s, lo, hi in seen:
        if (s, P) not in starts:  # a block's first step: a refresh
            assert (lo, hi) == (0, P + GEN)
            starts.add((s, P))
        elif lo > 0:
            assert (lo, hi) == (s - shift, s + L if cache == "dual" else P + GEN)
    assert len(seen) > 2 * len(starts) and any(lo > 0 for _, _, lo, _ in seen)
    assert any(lo == P - 1 for P, s, lo, _ in seen if s == P) == (arch == "dream")
    if cache == "dual":
        cfg = GenerationConfig(gen_length=GEN, block_length=L, sampler="threshold:tau=0.7", cache="none")
        assert out != [generate(ref, [p], cfg).tokens[0].tolist() for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("case", [0, 3], ids=[IDS[0], IDS[3]])
def test_work_counters_equal_the_embedded_engine(models, arch, case, caplog):
    """Each request's work, in the embedded engine's ``Counters`` units, equals the unbatched embedded
    run's with the same policy: one forward per step of its canvas, the rows each step recomputed x
    n_layers, and (P + G) x n_layers per step for the uncached baseline. SGLang's prompt-prefill forwards
    and the forwards after a response is decoded run no layer for it and are not counted (the first
    refresh recomputes the prompt), so no term differs. Read by request id (the core's ``ResponseSlots.work``,
    ``finished_work``) once decoded; four concurrent prompts, sync (prefix) and FDFO (dual)."""
    sg, ref = models[arch]
    cls, cfg, spec, steps, cache, fdfo = CASES[case]
    mask = ref.args.mask_token_id
    algo = cls(DllmConfig(cls.__name__, {**cfg, "cache": cache}, L, mask, 8, first_done_first_out_mode=fdfo))
    driver = BlockDriver(algo, CpuModelRunner(sg, max_len=64, max_reqs=len(PROMPTS)))
    with caplog.at_level(logging.DEBUG, logger="dllm_core.engine.responses"):
        driver.generate(PROMPTS, GEN, mask)
    host = algo.whole
    rids = [host.lc.responses[row.slot].rid for row in driver.rows]
    assert sorted(host.core.finished_work) == sorted(rids) and len(set(rids)) == len(PROMPTS)
    assert all(f"request {rid} decoded: " in caplog.text for rid in rids)  # the debug line per response
    for p, rid in zip(PROMPTS, rids):
        c = generate(ref, [p], GenerationConfig(gen_length=GEN, block_length=L, steps=steps, sampler=spec,
                                                cache=cache)).counters
        want = {"forwards": c.forwards, "token_layers": c.token_layers, "full_token_layers": c.full_token_layers}
        assert host.core.work(rid) == host.core.finished_work[rid] == want, p
        assert c.token_layers < c.full_token_layers  # the cache is live


def test_slot_reuse_starts_a_new_canvas(models):
    """One request slot, two requests in turn: the second (a new slot generation) gets a fresh canvas,
    sampler rows and K/V row."""
    sg, ref = models["llada"]
    mask = ref.args.mask_token_id
    runner = CpuModelRunner(sg, max_len=64, max_reqs=1)
    algo = SlowFast(DllmConfig("SlowFast", {"k": 3, "cache": "dual"}, L, mask, 1))
    for p in (PROMPTS[2], PROMPTS[0]):
        out = BlockDriver(algo, runner).generate([p], GEN, mask)
        cfg = GenerationConfig(gen_length=GEN, block_length=L, sampler="slowfast:k=3", cache="dual")
        want = generate(ref, [p], cfg)
        assert out == want.tokens.tolist()


# ---- launch and admission ----------------------------------------------------------------------
def resolved(model, algo: str, yaml_text: str, tmp_path):
    """SGLang's launch-time resolution of the server args (runs the algorithm's ``configure_server_args``)."""
    (tmp_path / "algo.yaml").write_text(yaml_text + "\n")
    sa = ServerArgs(model_path=str(model), dllm_algorithm=algo, dllm_algorithm_config=str(tmp_path / "algo.yaml"),
                    device="cpu")
    sa.resolve_once()
    return sa


def test_launch_turns_off_radix_cache_and_admits_whole_blocks(ckpt, tmp_path, caplog):
    """(Graphs: both keep them, ``test_sglang_plugin``.)"""
    sa = resolved(ckpt["dream"], "FastDllmThreshold", f"block_size: {L}\ncache: 'dual:every=2'", tmp_path)
    view = resolving_view(sa)
    assert view.disable_radix_cache and "radix cache disabled" in caplog.text
    assert view.cuda_graph_config.decode.backend != Backend.DISABLED and "CUDA graphs disabled" not in caplog.text
    cfg = DllmConfig.from_server_args(sa)
    assert cfg.options().policy.every == 2 and type(cfg.options().policy).__name__ == "DualCache"

    def req(n):
        return SimpleNamespace(origin_input_ids=[20, 21], sampling_params=SamplingParams(max_new_tokens=n))

    assert cfg.validate_request(req(3 * L)) is None and cfg.validate_request(req(L + 1)) is None  # 2 whole blocks
    for n in (0, None):  # admission: HTTP 400
        assert cfg.validate_request(req(n)) == "FastDllmThreshold: max_new_tokens must be >= 1, got 0"
    plain = DllmConfig.from_server_args(resolved(ckpt["llada"], "SlowFast", "cache: canvas", tmp_path))
    assert plain.options().policy is None and plain.validate_request(req(L + 1)) is None
    total = DllmConfig.from_server_args(resolved(ckpt["llada"], "DllmCore", f"block_size: {L}\nsteps: 4", tmp_path))
    assert total.validate_request(req(2 * L)) is None  # steps: the total over the response (2 per block)
    assert total.validate_request(req(3 * L)).startswith("DllmCore: steps 4 must be a multiple of the number of "
                                                         f"blocks 3 ({3 * L} positions in blocks of {L})")


BAD = [("FastDllmThreshold", "cache: triple",
        r"FastDllmThreshold\.cache: unknown policy 'triple'; allowed: \['canvas', 'dllm', 'dpad', 'dual', 'elastic', "
        r"'none', 'prefix'\]"),
       ("DllmCore", "cache: 'dllm:kp=0'", r"DllmCore\.cache\.kp must be >= 1, got 0"),
       ("DllmCore", "cache: 'dllm:graphs=false'",
        r"DllmCore\.cache: dllm has no option 'graphs'; allowed: \['first_layer', 'first_layer_prompt', 'kp', "
        r"'kr', 'metric', 'per_block', 'rho', 'seed', 'select', 'unit'\]"),
       ("SlowFast", "cache: 'dual:every=-1'", r"SlowFast\.cache\.every must be >= 0 \(0 = refresh only per block\), "
                                              r"got -1"),
       ("SlowFast", "cache: 'prefix:every=x'", r"SlowFast\.cache prefix\.every: cannot parse 'x' as int"),
       ("FastDllmFactor", "cache: 'prefix:graphs=false'",
        r"FastDllmFactor\.cache: prefix has no option 'graphs'; allowed: \['every'\]"),
       ("FastDllmFactor", "cache: 'canvas:every=2'",
        r"FastDllmFactor\.cache: canvas has no option 'every'; allowed: \['first_layer', 'kr', 'metric', 'rho', "
        r"'seed', 'select'\]"),
       ("FastDllmThreshold", "cache: 2", r"FastDllmThreshold\.cache must be a string, got 2"),
       ("FastDllmThreshold", "cache: dual\ndllm_cache: {kr: 2}",
        r"FastDllmThreshold\.dllm_cache: renamed in 0\.2 to FastDllmThreshold\.cache")]


@pytest.mark.parametrize("algo,text,message", BAD, ids=[t for _, t, _ in BAD])
def test_bad_cache_option_fails_at_launch(ckpt, tmp_path, algo, text, message):
    with pytest.raises(ValueError, match=r"--dllm-algorithm-config .*algo\.yaml: " + message):
        resolved(ckpt["llada"], algo, text, tmp_path)


@pytest.mark.parametrize("fdfo", [False, True], ids=["sync", "fdfo"])
def test_retracted_request_resumes_from_committed_tokens(models, fdfo):
    """A request SGLang retracted and re-admits with a new slot brings its committed output: the
    canvas resumes from it (re-prefilled by SGLang, nothing stepped in those forwards); resumed at a
    block boundary of the canvas, the rest equals the uninterrupted reference."""
    sg, ref = models["dream"]
    mask = ref.args.mask_token_id
    prompts = [PROMPTS[1], PROMPTS[3]]
    cfg = GenerationConfig(gen_length=GEN, block_length=L, sampler="threshold:tau=0.7", cache="dual")
    want = [generate(ref, [p], cfg).tokens[0].tolist() for p in prompts]
    algo = FastDllmThreshold(DllmConfig("FastDllmThreshold", {"tau": 0.7, "cache": "dual"}, L, mask, 2,
                                        first_done_first_out_mode=fdfo))
    out = BlockDriver(algo, CpuModelRunner(sg, max_len=64, max_reqs=2)).generate(
        prompts, GEN, mask, outputs=[want[0][:L], want[1][:2 * L]])
    assert out == want


def test_cache_needs_a_dllm_serve_model(tmp_path):
    (tmp_path / "c.yaml").write_text("cache: prefix\n")
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                                  "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                                                  "intermediate_size": 128, "vocab_size": 320}))
    with pytest.raises(ValueError, match=r"FastDllmFactor\.cache: prefix needs one of the dllm-serve models "
                                         r"\['LLaDAModelLM', 'DreamModel'\], got Qwen2ForCausalLM"):
        FastDllmFactor.configure_server_args(ServerArgs(model_path=str(qwen), dllm_algorithm="FastDllmFactor",
                                                        dllm_algorithm_config=str(tmp_path / "c.yaml")))


def test_request_info_hook():
    """The ForwardBatch hook hands the algorithms the batch's requests (dLLM blocks only); a batch it did not see is
    refused."""
    from integrations.sglang.response import BATCH

    reqs = [SimpleNamespace(origin_input_ids=[1, 2]), SimpleNamespace(origin_input_ids=[3])]
    batch = SimpleNamespace(dllm_config=object(), reqs=reqs)
    runner = SimpleNamespace(model=SimpleNamespace(response_forward=ResponseForward(None)))

    def fb(mode):
        return SimpleNamespace(forward_mode=mode, req_pool_indices=torch.tensor([5, 2]))

    BATCH.pending = None
    add_request_info(fb(ForwardMode.EXTEND), None, batch, runner)
    assert BATCH.pending is None
    add_request_info(fb(ForwardMode.DLLM_EXTEND), None, batch, runner)
    assert BATCH.requests([5, 2]) == reqs
    with pytest.raises(RuntimeError, match="ForwardBatch.init_new hook must be live"):
        BATCH.requests([2, 5])
