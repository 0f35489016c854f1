"""LLaDA2 (``llada2_moe``): the published checkpoint layout, its MoE and attention against plain references,
block-causal semantics, the embedded engine's exact prefix cache, and LLaDA2.1 token editing (against
SGLang's own ``JointThreshold``)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dllm_core import load_model
from dllm_core.engine import GenerationConfig, generate
from dllm_core.engine.step import denoise_step
from dllm_core.sampling import TokenContext, make_sampler

BL = 8  # the tiny checkpoint's block_size
PROMPTS = [[0, 7, 9, 11, 13], list(range(20, 31)), list(range(40, 57))]  # 5, 11, 17 tokens: 3 grid offsets


@pytest.fixture(scope="module")
def llada2(llada2_dir):  # llada2_dir: tests/conftest.py
    return load_model(llada2_dir)


def test_published_layout(llada2_dir, llada2):
    """Key names and config fields as LLaDA2.0-mini publishes them; save/load round trip; the merged
    3-D expert layout (dFactory's) loads to the same model."""
    cfg = json.loads((llada2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llada2_moe" and cfg["architectures"] == ["LLaDA2MoeModelLM"]
    for f in ("num_experts", "num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace",
              "moe_intermediate_size", "num_shared_experts", "partial_rotary_factor", "routed_scaling_factor",
              "score_function", "moe_router_enable_expert_bias", "norm_topk_prob", "head_dim"):
        assert f in cfg, f
    sd = load_file(llada2_dir / "model.safetensors")
    L0, L1 = "model.layers.0.", "model.layers.1."
    want = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight",
            L0 + "mlp.gate_proj.weight", L0 + "mlp.up_proj.weight", L0 + "mlp.down_proj.weight",
            L1 + "mlp.gate.weight", L1 + "mlp.gate.expert_bias", L1 + "mlp.shared_experts.down_proj.weight",
            L1 + "mlp.experts.7.up_proj.weight"}
    for i in (0, 1):
        want |= {f"model.layers.{i}.{k}.weight" for k in (
            "input_layernorm", "post_attention_layernorm", "attention.query_key_value", "attention.dense",
            "attention.query_layernorm", "attention.key_layernorm")}
    assert want <= set(sd)
    a = llada2.args
    assert sd[L1 + "attention.query_key_value.weight"].shape == ((a.n_heads + 2 * a.n_kv_heads) * a.head_dim, a.dim)
    assert sd[L1 + "attention.query_layernorm.weight"].shape == (a.head_dim,)
    assert sd[L1 + "mlp.experts.3.gate_proj.weight"].shape == (cfg["moe_intermediate_size"], a.dim)
    assert not any(".experts.8." in k for k in sd) and a.rotary_dim == a.head_dim // 2


def test_merged_expert_layout_loads(tmp_path, llada2_dir, llada2):
    sd = load_file(llada2_dir / "model.safetensors")
    merged = {k: v for k, v in sd.items() if ".experts." not in k}
    for p in ("gate_proj", "up_proj", "down_proj"):
        merged[f"model.layers.1.mlp.experts.{p}"] = torch.stack([sd[f"model.layers.1.mlp.experts.{e}.{p}.weight"]
                                                                 for e in range(8)])
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((llada2_dir / f).read_bytes())
    save_file(merged, tmp_path / "model.safetensors")
    m = load_model(tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), llada2.parameters()))
    del merged["model.layers.1.mlp.experts.up_proj"]
    save_file(merged, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing keys.*experts.up_proj"):
        load_model(tmp_path)


def _route(moe, x):
    """Routing written out per token: sigmoid scores, bias for the choice, groups by top-2 sum."""
    a, out = moe.a, []
    for t in x:
        s = torch.sigmoid(moe.gate.float() @ t.float())
        c = s + moe.expert_bias.float()
        g = c.view(a.n_group, -1)
        gsc = [sorted(row.tolist(), reverse=True)[:2] for row in g]
        keep = sorted(range(a.n_group), key=lambda i: -sum(gsc[i]))[:a.topk_group]
        cand = [e for e in range(a.n_experts) if e // (a.n_experts // a.n_group) in keep]
        top = sorted(cand, key=lambda e: -c[e].item())[:a.top_k]
        w = s[top] / s[top].sum() * a.routed_scale
        out.append((top, w))
    return out


def test_moe_against_per_token_experts(llada2):
    """The grouped-matmul MoE equals a loop over tokens and their chosen experts (+ shared expert)."""
    moe = llada2.layers[1].mlp
    x = torch.randn(37, llada2.args.dim)
    idx, w = moe.route(x)
    want = torch.zeros_like(x)
    for n, (top, wt) in enumerate(_route(moe, x)):
        assert sorted(idx[n].tolist()) == sorted(top)
        for e, we in zip(top, wt):
            h = F.silu(moe.w_gate[e] @ x[n]) * (moe.w_up[e] @ x[n])
            want[n] += we * (moe.w_down[e] @ h)
    want += moe.shared(x)
    torch.testing.assert_close(moe(x[None])[0], want, atol=1e-5, rtol=1e-5)


def _reference_logits(m, ids, block):
    """The whole model written plainly from the checkpoint tensors (HF names), block-causal on the grid."""
    sd, a = m.state_dict(), m.args
    T, D, H, Hk, r = ids.shape[1], a.head_dim, a.n_heads, a.n_kv_heads, a.rotary_dim

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + a.norm_eps) * w

    def rope(t):  # t [H, T, D]: rotate-half on the first r dims
        inv = 1.0 / a.rope_theta ** (torch.arange(0, r, 2).float() / r)
        ang = torch.arange(T).float()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = t[..., :r // 2], t[..., r // 2:r]
        return torch.cat([t[..., :r] * cos + torch.cat([-x2, x1], -1) * sin, t[..., r:]], -1)

    blk = torch.arange(T) // block
    bias = torch.where(blk[None, :] <= blk[:, None], 0.0, -math.inf)
    h = sd["embed.weight"][ids[0]]
    for i, layer in enumerate(m.layers):
        p = f"layers.{i}."
        qkv = (norm(h, sd[p + "attn_norm.weight"]) @ sd[p + "qkv_proj.weight"].T).view(T, H + 2 * Hk, D)
        q, k, v = qkv[:, :H], qkv[:, H:H + Hk], qkv[:, H + Hk:]
        q = rope(norm(q, sd[p + "q_norm.weight"]).transpose(0, 1))
        k = rope(norm(k, sd[p + "k_norm.weight"]).transpose(0, 1)).repeat_interleave(H // Hk, 0)
        att = (q @ k.transpose(1, 2) / math.sqrt(D) + bias).softmax(-1) @ v.transpose(0, 1).repeat_interleave(H // Hk, 0)
        h = h + att.transpose(0, 1).reshape(T, -1) @ sd[p + "o_proj.weight"].T
        h = h + layer.mlp(norm(h, sd[p + "ffn_norm.weight"])[None])[0]
    return (norm(h, sd["norm.weight"]) @ sd["lm_head.weight"].T)[None]


def test_forward_is_block_causal_and_matches_the_plain_model(llada2):
    from dllm_core.engine.generate import block_causal_mask

    ids = torch.randint(0, 300, (1, 21))
    keep, pos = torch.ones_like(ids, dtype=torch.bool), torch.arange(21)[None]
    mask = block_causal_mask(keep, pos, BL)
    got = llada2(ids, pos, mask)
    torch.testing.assert_close(got, _reference_logits(llada2, ids, BL), atol=1e-4, rtol=1e-4)
    later = ids.clone()
    later[0, 16:] = torch.randint(0, 300, (5,))  # the third block only
    torch.testing.assert_close(llada2(later, pos, mask)[:, :16], got[:, :16], atol=1e-5, rtol=1e-5)  # SDPA order only
    assert not torch.allclose(llada2(later, pos, mask)[:, 16:], got[:, 16:])


SAMPLERS = ["low_confidence", "threshold:tau=0.5", "slowfast", "threshold:tau=0.5,edit=0.5", "factor:f=1.5,edit=0.9"]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_generate_caches_exact_and_batching_invisible(llada2, sampler):
    """Block-causal generation: prefix and dual caches reproduce the uncached loop token for token (and
    recompute less); a batch of prompts on three grid offsets equals each prompt alone."""
    cfg = GenerationConfig(gen_length=16, block_length=BL, steps=24, sampler=sampler)
    ref = generate(llada2, PROMPTS, cfg)
    for i, p in enumerate(PROMPTS):
        one = generate(llada2, [p], cfg)
        assert torch.equal(one.tokens[0], ref.tokens[i]) and one.nfe[0] == ref.nfe[i]
    for cache in ("prefix", "dual", "canvas", "dllm:kr=1"):  # dllm: inside the block, kr=1 exact
        r = generate(llada2, PROMPTS, cfg, cache=cache)
        assert torch.equal(r.tokens, ref.tokens), cache
        assert r.nfe == ref.nfe and r.counters.token_layers < 0.7 * ref.counters.token_layers
    cached = generate(llada2, PROMPTS, cfg, cache="dllm:kr=2,rho=0.25")  # approximate: reuses block features
    assert cached.counters.ratio() < generate(llada2, PROMPTS, cfg, cache="canvas").counters.ratio()  # per forward
    for i, p in enumerate(PROMPTS):
        assert torch.equal(generate(llada2, [p], cfg, cache="dllm:kr=2,rho=0.25").tokens[0], cached.tokens[i])


def test_prompt_tail_shares_the_first_block(llada2):
    """The block grid is absolute (as LLaDA2 was trained): a 5-token prompt leaves 3 masks in grid block 0,
    so 16 generated tokens span grid blocks 0, 1 and 2 (the last decoded whole, its tail cut): three blocks
    of steps / (gen_length / block_length) = 8 fixed steps each."""
    r = generate(llada2, [PROMPTS[0]], gen_length=16, block_length=BL, steps=16, sampler="low_confidence")
    assert r.tokens.shape == (1, 16) and (r.tokens != llada2.args.mask_token_id).all()
    assert r.nfe == [3 * 8]
    r = generate(llada2, [PROMPTS[0] + [1, 2, 3]], gen_length=16, block_length=BL, steps=16, sampler="low_confidence")
    assert r.nfe == [2 * 8]  # an 8-token prompt: the answer fills grid blocks 1 and 2 exactly
    both = generate(llada2, [PROMPTS[0] + [1, 2, 3], PROMPTS[0]], gen_length=16, block_length=BL, steps=16,
                    sampler="low_confidence")  # the first row has nothing in the batch's last block
    assert both.nfe == [16, 24] and torch.equal(both.tokens[0], r.tokens[0])


def test_editing_off_is_the_plain_rule(llada2):
    """edit unset = the threshold rule; edit=1 never edits (p > 1 is impossible): same tokens, and each
    block costs one more forward (the step that changes nothing ends it)."""
    cfg = GenerationConfig(gen_length=16, block_length=BL, steps=16, sampler="threshold:tau=0.7")
    plain = generate(llada2, PROMPTS, cfg)
    off = generate(llada2, PROMPTS, cfg, sampler="threshold:tau=0.7,edit=1.0")
    assert torch.equal(off.tokens, plain.tokens)
    assert off.nfe == [n + 3 for n in plain.nfe]  # 3 blocks each
    edited = generate(llada2, PROMPTS, cfg, sampler="threshold:tau=0.7,edit=0.3")
    assert not torch.equal(edited.tokens, plain.tokens)


def test_editing_commits_what_sglang_joint_threshold_commits():
    """Our editing rule and SGLang's JointThreshold (its per-row path) on the same logits, step by step:
    identical tokens and done flags (rows with prompt tails, with and without post-edit budget)."""
    from types import SimpleNamespace

    from sglang.srt.dllm.algorithm.joint_threshold import JointThreshold
    from sglang.srt.dllm.config import DllmConfig

    B, L, V, mask = 4, 8, 24, 3
    for tau, edit, post in ((0.5, 0.4, 2), (0.3, 0.0, 0), (0.8, 0.6, 16)):
        algo = JointThreshold(DllmConfig("JointThreshold", {"threshold": tau, "edit_threshold": edit,
                                                            "max_post_edit_steps": post}, L, mask, B))
        x = torch.full((B, L), mask)
        x[1, :3], x[3, :5] = torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12])  # prompt tails
        fb = SimpleNamespace(input_ids=x.flatten().clone(), batch_size=B, dllm_prompt_mask=None)
        states = algo.init_step_state(fb)
        sampler = make_sampler(f"threshold:tau={tau},edit={edit},post_edit={post}")
        tc = TokenContext(mask)
        st = sampler.new_state(B, L, L, "cpu")
        sampler.begin_block(st, x == mask)
        ours, gen = x.clone(), torch.Generator().manual_seed(int(tau * 10))
        for _ in range(algo.max_steps(L)):
            logits = torch.randn(B, L, V, generator=gen) * 3
            logits[..., mask] = -1e4  # neither proposes [MASK]
            theirs = algo.step(fb, logits.flatten(0, 1).clone(), states)
            run = ~st["fin"]
            ours_new, done = denoise_step(sampler, st, logits, ours, tc)
            ours = torch.where(run[:, None], ours_new, ours)
            assert torch.equal(ours.flatten(), fb.input_ids), (tau, edit, post)
            assert done.tolist() == theirs
            if all(theirs):
                break
        assert all(theirs)


def test_bad_llada2_options(llada2):
    with pytest.raises(ValueError, match="--block-length 16 does not match the checkpoint's block_size 8"):
        generate(llada2, PROMPTS[:1], gen_length=16, block_length=16, steps=16)
    with pytest.raises(ValueError, match=r"--cache canvas.blocks=2: a block-causal LLaDA2MoeModelLM decodes one "
                                         r"block per canvas \(blocks=1\)"):
        generate(llada2, PROMPTS[:1], gen_length=16, block_length=BL, steps=16, cache="canvas:blocks=2")
    with pytest.raises(ValueError, match=r"--sampler threshold.edit must be in \[0.0, 1.0\], got 1.5"):
        make_sampler("threshold:edit=1.5")
    with pytest.raises(ValueError, match="low_confidence has no option 'edit'"):
        make_sampler("low_confidence:edit=0.5")
