"""The host contract (``dllm_core.cache.host``): a cache policy defined outside the engines (``toy_policy.py``:
refresh every third step, only the upper half of the layers) serves through the embedded engine and SGLang with
identical tokens and no engine code of its own (vLLM: the ``toy_policy`` case of ``test_vllm_fast_dllm.py``);
the plans the core hands a host."""
import pytest
import torch

from dllm_core import GenerationConfig, generate, load_model, make_cache
from dllm_core.cache import DualCache, HostPart, HostPlan, HostRequest
from dllm_core.testing import build_tiny_checkpoint
from toy_policy import TOY

L, GEN = 8, 24
PROMPTS = [[20 + i for i in range(5)], [40 + 3 * i for i in range(L)], [60 + i for i in range(13)]]


def reference(model, cache: str, sampler: str = "threshold:tau=0.7") -> list[list[int]]:
    """Unbatched: a host request keeps its own step counter (an embedded batch shares one)."""
    cfg = GenerationConfig(gen_length=GEN, block_length=L, sampler=sampler, cache=cache)
    return [generate(model, [p], cfg).tokens[0].tolist() for p in PROMPTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {a: build_tiny_checkpoint(tmp_path_factory.mktemp(f"hc_{a}"), a) for a in ("llada", "dream")}


def test_toy_policy_runs_its_schedule_in_the_embedded_engine(checkpoints):
    """The toy's work is its schedule's (steps 0, 3, 6, ...: every layer; others: the lower layer only), its
    output is not the uncached one (the reuse is live), and its exact setting (``every=1``) is."""
    model = load_model(checkpoints["llada"])
    pol = make_cache(TOY)
    assert (pol.every, pol.upper, pol.refreshes_prefix) == (3, 1, True)
    cfg = GenerationConfig(gen_length=GEN, block_length=L, steps=GEN, sampler="low_confidence", cache=TOY)
    c = generate(model, [PROMPTS[0]], cfg).counters
    T = len(PROMPTS[0]) + GEN
    assert c.token_layers == sum(T * (2 if s % 3 == 0 else 1) for s in range(GEN))
    assert reference(model, TOY) != reference(model, "none")
    assert reference(model, TOY.replace("upper=1", "upper=1,every=1")) == reference(model, "none")


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_toy_policy_serves_through_sglang(checkpoints, arch):
    pytest.importorskip("sglang.srt.dllm.algorithm")
    from integrations.sglang.algorithm import FastDllmThreshold
    from sglang_cpu import BlockDriver, CpuModelRunner, load_sglang_model
    from sglang.srt.dllm.config import DllmConfig
    from sglang.srt.plugins import load_plugins

    load_plugins()
    sg, model = load_sglang_model(checkpoints[arch]), load_model(checkpoints[arch])
    mask = model.args.mask_token_id
    algo = FastDllmThreshold(DllmConfig("FastDllmThreshold", {"tau": 0.7, "cache": TOY}, L, mask, 8,
                                        first_done_first_out_mode=True))
    out = BlockDriver(algo, CpuModelRunner(sg, max_len=64, max_reqs=len(PROMPTS))).generate(PROMPTS, GEN, mask)
    assert out == reference(model, TOY)


def test_host_plans_say_what_is_recomputed():
    """Fast-dLLM's dual cache on a host: a refresh runs the whole sequence; between refreshes the prefix is
    held and only the window's canvas columns are recomputed (Dream: from the row left of the window)."""
    req = HostRequest(DualCache(), prompt_len=5)
    req.begin_canvas(5)
    req.begin_block()
    first = req.plan(start=5, focus=(0, 8), shift=0, prefix=5, width=24)
    assert first == HostPlan(0, [HostPart("response", 5, 29, always=(0, 24))])
    second = req.plan(start=5, focus=(0, 8), shift=1, prefix=5, width=24)  # a new fresh range: a refresh
    assert second.run_from == 0
    third = req.plan(start=5, focus=(0, 8), shift=1, prefix=5, width=24)
    assert third == HostPlan(4, [HostPart("response", 5, 29, always=(0, 8))])
    prompt = third.cover("prompt", 0, 5)  # a host that runs every position: the held rows reused
    assert prompt.layer(0, "cpu")[0].tolist() == [[False] * 4 + [True]]
    assert torch.equal(third.parts[0].layer(1, "cpu")[0], torch.arange(24)[None] < 8)


def test_emission_and_prefill_of_a_refreshing_policy_keep_nothing():
    """A policy that refreshes the prefix runs no layer in the prompt prefill nor in the forward that emits a
    canvas (its next step recomputes those positions): a nameless part, whose store keeps nothing."""
    from dllm_core.cache import CanvasCache
    from dllm_core.cache.executor import NoFeatures, PartStores

    req = HostRequest(make_cache("dllm"), prompt_len=5)
    assert req.prefill_plan(5) == HostPlan(0, [HostPart("", 0, 5)])
    plan = req.commit_plan(13, 16)
    assert plan == HostPlan(13, [HostPart("", 13, 29)])
    stores = PartStores(2, 8, 16, torch.zeros(0))
    assert isinstance(plan.regions(0, stores, "cpu")[0].store, NoFeatures) and stores.stores == {}
    assert HostRequest(CanvasCache(), prompt_len=5).commit_plan(13, 16) is None  # the block canvas keeps its K/V


def test_elastic_plans_its_query_rows_and_probes_each_layer():
    """Elastic-Cache-style refresh on a host: every position live; the first step recomputes every layer, later steps
    the query rows (the fresh range + ``window``, and the previous step's fresh range) as ``always`` columns; the
    request's ``Drift`` is the plan's probe (kept across steps in ``HostRequest.state``), none where the test cannot
    fail or always refreshes (``gamma`` 0 / 1); a failing test turns the next layers to every position."""
    pol = make_cache("elastic:gamma=0.5,window=2,probe=2")
    req = HostRequest(pol, prompt_len=5)
    req.begin_canvas(5)
    req.begin_block()
    canvas = torch.full((16,), 7)
    first = req.plan(start=5, focus=(0, 8), shift=0, prefix=5, width=16, tokens=canvas)
    assert first.run_from == 0 and [(p.name, p.start, p.end) for p in first.parts] == [("prompt", 0, 5),
                                                                                       ("response", 5, 21)]
    assert all(p.scheduled(layer)[0] for p in first.parts for layer in range(4))  # nothing cached yet
    second = req.plan(start=13, focus=(2, 8), shift=0, prefix=5, width=16, changed=1, tokens=canvas)
    prompt, resp = second.parts
    assert second.probe is first.probe is req.state and prompt.always[1] <= prompt.always[0]
    assert resp.always == (0, 16) and not resp.scheduled(0)[0]  # [5, 13) of the last step, [15, 21) now + window
    second.probe.full_from = 2  # (as a test failing at layer 2 leaves it)
    assert [resp.scheduled(layer)[0] for layer in range(4)] == [False, False, True, True]
    for spec in ("elastic:gamma=0", "elastic:gamma=1"):
        r = HostRequest(make_cache(spec), prompt_len=5)
        r.begin_canvas(5)
        assert r.plan(5, (0, 8), 0, 5, 16, tokens=canvas).probe is None


def test_dpad_plans_keep_the_block_and_its_suffix_and_pack_them():
    """DPad on a host: the plan keeps [0, block end) + the window's suffix positions + the canvas's tail, its parts
    and columns count kept positions; a new block is a refresh (the kept set moved), later steps the window alone
    (dual). ``PackedStep`` lays out only the kept positions (RoPE positions their own), its parts from the host's
    position ranges, and finds the block's logit rows; a request that keeps everything lays out as before."""
    from dllm_core.cache.executor import PartStores
    from dllm_core.cache.host import PackedStep

    req = HostRequest(make_cache("dpad:window=4,decay=none,tail=1"), prompt_len=5)
    req.begin_canvas(5)
    req.begin_block()
    first = req.plan(start=13, focus=(0, 8), shift=0, prefix=5, width=24, block=8)  # the canvas's second block
    keep = [*range(21), 21, 22, 23, 24, 28]
    assert first.keep.tolist() == keep and first == HostPlan(0, [HostPart("response", 5, 26, always=(0, 21))])
    second = req.plan(start=13, focus=(0, 8), shift=0, prefix=5, width=24, block=8)
    assert second.keep.tolist() == keep and second == HostPlan(5, [HostPart("response", 5, 26, always=(8, 16))])
    assert (second.compact(13), second.compact(25), second.compact(28), second.compact(29)) == (13, 25, 25, 26)
    with pytest.raises(ValueError, match="cache dpad: the host gave no block length"):
        req.plan(start=13, focus=(0, 8), shift=0, prefix=5, width=24)
    whole = HostRequest(DualCache(), prompt_len=3)
    whole.begin_canvas(3)
    plans = [second, whole.plan(start=3, focus=(0, 8), shift=0, prefix=3, width=8)]
    names = [[("prompt", 0, 5), ("response", 5, 29)], [("prompt", 0, 3), ("response", 3, 11)]]
    step = PackedStep(plans, [29, 11], names, [PartStores(2, 8, 16, torch.zeros(0)) for _ in plans], "cpu")
    assert step.off == [0, 26, 37] and step.pos.tolist() == keep + list(range(11))
    assert step.kept.tolist() == keep + list(range(29, 40))
    assert [(p.name, p.start, p.end) for p in step.parts[0]] == [("prompt", 0, 5), ("response", 5, 26)]
    assert step.rows([13, 3], 8, shift=1).tolist() == [list(range(12, 20)), list(range(28, 36))]
    with pytest.raises(ValueError, match=r"positions \[20, 28\) are not all kept"):
        step.rows([20, 3], 8)


def test_the_adapters_import_from_the_core_only_what_the_architecture_page_lists():
    """Every name an adapter package imports from ``dllm_core`` is named in its column of the adapter table of
    ``docs/architecture.md`` (what an adapter uses of the core, and nothing else)."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "architecture.md").read_text()
    table = doc[doc.index("| | vLLM (`integrations/vllm`)"):].splitlines()[2:]
    listed = {"vllm": set(), "sglang": set()}
    for row in table[:next(i for i, line in enumerate(table) if not line.startswith("|"))]:
        for host, cell in zip(listed, row.split("|")[2:4]):
            listed[host].update(w for b in re.findall(r"`([^`]+)`", cell) for w in re.findall(r"\w+", b))
    for host, names in listed.items():
        used = set()  # (name, file)
        for f in (root / "integrations" / host).glob("*.py"):
            for n in ast.walk(ast.parse(f.read_text())):
                if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module.startswith("dllm_core"):
                    used.update((a.name, f.name) for a in n.names)
                elif isinstance(n, ast.Import):
                    used.update((a.name.split(".")[-1], f.name) for a in n.names if a.name.startswith("dllm_core"))
        assert used and not {u for u in used if u[0] not in names}, (host, sorted(u for u in used if u[0] not in names))
