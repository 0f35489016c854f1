"""LLaDA / Dream as SGLang dLLM models on CPU: built and loaded by SGLang's model loader (the
plugin's registry hook, real HF key names), run through RadixAttention + SGLang's torch-native
attention backend over a real paged KV pool, and decoded by the algorithms' real ``run`` loops.

The oracle is dllm_core: the plain bidirectional forward (logits), and ``generate`` with the
``canvas`` cache policy - the block-canvas semantics of a paged host, optionally with
response-side dLLM-Cache - which SGLang reproduces exactly when the prompt fills one block.
"""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.dllm.algorithm")

from dllm_core import load_model  # noqa: E402
from dllm_core.engine import GenerationConfig, generate  # noqa: E402
from dllm_core.testing import build_tiny_checkpoint  # noqa: E402
from integrations.sglang.algorithm import FastDllmFactor, FastDllmThreshold, SlowFast  # noqa: E402
from sglang_cpu import BlockDriver, CpuModelRunner, Row, load_sglang_model  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

L = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    load_plugins()  # registers the model classes (hook on get_model_architecture) and configs
    return {a: build_tiny_checkpoint(tmp_path_factory.mktemp(f"sg_{a}"), a) for a in ("llada", "dream")}


@pytest.fixture(scope="module")
def models(ckpt):
    return {a: (load_sglang_model(d), load_model(d)) for a, d in ckpt.items()}


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_weights_load_through_sglang_loader(models, arch):
    """Every SGLang parameter (fused QKV / gate-up included) holds the checkpoint's tensor."""
    sg, ref = models[arch]
    assert type(sg).__name__ == type(ref).__name__
    mine = dict(sg.named_parameters())
    for name, p in ref.named_parameters():
        target, shard = sg.sglang_name(name)
        got = mine[target]
        if shard is not None:
            a = sg.layers[0]
            sizes = {"q": (0, a.q_size), "k": (a.q_size, a.kv_size), "v": (a.q_size + a.kv_size, a.kv_size),
                     0: (0, ref.args.ffn_dim), 1: (ref.args.ffn_dim, ref.args.ffn_dim)}[shard]
            got = got.narrow(0, *sizes)
        assert torch.equal(got, p), name


def test_unknown_checkpoint_key_is_an_error(models):
    sg, _ = models["llada"]
    with pytest.raises(ValueError, match="unexpected checkpoint keys.*blocks.0.attn_q"):
        sg.load_weights([("model.transformer.blocks.0.attn_q.weight", torch.zeros(1))])


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_bidirectional_forward_matches_dllm_core(models, arch):
    """One block holding whole sequences (no prefix): SGLang's logits = dllm_core's forward
    (Dream's rows shifted by one: row i predicts position i + 1)."""
    sg, ref = models[arch]
    runner = CpuModelRunner(sg, max_len=64, max_reqs=2)
    ids = torch.randint(10, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    drv = BlockDriver(None, runner, block_size=16)
    rows = [Row(r.tolist(), 0, runner.alloc_slot()) for r in ids]
    out = runner.forward(drv.batch(rows, ids.tolist())).logits_output.full_logits.view(2, 16, -1)
    want = ref(ids, torch.arange(16).expand(2, 16), None)
    if ref.shift_logits:
        out, want = out[:, 1:], want[:, :-1]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


CASES = [(FastDllmThreshold, {"tau": 0.5}, "threshold:tau=0.5", "canvas", False),
         (SlowFast, {}, "slowfast", "canvas", True),
         (FastDllmThreshold, {"tau": 0.7, "cache": "canvas:kr=3,rho=0.25"}, "threshold:tau=0.7",
          "canvas:kr=3,rho=0.25", True),
         (FastDllmFactor, {"cache": "canvas:kr=2,rho=0.5,select=key,first_layer=false"}, "factor",
          "canvas:kr=2,rho=0.5,select=key,first_layer=false", False)]


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("cls,cfg,spec,cache,fdfo", CASES, ids=[f"{c[0].__name__}-{c[3]}-{'fdfo' if c[4] else 'sync'}"
                                                             for c in CASES])
def test_generation_matches_canvas_reference(models, arch, cls, cfg, spec, cache, fdfo):
    """Two requests, prompt = one block, 2 blocks generated: token for token the reference."""
    sg, ref = models[arch]
    mask = ref.args.mask_token_id
    prompts = [[20 + i for i in range(L)], [40 + 3 * i for i in range(L)]]
    algo = cls(DllmConfig(cls.__name__, cfg, L, mask, 4, first_done_first_out_mode=fdfo))
    driver = BlockDriver(algo, CpuModelRunner(sg, max_len=64, max_reqs=2))
    out = driver.generate(prompts, 2 * L, mask)
    want = generate(ref, prompts, GenerationConfig(gen_length=2 * L, block_length=L, sampler=spec, cache=cache))
    assert out == want.tokens.tolist()
    # each request's work: a forward per step it took (the embedded row's NFE), its rows through the full layers
    # (every block row when exact; fewer under dLLM-Cache), the whole sequence per step for the uncached loop
    work = algo.host.core.all_work()
    n_layers = ref.args.n_layers
    for row, nfe in zip(driver.rows, want.nfe):
        [w] = [w for rid, w in work.items() if rid.startswith(f"slot{row.slot}.")]
        assert w["forwards"] == nfe and w["full_token_layers"] == nfe * 3 * L * n_layers
        block_rows = nfe * L * n_layers
        assert w["token_layers"] == block_rows if cache == "canvas" else w["token_layers"] < block_rows, w
    if cache != "canvas":  # the cache is live: the exact semantics decode differently here
        exact = generate(ref, prompts, GenerationConfig(gen_length=2 * L, block_length=L, sampler=spec, cache="canvas"))
        assert exact.tokens.tolist() != out
        # every block was persisted: no request holds features
        assert all(not st.stores for st in algo.host.core.stores if st is not None) and algo.host.core.stores.count(None) < 4


def test_dream_prefix_row_once_per_block_and_slot_reuse(models):
    """Dream's row for block position 0 is computed once per block (then reused across steps) and
    never leaks into the next request of a reused slot (generation-tagged)."""
    sg, ref = models["dream"]
    mask = ref.args.mask_token_id
    runner = CpuModelRunner(sg, max_len=64, max_reqs=1)  # one slot: the second request reuses it
    algo = FastDllmThreshold(DllmConfig("FastDllmThreshold", {"tau": 0.9}, L, mask, 1))
    calls = []
    orig = sg.prefix_rows._recompute
    sg.prefix_rows._recompute = lambda ids, pos, slots: (calls.append(list(pos)), orig(ids, pos, slots))
    try:
        for prompt in ([20 + i for i in range(L)], [90 - 2 * i for i in range(L)]):
            out = BlockDriver(algo, runner).generate([prompt], 2 * L, mask)
            cfg = GenerationConfig(gen_length=2 * L, block_length=L, sampler="threshold:tau=0.9", cache="canvas")
            want = generate(ref, [prompt], cfg)
            assert out == want.tokens.tolist()
    finally:
        sg.prefix_rows._recompute = orig
    assert calls == [[L - 1], [2 * L - 1]] * 2  # per request: blocks at L and 2L; steps reuse it


def test_dreams_forward_holds_no_host_read_of_its_prefix_rows(models):
    """What SGLang's graph capture of Dream's block forward holds of its prefix rows: after ``prepare_for_forward``
    (SGLang's runner calls it before every forward, a replay's too; it recomputes a moved block's row), ``rows``
    traces with no graph break (no host read: ``fullgraph=True``) and reads the rows prepared, zeros at position 0."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    sg, ref = models["dream"]
    runner = CpuModelRunner(sg, max_len=64, max_reqs=2)
    drv, prompts = BlockDriver(None, runner, block_size=L), [[20 + i for i in range(2 * L)], [40 + i for i in range(L)]]
    rows = [Row(p, L, runner.alloc_slot()) for p in prompts]
    runner.forward(drv.batch(rows, [p[:L] for p in prompts]))  # each prompt's first block into the paged K/V
    rows[0].kv_len = L  # row 0's next block starts at L (its prefix row: position L - 1), row 1's at 0
    fb = drv.batch(rows, [prompts[0][L:], prompts[1][:L]])
    sg.prepare_for_forward(fb)
    with forward_context(ForwardContext(attn_backend=runner.backend)):
        eager = sg.prefix_rows.rows(fb.positions, fb)
        torch._dynamo.reset()
        got = torch.compile(lambda pos: sg.prefix_rows.rows(pos, fb), fullgraph=True, dynamic=False,
                            backend="eager")(fb.positions)
    want = ref(torch.tensor([prompts[0][:L]]), torch.arange(L)[None], None)[0, -1]  # [V]: position L - 1's logits
    assert torch.equal(got, eager) and not eager[1].any()
    torch.testing.assert_close(ref.logits(eager[0]), want, rtol=1e-5, atol=1e-5)


def test_graphs_replay_only_plain_forwards(models):
    """SGLang's decode graph runner keeps its graphs for every policy: through the plugin's hook on its real
    ``can_run_graph``, a forward whose model holds a ``StepContext`` (dLLM-Cache's cached steps over the block)
    runs eager, and every other forward (exact steps: each block's first, its persisting forward) may replay."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.plugins.hook_registry import HookRegistry

    from integrations.sglang.algorithm import plain_forwards_only
    from integrations.sglang.plugin import GRAPHS_HOOK

    assert any(h is plain_forwards_only for _, h, _ in HookRegistry._hooks[GRAPHS_HOOK])
    sg, ref = models["llada"]
    mask = ref.args.mask_token_id
    algo = FastDllmThreshold(DllmConfig("FastDllmThreshold", {"tau": 0.7, "cache": "canvas:kr=3,rho=0.25"}, L, mask,
                                        4))
    runner = CpuModelRunner(sg, max_len=64, max_reqs=2)
    graphs, forward, seen = SimpleNamespace(model_runner=runner), runner.forward, []

    def recorded(fb, *a, **kw):  # the real method's answer where the hook decides; the hook's own elsewhere
        cached = sg.context is not None
        seen.append((cached, DecodeCudaGraphRunner.can_run_graph(graphs, fb) if cached else
                     plain_forwards_only(lambda *_: True, graphs, fb)))
        return forward(fb, *a, **kw)

    runner.forward = recorded
    BlockDriver(algo, runner).generate([[20 + i for i in range(L)]], 2 * L, mask)
    assert {c: g for c, g in seen} == {True: False, False: True}  # both kinds ran
