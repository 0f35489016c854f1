"""dllm_core's ``canvas`` cache policy: the block-canvas semantics the vLLM adapter reproduces
(prompt prefilled alone, canvas attends to the frozen prefix + itself, nothing to its right)."""
import pytest
import torch

from dllm_core import GenerationConfig, generate, make_cache
from dllm_core.cache import Canvas
from dllm_core.cache.canvas import CanvasCache
from dllm_core.engine import build_canvas
from conftest import PROMPTS

CFG = GenerationConfig(gen_length=24, block_length=8, steps=24, cache="canvas")
SAMPLERS = ["low_confidence", "threshold:tau=0.6", "factor", "slowfast", "entropy"]


@pytest.mark.parametrize("sampler, cache", [(s, "canvas") for s in SAMPLERS] + [
    ("threshold:tau=0.6", "canvas:blocks=3,kr=2,rho=0.25"), ("slowfast", "canvas:blocks=3,kr=3,rho=0.25")])
def test_batched_rows_equal_their_unbatched_runs(model, sampler, cache):
    """Also with several blocks per canvas and the approximate response cache: a row idling in the
    batch (block done, others still decoding) neither advances nor updates its cache."""
    r = generate(model, PROMPTS, CFG, sampler=sampler, cache=cache)
    assert r.tokens.tolist() == [generate(model, [p], CFG, sampler=sampler, cache=cache).tokens[0].tolist()
                                 for p in PROMPTS]


def test_whole_response_canvas_is_closer_to_vanilla(llada):
    """One canvas holding the three blocks keeps the masked suffix and lets committed blocks see
    later ones (only the prompt stays frozen): closer to vanilla than one block per canvas."""
    van = generate(llada, PROMPTS, CFG, cache="none").tokens
    one = generate(llada, PROMPTS, CFG).tokens
    whole = generate(llada, PROMPTS, CFG, cache="canvas:blocks=3").tokens
    assert (whole == van).float().mean() > (one == van).float().mean()
    with pytest.raises(ValueError, match="canvas.blocks=2: gen_length 24 is not a multiple"):
        generate(llada, PROMPTS, CFG, cache="canvas:blocks=2")


def test_later_blocks_never_change_earlier_ones(model):
    """Nothing attends to the right of the current block: the first blocks of a longer generation
    are exactly the shorter generation (vanilla LLaDA has no such property)."""
    long = generate(model, PROMPTS, CFG)
    short = generate(model, PROMPTS, CFG, gen_length=8, steps=8)
    assert long.tokens[:, :8].tolist() == short.tokens.tolist()


def test_hidden_states_equal_a_block_masked_full_forward(model):
    """First denoise step of block 0: prompt rows see the prompt only, canvas rows see prompt +
    canvas; Dream's first canvas prediction is the last prompt row of that forward."""
    x, keep, pos, P = build_canvas(PROMPTS, CFG, model.args.mask_token_id, model.args.pad_token_id, "cpu")
    L, T = CFG.block_length, P + CFG.block_length
    x, keep, pos = x[:, :T], keep[..., :T], pos[:, :T]
    rows = torch.arange(T)
    allowed = (rows[None, :] < P) | (rows[:, None] >= P)  # [T, T] query -> key
    mask = keep & allowed[None, None]  # [B, 1, T, T]
    with torch.no_grad():
        h, rope = model.embed(x), model.rope(pos)
        for layer in model.layers:
            h = layer(h, rope, mask)
        pol = make_cache("canvas")
        st = pol.begin(model, Canvas(pos, keep, P, L))
        got = st.hidden(x, (P - 1, T - 1), None)
        st.end()
    torch.testing.assert_close(got, h[:, P - 1:T - 1], rtol=1e-5, atol=1e-5)


def test_exact_response_cache_settings_equal_uncached(model):
    base = generate(model, PROMPTS, CFG, sampler="threshold:tau=0.6")
    for spec in ("canvas:kr=1", "canvas:kr=3,rho=1.0", "canvas:kr=4,rho=1.0,select=key,first_layer=false"):
        assert generate(model, PROMPTS, CFG, sampler="threshold:tau=0.6", cache=spec).tokens.tolist() == \
            base.tokens.tolist(), spec


def test_work_counts(llada):
    """3 blocks x 8 fixed steps: 1 prompt prefill + 24 canvas steps + 2 commits; kr=2,rho=0.25 runs
    2 of 8 canvas rows on the adaptive layers (layer 0 always full)."""
    P, n = max(map(len, PROMPTS)), llada.args.n_layers
    c = generate(llada, PROMPTS, CFG).counters
    assert c.token_layers == (P + 24 * 8 + 2 * 8) * n
    c = generate(llada, PROMPTS, CFG, cache="canvas:kr=2,rho=0.25").counters
    adaptive_steps = 3 * 4  # steps 1, 3, 5, 7 of each block
    assert c.token_layers == (P + 2 * 8) * n + 24 * 8 + (24 - adaptive_steps) * 8 * (n - 1) + \
        adaptive_steps * 2 * (n - 1)
    assert c.v_only == adaptive_steps * 8 * (n - 1)


def test_from_spec_maps_host_cache_options():
    assert CanvasCache.from_spec("none") == CanvasCache()
    assert CanvasCache.from_spec("dllm:kp=50,kr=7,rho=0.3,metric=l2") == CanvasCache(kr=7, rho=0.3, metric="l2")
    assert CanvasCache.from_spec("canvas:kr=2").kr == 2
    for bad in ("prefix", "dual:every=2"):
        with pytest.raises(ValueError, match="allowed: \\['canvas', 'dllm', 'none'\\]"):
            CanvasCache.from_spec(bad)
    with pytest.raises(ValueError, match="canvas.kr must be >= 1"):
        CanvasCache.from_spec("canvas:kr=0")
    with pytest.raises(ValueError, match="unknown policy 'bogus'"):
        CanvasCache.from_spec("bogus")
