"""Cache policies: exact modes equal `none`, approximate modes skip the work they claim, errors."""
import pytest
import torch

from dllm_core import GenerationConfig, generate, make_cache
from dllm_core.cache import Canvas
from conftest import PROMPTS

CFG = GenerationConfig(gen_length=16, block_length=8, steps=8)
EXACT = ["prefix:every=1", "dual:every=1", "dllm:kp=1,kr=1", "dllm:kp=1,kr=1,first_layer=false",
         "dllm:kp=1,kr=1,unit=tokens"]
SAMPLERS = ["low_confidence", "threshold:tau=0.6", "factor", "slowfast", "entropy"]


@pytest.mark.parametrize("cache", EXACT)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_exact_modes_equal_none(model, cache, sampler):
    base = generate(model, PROMPTS, CFG, sampler=sampler)
    r = generate(model, PROMPTS, CFG, sampler=sampler, cache=cache)
    assert r.tokens.tolist() == base.tokens.tolist() and r.nfe == base.nfe


@pytest.mark.parametrize("cache", ["prefix", "dual", "dllm"])
def test_approximate_modes_run_with_cfg_and_sampling(model, cache):
    r = generate(model, PROMPTS, CFG, cache=cache, cfg_scale=1.0, temperature=0.7)
    assert r.tokens.shape == (3, 16) and not (r.tokens == model.args.mask_token_id).any()


def test_prefix_and_dual_compute_only_their_window(model):
    """Fixed schedule, 2 blocks x 4 steps, T = P + 16: the first step of each block is a full
    forward, the other 3 run [block start, T) (prefix) or the block (dual); Dream adds the one
    position left of the window its shifted logits need."""
    P, L, shift = max(map(len, PROMPTS)), model.args.n_layers, int(model.shift_logits)
    T = P + 16
    want = {"none": 8 * T,
            "prefix": 2 * T + 3 * (T - P + shift) + 3 * (T - P - 8 + shift),
            "dual": 2 * T + 6 * (8 + shift)}
    for name, positions in want.items():
        c = generate(model, PROMPTS, CFG, cache=name).counters
        assert c.forwards == 8 and c.token_layers == positions * L, name
        assert c.full_token_layers == 8 * T * L
        assert (c.cache_bytes > 0) == (name != "none")


def test_dllm_cache_schedule_counts(model):
    """kp=4, kr=2, rho=0.25 over 8 steps: step 0 full; c%4==0 -> full (both); c%2==0 -> response;
    else adaptive (floor(0.25 * 16) = 4 positions); layer 0 always full."""
    P, L = max(map(len, PROMPTS)), model.args.n_layers
    T, R = P + 16, 16
    per_step = {0: T, 1: 4, 2: R, 3: 4, 4: T, 5: 4, 6: R, 7: 4}
    c = generate(model, PROMPTS, CFG, cache="dllm:kp=4,kr=2,rho=0.25").counters
    assert c.token_layers == 8 * T + sum(per_step.values()) * (L - 1)
    assert c.v_only == 4 * R * (L - 1)  # V-verify projections on the adaptive steps
    c = generate(model, PROMPTS, CFG, cache="dllm:kp=100,kr=100,rho=0,first_layer=false").counters
    assert c.token_layers == T * L  # only the first step computes anything
    c = generate(model, PROMPTS, CFG, cache="dllm:kp=3,kr=100,rho=0,first_layer=false").counters
    assert c.token_layers == (T + 2 * P) * L  # steps 3 and 6 refresh the prompt only
    # first_layer_prompt=false: layer 0 refreshes the response alone, unless the prompt is due (both then)
    c = generate(model, PROMPTS, CFG, cache="dllm:kp=4,kr=2,rho=0.25,first_layer_prompt=false").counters
    layer0 = {s: T if s in (0, 4) else R for s in per_step}
    assert c.token_layers == sum(layer0.values()) + sum(per_step.values()) * (L - 1)
    assert c.v_only == 4 * R * (L - 1)


def test_dllm_first_layer_prompt_is_the_reference_when_the_prompt_is_always_due(model):
    """The prompt refreshed at every step: layer 0's refresh covers it either way (the same tokens); with it
    refreshed rarely the response-only layer 0 is another approximation (it runs, and costs less)."""
    base = generate(model, PROMPTS, CFG, cache="dllm:kp=1,kr=4,rho=0.25")
    r = generate(model, PROMPTS, CFG, cache="dllm:kp=1,kr=4,rho=0.25,first_layer_prompt=false")
    assert r.tokens.tolist() == base.tokens.tolist() and r.counters.token_layers == base.counters.token_layers
    ref = generate(model, PROMPTS, CFG, cache="dllm:kp=100,kr=4,rho=0.25").counters
    resp = generate(model, PROMPTS, CFG, cache="dllm:kp=100,kr=4,rho=0.25,first_layer_prompt=false").counters
    assert resp.token_layers < ref.token_layers


def test_dllm_cache_counting_tokens(model):
    """``unit=tokens``: the prompt / response refresh once ``kp`` / ``kr`` tokens changed since their last refresh.
    One token per step (the vanilla schedule): the step schedule, token for token and in work. A parallel sampler
    (threshold, 1-8 tokens per step here): less work per forward than refreshing at every step. (Batched rows share the embedded
    state's forwards, as with ``unit=steps``; the hosts reproduce a request's run alone: test_sglang_dllm_cache.)"""
    one = GenerationConfig(gen_length=16, block_length=8, steps=16)
    by_steps = generate(model, PROMPTS, one, cache="dllm:kp=3,kr=2,rho=0.25")
    by_tokens = generate(model, PROMPTS, one, cache="dllm:kp=3,kr=2,rho=0.25,unit=tokens")
    assert by_tokens.tokens.tolist() == by_steps.tokens.tolist()
    assert by_tokens.counters.token_layers == by_steps.counters.token_layers
    cfg = GenerationConfig(gen_length=16, block_length=8, steps=16, sampler="threshold:tau=0.9")
    for p in PROMPTS:
        every = generate(model, [p], cfg, cache="dllm:kp=1,kr=1,rho=0.25,unit=tokens").counters
        some = generate(model, [p], cfg, cache="dllm:kp=6,kr=3,rho=0.25,unit=tokens").counters
        assert every.forwards > 2 and every.token_layers == every.full_token_layers
        assert some.token_layers < 0.9 * some.full_token_layers


def test_dllm_adaptive_rho_one_equals_response_refresh(model):
    """rho=1 recomputes every response token against the cached prompt: the same as refreshing the
    response at every step (kr=1), whatever the selection rule."""
    base = generate(model, PROMPTS, CFG, cache="dllm:kp=100,kr=1,first_layer=false")
    for sel in ("value", "key", "random"):
        r = generate(model, PROMPTS, CFG, cache=f"dllm:kp=100,kr=100,rho=1,select={sel},first_layer=false")
        assert r.tokens.tolist() == base.tokens.tolist(), sel
        assert r.counters.token_layers == base.counters.token_layers


def test_dllm_assembles_only_the_rows_read_downstream(model, monkeypatch):
    """A forward whose later layers recompute no prompt row assembles the output of the rows read downstream alone
    (``cached_layer(live=...)``: the response, and Dream's row left of it); the same tokens as assembling every
    row, for step and token schedules, shared and per-row plans (a parallel sampler)."""
    from dllm_core.cache import dllm_cache, executor

    every_row = lambda *a, live=None, **k: executor.cached_layer(*a, **k)  # noqa: E731
    cases = [(CFG, "dllm:kp=4,kr=2,rho=0.25"), (CFG, "dllm:kp=5,kr=3,rho=0.5,first_layer_prompt=false"),
             (GenerationConfig(gen_length=16, block_length=8, steps=16, sampler="threshold:tau=0.7"),
              "dllm:kp=6,kr=3,rho=0.25,unit=tokens,first_layer_prompt=false")]
    for cfg, cache in cases:
        live = generate(model, PROMPTS, cfg, cache=cache)
        with monkeypatch.context() as m:
            m.setattr(dllm_cache, "cached_layer", every_row)
            full = generate(model, PROMPTS, cfg, cache=cache)
        assert live.tokens.tolist() == full.tokens.tolist() and live.nfe == full.nfe, cache


def test_dllm_cache_selection_variants_differ(dream):
    outs = {s: generate(dream, PROMPTS, CFG, cache=f"dllm:kp=50,kr=7,rho=0.25,{s}").tokens
            for s in ("select=value", "select=random", "metric=l2")}
    assert all(o.shape == (3, 16) for o in outs.values())


def test_cache_released_between_requests(llada):
    pol = make_cache("dual")
    res = generate(llada, PROMPTS, CFG, cache=pol)
    assert vars(pol) == vars(make_cache("dual"))  # the policy holds no state
    assert res.counters.cache_bytes == 2 * llada.args.n_layers * 3 * llada.args.n_kv_heads * (7 + 16) * \
        llada.args.head_dim * 4
    st = pol.begin(llada, Canvas(torch.zeros(3, 23, dtype=torch.long), None, 7, 8))
    st.end()
    assert set(vars(st)) == {"policy", "canvas", "counters"}  # buffers released


@pytest.mark.parametrize("spec, match", [
    ("dllm:rho=1.5", r"--cache dllm.rho must be in \[0.0, 1.0\], got 1.5"),
    ("dllm:rho=-0.1", r"--cache dllm.rho must be in \[0.0, 1.0\]"),
    ("dllm:kp=0", "--cache dllm.kp must be >= 1, got 0"),
    ("dllm:kr=0", "--cache dllm.kr must be >= 1, got 0"),
    ("dllm:select=query", r"--cache dllm.select must be one of \['key', 'random', 'value'\]"),
    ("dllm:metric=dot", r"--cache dllm.metric must be one of \['cosine', 'l2'\]"),
    ("lru", r"--cache: unknown policy 'lru'; allowed: \['canvas', 'dllm', 'dpad', 'dual', 'elastic', 'none', 'prefix'\]"),
    ("prefix:every=-1", "--cache prefix.every must be >= 0"),
    ("dllm:kp=x", "--cache dllm.kp: cannot parse 'x' as int"),
    ("dllm:unit=forwards", r"--cache dllm.unit must be one of \['steps', 'tokens'\], got 'forwards'"),
])
def test_bad_parameters(spec, match):
    with pytest.raises(ValueError, match=match):
        make_cache(spec)


def test_prefix_policy_rows_are_independent(dream):
    """Rows refreshing at different times (per-row windows) write only their own K/V."""
    pol = make_cache("dual")
    x = torch.randint(20, 200, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    st = pol.begin(dream, Canvas(pos, torch.ones(2, 1, 1, 12, dtype=torch.bool), 4, 4))
    fresh = torch.tensor([[4, 8], [4, 8]])
    st.hidden(x, (4, 8), fresh)
    k_before = st.kv[0][0].clone()
    x2 = x.clone()
    x2[:, 9] = 7
    st.hidden(x2, (4, 8), torch.tensor([[4, 8], [8, 12]]))  # row 1 moved on: it refreshes
    k_after = st.kv[0][0]
    assert torch.equal(k_after[0, :, 9], k_before[0, :, 9])  # row 0 kept its cached suffix
    assert not torch.equal(k_after[1, :, 9], k_before[1, :, 9])  # row 1 recomputed everything
    st.end()


def test_v_verify_picks_the_positions_whose_value_moved(llada):
    """The executor compares fresh V with the V cached before this step (not with itself) and
    leaves every candidate's V refreshed."""
    from dllm_core.cache import DLLMCache
    from dllm_core.cache.executor import CachedRows, Features, recompute_mask
    from dllm_core.models.layers import BlockOps

    a = llada.args
    ops = BlockOps(llada.layers[1], llada.rotary, 1, None)
    x, pos = torch.randn(12, a.dim, generator=torch.Generator().manual_seed(0)), torch.arange(12)
    feats = Features.zeros(1, 12, a.n_kv_heads * a.head_dim, a.dim, x)
    with torch.no_grad():
        feats.v[0] = ops.value(x)
        moved = [3, 7, 9]
        feats.v[0, moved] += 1.0
        g = CachedRows(torch.arange(12).view(1, 12), feats, torch.zeros(1, 12, dtype=torch.bool), True,
                       DLLMCache(rho=0.25), (0, 12), dense=True)
        rec = recompute_mask(ops, x, pos, [g])
        assert rec.nonzero().flatten().tolist() == moved
        assert torch.equal(feats.v[0], ops.value(x))
