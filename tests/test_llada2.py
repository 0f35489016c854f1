"""LLaDA2 (``llada2_moe``): the published checkpoint layout, its MoE and attention against plain references,
block-causal semantics, the embedded engine's exact prefix cache, and LLaDA2.1 token editing (against
SGLang's own ``JointThreshold``)."""
import json
import math

import numpy as np
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
    with pytest.raises(ValueError, match=r"--sampler threshold.schedule must be one of \['fast_dllm', 'llada2'\], "
                                         r"got 'official'"):
        make_sampler("threshold:schedule=official")
    with pytest.raises(ValueError, match=r"--sampler low_confidence.schedule must be one of \['dream', 'llada', "
                                         r"'llada2'\], got 'llada3'"):
        make_sampler("low_confidence:schedule=llada3")


def test_grid_requests_attend_a_chunk_after_cached_pages_block_causally():
    """A paged host's non-causal attention over the core's ``GridRequests`` (one request per grid block of each prompt
    chunk, its keys up to its block's end) is the block-causal attention of the whole prompt, for chunks after cached
    pages; a request that is not a chunk stays whole; a page that cuts a grid block is refused."""
    from dllm_core.engine.context import GridRequests
    from dllm_core.engine.generate import block_causal_mask, prefix_pages_error

    g = torch.Generator().manual_seed(0)
    block, P, heads, hd = 4, 21, 2, 8
    q, k, v = (torch.randn(heads, P, hd, generator=g) for _ in range(3))
    pos = torch.arange(P)[None]
    full = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=block_causal_mask(
        torch.ones_like(pos, dtype=torch.bool), pos, block))[0]  # [H, P, hd]
    # rows: request 0 = positions 8..20 of the prompt (8 cached), request 1 = 5 rows of something else
    grid = GridRequests.of(np.array([0, 13, 18]), np.array([P, 40]), np.array([True, False]), block)
    assert grid.req.tolist() == [0, 0, 0, 0, 1] and grid.qsl.tolist() == [0, 4, 8, 12, 13, 18]
    assert grid.back.tolist() == [9, 5, 1, 0, 0]
    for r in range(4):
        rows, end = slice(int(grid.qsl[r]), int(grid.qsl[r + 1])), P - int(grid.back[r])
        qs = q[:, 8 + rows.start:8 + rows.stop]
        o = F.scaled_dot_product_attention(qs[None], k[None, :, :end], v[None, :, :end])[0]
        assert torch.allclose(o, full[:, 8 + rows.start:8 + rows.stop], atol=1e-6), r
    assert prefix_pages_error(128, 32) is None and prefix_pages_error(64, 8) is None
    assert "allowed: multiples of 32" in prefix_pages_error(16, 32)


# ---- LLaDA2's official schedule (``schedule=llada2``) against a transcription of the official ``generate`` --------
# The official loop (``LLaDA2MoeModelLM.generate`` in the checkpoints' modeling_llada2_moe.py; docs/llada2.md) is
# written out below step for step, greedy: LLaDA2.0's (``edit`` None: a schedule of the block length over the
# steps, a block ending at its first step without a mask) and LLaDA2.1's (``edit``: a fixed num_to_transfer of 1,
# T2T editing, ``max_post_steps`` mask-free forwards). Their EOS stops between blocks are left out (our engines
# decode every block; the tokens up to the first EOS are the same).

def _greedy(logits):
    """The official greedy proposal: argmax of the whole vocabulary and its softmax probability. [L, V] -> [L], [L]."""
    x0 = logits.argmax(-1)
    return x0, logits.softmax(-1).gather(-1, x0[:, None])[:, 0]


def _top(conf, k):
    pick = torch.zeros(conf.shape, dtype=torch.bool)
    pick[conf.topk(k).indices] = True
    return pick


def official_block(forward, blk, in_prompt, steps, tau, edit=None, post_max=16, mask=3):
    """One block of the official loop. forward() -> logits [L, V] of the block; blk [L] (a view, written in place);
    in_prompt [L] bool: prompt positions in the block. -> forwards run."""
    L, forwards = blk.shape[0], 0
    if edit is None:  # LLaDA2.0
        sched = [L // steps + (i < L % steps) for i in range(steps)]
        for step in range(steps):
            active = blk == mask
            if not active.any():
                break
            x0, p = _greedy(forward())
            forwards += 1
            conf = torch.where(active, p, -math.inf)
            high = conf > tau
            pick = high if int(high.sum()) >= sched[step] else _top(conf, min(sched[step], int(active.sum())))
            blk[pick] = x0[pick]
        return forwards
    post = 0  # LLaDA2.1
    while True:
        old, active = blk.clone(), blk == mask
        if not active.any():
            post += 1
        if post > post_max:
            break
        x0, p = _greedy(forward())
        forwards += 1
        m2t = torch.zeros_like(active)
        if active.any():
            conf = torch.where(active, p, -math.inf)
            high = (conf > tau) & active
            m2t = high if int(high.sum()) >= 1 else _top(conf, 1)
        t2t = ~active & ~in_prompt & (p > edit) & (x0 != old)
        blk[m2t | t2t] = x0[m2t | t2t]
        if not active.any() and not t2t.any():
            break
    return forwards


def official_generate(model, prompt, gen_length, steps, tau, edit=None, post_max=16):
    """The official block loop over a prompt on ``model`` (its forward over the sequence up to the block's end,
    block-causal on the absolute grid). -> (generated tokens, forwards)."""
    from dllm_core.engine.generate import block_causal_mask

    L, mask, P = model.block_causal, model.args.mask_token_id, len(prompt)
    steps = min(steps, gen_length)
    n_blocks = -(-(P + gen_length) // L)
    x = torch.full((1, n_blocks * L), mask)
    x[0, :P] = torch.tensor(prompt)
    pos = torch.arange(n_blocks * L)[None]
    forwards = 0
    for b in range(P // L, n_blocks):
        end = (b + 1) * L
        att = block_causal_mask(torch.ones(1, end, dtype=torch.bool), pos[:, :end], L)
        forwards += official_block(lambda: model(x[:, :end], pos[:, :end], att)[0, -L:], x[0, end - L:end],
                                   torch.arange(end - L, end) < P, steps, tau, edit, post_max, mask)
    return x[0, P:P + gen_length].tolist(), forwards


def ours_block(spec, x, streams, steps, mask=3):
    """Our sampler over a batch of blocks x [B, L] as the engines drive it (plan_step / take_step), row b's k-th
    forward seeing streams[b][k]. -> (x, forwards per row)."""
    from dllm_core.engine import plan_step, take_step

    sampler, tc, (B, L) = make_sampler(spec), TokenContext(mask), x.shape
    st, used = sampler.new_state(B, L, steps, "cpu"), [0] * B
    sampler.begin_block(st, x == mask)
    for _ in range(sampler.max_steps(L, steps) + 1):
        if sampler.block_done(st, masked := x == mask):
            break
        plan = plan_step(sampler, st, masked)
        logits = torch.stack([streams[b][min(used[b], len(streams[b]) - 1)] for b in range(B)])
        x, _ = take_step(sampler, st, plan, logits, x, tc)
        used = [u + int(a) for u, a in zip(used, plan.active.tolist())]
    assert sampler.block_done(st, x == mask)
    return x, used


TAILS, V = (0, 3, 5, 7), 24  # rows: prompt tails of 0 (a whole block to decode), 3, 5 and 7 positions


def _random_blocks(seed, L=8, n=30, mask=3):
    """Blocks with prompt tails and, per row, a stream of random logits ([MASK] never the argmax)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.full((len(TAILS), L), mask)
    for b, t in enumerate(TAILS):
        x[b, :t] = torch.randint(4, V, (t,), generator=g)
    streams = torch.randn(len(TAILS), n, L, V, generator=g) * 3
    streams[..., mask] = -1e4
    return x, streams


def official_rows(x, streams, steps, tau, edit=None, post_max=16):
    """The official block loop on each row of x with its stream of logits. -> (x, forwards per row)."""
    out, forwards = x.clone(), []
    for b, t in enumerate(TAILS):
        it = iter(streams[b])
        forwards.append(official_block(lambda: next(it), out[b], torch.arange(x.shape[1]) < t, steps, tau, edit,
                                       post_max))
    return out, forwards


OFFICIAL_CASES = [  # spec, steps per block, the official loop's (threshold, editing_threshold, max_post_steps)
    ("low_confidence:schedule=llada2", 8, (1.0, None, 0)),  # threshold 1: never passed, the schedule alone
    ("low_confidence:schedule=llada2", 3, (1.0, None, 0)),
    ("low_confidence:schedule=llada2", 11, (1.0, None, 0)),
    ("threshold:tau=0.9,schedule=llada2", 8, (0.9, None, 0)),
    ("threshold:tau=0.6,schedule=llada2", 3, (0.6, None, 0)),
    ("threshold:tau=0.3,schedule=llada2", 2, (0.3, None, 0)),
    ("threshold:tau=0.5,edit=0.4,post_edit=2,schedule=llada2", 8, (0.5, 0.4, 2)),
    ("threshold:tau=0.3,edit=0.0,post_edit=0,schedule=llada2", 8, (0.3, 0.0, 0)),
    ("threshold:tau=0.8,edit=0.6,post_edit=16,schedule=llada2", 8, (0.8, 0.6, 16)),
    ("threshold:tau=0.5,edit=0.9,post_edit=1,schedule=llada2", 3, (0.5, 0.9, 1)),
]


@pytest.mark.parametrize("spec, steps, official", OFFICIAL_CASES)
@pytest.mark.parametrize("seed", range(4))
def test_official_schedule_on_random_logits(spec, steps, official, seed):
    """schedule=llada2 commits what the official loop commits, step for step on the same logits, in a batch of rows
    with prompt tails: identical tokens and forwards per row."""
    x, streams = _random_blocks(seed)
    want, want_forwards = official_rows(x, streams, steps, *official)
    got, forwards = ours_block(spec, x, streams, steps)
    assert torch.equal(got, want) and forwards == want_forwards


def test_default_schedules_differ_from_the_official_one():
    """The three differences the option exists for, on the same logits (docs/llada2.md)."""
    x, streams = _random_blocks(0)
    # 1. low_confidence on a prompt-tail block: the remaining masks split over every step vs the block length
    want, want_forwards = official_rows(x, streams, 8, 1.0)
    got, forwards = ours_block("low_confidence", x, streams, 8)
    assert forwards == [8] * 4 and want_forwards == [8 - t for t in TAILS]  # one per step either way ...
    assert torch.equal(got, want)  # ... so the same tokens: only the idle steps differ
    want, want_forwards = official_rows(x, streams, 3, 1.0)
    got, forwards = ours_block("low_confidence", x, streams, 3)
    assert forwards == [3] * 4 and want_forwards == [3, 2, 1, 1] and not torch.equal(got, want)
    # 2. editing: the budget spent, ours runs one more forward (committing nothing)
    for seed in range(3):
        x, streams = _random_blocks(seed)
        want, want_forwards = official_rows(x, streams, 8, 0.3, 0.0, 0)
        got, forwards = ours_block("threshold:tau=0.3,edit=0.0,post_edit=0", x, streams, 8)
        assert torch.equal(got, want) and forwards == [n + 1 for n in want_forwards]
    # 3. fewer steps than positions: the official rule commits the scheduled n when too few pass, ours the top-1
    x, streams = _random_blocks(1)
    want, want_forwards = official_rows(x, streams, 2, 0.6)
    got, forwards = ours_block("threshold:tau=0.6", x, streams, 2)
    assert max(want_forwards) <= 2 < max(forwards) and not torch.equal(got, want)


SHIPPED = __import__("pathlib").Path(__file__).resolve().parents[1] / "models" / "llada2-tasks"


@pytest.fixture(scope="module")
def shipped():
    if not (SHIPPED / "config.json").is_file():
        pytest.skip("models/llada2-tasks not shipped")
    from dllm_core import load_tokenizer
    from dllm_core.tasks import make_task
    from dllm_core.tasks.evaluate import prompts_of

    tok = load_tokenizer(SHIPPED)
    return load_model(SHIPPED, dtype=torch.float32), prompts_of(tok, make_task("arithmetic").examples("test", 6))


@pytest.mark.parametrize("spec, steps, official, cache", [
    ("low_confidence:schedule=llada2", 8, (1.0, None, 0), "none"),
    ("low_confidence:schedule=llada2", 3, (1.0, None, 0), "prefix"),
    ("threshold:tau=0.9,schedule=llada2", 8, (0.9, None, 0), "none"),
    ("threshold:tau=0.9,schedule=llada2", 2, (0.9, None, 0), "prefix"),
    ("threshold:tau=0.7,edit=0.5,post_edit=2,schedule=llada2", 8, (0.7, 0.5, 2), "none"),
    ("threshold:tau=0.5,edit=0.0,post_edit=0,schedule=llada2", 8, (0.5, 0.0, 0), "prefix"),
])
def test_official_schedule_on_the_shipped_model(shipped, spec, steps, official, cache):
    """models/llada2-tasks, six held-out arithmetic prompts (grid offsets vary) in one batch: the embedded engine
    with schedule=llada2 == the official loop on the same model, tokens and forwards per prompt."""
    model, prompts = shipped
    G = 24  # the task's answer: 3 blocks of 8 (+ the prompt's tail block)
    r = generate(model, prompts, gen_length=G, block_length=model.block_causal, steps=steps * G // model.block_causal,
                 sampler=spec, cache=cache)
    for i, p in enumerate(prompts):
        tokens, forwards = official_generate(model, p, G, steps, *official)
        assert r.tokens[i].tolist() == tokens and r.nfe[i] == forwards, (i, spec)
