"""Fast-dLLM's ``prefix`` / ``dual`` caches and dLLM-Cache served by the real vLLM engine (diffusion pathway, CPU
harness) equal the embedded engine with the same policy, token for token.

The engine serves the whole response as one canvas (``canvas_length`` 24, blocks of 8 inside it; each block
streamed when decoded, the default of a policy that refreshes the prefix, except where ``dllm_stream`` is false):
the prompt's K/V are recomputed with the masked response present at every refresh (extra prefix
rows beside vLLM's scheduled rows, written into the paged cache in place), the masked suffix takes
part in every step, and between refreshes the executor reuses the canvas rows outside the policy's
window. One engine per architecture (module fixture), every case in one concurrent batch. The
one-block canvas (``canvas_length`` 8) is covered by ``test_vllm_engine.py`` (chained reference).
"""
import pytest

from dllm_core import GenerationConfig, generate, load_model

pytest.importorskip("vllm")
from vllm_harness.jobs import ENGINE, finish_engine, start_engine, stop, tiny_checkpoint  # noqa: E402
from toy_policy import TOY  # noqa: E402

PROMPTS = [[25, 26, 27, 28, 29, 21, 33], [30, 31, 32], [40, 41, 42, 43, 44], [50, 51],
           [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
GEN, BLOCK = 24, 8
ELASTIC = "elastic:gamma=0.997,window=4,probe=1"  # a tiny model drifts little: some tests fail at 0.997
DPAD, DPAD_G = "dpad:window=8,decay=none,tail=2", "dpad:cache=prefix,window=12,seed=3"  # G: keeps 3 of 12, 4 of 8
# name -> (extra_args (dllm_steps: the total over the response), reference sampler, reference cache, block length,
# steps per block[, max_tokens])
CASES = {
    "no_options": ({}, "low_confidence", "dual", GEN, GEN),  # the server's default policy
    "dual_low_confidence": ({"dllm_block_length": BLOCK, "dllm_steps": 12}, "low_confidence", "dual", BLOCK, 4),
    "dual_threshold": ({"dllm_stream": False, "dllm_sampler": "threshold:tau=0.6", "dllm_block_length": BLOCK},
                       "threshold:tau=0.6", "dual", BLOCK, BLOCK),
    "dual_slowfast": ({"dllm_sampler": "slowfast", "dllm_block_length": BLOCK}, "slowfast", "dual", BLOCK, BLOCK),
    "dual_every": ({"dllm_sampler": "threshold:tau=0.6", "dllm_cache": "dual:every=2", "dllm_block_length": BLOCK},
                   "threshold:tau=0.6", "dual:every=2", BLOCK, BLOCK),
    "prefix_threshold": ({"dllm_stream": False, "dllm_sampler": "threshold:tau=0.6", "dllm_cache": "prefix",
                          "dllm_block_length": BLOCK}, "threshold:tau=0.6", "prefix", BLOCK, BLOCK),
    "prefix_factor": ({"dllm_sampler": "factor", "dllm_cache": "prefix", "dllm_block_length": 4},
                      "factor", "prefix", 4, 4),
    "dual_exact": ({"dllm_cache": "dual:every=1", "dllm_block_length": BLOCK, "dllm_steps": 12},
                   "low_confidence", "none", BLOCK, 4),
    # dLLM-Cache: prompt every kp steps, response every kr, V-verify in between (counter across blocks)
    "dllm_low_confidence": ({"dllm_cache": "dllm:kp=5,kr=2,rho=0.25", "dllm_block_length": BLOCK, "dllm_steps": 12},
                            "low_confidence", "dllm:kp=5,kr=2,rho=0.25", BLOCK, 4),
    "dllm_threshold": ({"dllm_stream": False, "dllm_sampler": "threshold:tau=0.6", "dllm_block_length": BLOCK,
                        "dllm_cache": "dllm:kp=3,kr=2,rho=0.5,first_layer=false"}, "threshold:tau=0.6",
                       "dllm:kp=3,kr=2,rho=0.5,first_layer=false", BLOCK, BLOCK),
    "dllm_per_block": ({"dllm_sampler": "slowfast", "dllm_block_length": BLOCK,
                        "dllm_cache": "dllm:kp=4,kr=3,rho=0.25,select=key,per_block=true"}, "slowfast",
                       "dllm:kp=4,kr=3,rho=0.25,select=key,per_block=true", BLOCK, BLOCK),
    "dllm_tokens": ({"dllm_stream": False, "dllm_sampler": "threshold:tau=0.6", "dllm_block_length": BLOCK,
                     "dllm_cache": "dllm:kp=6,kr=3,rho=0.5,unit=tokens,first_layer_prompt=false"},
                    "threshold:tau=0.6", "dllm:kp=6,kr=3,rho=0.5,unit=tokens,first_layer_prompt=false", BLOCK, BLOCK),
    # a policy defined outside the engines (tests/toy_policy.py), served by its import path: the host contract
    "toy_policy": ({"dllm_sampler": "threshold:tau=0.6", "dllm_block_length": BLOCK, "dllm_cache": TOY},
                   "threshold:tau=0.6", TOY, BLOCK, BLOCK),
    "dllm_exact": ({"dllm_cache": "dllm:kp=1,kr=1", "dllm_block_length": BLOCK, "dllm_steps": 12},
                   "low_confidence", "none", BLOCK, 4),
    # Elastic-Cache-style refresh: query rows in every layer, every position from a layer whose drift test fails
    "elastic_threshold": ({"dllm_stream": False, "dllm_sampler": "threshold:tau=0.6", "dllm_block_length": BLOCK,
                           "dllm_cache": ELASTIC}, "threshold:tau=0.6", ELASTIC, BLOCK, BLOCK),
    "elastic_stream": ({"dllm_sampler": "slowfast", "dllm_block_length": BLOCK, "dllm_stream": True,
                        "dllm_cache": ELASTIC}, "slowfast", ELASTIC, BLOCK, BLOCK),
    "elastic_exact": ({"dllm_cache": "elastic:gamma=1", "dllm_block_length": BLOCK, "dllm_steps": 12},
                      "low_confidence", "none", BLOCK, 4),
    # DPad: the forward over the kept positions alone (suffix positions out, as queries and as keys)
    "dpad_threshold": ({"dllm_stream": False, "dllm_sampler": "threshold:tau=0.6", "dllm_block_length": BLOCK,
                        "dllm_cache": DPAD}, "threshold:tau=0.6", DPAD, BLOCK, BLOCK),
    "dpad_gaussian": ({"dllm_stream": False, "dllm_block_length": BLOCK, "dllm_steps": 12, "dllm_cache": DPAD_G},
                      "low_confidence", DPAD_G, BLOCK, 4),
    "dpad_alone": ({"dllm_stream": False, "dllm_sampler": "threshold:tau=0.6", "dllm_block_length": BLOCK,
                    "dllm_cache": "dpad:cache=none,window=4,decay=none"}, "threshold:tau=0.6",
                   "dpad:cache=none,window=4,decay=none", BLOCK, BLOCK),
    "dpad_stream": ({"dllm_sampler": "slowfast", "dllm_block_length": BLOCK, "dllm_stream": True,
                     "dllm_cache": DPAD_G}, "slowfast", DPAD_G, BLOCK, BLOCK),
    # streaming: each block is emitted when decoded; the next canvas is the rest of the response
    "dual_stream": ({"dllm_block_length": BLOCK, "dllm_steps": 12, "dllm_stream": True}, "low_confidence", "dual",
                    BLOCK, 4),
    "dual_stream_slowfast": ({"dllm_sampler": "slowfast", "dllm_block_length": BLOCK, "dllm_stream": True},
                             "slowfast", "dual", BLOCK, BLOCK),
    "prefix_stream": ({"dllm_sampler": "threshold:tau=0.6", "dllm_cache": "prefix", "dllm_block_length": BLOCK,
                       "dllm_stream": True}, "threshold:tau=0.6", "prefix", BLOCK, BLOCK),
    "dllm_stream": ({"dllm_sampler": "threshold:tau=0.6", "dllm_block_length": BLOCK, "dllm_stream": True,
                     "dllm_cache": "dllm:kp=3,kr=2,rho=0.5"}, "threshold:tau=0.6", "dllm:kp=3,kr=2,rho=0.5", BLOCK, BLOCK),
    # max_tokens 16 < canvas_length 24: the canvas is cut at max_tokens (gen_length 16)
    "dual_max_tokens": ({"dllm_sampler": "threshold:tau=0.6", "dllm_block_length": BLOCK}, "threshold:tau=0.6",
                        "dual", BLOCK, BLOCK, 16),
}
INVALID = {"stream_needs_fast_dllm": {"dllm_stream": True, "dllm_cache": "none"},
           "stream_dllm_too_long": {"dllm_stream": True, "dllm_cache": "dllm", "max_tokens": 32}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {a: tiny_checkpoint(tmp_path_factory.mktemp(f"vllm_fd_{a}"), a) for a in ("llada", "dream")}


@pytest.fixture(scope="module")
def engines(checkpoints):
    batch = [{"prompt_token_ids": p, "params": {"max_tokens": gen_of(case), "ignore_eos": True, "extra_args": case[0]}}
             for case in CASES.values() for p in PROMPTS]
    invalid = [{"prompt_token_ids": PROMPTS[0], "params": {"max_tokens": xa.get("max_tokens", 8),
                "extra_args": {k: v for k, v in xa.items() if k != "max_tokens"}}} for xa in INVALID.values()]
    # DPad alone in a batch: its steps between refreshes add no prefix row and drop canvas rows
    alone = [{"prompt_token_ids": p, "params": {"max_tokens": GEN, "ignore_eos": True,
                                                "extra_args": CASES["dpad_threshold"][0]}} for p in PROMPTS[:1]]
    engine = {**ENGINE, "diffusion_config": {"canvas_length": GEN}}
    procs = {a: start_engine({"model": str(d), "engine": engine, "batches": [batch, alone], "invalid": invalid,
                              "work": True})
             for a, d in checkpoints.items()}
    yield procs
    for p in procs.values():
        stop(p)


@pytest.fixture(scope="module", params=["llada", "dream"])
def served(request, engines, checkpoints):
    res = finish_engine(engines[request.param])
    outs, n = res["batches"][0], len(PROMPTS)
    per_case = {name: outs[i * n:(i + 1) * n] for i, name in enumerate(CASES)}
    per_case["dpad_threshold_alone"] = res["batches"][1]
    work = {name: res["work"][0][i * n:(i + 1) * n] for i, name in enumerate(CASES)}
    return per_case, load_model(checkpoints[request.param]), dict(zip(INVALID, res["invalid"])), work


def gen_of(case) -> int:
    return case[5] if len(case) > 5 else GEN


def reference(model, sampler: str, cache: str, block: int, steps: int, gen: int = GEN,
              prompts=PROMPTS) -> list[list[int]]:
    """The embedded engine, one request at a time: a host request keeps its own dLLM-Cache step
    counter, while an embedded batch shares one (lock step) and differs once rows finish blocks at
    different steps."""
    cfg = GenerationConfig(gen_length=gen, block_length=block, steps=gen // block * steps, sampler=sampler, cache=cache)
    return [generate(model, [p], cfg).tokens[0].tolist() for p in prompts]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_embedded_policy(served, case):
    outs, model, *_ = served
    _, sampler, cache, block, steps, *gen = CASES[case]
    assert outs[case] == reference(model, sampler, cache, block, steps, *gen)


def test_dpad_alone_in_a_batch(served):
    """A batch of DPad requests only: its steps between refreshes add no prefix row to the forward, only drop canvas
    rows (the RowLayout then holds no extra row)."""
    outs, model, *_ = served
    _, sampler, cache, block, steps = CASES["dpad_threshold"]
    assert outs["dpad_threshold_alone"] == reference(model, sampler, cache, block, steps)[:1]


def test_the_caches_change_the_output(served):
    """The equalities above are not vanilla in disguise: between refreshes the cached rows differ."""
    outs, model, *_ = served
    vanilla = reference(model, "threshold:tau=0.6", "none", BLOCK, BLOCK)
    assert outs["dual_threshold"] != vanilla or outs["prefix_threshold"] != vanilla
    assert outs["dllm_threshold"] != vanilla
    assert outs["elastic_threshold"] != vanilla
    assert outs["dpad_alone"] != vanilla


def test_streaming_is_refused_without_a_prefix_refreshing_cache(served):
    _, _, errors, _ = served
    assert "extra_args.dllm_stream needs a cache that refreshes the prefix" in errors["stream_needs_fast_dllm"]
    assert "max_tokens 32: a streamed dLLM-Cache response must fit the served canvas_length 24" in \
        errors["stream_dllm_too_long"]


@pytest.mark.parametrize("case", ["dual_threshold", "prefix_threshold", "dllm_threshold", "dual_stream",
                                  "dllm_stream", "elastic_threshold", "elastic_stream", "dpad_threshold",
                                  "dpad_stream"])
def test_work_counters_equal_the_embedded_engine(served, case):
    """The host reports each request's work in the embedded engine's units: the same token-layer
    evaluations and vanilla baseline; vLLM's prompt prefill and its commit forwards run no layer
    (the first refresh recomputes the prompt; a commit reuses every row)."""
    _, model, _, work = served
    _, sampler, cache, block, steps, *gen = CASES[case]
    cfg = GenerationConfig(gen_length=GEN, block_length=block, steps=GEN // block * steps, sampler=sampler, cache=cache)
    commits = GEN // block if CASES[case][0].get("dllm_stream") else 1
    for p, got in zip(PROMPTS, work[case]):
        c = generate(model, [p], cfg).counters
        assert got == {"forwards": c.forwards + 1 + commits, "token_layers": c.token_layers,
                       "full_token_layers": c.full_token_layers}
