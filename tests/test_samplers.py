"""Transfer rules pinned on crafted confidence sequences, parity with SGLang, end-to-end matrix."""
import types

import pytest
import torch

from dllm_core import GenerationConfig, generate, make_sampler
from dllm_core.sampling import SAMPLERS, TokenContext, factor_commit, threshold_commit
from dllm_core.cache import CACHES
from conftest import PROMPTS

T = torch.tensor


def test_threshold_rule():
    conf = T([[0.95, 0.91, 0.89, 0.5], [0.3, 0.2, 0.6, 0.1], [0.99, 0.97, 0.2, 0.93]])
    masked = T([[1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0]]).bool()
    got = threshold_commit(conf, masked, 0.9)
    assert got.tolist() == [[True, True, False, False],   # every conf >= tau
                            [False, False, True, False],  # none qualifies: only the top-1 (forced)
                            [False, True, False, False]]  # unmasked positions are never committed


@pytest.mark.parametrize("seed", range(5))
def test_threshold_never_commits_below_tau_except_forced_top1(seed):
    g = torch.Generator().manual_seed(seed)
    conf, masked = torch.rand(6, 32, generator=g), torch.rand(6, 32, generator=g) < 0.7
    got = threshold_commit(conf, masked, 0.8)
    below = got & (conf < 0.8)
    assert (below.sum(-1) <= 1).all() and (got.sum(-1) >= masked.any(-1).long()).all()
    forced = below.any(-1)
    assert not (got[forced].sum(-1) > 1).any()  # the forced top-1 only when nothing qualified
    assert (got == masked & (conf >= 0.8) | below).all()


@pytest.mark.parametrize("spec", sorted(SAMPLERS) + ["threshold:tau=0.9,edit=0.5,post_edit=2",
                                                      "factor:f=1.0,edit=0.5,post_edit=0",
                                                      "low_confidence:schedule=llada2", "random:schedule=llada2",
                                                      "threshold:tau=0.9,schedule=llada2",
                                                      "threshold:tau=0.9,edit=0.5,post_edit=2,schedule=llada2",
                                                      "threshold:tau=0.5,edit=0.0,post_edit=0,schedule=llada2"])
def test_commits_fall_in_active_rows_only(spec):
    """Sampler.step's contract (take_step commits what it returns without masking by rows): rows without masks,
    or finished editing rows, commit nothing, whatever their logits."""
    sampler, L, B, mask = make_sampler(spec), 8, 6, 0
    g = torch.Generator().manual_seed(3)
    x = torch.randint(1, 20, (B, L), generator=g)
    x[:3, 2:] = mask  # rows 0-2 decode; rows 3-5 have no mask at all
    st = sampler.new_state(B, L, 4, "cpu")
    sampler.begin_block(st, x == mask)
    tc, seen = TokenContext(mask_id=mask), 0
    for _ in range(L + 4):
        active = sampler.active(st, x == mask)
        logits = torch.randn(B, L, 20, generator=g) * 3
        x0, commit = sampler.step(logits, x, st, tc)
        assert not (commit & ~active[:, None]).any()
        seen += int(commit.any())
        x = torch.where(commit, x0, x)
    assert seen > 0 and not (x == mask).any()


def test_factor_rule_n():
    # sorted 0.99, 0.8, 0.7, 0.5: n=2 -> 3 * 0.2 = 0.6 < 1; n=3 -> 4 * 0.3 = 1.2 >= 1 -> commit 2
    conf = T([[0.7, 0.99, 0.5, 0.8], [0.1, 0.2, 0.3, 0.05], [0.99, 0.99, 0.98, 0.97]])
    masked = torch.ones(3, 4, dtype=torch.bool)
    got = factor_commit(conf, masked, 1.0)
    assert got.tolist() == [[False, True, False, True], [False, False, True, False], [True] * 4]
    assert factor_commit(conf, masked, 2.0)[0].tolist() == [True, True, False, True]  # 4 * 0.3 < 2; 5 * 0.5 >= 2


def slowfast_steps(sampler, confs, L=8):
    """Drive SlowFast's select over a crafted per-step confidence sequence of one row."""
    st = sampler.new_state(1, L, L, "cpu")
    masked = torch.ones(1, L, dtype=torch.bool)
    sampler.begin_block(st, masked)
    trace = []
    for c in confs:
        commit = sampler.select(T([c]), masked, st, 0)
        masked &= ~commit
        lo, hi = sampler.focus(st)
        trace.append((commit[0].nonzero()[:, 0].tolist(), bool(st["fast"][0]), (int(lo), int(hi))))
    return trace


def test_slowfast_stable_span_then_fast_stage():
    sf = make_sampler("slowfast")  # min_conf 0.1, high 0.85, K 8, W 2, var 1.0
    tr = slowfast_steps(sf, [
        [0.9, 0.5, 0.3, 0.2, 0.05, 0.05, 0.05, 0.05],  # slow: commit 0, span end estimate 4
        [0.0, 0.6, 0.4, 0.2, 0.05, 0.05, 0.05, 0.05],  # slow: commit 1, estimate 4 again -> stable
        [0.0, 0.0, 0.9, 0.86, 0.95, 0.9, 0.9, 0.9],    # fast over [2, 4): both >= 0.85; 4.. outside
        [0.0, 0.0, 0.0, 0.0, 0.3, 0.2, 0.2, 0.2],      # span done -> slow again
    ])
    assert tr[0] == ([0], False, (0, 8))
    assert tr[1] == ([1], True, (2, 4))
    assert tr[2] == ([2, 3], False, (0, 8))
    assert tr[3] == ([4], False, (0, 8))


def test_slowfast_fast_stage_without_confident_tokens_commits_top_k_fast():
    sf = make_sampler("slowfast:k_fast=2")
    tr = slowfast_steps(sf, [
        [0.9, 0.5, 0.3, 0.3, 0.3, 0.3, 0.05, 0.05],  # estimate 6
        [0.0, 0.9, 0.3, 0.3, 0.3, 0.3, 0.05, 0.05],  # estimate 6 -> fast over [2, 6)
        [0.0, 0.0, 0.5, 0.7, 0.6, 0.2, 0.99, 0.1],   # none >= 0.85 in span: top-2 of span (3, 4)
    ])
    assert tr[1][1:] == (True, (2, 6))
    assert tr[2] == ([3, 4], True, (2, 6))


UNSTABLE = [[0.9] + [0.05] * 6 + [0.5], [0.0, 0.9, 0.5] + [0.05] * 5] * 2 + [[0.0] * 4 + [0.9, 0.5, 0.05, 0.4]]


def test_slowfast_unstable_fallback_uses_history_mean():
    sf = make_sampler("slowfast:k=3")
    tr = slowfast_steps(sf, UNSTABLE)  # estimates 8, 3, 8: variance > 1 -> after K=3 slow steps
    assert [t[1] for t in tr[:2]] == [False, False]
    assert tr[2] == ([7], True, (2, 6))  # span end = round(mean(3, 8)) = 6 from cursor 2


def test_slowfast_extreme_fallback_stays_slow():
    sf = make_sampler("slowfast:k=3,fallback=extreme")
    tr = slowfast_steps(sf, UNSTABLE)
    assert all(len(t[0]) == 1 and not t[1] for t in tr)


def test_slowfast_std_statistic():
    # estimates 4 and 6: variance 1.0 (not < 1), standard deviation 1.0 (< 1.5)
    seq = [[0.9, 0.5, 0.3, 0.2, 0.05, 0.05, 0.05, 0.05], [0.0, 0.9, 0.3, 0.2, 0.3, 0.3, 0.05, 0.05]]
    assert not slowfast_steps(make_sampler("slowfast"), seq)[1][1]
    assert slowfast_steps(make_sampler("slowfast:stat=std,var=1.5"), seq)[1][1]


@pytest.mark.parametrize("spec, match", [
    ("slowfast:high=1.5", r"--sampler slowfast.high must be in \[0.0, 1.0\]"),
    ("slowfast:k=0", "--sampler slowfast.k must be >= 1"),
    ("slowfast:fallback=none", r"--sampler slowfast.fallback must be one of \['extreme', 'mean'\]"),
    ("factor:f=0", "--sampler factor.f must be > 0"),
    ("maskgit_plus:alg_temp=-1", "--sampler maskgit_plus.alg_temp must be >= 0"),
    ("low_confidence:confidence=max", r"confidence must be one of \['low_confidence', 'random'"),
    ("threshold:tau=high", "--sampler threshold.tau: cannot parse 'high' as float"),
])
def test_bad_sampler_options(spec, match):
    with pytest.raises(ValueError, match=match):
        make_sampler(spec)


def test_threshold_matches_sglang_low_confidence():
    """Same logits -> the same committed positions and tokens as SGLang's own LowConfidence."""
    from sglang.srt.dllm.algorithm.low_confidence import LowConfidence
    from sglang.srt.dllm.config import DllmConfig

    B, L, V, mask = 4, 16, 50, 49
    algo = LowConfidence(DllmConfig("LowConfidence", {"threshold": 0.6}, L, mask, 8))
    ours = make_sampler("threshold:tau=0.6")
    tc = TokenContext(mask_id=mask)
    g = torch.Generator().manual_seed(0)
    ids = torch.full((B, L), mask)
    ids[1, :5] = 3  # a row whose block already has committed tokens
    st = ours.new_state(B, L, L, "cpu")
    ours.begin_block(st, ids == mask)
    for _ in range(6):
        logits = torch.randn(B, L, V, generator=g) * 4
        logits[..., mask] = -1e4  # neither side may propose [MASK]
        fb = types.SimpleNamespace(batch_size=B, input_ids=ids.clone().view(-1), dllm_prompt_mask=None)
        algo.step(fb, logits.view(B * L, V), [None] * B)
        x0, commit = ours.step(logits, ids, st, tc)
        ids = torch.where(commit, x0, ids)
        assert torch.equal(fb.input_ids.view(B, L), ids)


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_every_sampler_with_every_cache_end_to_end(model, sampler):
    cfg = GenerationConfig(gen_length=16, block_length=8, steps=8, sampler=sampler)
    for cache in sorted(CACHES):
        if cache == "canvas":
            continue  # covered by its own tests
        r = generate(model, PROMPTS, cfg, cache=cache)
        assert not (r.tokens == model.args.mask_token_id).any(), (sampler, cache)
        assert all(1 <= n <= 16 for n in r.nfe)


def test_schedules():
    from dllm_core.sampling.fixed import dream_count, llada2_count, llada_counts
    assert llada_counts(T([10, 8]), 4).tolist() == [[3, 3, 2, 2], [2, 2, 2, 2]]
    # LLaDA2: the block length (not its masks) over the steps; past the L-th step of more steps than L, none
    assert [int(llada2_count(T([i]), 10, 4)) for i in range(4)] == [3, 3, 2, 2]
    assert [int(llada2_count(T([i]), 4, 6)) for i in range(6)] == [1, 1, 1, 1, 0, 0]
    # Dream: int(n * (1 - s/t)) over linspace(1, 1e-3, 5): step 0 of 4 with 8 masks -> int(8 * 0.24975) = 1
    t = torch.linspace(1, 1e-3, 5)
    n = dream_count(T([8, 8, 3]), T([0, 2, 3]), 4, 1e-3)
    assert n.tolist() == [int(8 * (1 - t[1] / t[0])), int(8 * (1 - t[3] / t[2])), 3]  # the last step takes all


def test_slowfast_positional_caching_through_the_cache_policy(dream):
    """In SlowFast's fast stage the dual cache recomputes only the span: a new span is a refresh
    point (one full forward), then steps run the span alone against cached K/V elsewhere."""
    from dllm_core.cache import DualCache
    from dllm_core.cache.fast_dllm import PrefixState

    widths = []

    class SpyState(PrefixState):
        def _window(self, ids, pos, at, keep, mask):
            widths.append(ids.shape[1])
            return super()._window(ids, pos, at, keep, mask)

    class Spy(DualCache):
        state_cls = SpyState

    prompts = [PROMPTS[0]]
    cfg = GenerationConfig(gen_length=32, block_length=16, steps=32, sampler="slowfast:min_conf=0.02,var=4,k=3")
    r = generate(dream, prompts, cfg, cache=Spy())
    T = len(prompts[0]) + 32
    spans = [w for w in widths if w < 16 + 1]  # narrower than block (+1 shifted row): fast-stage steps
    assert spans, widths
    assert widths.count(T) > 2  # refreshed at each block start and at each new span
    assert 16 + 1 in widths  # slow-stage steps run the whole block (+ the shifted row)
    assert not (r.tokens == dream.args.mask_token_id).any()
