"""TokenSwift core: tree mask / verification, n-gram table, dynamic draft cache, penalty window, heads,
and losslessness of the decoding loop (greedy tokens identical to AR for any draft-side settings)."""
import pytest
import torch

from dllm_core.drafters.tokenswift import (ContextualPenalty, DynamicDraftCache, HeadsConfig, KVCache, NGramTable,
                                           TokenSwiftConfig, TokenSwiftHeads, Tree, accept_tree,
                                           autoregressive_generate, build_tree, group_scores, load_heads, save_heads,
                                           tokenswift_generate, tree_attention_mask)
from dllm_core.drafters.tokenswift.attention import use_tokenswift_attention
from dllm_core.drafters.tokenswift.draft import head_paths
from dllm_core.drafters.tokenswift.tree import path_token_mask, tree_position_ids
from dllm_core.drafters.verify import SamplingParams

PROMPT = list(range(10, 40))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from dllm_core.drafters.target import load_target
    from dllm_core.drafters.tiny import build_tiny_target

    return load_target(build_tiny_target(tmp_path_factory.mktemp("ts_target")))


@pytest.fixture(scope="module")
def heads(target):
    h = TokenSwiftHeads(HeadsConfig.for_target(target.config))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for f in h.layers:
            f.weight.copy_(torch.randn(f.weight.shape, generator=g) * 0.1)
    return h.eval()


# --- tree ------------------------------------------------------------------------------------------------------
def test_build_tree_merges_prefixes_and_mask_sees_only_ancestors():
    tree = build_tree(7, [[1, 2, 3], [1, 2, 4], [5, 6], [1, 9]])
    assert tree.tokens.tolist() == [7, 1, 2, 3, 4, 5, 6, 9]
    assert tree.parents.tolist() == [0, 0, 1, 2, 2, 0, 5, 1]
    assert tree.depth.tolist() == [0, 1, 2, 3, 3, 1, 2, 2]
    mask = tree_attention_mask(tree, prefix_len=5)[0, 0]  # [8, 13]
    assert mask.shape == (8, 13) and mask[:, :5].all()
    block = mask[:, 5:]
    for i in range(tree.size):  # a node attends to exactly its root..node path
        path, j = {i}, i
        while j != 0:
            j = int(tree.parents[j])
            path.add(j)
        assert set(torch.nonzero(block[i]).flatten().tolist()) == path
    # siblings / cousins never see each other: 3 and 4 (siblings), 6 and 2 (cousins), 9 and 2 (siblings)
    for a, b in [(3, 4), (4, 3), (6, 2), (2, 6), (7, 2), (2, 7), (7, 3)]:
        assert not block[a, b]
    assert tree_position_ids(tree, 5).tolist() == [[5, 6, 7, 8, 8, 6, 7, 7]]
    assert sorted(map(tuple, tree.chains.tolist())) == [(1, 2, 3), (1, 2, 4), (1, 7, -1), (5, 6, -1)]
    row = tree.chains.tolist().index([1, 7, -1])
    assert tree.drafts[row].tolist() == [1, 9, -1] and tree.before[row].tolist() == [0, 1, 7, 0]


def test_build_tree_respects_max_nodes():
    tree = build_tree(0, [[1, 2, 3], [4, 5, 6]], max_nodes=4)
    assert tree.tokens.tolist() == [0, 1, 2, 3, 4]


@torch.inference_mode()
def test_tree_forward_equals_each_path_alone(target):
    """One tree forward (4D mask + position ids through the transformers model) gives, at every node, the
    logits of running that node's root..node path causally after the prefix."""
    prefix = PROMPT[:12]
    tree = build_tree(50, [[60, 61, 62], [60, 70], [80, 81], [90]])
    body, lm = target.get_decoder(), target.get_output_embeddings()
    with use_tokenswift_attention(target):
        cache = KVCache()
        body(input_ids=torch.tensor([prefix]), position_ids=torch.arange(len(prefix))[None],
             attention_mask={"full_attention": None}, past_key_values=cache, use_cache=True)
        cache.commit()
        h = body(input_ids=tree.tokens[None], position_ids=tree_position_ids(tree, len(prefix)),
                 attention_mask={"full_attention": tree_attention_mask(tree, len(prefix))}, past_key_values=cache,
                 use_cache=True).last_hidden_state[0]
    got = lm(h)
    for i in range(tree.size):
        path, j = [i], i
        while j != 0:
            j = int(tree.parents[j])
            path.append(j)
        seq = prefix + tree.tokens[path[::-1]].tolist()
        want = target(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(got[i], want, atol=2e-4, rtol=1e-4)


def test_accept_tree_longest_valid_path_and_bonus():
    tree = build_tree(7, [[1, 2, 3], [1, 2, 4], [5, 6]])  # nodes: 0:7 1:1 2:2 3:3 4:4 5:5 6:6
    choice = torch.tensor([1, 2, 4, 11, 12, 6, 13])  # target after root->1, after 1->2, after 2->4 ...
    acc = accept_tree(tree, choice)
    assert acc.nodes == [1, 2, 4] and int(acc.next_token) == 12
    acc = accept_tree(tree, torch.tensor([5, 9, 9, 9, 9, 8, 9]))
    assert acc.nodes == [5] and int(acc.next_token) == 8
    acc = accept_tree(tree, torch.tensor([3, 9, 9, 9, 9, 9, 9]))
    assert acc.nodes == [] and int(acc.next_token) == 3
    only_root = build_tree(7, [])
    assert accept_tree(only_root, torch.tensor([4])).nodes == []


def test_accept_tree_breaks_ties_at_random():
    """Two equally valid paths (duplicate branches, as unmerged candidates give): each is chosen for some seed,
    and the emitted tokens are the same either way."""
    tree = Tree(tokens=torch.tensor([7, 1, 1]), parents=torch.tensor([0, 0, 0]), depth=torch.tensor([0, 1, 1]),
                ancestors=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool),
                chains=torch.tensor([[1], [2]]), drafts=torch.tensor([[1], [1]]), before=torch.tensor([[0, 1], [0, 2]]))
    choice = torch.tensor([1, 5, 5])
    picks = {tuple(accept_tree(tree, choice, torch.Generator().manual_seed(s)).nodes) for s in range(20)}
    assert picks == {(1,), (2,)}
    assert {int(accept_tree(tree, choice, torch.Generator().manual_seed(s)).next_token) for s in range(5)} == {5}


def test_head_paths_beam():
    logits = torch.full((2, 6), -10.0)
    logits[0, 1], logits[0, 2] = 5.0, 4.0
    logits[1, 3], logits[1, 4] = 5.0, 3.0
    assert head_paths(logits, k=2, m=3) == [[1, 3], [2, 3], [1, 4]]


# --- n-gram table ----------------------------------------------------------------------------------------------
def test_ngram_table_counts_topk_and_incremental_updates():
    stream = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2, 8]
    inc = NGramTable(3)
    for i in range(0, len(stream), 3):  # chunked updates == one update
        inc.update(stream[i:i + 3])
    full = NGramTable(3)
    full.update(stream)
    assert inc.table == full.table
    assert full.count((1, 2, 3)) == 3 and full.count((2, 3, 4)) == 2 and full.count((2, 3, 5)) == 1
    assert full.top(1, 5) == [(2, 3), (2, 8)]  # count 3, then 1
    assert full.top(2, 5) == [(3, 4), (3, 5)]
    assert full.top(3, 3) == [(4, 9), (5, 1), (4, 1)]  # all seen once: the most recent first
    assert full.top(3, 1) == [(4, 9)]
    assert full.top(42, 3) == [] and len(full) == len(set(zip(stream, stream[1:], stream[2:])))
    # equal counts: the most recent first
    t = NGramTable(2)
    t.update([1, 5, 1, 6, 1, 7])
    assert t.top(1, 3) == [(7,), (6,), (5,)]
    with pytest.raises(ValueError, match="--ngram-n must be >= 2"):
        NGramTable(1)


# --- penalty -------------------------------------------------------------------------------------------------
def test_penalty_window_slides_and_scales_by_sign():
    pen = ContextualPenalty(8, theta=2.0, window=3, banned=(7,))
    pen.push([1, 2])
    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, 1.0, 1.0, 1.0, 1.0]])
    out = pen.apply(logits)
    assert out.tolist() == [[1.0, 1.0, -4.0, 4.0, 1.0, 1.0, 1.0, float("-inf")]]
    pen.push([3, 4])  # window = [2, 3, 4]: token 1 left it
    assert pen.window_mask(torch.tensor([0]))[0].nonzero().flatten().tolist() == [2, 3, 4]
    # a node at depth 2 continues the last 3-2 = 1 generated token (4) plus its own path tokens
    path = torch.zeros(1, 8, dtype=torch.bool)
    path[0, 6] = True
    assert pen.window_mask(torch.tensor([2]), path)[0].nonzero().flatten().tolist() == [4, 6]
    pen.push([5, 5, 5, 5])
    assert pen.counts.tolist() == [0, 0, 0, 0, 0, 3, 0, 0]
    big = ContextualPenalty(8, theta=2.0, window=3)
    big.push([1, 2, 3, 4, 5, 6])  # one push longer than the window
    assert big.counts.nonzero().flatten().tolist() == [4, 5, 6]
    with pytest.raises(ValueError, match="--penalty must be >= 1"):
        ContextualPenalty(8, theta=0.5)


def test_penalty_of_tree_nodes_equals_penalty_of_ar_at_that_point():
    torch.manual_seed(0)
    pen = ContextualPenalty(16, theta=1.5, window=4)
    hist = [3, 4, 5, 6, 7]
    pen.push(hist)
    tree = build_tree(7, [[8, 3], [9]])
    logits = torch.randn(tree.size, 16)
    got = pen.apply(logits, tree.depth, path_token_mask(tree, 16))
    for i in range(tree.size):
        path, j = [], i
        while j != 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        ref = ContextualPenalty(16, theta=1.5, window=4)
        ref.push(hist + path[::-1])
        torch.testing.assert_close(got[i], ref.apply(logits[i:i + 1])[0])


# --- dynamic draft cache ---------------------------------------------------------------------------------------
def _fill(full: KVCache, n: int, g: torch.Generator, layers: int = 2):
    for layer in range(layers):
        k = torch.randn(1, 2, n, 8, generator=g)
        full.update(k, k * 2, layer)
    full.commit()


def test_group_scores_sum_the_group_without_repeating_k():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 6, 1, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    rep = k.repeat_interleave(3, 1)  # the reference: every query head against its (repeated) key head
    per_head = torch.einsum("bhd,bhld->bhl", q[:, :, 0], rep)  # [1, 6, 10]
    torch.testing.assert_close(group_scores(q, k), per_head.view(1, 2, 3, 10).sum(2))


def test_dynamic_cache_budget_sinks_and_rebuild_rule():
    g = torch.Generator().manual_seed(0)
    full, dc = KVCache(), DynamicDraftCache(budget=12, sinks=3, rebuild_every=4)
    queries = {i: torch.randn(1, 4, 1, 8, generator=g) for i in range(2)}
    _fill(full, 9, g)
    dc.sync(full, queries)
    assert dc.length == 9 and dc.rebuilds == 0  # fits: an exact mirror
    torch.testing.assert_close(dc.keys[0][:, :, :9], full.layer(0)[0])
    _fill(full, 10, g)  # 19 > budget: first ranking
    dc.sync(full, queries)
    assert dc.rebuilds == 1 and dc.length == 12
    k0 = full.layer(0)[0]
    score = group_scores(queries[0], k0[:, :, 3:])
    for h in range(2):  # sinks + the top-9 by group score, per head
        want = set((score[0, h].topk(9).indices + 3).tolist()) | {0, 1, 2}
        assert set(dc.positions[0][0, h].tolist()) == want
    rebuilds = dc.rebuilds
    for step in range(12):  # 3 new entries per step
        before = dc.rebuilds
        _fill(full, 3, g)
        dc.sync(full, queries)
        for layer in range(2):
            pos = dc.positions[layer][0]  # [Hkv, B]
            assert dc.length == 12 and pos.shape[-1] == 12
            kf = full.layer(layer)[0]
            score = group_scores(queries[layer], kf[:, :, 3:])[0]
            for h in range(2):
                held = set(pos[h].tolist())
                assert {0, 1, 2} <= held and len(held) == 12  # sinks always there, no duplicates
                if dc.rebuilds > before:  # re-ranked: sinks + the top |B|-|S| of everything
                    assert held == set((score[h].topk(9).indices + 3).tolist()) | {0, 1, 2}
                else:  # inserted: the newest replaced the least important and are protected
                    assert set(range(full.length - 3, full.length)) <= held
                # every slot holds the exact full-cache entry of its position
                torch.testing.assert_close(dc.keys[layer][0, h, :12], kf[0, h, pos[h]])
        assert dc.replaced <= dc.rebuild_every
    assert dc.rebuilds - rebuilds == 12 * 3 // 6  # inserts of 3 + 3 pass rebuild_every=4 every second step
    with pytest.raises(ValueError, match="budget 8 must exceed sinks 4"):
        DynamicDraftCache(budget=8, sinks=4)


# --- heads -------------------------------------------------------------------------------------------------
def test_heads_chain_residually_and_roundtrip(tmp_path, heads, target):
    h0 = torch.randn(3, target.config.hidden_size)
    hs = heads(h0)
    assert hs.shape == (3, 4, target.config.hidden_size)
    h1 = heads.layers[0](h0) + h0
    torch.testing.assert_close(hs[:, 1], h1)
    torch.testing.assert_close(hs[:, 2], heads.layers[1](h1) + h1)
    lm = target.get_output_embeddings()
    torch.testing.assert_close(heads.logits(h0, lm)[:, 0], lm(h0))
    fresh = TokenSwiftHeads(HeadsConfig.for_target(target.config))
    torch.testing.assert_close(fresh.logits(h0, lm), lm(h0)[:, None].expand(-1, 4, -1))  # zero init
    back = load_heads(save_heads(heads, tmp_path / "h"))
    torch.testing.assert_close(back(h0), heads(h0))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    with pytest.raises(ValueError, match="not a TokenSwiftHeads checkpoint"):
        load_heads(tmp_path / "bad")


# --- losslessness ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft,extra", [
    ("shared", {}),
    ("shared", {"penalty": 1.5, "penalty_window": 40, "max_nodes": 6, "ngram_topk": 0}),
    ("dynamic", {"budget": 40, "sinks": 4, "rebuild_every": 5}),
    ("dynamic", {"budget": 24, "sinks": 2, "penalty": 1.3, "penalty_window": 16, "head_paths": 1, "head_topk": 1}),
])
def test_greedy_output_identical_to_ar(target, heads, draft, extra):
    cfg = TokenSwiftConfig(max_new_tokens=160, draft=draft, **extra)
    ar = autoregressive_generate(target, PROMPT, cfg)
    ts = tokenswift_generate(target, heads, PROMPT, cfg)
    assert ts.tokens == ar.tokens and len(ts.tokens) == 160
    assert len(set(ar.tokens)) > 10  # a non-degenerate text
    assert sum(ts.accept_lengths) == 159 and ts.tokens_per_step > 1
    assert len(ts.accept_lengths) < 159  # fewer verification forwards than tokens
    if draft == "dynamic":
        assert ts.rebuilds > 0  # the budget was exceeded and the cache re-ranked
        assert ts.forwards == 2 * len(ts.accept_lengths)


def test_ar_matches_the_shared_dflash_baseline(target):
    from dllm_core.drafters import SpecConfig, ar_generate

    ours = autoregressive_generate(target, PROMPT, TokenSwiftConfig(max_new_tokens=64))
    assert ours.tokens == ar_generate(target, PROMPT, SpecConfig(max_new_tokens=64)).tokens


def test_stop_tokens_and_banned_tokens(target, heads):
    free = autoregressive_generate(target, PROMPT, TokenSwiftConfig(max_new_tokens=40))
    stop = free.tokens[17]
    cfg = TokenSwiftConfig(max_new_tokens=40, stop_token_ids=(stop,))
    first = free.tokens.index(stop)
    assert tokenswift_generate(target, heads, PROMPT, cfg).tokens == free.tokens[:first + 1]
    banned = TokenSwiftConfig(max_new_tokens=40, banned_token_ids=(stop,))
    out = tokenswift_generate(target, heads, PROMPT, banned)
    assert stop not in out.tokens and out.tokens == autoregressive_generate(target, PROMPT, banned).tokens


def test_near_zero_temperature_sampling_matches_greedy(target, heads):
    cfg = TokenSwiftConfig(max_new_tokens=60, sampling=SamplingParams(temperature=1e-4), seed=3)
    greedy = autoregressive_generate(target, PROMPT, TokenSwiftConfig(max_new_tokens=60))
    assert tokenswift_generate(target, heads, PROMPT, cfg).tokens == greedy.tokens


def test_config_errors_name_the_option():
    with pytest.raises(ValueError, match=r"--draft must be one of \['shared', 'dynamic'\]"):
        TokenSwiftConfig(draft="medusa")
    with pytest.raises(ValueError, match="--budget 20 must exceed --sinks 16"):
        TokenSwiftConfig(draft="dynamic", budget=20)
    with pytest.raises(ValueError, match="--ngram-n must be >= 2"):
        TokenSwiftConfig(ngram_n=1)


def test_race_advances_the_decoder_that_is_behind_and_keeps_outputs(target, heads):
    from dllm_core.drafters.tokenswift.bench import race
    from dllm_core.drafters.tokenswift.generate import iter_autoregressive, iter_tokenswift

    cfg = TokenSwiftConfig(max_new_tokens=50)
    log = []

    def logged(i, it):
        for res in it:
            log.append((i, len(res.tokens)))
            yield res

    out = race([logged(0, iter_autoregressive(target, PROMPT, cfg)),
                logged(1, iter_tokenswift(target, heads, PROMPT, cfg))])
    assert out[0].tokens == out[1].tokens == autoregressive_generate(target, PROMPT, cfg).tokens
    assert {i for i, _ in log} == {0, 1}
    counts = {0: 0, 1: 0}
    for i, n in log:  # a decoder only moves when it is not ahead of the other
        assert counts[i] <= min(counts.values()) or counts[1 - i] >= 50
        counts[i] = n
    assert out[0].seconds > 0 and out[1].marks[-1][0] == 50 and 0 < out[1].marks[-1][1] <= out[1].seconds


def test_ngram_ranked_top_equals_a_full_scan():
    import random

    rng = random.Random(0)
    stream = [rng.choice([1, 2, 3, 4, 5]) for _ in range(3000)]
    fast, slow = NGramTable(4, keep=5), NGramTable(4, keep=0)
    for i in range(0, len(stream), 7):
        fast.update(stream[i:i + 7])
        slow.update(stream[i:i + 7])
        for first in (1, 3, 5):
            for k in (1, 3, 5):
                assert fast.top(first, k) == slow.top(first, k)
    assert fast.top(2, 9) == slow.top(2, 9)  # beyond keep: the scan


def test_candidate_paths_rank_ngrams_with_the_heads():
    from dllm_core.drafters.tokenswift.draft import candidate_paths

    table = NGramTable(3)
    table.update([7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 3, 4, 7, 5, 6, 9])  # after 7: (1, 2) x3, (3, 4), (5, 6)
    levels = torch.full((2, 10), -5.0)
    levels[0, 5], levels[1, 6] = 5.0, 5.0  # the heads believe in 7 -> 5 6
    paths = candidate_paths(levels, table, 7, False, head_topk=1, num_head_paths=1, ngram_topk=3)
    assert paths == [[5, 6], [1, 2], [5, 6], [3, 4]]  # heads' path, then n-grams by frequency, then recency
    paths = candidate_paths(levels, table, 7, False, 1, 1, 3, ngram_paths=1)
    assert paths == [[5, 6], [5, 6]]  # only the n-gram the heads rank first
    paths = candidate_paths(levels, table, 7, True, 1, 1, 3)  # dynamic: keyed on the drafted first token 5
    assert paths == [[5, 6], [5, 6, 9]]


def test_candidate_paths_without_heads_are_the_ngrams():
    from dllm_core.drafters.tokenswift.draft import candidate_paths

    table = NGramTable(3)
    table.update([7, 1, 2, 7, 1, 2, 7, 3, 4, 7, 5, 6, 9])  # after 7: (1, 2) x2, then (5, 6), (3, 4) by recency
    assert candidate_paths(None, table, 7, False, 1, 1, 3) == [[1, 2], [5, 6], [3, 4]]
    assert candidate_paths(None, table, 7, False, 1, 1, 3, ngram_paths=2) == [[1, 2], [5, 6]]
    assert candidate_paths(None, table, 8, False, 1, 1, 3) == []


# --- one drafter for every host --------------------------------------------------------------------------------
def test_main_branch_follows_the_child_most_candidates_go_through():
    from dllm_core.drafters.tokenswift.tree import main_branch

    tree = build_tree(7, [[1, 2], [3, 4, 5], [1, 2, 6, 8], [1, 9]])  # 1: 2 leaves below, 3: 1; then 2 vs 9: a tie
    assert main_branch(tree, 5) == [1, 2, 6, 8]
    assert main_branch(tree, 2) == [1, 2] and main_branch(tree, 0) == []
    assert main_branch(build_tree(7, [[1, 2], [3, 4], [3, 5]]), 3) == [3, 4]  # outvoted: the later branch
    assert main_branch(build_tree(7, [[3], [3, 4], [1, 2, 6]]), 3) == [3, 4]  # a tie: the earlier candidate
    assert main_branch(build_tree(7, []), 3) == []


def test_padded_tree_has_a_fixed_width():
    from dllm_core.drafters.tokenswift.tree import padded

    ids, mask = padded(build_tree(5, [[1, 2], [1, 3]]), 6)  # 5 -> 1 -> {2, 3}, two padding children of the root
    assert ids.tolist() == [5, 1, 2, 3, 5, 5]
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0],
                                   [1, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="does not fit 3 draft tokens"):
        padded(build_tree(0, [[1, 2, 3]]), 3)


def test_a_narrower_verify_takes_the_trees_first_nodes(monkeypatch):
    """SGLang's adaptive TOKENSWIFT verifies the first W nodes of the padded tree: every W gives a tree (each node's
    ancestors among the first W), the same as the whole tree's first W rows."""
    from dllm_core.drafters.tokenswift.tree import padded
    from integrations.sglang.tokenswift import TreeDrafter

    tree = build_tree(5, [[1, 2, 4], [1, 3], [6, 7]])  # 5 -> 1 -> {2 -> 4, 3}, 5 -> 6 -> 7
    drafter = TreeDrafter(8)
    monkeypatch.setattr(drafter, "tree", lambda rid, tokens: tree)
    full_ids, full_mask = padded(tree, 8)
    for w in range(1, 9):
        ids, mask = drafter.draft("r", [5], w)
        assert ids.tolist() == full_ids[:w].tolist() and (mask == full_mask[:w, :w].numpy()).all()
        assert (full_mask[:w, w:].sum() == 0) and mask.diagonal().all()  # no ancestor left out
    assert drafter.draft("r", [5])[0].tolist() == full_ids.tolist()


def test_draft_options_are_shared_by_the_loop_and_the_hosts():
    from dataclasses import asdict, fields

    from dllm_core.drafters.tokenswift.config import DraftOptions

    cfg = TokenSwiftConfig()
    assert isinstance(cfg, DraftOptions)
    assert {f.name: getattr(cfg, f.name) for f in fields(DraftOptions)} == asdict(DraftOptions())
    with pytest.raises(ValueError, match="--head-topk must be >= 1, got 0"):
        DraftOptions(head_topk=0)
    with pytest.raises(ValueError, match="--ngram-paths must be >= 0, got -1"):
        TokenSwiftConfig(ngram_paths=-1)
    with pytest.raises(ValueError, match=r"host\.ngram_topk must be an integer, got 2\.5"):
        DraftOptions.from_mapping({"ngram_topk": 2.5}, "host")
    with pytest.raises(ValueError, match=r"^host\.max_nodes must be >= 0, got -1$"):
        DraftOptions.from_mapping({"max_nodes": -1}, "host")
    with pytest.raises(ValueError, match=r"host: unknown option\(s\) \['budget'\]"):
        DraftOptions.from_mapping({"budget": 3}, "host")  # the loop's draft cache, not a drafting option
    assert DraftOptions.from_mapping({"x": 1, "max_nodes": 3}, "host", host_keys=("x",)) == DraftOptions(max_nodes=3)


def test_host_drafter_keeps_one_state_per_key_and_restarts_it_for_another_request():
    from dllm_core.drafters.tokenswift.config import DraftOptions
    from dllm_core.drafters.tokenswift.drafter import TokenSwiftDrafter

    d = TokenSwiftDrafter(DraftOptions(ngram_n=2, ngram_topk=4))
    a = d.request(0, [1, 2, 1, 3])
    assert d.request(0, [1, 2, 1, 3, 1]) is a and a.seen == 5  # fed incrementally
    assert a.table.top(1, 4) == [(3,), (2,)]
    b = d.request(0, [9, 2, 1])  # shorter: another request took key 0
    assert b is not a and b.table.top(1, 4) == [] and d.request(0, [9, 2, 1, 5, 6, 7]) is b
    c = d.request(0, [9, 2, 4, 5, 6, 7, 8])  # same newest-seen token, other first tokens
    assert c is not b and d.request(0, [9, 2, 4, 5, 6, 0, 8]) is not c  # other token at the last one seen
    tree = d.tree(1, [4, 5, 4, 6, 4])  # no heads: the n-grams of key 1 only
    assert tree.tokens.tolist() == [4, 6, 5] and d.chain(1, [4, 5, 4, 6, 4], 3) == [6]
    d.erase([0, 1])
    assert d.requests == {}
    with pytest.raises(ValueError, match="heads need the target's lm_head"):
        TokenSwiftDrafter(DraftOptions(), heads=object())


def test_embedded_loop_vllm_and_sglang_draft_the_same(target, heads, tmp_path, monkeypatch):
    """The embedded loop's trees, replayed with the same token histories and hidden rows through the SGLang
    drafter and the vLLM proposer (default options everywhere): the same trees, and vLLM's chain is their main
    branch."""
    from types import SimpleNamespace

    import numpy as np

    from dllm_core.drafters.tokenswift.drafter import RequestDrafter
    from dllm_core.drafters.tokenswift.tree import main_branch, padded
    from integrations.sglang.tokenswift import TreeDrafter
    from integrations.vllm.tokenswift_proposer import TokenSwiftProposer

    events, draft, set_hidden = [], RequestDrafter.draft, RequestDrafter.set_hidden

    def spy_draft(self, tokens, levels=None, drafted_first=False, device="cpu"):
        h0 = self.h0(tokens)
        tree = draft(self, tokens, levels, drafted_first, device)
        events.append(("draft", list(tokens), h0, tree))
        return tree

    def spy_hidden(self, rows):
        events.append(("hidden", rows.clone()))
        set_hidden(self, rows)

    cfg = TokenSwiftConfig(max_new_tokens=80)
    with monkeypatch.context() as m:
        m.setattr(RequestDrafter, "draft", spy_draft)
        m.setattr(RequestDrafter, "set_hidden", spy_hidden)
        assert len(tokenswift_generate(target, heads, PROMPT, cfg).tokens) == 80

    lm = target.get_output_embeddings()

    class VllmTarget(torch.nn.Module):  # what the proposer uses of vLLM's model: parameters, hook, compute_logits
        def __init__(self):
            super().__init__()
            self.lm = lm

        def compute_logits(self, h):
            return self.lm(h)

    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                                  model_config=SimpleNamespace(max_model_len=4096,
                                                               get_hidden_size=lambda: target.config.hidden_size),
                                  additional_config={"tokenswift": {"heads": str(save_heads(heads, tmp_path / "h"))}},
                                  scheduler_config=SimpleNamespace(get_scheduler_cls=lambda: object))  # vLLM's own
    proposer = TokenSwiftProposer(vllm_config)
    proposer.load_model(VllmTarget())
    sglang = TreeDrafter(cfg.max_nodes + 1, heads=heads, lm_head=lm)
    steps, extended = 0, 0
    for ev in events:
        if ev[0] == "hidden":
            sglang.set_hidden("r", ev[1])
            continue
        _, tokens, h0, tree = ev
        want = (tree.tokens.tolist(), tree.parents.tolist())
        ids, mask = sglang.draft("r", tokens)
        got = sglang.requests["r"].tree
        assert (got.tokens.tolist(), got.parents.tolist()) == want
        want_ids, want_mask = padded(tree, cfg.max_nodes + 1)
        assert ids.tolist() == want_ids.tolist() and (mask == want_mask.numpy()).all()
        n = len(tokens)
        proposer._captured = (h0[None], torch.tensor([n - 2]), torch.tensor([0, 1]))  # the hook's capture
        chain = proposer.propose([[tokens[-1]]], [n], np.array([tokens]))[0]
        got = proposer.drafter.requests[0].tree
        assert (got.tokens.tolist(), got.parents.tolist()) == want
        assert chain == main_branch(tree, 3) and len(chain) == 3
        steps += 1
        extended += tree.size > 1 + heads.cfg.num_heads  # n-grams or more head paths branched off
    assert steps > 5 and extended == steps and proposer.stats["from_heads"] == steps


def test_row_at_finds_a_requests_position_in_a_hosts_flat_rows():
    """A host forward's rows of two requests (positions 5-7 and 0-1): the row at a position the forward ran, None
    for one it did not run or a request row it did not hold."""
    from dllm_core.drafters.tokenswift.drafter import row_at

    hidden, positions, qsl = torch.arange(5.0)[:, None], torch.tensor([5, 6, 7, 0, 1]), torch.tensor([0, 3, 5])
    assert [float(row_at(hidden, positions, qsl, 0, p)) for p in (5, 7)] == [0.0, 2.0]
    assert float(row_at(hidden, positions, qsl, 1, 1)) == 4.0
    assert row_at(hidden, positions, qsl, 0, 4) is None and row_at(hidden, positions, qsl, 1, 2) is None
    assert row_at(hidden, positions, qsl, 2, 0) is None
