"""LLaDA2 (block diffusion, MoE) served by the real vLLM engine (Model Runner V2, diffusion pathway, CPU
harness) on vLLM's own Bailing-MoE layers (``FusedMoE``): our samplers per request reproduce the embedded
engine token for token - prompts of every grid offset in one batch (the prompt's tail block decoded with the
first answer tokens), token editing, every admitted cache, canvases cut by max_tokens - the shipped task model
keeps its accuracy over HTTP, and bad options are refused (admission errors, HTTP 400, a canvas that is not the
checkpoint's block).

One offline engine (tiny random checkpoint) and one server (the shipped model) start together.
"""
from pathlib import Path

import pytest
import torch

from dllm_core import GenerationConfig, generate, load_model
from dllm_core.models import DiffusionLM

pytest.importorskip("vllm")
from vllm_harness.jobs import (CANVAS, ENGINE, finish_engine, post, serving, start_engine, stop,  # noqa: E402
                               tiny_checkpoint)

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "llada2-tasks"
# grid offsets 7, 3, 5, 2, 3 (11 tokens), 0 (8 and 16 tokens)
PROMPTS = [[25, 26, 27, 28, 29, 21, 33], [30, 31, 32], [40, 41, 42, 43, 44], [50, 51],
           [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [71, 72, 73, 74, 75, 76, 77, 78],
           [80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95]]
GEN = 3 * CANVAS
SERVER = {"sampler": "threshold:tau=0.6"}  # server-wide --additional-config dllm (cache: the default, dual)
# name -> (extra_args, max_tokens, reference sampler, steps per block)
CASES = {
    "low_confidence": ({"dllm_sampler": "low_confidence", "dllm_steps": 12, "dllm_cache": "none"}, GEN,
                       "low_confidence", 4),
    "threshold": ({"dllm_sampler": "threshold:tau=0.5", "dllm_cache": "prefix"}, GEN, "threshold:tau=0.5", CANVAS),
    "slowfast": ({"dllm_sampler": "slowfast"}, GEN, "slowfast", CANVAS),
    "factor": ({"dllm_sampler": "factor:f=1.5"}, GEN, "factor:f=1.5", CANVAS),
    "edit": ({"dllm_sampler": "threshold:tau=0.5,edit=0.5"}, GEN, "threshold:tau=0.5,edit=0.5", CANVAS),
    "factor_edit": ({"dllm_sampler": "factor:f=1.5,edit=0.9,post_edit=2", "dllm_block_length": CANVAS}, GEN,
                    "factor:f=1.5,edit=0.9,post_edit=2", CANVAS),
    "server_default": ({}, GEN, SERVER["sampler"], CANVAS),
    "llada2_low_confidence": ({"dllm_sampler": "low_confidence:schedule=llada2", "dllm_steps": 9, "dllm_cache": "none"},
                              GEN, "low_confidence:schedule=llada2", 3),  # LLaDA2's official schedule
    "llada2_edit": ({"dllm_sampler": "threshold:tau=0.5,edit=0.5,post_edit=2,schedule=llada2"}, GEN,
                    "threshold:tau=0.5,edit=0.5,post_edit=2,schedule=llada2", CANVAS),
    "short": ({"dllm_sampler": "threshold:tau=0.5"}, GEN - 5, "threshold:tau=0.5", CANVAS),
}
# 8 requests after one 600-token prefix (a few-shot prompt's exemplars): the first alone, then the other 7, then all 8
# with the prefix cache unread (prefix caching is on for a block-causal model, vLLM's default)
SHARED = [20 + (7 * i) % 70 for i in range(600)]
QUESTIONS = [[30 + i, 41 + i, 52 + i] for i in range(8)]


def shared(q: list[int], skip: bool) -> dict:
    return {"prompt_token_ids": SHARED + q, "params": {"max_tokens": 2 * CANVAS, "ignore_eos": True,
            "skip_reading_prefix_cache": skip, "extra_args": {"dllm_sampler": "threshold:tau=0.5"}}}


INVALID = {
    "block_length": {"dllm_block_length": 4},
    "cache": {"dllm_cache": "dllm:kr=2"},
    "edit": {"dllm_sampler": "threshold:tau=0.5,edit=1.5"},
    "post_edit": {"dllm_sampler": "threshold:tau=0.5,edit=0.9,post_edit=-1"},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm_llada2"), "llada2")


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    """(per-case outputs, admission errors) of the offline engine; the server (shipped model) starts alongside."""
    batch = [{"prompt_token_ids": p, "params": {"max_tokens": mt, "ignore_eos": True, "extra_args": xa}}
             for xa, mt, *_ in CASES.values() for p in PROMPTS]
    invalid = [{"prompt_token_ids": PROMPTS[0], "params": {"max_tokens": 8, "extra_args": xa}}
               for xa in INVALID.values()]
    sharing = [[shared(QUESTIONS[0], False)], [shared(q, False) for q in QUESTIONS[1:]],
               [shared(q, True) for q in QUESTIONS]]
    proc = start_engine({"model": str(tiny), "engine": {**ENGINE, "max_model_len": 1024,
                                                        "additional_config": {"dllm": SERVER}},
                         "batches": [batch, *sharing], "invalid": invalid, "work": True})
    try:
        res = finish_engine(proc)
    finally:
        stop(proc)
    print(f"\nvLLM LLaDA2: startup {res['seconds']['startup']:.1f} s, {len(batch)} + 3 x 8 requests "
          f"{res['seconds']['generate']:.1f} s; prompt tokens from the prefix cache {res['cached'][1:]}")
    outs, n = res["batches"][0], len(PROMPTS)
    cases = {name: outs[i * n:(i + 1) * n] for i, name in enumerate(CASES)}
    cases["sharing"] = {k: [r[1] + r[2], r[3]] for k, r in (("tokens", res["batches"]), ("cached", res["cached"]),
                                                           ("work", res["work"]))}
    return cases, dict(zip(INVALID, res["invalid"]))


def reference(model, sampler: str, steps: int, gen: int = GEN, prompts=PROMPTS) -> list[list[int]]:
    """The embedded engine, each prompt alone (its block grid; batching is invisible there)."""
    cfg = GenerationConfig(gen_length=gen, block_length=CANVAS, steps=gen // CANVAS * steps, sampler=sampler)
    return [generate(model, [p], cfg).tokens[0].tolist() for p in prompts]


@pytest.mark.parametrize("case", ["low_confidence", "threshold", "slowfast", "factor", "edit", "factor_edit",
                                  "server_default", "llada2_low_confidence", "llada2_edit"])
def test_greedy_output_equals_the_embedded_engine(served, tiny, case):
    outs, _ = served
    _, _, sampler, steps = CASES[case]
    assert outs[case] == reference(load_model(tiny), sampler, steps)


def test_requests_sharing_a_prefix_prefill_only_their_own_suffix(served):
    """vLLM's prefix caching stays on for a block-causal model: 7 requests after a first with the same 600-token
    prefix read its cached pages (whole grid blocks), their model forwards run only the rest of the prompt (the
    rows counted by the core's work tally: the cached tokens x layers fewer), and their tokens equal those of the
    same requests with the cache unread."""
    on, off = served[0]["sharing"]["tokens"]
    (cached, unread), (work_on, work_off) = served[0]["sharing"]["cached"], served[0]["sharing"]["work"]
    assert on == off
    assert unread == [0] * 8 and cached[0] == 0, (cached, unread)
    page = cached[1]
    assert 0 < page <= 600 and page % CANVAS == 0 and cached == [0] + [page] * 7, cached
    layers = 2
    for w_on, w_off, c in zip(work_on, work_off, cached):
        assert w_off["token_layers"] - w_on["token_layers"] == c * layers, (w_on, w_off, c)
    assert len(set(map(tuple, on))) > 1  # the questions decode differently


def test_editing_changed_something(served):
    """The editing case is not the plain rule in disguise: T2T replaced committed tokens somewhere."""
    outs, _ = served
    assert outs["edit"] != outs["threshold"]


def test_max_tokens_cuts_the_last_block(served, tiny):
    """The last block is decoded whole (as embedded), its tail cut: the first tokens of the full answer, since a
    block-causal model's earlier blocks never see later ones."""
    outs, _ = served
    full = reference(load_model(tiny), "threshold:tau=0.5", CANVAS)
    assert outs["short"] == [r[:GEN - 5] for r in full]


def test_bad_llada2_options_are_refused_at_admission(served):
    _, errors = served
    assert "extra_args.dllm_block_length" in errors["block_length"] and \
        "does not match the checkpoint's block_size 8" in errors["block_length"]
    assert "extra_args.dllm_cache" in errors["cache"] and \
        "allowed: ['none', 'prefix', 'dual']" in errors["cache"]
    assert "extra_args.dllm_sampler" in errors["edit"] and "edit" in errors["edit"]
    assert "extra_args.dllm_sampler" in errors["post_edit"] and "post_edit" in errors["post_edit"]


def test_reference_decisions_are_robust(tiny, monkeypatch):
    """Equality is only meaningful if no reference decision is a float-noise tie: +-1e-3 noise on every logit
    changes no case's output."""
    model = load_model(tiny)
    cases = {k: v for k, v in CASES.items() if k != "short"}
    clean = {k: reference(model, v[2], v[3]) for k, v in cases.items()}
    logits = DiffusionLM.logits
    for eps in (1e-3, -1e-3):
        gen = torch.Generator().manual_seed(1234)
        monkeypatch.setattr(DiffusionLM, "logits", lambda self, h, e=eps: (lambda lg: lg + e * torch.randn(
            lg.shape, generator=gen))(logits(self, h)))
        assert {k: reference(model, v[2], v[3]) for k, v in cases.items()} == clean


def test_a_canvas_other_than_the_block_and_a_page_that_cuts_one_are_refused(tiny):
    """The engine's config resolution (``EngineArgs.create_engine_config``, which runs our config hook, the code an
    engine start runs before any worker) refuses it, here in-process."""
    from vllm.engine.arg_utils import EngineArgs

    engine = {**ENGINE, "diffusion_config": {"canvas_length": 2 * CANVAS}}
    args = EngineArgs(model=str(tiny), tokenizer=str(tiny), **engine)
    with pytest.raises(ValueError, match=r"canvas_length 16 must equal the checkpoint's block_size 8"):
        args.create_engine_config()
    # prefix caching (on): a page that cuts a grid block is refused where the page is resolved (the scheduler's start)
    from types import SimpleNamespace

    from integrations.vllm.configs import LLaDA2Config
    from integrations.vllm.scheduler import check_prefix_pages

    def resolved(page: int, on: bool = True):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=LLaDA2Config(block_size=32)),
                               cache_config=SimpleNamespace(block_size=page, enable_prefix_caching=on))

    assert check_prefix_pages(resolved(128)) == check_prefix_pages(resolved(16, on=False)) == 32
    with pytest.raises(ValueError, match=r"--block-size 16: a prefix-cached page of a block-causal model holds whole "
                                         r"grid blocks; allowed: multiples of 32, or --no-enable-prefix-caching"):
        check_prefix_pages(resolved(16))


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="models/llada2-tasks not shipped")
def test_shipped_model_over_http_keeps_its_accuracy_and_refuses_bad_options():
    """The shipped LLaDA2 task model behind vLLM's OpenAI server: 20 held-out arithmetic and sort prompts each, in one
    request each decode the embedded engine's tokens (accuracy >= 90 %, the embedded one's); a bad option is
    an HTTP 400 and the server keeps serving."""
    from dllm_core import load_tokenizer
    from dllm_core.cli import stop_ids
    from dllm_core.tasks import make_task
    from dllm_core.tasks.evaluate import accuracy, generate_batched, prompts_of, task_config

    ref, tok = load_model(SHIPPED, dtype=torch.float32), load_tokenizer(SHIPPED)
    with serving(SHIPPED, "--dllm-sampler", "threshold:tau=0.9", "--dllm-cache", "prefix") as url:
        for name in ("arithmetic", "sort"):
            task = make_task(name)
            examples = task.examples("test", 20)
            prompts = prompts_of(tok, examples)
            code, body = post(url, {"model": str(SHIPPED), "prompt": prompts, "max_tokens": task.gen_length,
                                    "ignore_eos": True, "return_token_ids": True})
            assert code == 200, body
            got = [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]
            want = generate_batched(ref, prompts, task_config(task, "threshold:tau=0.9"), batch_size=20).tokens
            assert got == [list(t) for t in want], name
            assert accuracy(task, tok, stop_ids(tok, ref), examples, got) >= 0.9, name
        bad = {"model": str(SHIPPED), "prompt": prompts[0], "max_tokens": 8}
        for xargs, text in (({"dllm_block_length": 4}, "does not match the checkpoint's block_size 8"),
                            ({"dllm_sampler": "threshold:tau=0.9,edit=2"}, "edit"),
                            ({"dllm_cache": "dllm"}, "allowed: ['none', 'prefix', 'dual']")):
            code, body = post(url, {**bad, "vllm_xargs": xargs})
            assert code == 400 and text in body["error"]["message"], body
        code, body = post(url, {**bad, "return_token_ids": True, "ignore_eos": True})
        assert code == 200 and len(body["choices"][0]["token_ids"]) == 8
        # logprobs through the OpenAI route: each token's and its step's top 2, the embedded engine's (to 1e-4)
        code, body = post(url, {**bad, "max_tokens": 16, "return_token_ids": True, "ignore_eos": True, "logprobs": 2})
        assert code == 200, body
        one = generate(ref, [prompts[0]], GenerationConfig(gen_length=16, block_length=8, steps=16,
                                                           sampler="threshold:tau=0.9", logprobs=2))
        lp, ids = body["choices"][0]["logprobs"], body["choices"][0]["token_ids"]
        assert ids == one.tokens[0].tolist()
        assert lp["token_logprobs"] == pytest.approx(one.logprobs.token[0].tolist(), abs=1e-4)
        assert [v for d in lp["top_logprobs"] for v in sorted(d.values(), reverse=True)] == pytest.approx(
            one.logprobs.top[0].flatten().tolist(), abs=1e-4)
