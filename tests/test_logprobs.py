"""Log-probabilities of a diffusion answer (``GenerationConfig.logprobs``, ``dllm_core/engine/logprobs.py``): each
token's under the logits of the step that committed it, and that step's top alternatives."""
import importlib
import json

import pytest
import torch

from dllm_core import GenerationConfig, generate
from conftest import PROMPTS

gen_module = importlib.import_module("dllm_core.engine.generate")  # (the package's ``generate`` is the function)


def steps_of(monkeypatch) -> list:
    """Every step's (block start, block tokens before, after), recorded around the loop's ``take_step``."""
    seen, take = [], gen_module.take_step

    def recorded(sampler, st, plan, logits, x, tc, *a, **kw):
        out = take(sampler, st, plan, logits, x, tc, *a, **kw)
        seen.append((x.clone(), out[0].clone()))
        return out

    monkeypatch.setattr(gen_module, "take_step", recorded)
    return seen


@pytest.mark.parametrize("sampler", ["low_confidence", "threshold:tau=0.5"])
def test_each_token_has_the_log_softmax_of_the_step_that_committed_it(model, sampler, monkeypatch):
    """The oracle: the model's plain forward over the whole canvas as it was before each step (its own row, or
    Dream's row before it), log-softmax at the committed token; the step's top 3 are the forward's top 3."""
    seen = steps_of(monkeypatch)
    prompt, G, L = PROMPTS[0], 16, 8
    r = generate(model, [prompt], GenerationConfig(gen_length=G, block_length=L, sampler=sampler, logprobs=3))
    mask, shift, P = model.args.mask_token_id, int(model.shift_logits), len(prompt)
    canvas = torch.tensor([prompt + [mask] * G])
    pos, checked = torch.arange(P + G)[None], 0
    for before, after in seen:
        s = next(P + b * L for b in range(G // L) if torch.equal(canvas[:, P + b * L:P + (b + 1) * L], before))
        logp = torch.log_softmax(model(canvas, pos, None)[0].float(), -1)  # [T, V]
        for c in (after != before)[0].nonzero()[:, 0].tolist():
            row, i = logp[s + c - shift], s + c - P
            assert r.logprobs.token[0, i].item() == pytest.approx(row[after[0, c]].item(), abs=1e-5)
            v, ids = row.topk(3)
            torch.testing.assert_close(r.logprobs.top[0, i], v, atol=1e-5, rtol=1e-5)
            assert r.logprobs.top_ids[0, i].tolist() == ids.tolist()
            checked += 1
        canvas[:, s:s + L] = after
    assert checked == G and torch.equal(canvas[0, P:], r.tokens[0])


@pytest.mark.parametrize("cache", ["none", "dual", "dllm:kp=2,kr=2,rho=0.5"])
def test_a_batched_row_reports_what_it_reports_alone(model, cache):
    """Left-padded rows in lock step: each row's log-probabilities are its unbatched run's; greedy commits the
    step's most likely token, so its log-probability heads the step's list."""
    cfg = GenerationConfig(gen_length=16, block_length=8, sampler="low_confidence", cache=cache, logprobs=2)
    batch = generate(model, PROMPTS, cfg).logprobs
    for i, p in enumerate(PROMPTS):
        alone = generate(model, [p], cfg).logprobs
        torch.testing.assert_close(batch.token[i], alone.token[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(batch.top_ids[i], alone.top_ids[0])
    torch.testing.assert_close(batch.token, batch.top[..., 0], atol=1e-6, rtol=1e-6)
    assert (batch.token < 0).all()


def test_none_asked_none_computed_and_bad_values_name_the_option(llada):
    r = generate(llada, PROMPTS[:1], GenerationConfig(gen_length=8, block_length=8))
    assert r.logprobs is None
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match=r"--logprobs must be an integer in \[0, 20\]"):
            GenerationConfig(logprobs=bad)


def test_canvases_of_a_paged_host_report_each_canvas_s_logprobs(llada):
    """``generate_in_canvases`` (a host's canvases, each a generation): the answers' log-probabilities side by
    side, each canvas's those of its own generation."""
    cfg = GenerationConfig(gen_length=16, block_length=8, steps=16, logprobs=1)
    two = gen_module.generate_in_canvases(llada, PROMPTS[:2], cfg, 8)
    first = generate(llada, PROMPTS[:2], GenerationConfig(gen_length=8, block_length=8, steps=8, logprobs=1))
    assert two.logprobs.token.shape == (2, 16) and two.logprobs.top.shape == (2, 16, 1)
    torch.testing.assert_close(two.logprobs.token[:, :8], first.logprobs.token)

