"""The real vLLM engine (Model Runner V2, diffusion pathway, CPU harness) serving tiny LLaDA and
Dream checkpoints reproduces the embedded engine token for token: the ``canvas`` reference policy and
Fast-dLLM's prefix / dual with one-block canvases (each canvas a generation of its own).

One engine per model: both start at once (module fixture), each runs every case below in ONE
batch of concurrent requests with prompts of different lengths and per-request policies.
"""
from dataclasses import replace

import pytest
import torch

from dllm_core import GenerationConfig, load_model
from dllm_core.cache import CanvasCache, DLLMCache, host_cache
from dllm_core.engine import generate, generate_in_canvases
from dllm_core.models import DiffusionLM

pytest.importorskip("vllm")
from vllm_harness.jobs import CANVAS, ENGINE, finish_engine, start_engine, stop, tiny_checkpoint  # noqa: E402

PROMPTS = [[25, 26, 27, 28, 29, 21, 33], [30, 31, 32], [40, 41, 42, 43, 44], [50, 51],
           [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
BLOCKS = 3
SERVER = {"sampler": "threshold:tau=0.7", "cache": "none", "chain": True}  # server-wide: chained canvases asked for
# name -> (extra_args (dllm_steps: the total over the response), max_tokens, reference sampler, reference cache,
# steps per block, block length)
CASES = {
    "low_confidence": ({"dllm_sampler": "low_confidence", "dllm_steps": 12}, 24, "low_confidence", "none", 4, CANVAS),
    "threshold": ({"dllm_sampler": "threshold:tau=0.6"}, 24, "threshold:tau=0.6", "none", CANVAS, CANVAS),
    "slowfast": ({"dllm_sampler": "slowfast"}, 24, "slowfast", "none", CANVAS, CANVAS),
    "factor": ({"dllm_sampler": "factor"}, 24, "factor", "none", CANVAS, CANVAS),
    "server_default": ({}, 24, SERVER["sampler"], "none", CANVAS, CANVAS),
    "dllm_exact": ({"dllm_sampler": "low_confidence", "dllm_steps": 12, "dllm_cache": "canvas:kr=3,rho=1.0"},
                   24, "low_confidence", "canvas:kr=3,rho=1.0", 4, CANVAS),
    "dllm_approx": ({"dllm_sampler": "threshold:tau=0.6", "dllm_cache": "canvas:kr=3,rho=0.25"}, 24,
                    "threshold:tau=0.6", "canvas:kr=3,rho=0.25", CANVAS, CANVAS),
    "short": ({"dllm_sampler": "threshold:tau=0.6"}, 20, "threshold:tau=0.6", "none", CANVAS, CANVAS),
    # two semi-autoregressive blocks of 4 inside each canvas of 8
    "blocks_low_confidence": ({"dllm_sampler": "low_confidence", "dllm_block_length": 4, "dllm_steps": 12}, 24,
                              "low_confidence", "none", 2, 4),
    "blocks_threshold": ({"dllm_sampler": "threshold:tau=0.6", "dllm_block_length": 4,
                          "dllm_cache": "canvas:kr=2,rho=0.25"}, 24, "threshold:tau=0.6", "canvas:kr=2,rho=0.25", 4, 4),
    # Fast-dLLM with one-block canvases: each canvas is a generation of its own (prefix refreshed with it)
    "dual_canvases": ({"dllm_sampler": "low_confidence", "dllm_steps": 12, "dllm_cache": "dual"}, 24,
                      "low_confidence", "dual", 4, CANVAS),
    "prefix_canvases": ({"dllm_sampler": "threshold:tau=0.6", "dllm_block_length": 4, "dllm_cache": "prefix"}, 24,
                        "threshold:tau=0.6", "prefix", 4, 4),
    "dllm_canvases": ({"dllm_sampler": "threshold:tau=0.6", "dllm_cache": "dllm:kp=4,kr=2,rho=0.25"}, 24,
                      "threshold:tau=0.6", "dllm:kp=4,kr=2,rho=0.25", CANVAS, CANVAS),
}
SAMPLED = [(i, seed) for i in (0, 2) for seed in (7, 7, 8)]  # (prompt, the request's seed): temperature 0.8
SAMPLED_ARGS = {"dllm_sampler": "low_confidence", "dllm_steps": 12}
LOGPROBS = [0, 3]  # prompts asking for logprobs (top 2) with the low_confidence case's options
INVALID = {
    "dllm_sampler": {"dllm_sampler": "bogus"},
    "dllm_cache": {"dllm_cache": "dual:every=-1"},
    "dllm_steps": {"dllm_steps": 0},
    "dllm_colour": {"dllm_colour": "red"},
    "tau": {"dllm_sampler": "threshold:tau=1.5"},
    "block_length": {"dllm_block_length": 3},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {a: tiny_checkpoint(tmp_path_factory.mktemp(f"vllm_{a}"), a) for a in ("llada", "dream")}


@pytest.fixture(scope="module")
def engines(checkpoints):
    """Both engines start together (each ~30-60 s of start-up on 2 cores)."""
    batch = [{"prompt_token_ids": p, "params": {"max_tokens": mt, "ignore_eos": True, "extra_args": xa}}
             for xa, mt, *_ in CASES.values() for p in PROMPTS]
    batch += [{"prompt_token_ids": PROMPTS[i], "params": {"max_tokens": 24, "ignore_eos": True, "temperature": 0.8,
                                                          "seed": seed, "extra_args": SAMPLED_ARGS, "logprobs": 0}}
              for i, seed in SAMPLED]
    xa, mt, *_ = CASES["low_confidence"]
    batch += [{"prompt_token_ids": PROMPTS[i], "params": {"max_tokens": mt, "ignore_eos": True, "extra_args": xa,
                                                          "logprobs": 2}} for i in LOGPROBS]
    invalid = [{"prompt_token_ids": PROMPTS[0], "params": {"max_tokens": 8, "extra_args": xa}}
               for xa in INVALID.values()]
    engine = {**ENGINE, "additional_config": {"dllm": SERVER}}
    procs = {a: start_engine({"model": str(d), "engine": engine, "batches": [batch], "invalid": invalid})
             for a, d in checkpoints.items()}
    yield procs
    for p in procs.values():
        stop(p)


@pytest.fixture(scope="module", params=["llada", "dream"])
def served(request, engines, checkpoints):
    """(per-case vLLM outputs, invalid-request errors, reference model) of one architecture."""
    res = finish_engine(engines[request.param])
    print(f"\nvLLM {request.param}: startup {res['seconds']['startup']:.1f} s, "
          f"{len(res['batches'][0])} requests {res['seconds']['generate']:.1f} s")
    outs = res["batches"][0]
    n = len(PROMPTS)
    per_case = {name: outs[i * n:(i + 1) * n] for i, name in enumerate(CASES)}
    per_case["sampled"] = outs[len(CASES) * n:len(CASES) * n + len(SAMPLED)]
    per_case["sampled_logprobs"] = res["logprobs"][0][len(CASES) * n:len(CASES) * n + len(SAMPLED)]
    per_case["logprobs"] = list(zip(outs[-len(LOGPROBS):], res["logprobs"][0][-len(LOGPROBS):]))
    return per_case, dict(zip(INVALID, res["invalid"])), load_model(checkpoints[request.param])


def reference(model, sampler: str, cache: str, steps: int, block: int = CANVAS) -> list[list[int]]:
    """The embedded engine serving canvases of CANVAS positions made of CANVAS // block blocks: the
    canvas policy, or a Fast-dLLM policy canvas by canvas."""
    n_blocks = BLOCKS * CANVAS // block
    pol = host_cache(cache)
    if isinstance(pol, CanvasCache):
        pol = replace(pol, blocks=CANVAS // block)
    cfg = GenerationConfig(gen_length=BLOCKS * CANVAS, block_length=block, steps=n_blocks * steps, sampler=sampler,
                           cache=pol)
    if isinstance(pol, DLLMCache):  # a host request keeps its own step counter (an embedded batch shares one)
        return [generate_in_canvases(model, [p], cfg, CANVAS).tokens[0].tolist() for p in PROMPTS]
    return generate_in_canvases(model, PROMPTS, cfg, CANVAS).tokens.tolist()


@pytest.mark.parametrize("case", ["low_confidence", "threshold", "slowfast", "factor", "server_default",
                                  "blocks_low_confidence", "blocks_threshold", "dual_canvases", "prefix_canvases",
                                  "dllm_canvases"])
def test_greedy_output_equals_canvas_reference(served, case):
    outs, _, model = served
    _, max_tokens, sampler, cache, steps, block = CASES[case]
    assert outs[case] == reference(model, sampler, cache, steps, block)


def test_dllm_cache_exact_setting_reproduces_uncached_output(served):
    """rho=1 recomputes every canvas position on the adaptive steps: identical to no cache, through
    vLLM's cached-layer path (K/V and features taken from the canvas cache, then overwritten)."""
    outs, _, model = served
    assert outs["dllm_exact"] == outs["low_confidence"]
    assert outs["dllm_exact"] == reference(model, "low_confidence", "canvas:kr=3,rho=1.0", 4)


def test_dllm_cache_approximate_setting_equals_reference(served):
    outs, _, model = served
    ref = reference(model, "threshold:tau=0.6", "canvas:kr=3,rho=0.25", CANVAS)
    assert outs["dllm_approx"] == ref
    assert ref != reference(model, "threshold:tau=0.6", "none", CANVAS)  # the cache did change something


def test_max_tokens_inside_a_canvas_cuts_the_canvas(served):
    """The response rule of every engine: max_tokens 20 in blocks of 8 decodes 3 whole blocks and emits 20
    tokens (``DllmScheduler`` schedules no canvas past the blocks holding max_tokens)."""
    outs, _, model = served
    full = reference(model, "threshold:tau=0.6", "none", CANVAS)
    assert outs["short"] == [r[:20] for r in full]
    assert all(len(r) == 20 and model.args.mask_token_id not in r for r in outs["short"])


def test_a_sampled_request_with_a_seed_draws_what_the_embedded_engine_draws_with_that_seed(served):
    """A request's ``seed`` is its own generator (``ResponseSlots.admit``): sampled at temperature 0.8 among other
    requests, it decodes what ``generate`` decodes for its prompt alone with that seed, with its logprobs; the same
    seed twice in one batch gives the same tokens, another seed others."""
    outs, _, model = served
    got = outs["sampled"]
    cfg = GenerationConfig(gen_length=BLOCKS * CANVAS, block_length=CANVAS, steps=12, sampler="low_confidence",
                           cache=CanvasCache(), temperature=0.8)
    for (i, seed), out, lps in zip(SAMPLED, got, outs["sampled_logprobs"]):
        want = generate(model, [PROMPTS[i]], replace(cfg, seed=seed, logprobs=0))
        assert out == want.tokens[0].tolist(), (i, seed)
        # its logprobs: the embedded engine's for the same tokens (to 1e-4), each under the step that committed it
        assert [dict((t, v) for t, v, _ in pos)[tok] for tok, pos in zip(out, lps)] == \
            pytest.approx(want.logprobs.token[0].tolist(), abs=1e-4)
    assert got[0] == got[1] != got[2] and got[3] == got[4] != got[5]
    assert got[0] != reference(model, "low_confidence", "none", 4)[0]  # sampled, not greedy


def test_a_request_s_logprobs_are_the_embedded_engine_s(served):
    """``SamplingParams.logprobs`` (top 2): each emitted token's log-probability, rank and its step's top 2 equal the
    embedded engine's for the same tokens (to 1e-4), request by request among others that ask for none."""
    outs, _, model = served
    cfg = GenerationConfig(gen_length=BLOCKS * CANVAS, block_length=CANVAS, steps=12, sampler="low_confidence",
                           cache=CanvasCache(), logprobs=2)
    for i, (tokens, got) in zip(LOGPROBS, outs["logprobs"]):
        want = generate(model, [PROMPTS[i]], cfg)
        assert tokens == want.tokens[0].tolist() and len(got) == len(tokens)
        lp = want.logprobs
        for j, (t, pos) in enumerate(zip(tokens, got)):
            by_id = {tid: (v, rank) for tid, v, rank in pos}
            assert by_id[t][0] == pytest.approx(lp.token[0, j].item(), abs=1e-4) and by_id[t][1] == lp.rank[0, j]
            for tid, v in zip(lp.top_ids[0, j].tolist(), lp.top[0, j].tolist()):
                assert by_id[tid][0] == pytest.approx(v, abs=1e-4)
            assert set(by_id) <= {t, *lp.top_ids[0, j].tolist()}


def test_bad_per_request_options_are_rejected_at_admission(served):
    _, errors, _ = served
    assert "extra_args.dllm_sampler" in errors["dllm_sampler"] and "'bogus'" in errors["dllm_sampler"]
    assert "extra_args.dllm_cache" in errors["dllm_cache"] and "every must be >= 0" in errors["dllm_cache"]
    assert "extra_args.dllm_steps" in errors["dllm_steps"] and ">= 1" in errors["dllm_steps"]
    assert "unknown dllm option" in errors["dllm_colour"]
    assert "tau must be in [0.0, 1.0]" in errors["tau"]
    assert "block_length 3 must divide the served canvas_length 8" in errors["block_length"]


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_reference_decisions_are_robust(checkpoints, arch, monkeypatch):
    """Token-for-token equality is only meaningful if no decision of the reference is a float-noise
    tie: +-1e-3 noise on every logit must not change any case's output."""
    model = load_model(checkpoints[arch])
    cases = {k: v for k, v in CASES.items() if k != "short"}
    clean = {k: reference(model, *v[2:]) for k, v in cases.items()}
    logits = DiffusionLM.logits
    for eps in (1e-3, -1e-3):
        gen = torch.Generator().manual_seed(1234)
        monkeypatch.setattr(DiffusionLM, "logits", lambda self, h, e=eps: (lambda lg: lg + e * torch.randn(
            lg.shape, generator=gen))(logits(self, h)))
        assert {k: reference(model, *v[2:]) for k, v in cases.items()} == clean
