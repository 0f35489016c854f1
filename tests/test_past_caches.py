"""Past the published caches: DPad's suffix dropout (``dpad``) and Elastic-Cache-style adaptive refresh
(``elastic``). Exact modes equal the plain loop token for token (tiny models and the shipped long-answer model);
the approximate modes do the work they claim, rows are independent of their batch, and bad options name the
option and its allowed values. The paged hosts serve both (``dpad``: a plan that keeps part of the positions)."""
from pathlib import Path

import numpy as np
import pytest

from dllm_core import GenerationConfig, generate, load_model, make_cache
from dllm_core.cache import DPadCache, ElasticCache, host_cache
from conftest import PROMPTS

CFG = GenerationConfig(gen_length=32, block_length=8, steps=16)
SAMPLERS = ["low_confidence", "threshold:tau=0.6", "slowfast"]
LONG = Path(__file__).resolve().parents[1] / "models" / "llada-long"


def same(a, b) -> bool:
    return a.tokens.tolist() == b.tokens.tolist() and a.nfe == b.nfe


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_exact_modes_equal_the_plain_loop(model, sampler):
    """``elastic:gamma=1`` / ``every=1`` refresh everything each step: ``none``. ``dpad`` whose window reaches the
    canvas end without dropout keeps every position: its base cache (none / prefix / dual) token for token."""
    runs = {c: generate(model, PROMPTS, CFG, sampler=sampler, cache=c) for c in ("none", "prefix", "dual")}
    for spec in ("elastic:gamma=1", "elastic:every=1,gamma=0.5", "elastic:gamma=1,window=0,probe=1"):
        assert same(generate(model, PROMPTS, CFG, sampler=sampler, cache=spec), runs["none"]), spec
    for base in ("none", "prefix", "dual"):
        spec = f"dpad:cache={base},window=32,decay=none"
        assert same(generate(model, PROMPTS, CFG, sampler=sampler, cache=spec), runs[base]), spec


@pytest.mark.parametrize("spec", ["elastic:gamma=0.9", "elastic:gamma=0.99,window=8,probe=1", "dpad",
                                  "dpad:cache=prefix,window=8,decay=none,tail=2"])
def test_a_batched_row_equals_its_run_alone(llada, spec):
    """Rows of different prompt lengths decide their refreshes (elastic) and see their kept set (dpad) alone."""
    cfg = GenerationConfig(gen_length=32, block_length=8, sampler="threshold:tau=0.6", cache=spec)
    batch = generate(llada, PROMPTS, cfg)
    for i, p in enumerate(PROMPTS):
        alone = generate(llada, [p], cfg)
        assert batch.tokens[i].tolist() == alone.tokens[0].tolist() and batch.nfe[i] == alone.nfe[0], (spec, i)


def test_dpad_forward_sees_the_block_and_its_kept_suffix(llada):
    """``cache=none``: every step one forward over [0, block end) + the window (clipped at the canvas end); the
    kept set is a fixed function of (seed, block), DPad's Gaussian keep probabilities (0.80 next to the block)."""
    P, L, T = max(map(len, PROMPTS)), llada.args.n_layers, max(map(len, PROMPTS)) + 32
    cfg = GenerationConfig(gen_length=32, block_length=8, steps=16, sampler="low_confidence")
    c = generate(llada, PROMPTS, cfg, cache="dpad:cache=none,window=12,decay=none").counters
    per_block = [min(P + 8 * (b + 1) + 12, T) for b in range(4)]
    assert c.forwards == 16 and c.token_layers == 4 * L * sum(per_block) and c.full_token_layers == 16 * T * L
    pol = make_cache("dpad:window=64")
    p = pol.keep_probability()
    assert p[0] == pytest.approx(2 / np.sqrt(2 * np.pi)) and p[-1] < 1e-3 and (np.diff(p) <= 0).all()
    cols = pol.kept(3, 100, 300)
    assert (cols[:100] == np.arange(100)).all() and cols[-1] < 164 and (cols == pol.kept(3, 100, 300)).all()
    assert 8 < len(cols) - 100 < 40 and cols.tolist() != pol.kept(4, 100, 300).tolist()
    tail = make_cache("dpad:window=4,decay=none,tail=3").kept(0, 10, 40)
    assert tail.tolist() == list(range(14)) + [37, 38, 39]


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny LLaDA of 4 layers: room for a refresh from a middle layer."""
    from dllm_core.testing import build_tiny_checkpoint

    return load_model(build_tiny_checkpoint(tmp_path_factory.mktemp("deep"), "llada", n_layers=4))


def refreshes(model, spec: str, cfg: GenerationConfig):
    """The run's counters and its row refreshes by first layer (the last entry: rows that did not refresh)."""
    from dllm_core.cache import elastic

    seen, init = {}, elastic.ElasticState.__init__

    def keep(self, *a, **k):
        init(self, *a, **k)
        seen["state"] = self

    elastic.ElasticState.__init__ = keep
    try:
        r = generate(model, PROMPTS, cfg, cache=spec)
    finally:
        elastic.ElasticState.__init__ = init
    return r.counters, seen["state"].refreshes.tolist()


def test_elastic_refreshes_by_its_drift_test(deep):
    """gamma=0: only the first step (nothing cached) runs every position; then only the query rows (the block,
    the previous step's commits, the window). gamma=1: every step refreshes every row from layer 0, the work of
    ``none``. In between, failing tests refresh from a middle layer; the last layer is never tested."""
    cfg = GenerationConfig(gen_length=32, block_length=8, steps=32, sampler="low_confidence")
    P, L, T = max(map(len, PROMPTS)), deep.args.n_layers, max(map(len, PROMPTS)) + 32
    never, n0 = refreshes(deep, "elastic:gamma=0,window=4", cfg)
    always, n1 = refreshes(deep, "elastic:gamma=1,window=4", cfg)
    some, n9 = refreshes(deep, "elastic:gamma=0.999,window=4,probe=1", cfg)
    assert n0 == [3, 0, 0, 0, 31 * 3] and n1 == [32 * 3, 0, 0, 0, 0]
    assert always.token_layers == always.full_token_layers == 32 * T * L
    assert sum(n9[1:L]) > 0 and n9[L] < 31 * 3 and n9[0] == 3
    for layers in (1, 2):  # the test at layers [0, layers) only: refreshes from no later layer
        _, n = refreshes(deep, f"elastic:gamma=0.999,window=4,probe=1,layers={layers}", cfg)
        assert n[layers] > 0 and sum(n[layers + 1:L]) == 0, (layers, n)
    assert never.token_layers < some.token_layers < always.token_layers
    assert never.token_layers < 0.4 * never.full_token_layers
    every, ne = refreshes(deep, "elastic:gamma=0,every=4", cfg)
    assert ne[0] == 3 * 8 and ne[L] == 3 * 24


def test_a_refresh_from_a_middle_layer_equals_a_step_planned_full_from_there(deep, monkeypatch):
    """Elastic's two passes (``executor.run_layers``: the tests on the device, one read for the step): a request
    whose drift test fails at layer 2 ends the step with what a step planned full from layer 2 gives it - hidden
    rows, every stored feature, work - and the other request is untouched; eagerly and with each pass compiled
    with no graph break."""
    import torch

    from dllm_core.cache import elastic
    from dllm_core.testing import PackedHostStep

    after, forced = elastic.Drift.after, []

    def test(self, layer, *a):  # request 0 fails at layer 2 (when asked), nothing else ever fails
        got = after(self, layer, *a)
        return None if got is None else got.new_tensor(self in forced and layer == 2)

    def step(fail: bool, wrap=None):
        h = PackedHostStep(deep, "elastic:gamma=0.9,probe=1")
        d = h.reqs[0].state
        forced[:] = [d] if fail else []
        d.full_from = None if fail else 2  # the reference: planned full from layer 2
        with torch.no_grad():
            return h.run(h.x, wrap), h.features(), h.step.work().tolist(), d.failed

    monkeypatch.setattr(elastic.Drift, "after", test)
    torch._dynamo.reset()
    want = step(False)
    for got in (step(True), step(True, lambda f: torch.compile(f, fullgraph=True, dynamic=False, backend="eager"))):
        assert got[3] == 2
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        assert got[2] == want[2] and got[2][0] > got[2][1], (got[2], want[2])


@pytest.mark.skipif(not (LONG / "model.safetensors").exists(), reason="shipped models/llada-long missing")
def test_exact_modes_on_the_long_answer_model():
    """The shipped long-answer model, a 256-token count answer with the threshold sampler: the exact modes equal the
    plain loop; the default settings solve what the plain dual cache solves with less work."""
    from dllm_core import load_tokenizer
    from dllm_core.cli import decode, stop_ids
    from dllm_core.tasks import parse_tasks
    from dllm_core.tasks.evaluate import prompts_of

    model, tok = load_model(LONG), load_tokenizer(LONG)
    task = parse_tasks("count:span=48")[0]
    exs = task.examples("test", 2, 29)
    prompts = prompts_of(tok, exs)
    cfg = GenerationConfig(gen_length=256, block_length=32, steps=256, sampler="threshold:tau=0.9")
    base = {c: generate(model, prompts, cfg, cache=c) for c in ("none", "dual")}
    assert same(generate(model, prompts, cfg, cache="elastic:gamma=1"), base["none"])
    assert same(generate(model, prompts, cfg, cache="dpad:window=256,decay=none"), base["dual"])
    stop = stop_ids(tok, model)
    solved = lambda r: [task.score(decode(tok, ids, stop), ex) for ids, ex in zip(r.tokens.tolist(), exs)]
    for spec in ("elastic", "dpad:window=128,decay=none,tail=8"):
        r = generate(model, prompts, cfg, cache=spec)
        assert solved(r) == solved(base["dual"]) and r.counters.ratio() < base["dual"].counters.ratio(), spec


@pytest.mark.parametrize("spec, error", [
    ("dpad:cache=lru", "--cache dpad.cache must be one of ['dual', 'none', 'prefix'], got 'lru'"),
    ("dpad:decay=linear", "--cache dpad.decay must be one of ['gaussian', 'none'], got 'linear'"),
    ("dpad:window=-1", "--cache dpad.window must be >= 0, got -1"),
    ("elastic:layers=-1", "--cache elastic.layers must be >= 0 (0 = the test at every layer but the last), got -1"),
    ("dpad:k=0", "--cache dpad.k must be > 0.0, got 0.0"),
    ("dpad:tail=-2", "--cache dpad.tail must be >= 0, got -2"),
    ("dpad:sigma=2", "--cache: dpad has no option 'sigma'; allowed: ['cache', 'decay', 'every', 'graphs', 'k', "
                     "'scale', 'seed', 'tail', 'window']"),
    ("elastic:gamma=1.5", "--cache elastic.gamma must be in [0.0, 1.0], got 1.5"),
    ("elastic:probe=0", "--cache elastic.probe must be >= 1, got 0"),
    ("elastic:every=-1", "--cache elastic.every must be >= 0 (0 = refresh only by the drift test), got -1"),
    ("elastic:gamma=high", "--cache elastic.gamma: cannot parse 'high' as float"),
    ("elastic:layer=2", "--cache: elastic has no option 'layer'; allowed: ['every', 'gamma', 'graphs', 'layers', "
                        "'probe', 'window']"),
])
def test_option_errors_name_the_option_and_allowed_values(spec, error):
    with pytest.raises(ValueError) as e:
        make_cache(spec)
    assert str(e.value) == error


def test_hosts_serve_elastic_and_dpad(llada2_dir):
    """The paged hosts serve ``elastic`` (its drift test is the plan's probe) and ``dpad`` (its plan keeps the
    positions the forward sees) through the host contract; equalities with the embedded engine:
    ``test_vllm_fast_dllm.py``, ``test_sglang_dllm_cache.py``. A block-causal model has no suffix to drop or to cache
    stale: the embedded engine and a paged host's options refuse both."""
    from dllm_core.engine.host_options import Served
    from dllm_core.engine.request import DecodeOptions

    from dllm_core.engine.host_options import block_host_policy

    llada2 = load_model(llada2_dir)
    with pytest.raises(ValueError, match=r"unknown policy 'lru'; allowed: \['canvas', 'dllm', 'dpad', 'dual', "
                                         r"'elastic', 'none', 'prefix'\]"):
        block_host_policy("lru", "DllmCore.cache")
    assert host_cache("elastic:gamma=0.7") == block_host_policy("elastic:gamma=0.7", "DllmCore.cache") == \
        ElasticCache(gamma=0.7)
    assert host_cache("dpad:window=16") == block_host_policy("dpad:window=16", "DllmCore.cache") == DPadCache(window=16)
    with pytest.raises(ValueError, match="^DllmCore.cache: dpad has no option 'graphs'"):
        block_host_policy("dpad:graphs=false", "DllmCore.cache")
    for spec in ("dpad", "elastic"):
        with pytest.raises(ValueError, match=f"--cache {spec} is not available for the block-causal"):
            generate(llada2, [[20, 21, 22]], GenerationConfig(gen_length=8, block_length=llada2.block_causal,
                                                              cache=spec))
        with pytest.raises(ValueError, match=f"^dllm_cache {spec} is not served for a block-causal model; allowed: "
                                             r"\['none', 'prefix', 'dual'\]"):
            Served(block_causal=32, prefix="dllm_").check(DecodeOptions(cache=spec))
