"""Graph capture of the decoding step (issue "every policy keeps the hosts' CUDA graphs"): what runs inside a step
traces as one graph with no break (``torch.compile(fullgraph=True, dynamic=False)``, the tracing a CUDA-graph
capture needs: no host read, no data-dependent shape), and one graph serves every step of a block."""
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from dllm_core.sampling import SAMPLERS, TokenContext, make_sampler

B, L, V, MASK = 3, 8, 32, 31
STEPS = 8  # per block (the fixed-schedule rules: one token a step)
SPECS = [*SAMPLERS, "threshold:schedule=llada2", "threshold:edit=0.9", "slowfast:k_fast=2"]


def block(spec: str, tc: TokenContext, step) -> tuple[torch.Tensor, int]:
    """One block of L masks (row 0 begins with two prompt tokens) stepped STEPS times by ``step`` over seeded
    logits -> (tokens [B, L], graphs compiled)."""
    sampler = make_sampler(spec)
    st = sampler.new_state(B, L, STEPS, "cpu")
    x = torch.full((B, L), MASK)
    x[0, :2] = 3
    sampler.begin_block(st, x == MASK)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x0, commit = step(sampler, torch.randn(B, L, V, generator=g), x, st, tc)
        x = torch.where(commit, x0, x)
        st["n"] += 1  # the host counter ``Sampler.step`` moves, outside the traced part
    return x, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("spec", SPECS)
def test_each_samplers_device_step_is_one_graph_for_every_step(spec):
    """Every registered sampler's ``device_step`` compiles with no graph break, one graph for all STEPS steps of the
    block, and commits what the eager step commits, token for token."""
    tc = TokenContext(MASK)  # the global generator (random choices): dynamo cannot trace a torch.Generator argument
    torch.manual_seed(1)
    eager, _ = block(spec, tc, lambda s, lg, x, st, tc: s.device_step(lg, x, st, tc))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda s, lg, x, st, tc: s.device_step(lg, x, st, tc), fullgraph=True, dynamic=False,
                             backend="eager")
    torch.manual_seed(1)
    got, graphs = block(spec, tc, compiled)
    assert torch.equal(got, eager), spec
    assert graphs == 1, f"{spec}: {graphs} graphs for {STEPS} steps (a host value in the step's inputs)"
    assert not (got == MASK).all(), spec


def test_the_public_step_moves_the_host_counter_once_per_step():
    """``Sampler.step`` = ``device_step`` + the host step counter (what ``dllm_core.engine.step`` reads for the
    stuck rule and a fixed schedule's end)."""
    s = make_sampler("low_confidence")
    st = s.new_state(1, L, L, "cpu")
    x = torch.full((1, L), MASK)
    s.begin_block(st, x == MASK)
    for n in range(1, 4):
        x0, c = s.step(torch.randn(1, L, V), x, st, TokenContext(MASK))
        x = torch.where(c, x0, x)
        assert st["n"] == n and int(st["i"][0]) == n and int((x != MASK).sum()) == n


# --- the executor's row operations on a host's step ---------------------------------------------------------------
HOST_POLICIES = ["prefix", "dual", "dllm:kp=3,kr=2,rho=0.25", "dllm:kp=3,kr=2,rho=0.25,unit=tokens",
                 "dpad:window=4,decay=none,tail=1", "elastic:gamma=0.9"]


def host_forward(model, spec: str, compiled: bool, buckets: bool = False):
    """The core's ``PackedHostStep`` (a cached step of two requests on a whole-response host, ``buckets``: its rows
    padded to the bucket set) run eagerly or compiled -> (hidden [N, d], every stored feature, rows x layers run per
    request)."""
    from dllm_core.testing import PackedHostStep

    h = PackedHostStep(model, spec, buckets=buckets)
    wrap = (lambda f: torch.compile(f, fullgraph=True, dynamic=False, backend="eager")) if compiled else None
    with torch.no_grad():
        out = h.run(h.x, wrap)
    return out, h.features(), h.step.work()


@pytest.mark.parametrize("spec,buckets", [(s, False) for s in HOST_POLICIES] +
                         [(s, True) for s in ("dual", "dpad:window=4,decay=none,tail=1", "elastic:gamma=0.9")])
def test_each_policys_host_step_compiles_with_no_graph_break(llada, spec, buckets):
    """A cached host step (the core's ``PackedStep``: plan regions, V-verify picks, the recomputed rows to a bucket,
    packed attention; Elastic's planned pass with its drift tests on the device) traces with no graph break under
    ``torch.compile(fullgraph=True, dynamic=False)``, and its hidden states, stored features and work equal the eager
    step's (a refresh pass: ``test_past_caches``); so does the step padded to the bucket set (``buckets``)."""
    eager = host_forward(llada, spec, False, buckets)
    torch._dynamo.reset()
    got = host_forward(llada, spec, True, buckets)
    assert torch.equal(got[0], eager[0]), spec
    assert len(got[1]) == len(eager[1]) and all(torch.equal(a, b) for a, b in zip(got[1], eager[1])), spec
    assert torch.equal(got[2], eager[2]), spec
    assert int(eager[2].sum()) < eager[0].shape[0] * llada.args.n_layers, f"{spec}: the step cached nothing"



def block_canvas_step(model, spec: str, compiled: bool):
    """The block canvas's second step (the core's ``BlockLifecycle``: SGLang's block scheduler's path) over two
    requests' blocks of 8 under ``spec``, each block attending within itself -> (hidden [2 * 8, d], rows x layers
    run per request)."""
    import numpy as np

    from dllm_core.engine.block_canvas import BlockLifecycle
    from dllm_core.engine.host_options import FlatOptions
    from dllm_core.models.layers import PackedAttention
    from dllm_core.testing import PackedHostStep

    a, n, slots = model.args, 8, np.array([0, 1])
    opts = FlatOptions.parse("test", None, {"sampler": "low_confidence", "cache": spec})
    lc = BlockLifecycle(n, a.mask_token_id, "cpu", features=(a.n_layers, a.n_kv_heads * a.head_dim, a.dim,
                                                             model.embed.weight[:0]))
    for s, P in enumerate((5, 3)):
        lc.admit(s, f"r{s}", opts, 2 * n, P, None)
    ids = torch.full((2, n), a.mask_token_id)
    lc.start(slots, ids)
    blocks = SimpleNamespace(attention=PackedAttention([0, n, 2 * n], "cpu"))
    ops = {id(b): PackedHostStep._ops(SimpleNamespace(model=model), b, blocks) for b in model.layers}
    pos = torch.arange(n).repeat(2)

    def run(ctx, x):
        return ctx.run(model.layers, x, pos, None, lambda b: ops[id(b)])

    with torch.no_grad():  # the block's first step: every row through every layer
        first = run(lc.plan(slots, [0, 1], opts.caching), model.embed(ids.flatten()))
        lc.take(slots, [0, 1], model.logits(first), ids)
        ctx = lc.plan(slots, [0, 1], opts.caching)
        assert ctx is not None, f"{spec}: the second step runs no cached layer"
        step = lambda x: run(ctx, x)  # noqa: E731
        if compiled:
            step = torch.compile(step, fullgraph=True, dynamic=False, backend="eager")
        return step(model.embed(ids.flatten())), lc.slots.token_layers[:2].clone()


@pytest.mark.parametrize("spec", ["canvas:kr=4,rho=0.25", "canvas:kr=4,rho=0.5,select=key"])
def test_the_block_canvas_cached_step_compiles_with_no_graph_break(llada, spec):
    """The block canvas's cached step (``canvas``, the registered policy a whole-response host does not run: dLLM-Cache
    over each request's block, V-verify picks to a bucket) traces with no graph break and equals eager: the same work
    and hidden states (to float rounding: traced, each block's queries are padded to the block, eagerly to the most
    any block asks, so attention sums in another order)."""
    eager = block_canvas_step(llada, spec, compiled=False)
    torch._dynamo.reset()
    got = block_canvas_step(llada, spec, compiled=True)
    torch.testing.assert_close(got[0], eager[0])
    assert torch.equal(got[1], eager[1]), spec
    assert int(eager[1].sum()) < 2 * 2 * 8 * llada.args.n_layers, f"{spec}: the step cached nothing"
