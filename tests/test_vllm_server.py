"""The OpenAI-compatible server (started through the ``--dllm-*`` launcher, CPU harness) answers
completions with the canvas reference's tokens, takes per-request options (Fast-dLLM's dual cache
among them) through ``vllm_xargs``,
and rejects a bad option with HTTP 400 while it keeps serving. Each server runs as a job (its requests sent, the
answers recorded, the server stopped): one server alive at a time."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from dllm_core import GenerationConfig, generate, load_model
from dllm_core.engine import generate_in_canvases
from dllm_core.cache.canvas import CanvasCache

pytest.importorskip("vllm")
from recorded import Recorded  # noqa: E402
from vllm_harness.jobs import CANVAS, ROOT, post, serving, tiny_checkpoint  # noqa: E402

LONG = ROOT / "models" / "llada-long"

PROMPT = [30, 31, 32, 33, 34]


XARGS = {  # every request the tests below send, by name (None: no vllm_xargs, the server-wide options)
    "default": None,
    "low_confidence": {"dllm_sampler": "low_confidence", "dllm_steps": 8, "dllm_cache": "canvas:kr=2,rho=1.0"},
    "dual": {"dllm_sampler": "low_confidence", "dllm_steps": 8, "dllm_cache": "dual"},
    "bad_tau": {"dllm_sampler": "threshold:tau=7"},
    "bad_every": {"dllm_cache": "prefix:every=-1"},
    "after_bad": None,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server as a job: every request below (in this order, then a prompt holding the mask token and one more
    default request) sent, the (status, body) answers recorded, the server stopped."""
    model = tiny_checkpoint(tmp_path_factory.mktemp("vllm_srv"), "llada")
    ref = load_model(model)
    mask = ref.args.mask_token_id
    rec = Recorded()
    with serving(model, "--dllm-sampler", "threshold:tau=0.7", "--dllm-cache", "none",
                 "--additional-config", '{"dllm": {"chain": true}}') as url:  # 16-token answers, canvases of 8
        for name, xargs in XARGS.items():
            rec.run(name, complete, url, model, xargs)
        rec.run("mask", post, url, {"model": str(model), "prompt": [30, mask, 32], "max_tokens": 8})
        rec.run("after_mask", complete, url, model, None)
    return rec, ref


def complete(url, model_dir, xargs: dict | None):
    body = {"model": str(model_dir), "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True,
            "return_token_ids": True}
    if xargs:
        body["vllm_xargs"] = xargs
    return post(url, body)


def reference(model, sampler: str, steps: int = CANVAS) -> list[int]:
    cfg = GenerationConfig(gen_length=2 * CANVAS, block_length=CANVAS, steps=2 * steps, sampler=sampler,
                           cache=CanvasCache())
    return generate(model, [PROMPT], cfg).tokens[0].tolist()


def test_completion_uses_the_server_wide_sampler(server):
    rec, model = server
    code, body = rec["default"]
    assert code == 200, body
    assert body["choices"][0]["token_ids"] == reference(model, "threshold:tau=0.7")
    assert body["usage"]["completion_tokens"] == 16


def test_per_request_options_through_vllm_xargs(server):
    rec, model = server
    code, body = rec["low_confidence"]
    assert code == 200, body
    assert body["choices"][0]["token_ids"] == reference(model, "low_confidence", steps=4)


def test_fast_dllm_dual_through_vllm_xargs(server):
    """Fast-dLLM's DualCache per request: each 8-token canvas is a generation of its own (the prefix
    refreshed with it), as the embedded engine decodes it."""
    rec, model = server
    code, body = rec["dual"]
    assert code == 200, body
    cfg = GenerationConfig(gen_length=2 * CANVAS, block_length=CANVAS, steps=8, sampler="low_confidence", cache="dual")
    assert body["choices"][0]["token_ids"] == generate_in_canvases(model, [PROMPT], cfg, CANVAS).tokens[0].tolist()


def test_bad_option_is_a_400_and_the_server_keeps_serving(server):
    rec, model = server
    code, body = rec["bad_tau"]
    assert code == 400
    assert "extra_args.dllm_sampler" in body["error"]["message"] and "tau must be in [0.0, 1.0]" in \
        body["error"]["message"]
    code, body = rec["bad_every"]
    assert code == 400 and "extra_args.dllm_cache" in body["error"]["message"]
    code, body = rec["after_bad"]
    assert code == 200 and body["choices"][0]["token_ids"] == reference(model, "threshold:tau=0.7")


def test_prompt_with_the_mask_token_is_a_400_and_the_server_keeps_serving(server):
    rec, model = server
    mask = model.args.mask_token_id
    code, body = rec["mask"]
    assert code == 400, body
    assert f"prompts must not contain the mask token id {mask} (found at position 1)" in body["error"]["message"]
    code, body = rec["after_mask"]
    assert code == 200 and body["choices"][0]["token_ids"] == reference(model, "threshold:tau=0.7")


@pytest.mark.skipif(not (LONG / "config.json").is_file(), reason="models/llada-long not shipped")
def test_no_option_at_all_answers_long_requests_with_the_embedded_engines_tokens():
    """Defaults never lose quality: a server started with no dllm or diffusion option (the model's own context,
    the default canvas: every response one canvas) answers 256-token requests on the shipped long model with the
    embedded engine's tokens for the same defaults (low_confidence one token per step, blocks of 32, Fast-dLLM's
    dual cache; blocks streamed as they finish)."""
    from dllm_core import load_tokenizer
    from dllm_core.tasks import make_task
    from dllm_core.tasks.evaluate import prompts_of

    task = make_task("count:span=48")
    prompts = prompts_of(load_tokenizer(LONG), task.examples("test", 2))
    cfg = GenerationConfig(gen_length=256, block_length=32, sampler="low_confidence", cache="dual")
    want = generate(load_model(LONG), prompts, cfg).tokens.tolist()
    with serving(LONG, tiny=False) as url, ThreadPoolExecutor(len(prompts)) as pool:  # in flight together
        answers = list(pool.map(lambda p: post(url, {"model": str(LONG), "prompt": p, "max_tokens": 256,
                                                     "ignore_eos": True, "return_token_ids": True}), prompts))
    for (code, body), w in zip(answers, want):
        assert code == 200, body
        assert body["choices"][0]["token_ids"] == w
