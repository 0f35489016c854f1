"""The reference loop: official LLaDA semantics, NFE, batching, Dream's shift, errors, CLI."""
import json
import subprocess
import sys

import pytest
import torch

from dllm_core import GenerationConfig, generate
from conftest import PROMPTS

CFG = GenerationConfig(gen_length=16, block_length=8, steps=8)


def official_llada(model, prompt, gen_length, block_length, steps, cfg_scale=0.0):
    """Straight transcription of LLaDA's official greedy `generate` (low_confidence): full logits
    every step, -inf right of the block, per-row topk."""
    mask_id = model.args.mask_token_id
    x = torch.tensor([prompt + [mask_id] * gen_length])
    P = len(prompt)
    pos = torch.arange(x.shape[1])[None]
    n_blocks = gen_length // block_length
    for b in range(n_blocks):
        blk = x[:, P + b * block_length:P + (b + 1) * block_length] == mask_id
        m, s = int(blk.sum()), steps // n_blocks
        counts = [m // s + (1 if i < m % s else 0) for i in range(s)]
        for i in range(s):
            mask_index = x == mask_id
            if cfg_scale > 0:
                un = x.clone()
                un[:, :P] = mask_id
                logits = model(torch.cat([x, un]), pos.expand(2, -1), None)
                cond, unc = logits.chunk(2)
                logits = unc + (cfg_scale + 1) * (cond - unc)
            else:
                logits = model(x, pos, None)
            x0 = logits.argmax(-1)
            p = logits.softmax(-1).gather(-1, x0[..., None])[..., 0]
            p[:, P + (b + 1) * block_length:] = -float("inf")
            x0 = torch.where(mask_index, x0, x)
            conf = torch.where(mask_index, p, torch.tensor(-float("inf")))
            sel = torch.topk(conf[0], k=counts[i]).indices
            x[0, sel] = x0[0, sel]
    return x[0, P:]


@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_matches_official_llada_loop(llada, cfg_scale):
    for p in PROMPTS:
        want = official_llada(llada, p, 16, 8, 8, cfg_scale)
        got = generate(llada, [p], CFG, cfg_scale=cfg_scale)
        assert got.tokens[0].tolist() == want.tolist()


def test_nfe_equals_steps_for_fixed_schedules(model):
    for s in ("low_confidence", "random", "maskgit_plus", "topk_margin", "entropy", "origin"):
        r = generate(model, PROMPTS, CFG, sampler=s, steps=12)  # 6 steps per block of 8
        assert r.nfe == [12, 12, 12], s
        assert not (r.tokens == model.args.mask_token_id).any(), s


@pytest.mark.parametrize("sampler", ["low_confidence", "threshold:tau=0.7", "factor", "slowfast", "topk_margin"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_batched_equals_unbatched(model, sampler, cache):
    batched = generate(model, PROMPTS, CFG, sampler=sampler, cache=cache)
    for i, p in enumerate(PROMPTS):
        alone = generate(model, [p], CFG, sampler=sampler, cache=cache)
        assert alone.tokens[0].tolist() == batched.tokens[i].tolist()
        assert alone.nfe[0] == batched.nfe[i]


def test_dream_shift_is_applied(dream, llada):
    """With one masked position, the token must be the argmax of the row *before* it (Dream) or
    of its own row (LLaDA); prompts are chosen where the two differ so the test can fail."""
    checked = 0
    for m, shift in ((dream, 1), (llada, 0)):
        for start in range(20, 200, 7):
            p = list(range(start, start + 4))
            x = torch.tensor([p + [m.args.mask_token_id]])
            logits = m(x, torch.arange(5)[None], None)[0]
            own, prev = int(logits[4].argmax()), int(logits[3].argmax())
            if own == prev:
                continue
            got = generate(m, [p], gen_length=1, block_length=1, steps=1).tokens[0, 0].item()
            assert got == (prev if shift else own)
            checked += 1
            break
    assert checked == 2


def test_sampling_is_seeded(model):
    a = generate(model, PROMPTS, CFG, temperature=1.0, seed=3)
    b = generate(model, PROMPTS, CFG, temperature=1.0, seed=3)
    c = generate(model, PROMPTS, CFG, temperature=1.0, seed=4)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)


def test_eos_options(llada):
    eos = llada.args.eos_token_id
    r = generate(llada, PROMPTS, CFG, logits_eos_inf=True)
    assert not (r.tokens == eos).any()


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=7), "--steps 7 must be a multiple of the number of blocks 2"),
    (dict(gen_length=20, steps=20), r"--steps 20 must be a multiple of the number of blocks 3 \(24 positions in "
                                    r"blocks of 8\) \(steps is the total over the response"),
    (dict(gen_length=0), "--gen-length must be >= 1, got 0"),
    (dict(sampler="greedy"), r"--sampler: unknown policy 'greedy'; allowed: \['entropy', 'factor', .*"),
    (dict(sampler="threshold:tau=2"), r"--sampler threshold.tau must be in \[0.0, 1.0\], got 2.0"),
    (dict(sampler="threshold:t=2"), r"--sampler: threshold has no option 't'; allowed: \['confidence', 'edit', 'post_edit', 'schedule', 'tau'\]"),
    (dict(temperature=-1.0), "--temperature must be >= 0"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**{**dict(gen_length=16, block_length=8, steps=8), **kwargs})


def test_response_not_whole_blocks_is_decoded_in_the_blocks_covering_it(llada):
    """The response-length rule of every engine: 20 tokens in blocks of 8 decode 24 positions (3 blocks,
    ``steps`` the total over them) and return the first 20."""
    cfg = GenerationConfig(gen_length=20, block_length=8)
    assert (cfg.decoded_length, cfg.num_blocks, cfg.steps_per_block) == (24, 3, 8)
    cut, whole = generate(llada, PROMPTS, cfg), generate(llada, PROMPTS, gen_length=24, block_length=8, steps=24)
    assert cut.tokens.shape[1] == 20 and torch.equal(cut.tokens, whole.tokens[:, :20])


def test_runtime_errors(llada):
    with pytest.raises(ValueError, match="--prompt: 1030 prompt tokens \\+ --gen-length 16 exceed the model's "
                                         "max_sequence_length 1024"):
        generate(llada, [[50] * 1030], CFG)
    with pytest.raises(ValueError, match="--prompt: prompts must not contain the mask token id"):
        generate(llada, [[50, llada.args.mask_token_id]], CFG)

def test_missing_mask_token_id(tmp_path):
    from dllm_core import load_model
    from dllm_core.testing import build_tiny_checkpoint
    d = build_tiny_checkpoint(tmp_path / "m", "llada")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["mask_token_id"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mask_token_id: the model's config.json has none"):
        generate(load_model(d), PROMPTS, CFG)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dllm_core.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_generate_json(llada_dir, dream_dir, llada):
    out = run_cli("generate", "--model", str(llada_dir), "--prompt", "Hello world!", "--chat", "--gen-length", "16",
                  "--block-length", "8", "--steps", "8", "--json", "--logprobs", "2")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert set(r) >= {"text", "token_ids", "nfe", "seconds"} and r["nfe"] == 8 and len(r["token_ids"]) == 16
    assert len(r["logprobs"]) == 16 and all(len(t) == 2 for t in r["top_logprobs"])
    assert [t[0][0] for t in r["top_logprobs"]] == r["token_ids"]  # greedy: each token heads its step's list
    out = run_cli("generate", "--model", str(dream_dir), "--prompt", "a", "--prompt", "bcd", "--gen-length", "8",
                  "--block-length", "8", "--steps", "4", "--sampler", "threshold:tau=0.5", "--cache", "dual")
    assert out.returncode == 0, out.stderr and "nfe" in out.stderr


@pytest.mark.parametrize("args, match", [
    (["--gen-length", "10", "--steps", "4", "--block-length", "4"], r"--steps 4 must be a multiple of the number of "
                                                                     r"blocks 3 \(12 positions in blocks of 4\)"),
    (["--cache", "dllm:rho=3"], r"--cache dllm.rho must be in \[0.0, 1.0\], got 3.0"),
    (["--dtype", "int8"], r"--dtype must be one of \['float32', 'bfloat16', 'float16'\]"),
])
def test_cli_errors(llada_dir, args, match):
    import re
    out = run_cli("generate", "--model", str(llada_dir), "--prompt", "x", *args)
    assert out.returncode == 2 and re.search(match, out.stderr), out.stderr
