"""Speculative decoding through SGLang's real server runtime on this CPU (test-only harness
``tests/sglang_harness``), as users launch it:

* ``--speculative-algorithm DFLASH --speculative-draft-model-path models/dflash-qwen3-tasks``: in float32, greedy
  output identical to the same server without speculation; acceptance read from SGLang's own per-request metrics;
  a ``--dtype bfloat16`` DFLASH server answers with the drafter accepted too (the drafter runs in the server's dtype,
  whatever its config.json names);
* ``--speculative-algorithm TOKENSWIFT`` (registered by our plugin) with the shipped TokenSwift heads:
  lossless against plain decoding.

The float32 DFLASH server also takes a soak (hundreds of requests, client hang-ups, bad requests of many kinds:
each a 4xx naming its problem, the server keeps serving, no good request lost). The plain-decoding server
(``models/qwen3-tasks``, float32) and the float32 DFLASH server run once for the module as jobs (every request
sent, the answers recorded, the server stopped); every other configuration is launched by its one test. One server
is alive at a time.
"""
import concurrent.futures as cf
import importlib.util
import json
import statistics
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.speculative.dflash_worker_v2")

from dllm_core import load_tokenizer  # noqa: E402
from dllm_core.tasks import make_task  # noqa: E402
from dllm_core.tasks.evaluate import prompts_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
from recorded import Recorded  # noqa: E402
from sglang_harness.server import SGLangServer  # noqa: E402

TARGET = ROOT / "models" / "qwen3-tasks"
# float32: greedy exactness (in bfloat16 the batched verify forward and the one-token decode forward round
# differently, so a near tie can flip: docs/dflash.md "Dtypes and exactness")
COMMON = ("--dtype", "float32")
MAX_NEW = 32
DFLASH = ("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(ROOT / "models" /
          "dflash-qwen3-tasks"), "--speculative-num-draft-tokens", "16",
          "--speculative-draft-attention-backend", "torch_native")


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(TARGET)
    return [p for name in ("arithmetic", "sort") for p in prompts_of(tok, make_task(name).examples("test", 8))]


def serve_all(srv: SGLangServer, prompts: list[list[int]]) -> list[dict]:
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: srv.generate(p, MAX_NEW), prompts))


@pytest.fixture(scope="module")
def plain(prompts, tmp_path_factory):
    """Plain decoding's answers (the server stopped once they are in)."""
    with SGLangServer(TARGET, *COMMON, log=tmp_path_factory.mktemp("ar") / "server.log") as srv:
        return [o["output_ids"] for o in serve_all(srv, prompts)]


def assert_blocks_accepted(out: list[dict]) -> None:
    """SGLang reports each request's verify steps, and a mean accepted length per step (the bonus token
    included) above 2 over the batch."""
    accept = [o["meta_info"]["spec_accept_length"] for o in out]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in out)
    assert statistics.mean(accept) > 2.0, accept


N_SOAK = 160


@pytest.fixture(scope="module")
def dflash(prompts, tmp_path_factory):
    """The float32 DFLASH server as a job: lm-eval's route, the 16 concurrent answers, and a soak between two probes
    (``Recorded``); the server is stopped before any test reads them."""
    from lm_eval_routes import served
    from sglang_harness.soak import bad_requests, soak

    cases = [{"input_ids": p, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0}} for p in prompts]
    vocab = json.loads((TARGET / "config.json").read_text())["vocab_size"]
    bad = bad_requests(prompts[0], vocab, 8192)
    rec = Recorded()
    with SGLangServer(TARGET, *COMMON, *DFLASH, log=tmp_path_factory.mktemp("dflash") / "server.log") as srv:
        if importlib.util.find_spec("lm_eval") is not None:
            rec.run("lm_eval", served, srv.url, TARGET)
        rec.run("concurrent", serve_all, srv, prompts)
        rec.run("probe", lambda: srv.generate(prompts[0], MAX_NEW)["output_ids"])
        rec.run("soak", soak, srv.url, cases, bad, n=N_SOAK, in_flight=24, hang_up_share=0.2)
        rec.run("probe_after", lambda: srv.generate(prompts[0], MAX_NEW)["output_ids"])
    rec.bad = bad
    return rec


def test_lm_eval_through_dflash_equals_the_embedded_route(dflash):
    """lm-eval's ``local-completions`` against the DFLASH server answers the shipped ``dllm_arithmetic`` examples as
    ``--model dllm`` does with greedy decoding of the same target (issue 35.2; float32: lossless)."""
    pytest.importorskip("lm_eval")
    from lm_eval_routes import embedded

    assert dflash["lm_eval"] == embedded(TARGET, gen_length=24)


def test_dflash_is_lossless_and_accepts_blocks(plain, dflash):
    """``--dtype float32`` (the drafter's config.json names bfloat16: it runs in float32 all the same): 16
    concurrent greedy requests, every answer equals plain decoding's, blocks accepted."""
    out = dflash["concurrent"]
    assert [o["output_ids"] for o in out] == plain
    assert_blocks_accepted(out)


def test_dflash_survives_a_soak_and_bad_requests(plain, dflash):
    """160 greedy requests of the 16 prompts, 24 in flight, a fifth of the clients hanging up mid-request, bad
    requests of 9 kinds among them (3 of each): every bad one gets a 4xx naming its problem (an id past the
    vocabulary stopped SGLang's scheduler before the plugin's admission check), no good one is lost and each
    answers plain decoding's tokens every time; a probe answers the same before and after."""
    rep = dflash["soak"]
    assert not rep.lost and rep.served + rep.hung_up == N_SOAK, rep.lost[:3]
    for i, answers in rep.answers.items():
        assert answers == {tuple(plain[i])}, i
    for name, (_, text) in dflash.bad.items():
        for status, body in rep.bad[name]:
            assert 400 <= status < 500 and text in body, (name, status, body[:300])
    assert dflash["probe_after"] == dflash["probe"] == plain[0]


def test_dflash_adaptive_draft_length_is_lossless_and_keeps_the_drafter_context(prompts, plain, tmp_path):
    """``--speculative-adaptive`` (the core's draft length per step, ``integrations/sglang/spec.py``) with options
    that make it alternate plain steps (k = 0: the drafter's forward skipped) and whole blocks (speculation never
    wins by a margin of 1e9; every second step re-measures the block): 16 concurrent greedy answers equal plain
    decoding's, and the blocks after plain steps are accepted as a drafter that saw every token accepts them (the
    drafter's context written at k = 0 too: 2.2 tokens per verify step here, 1.6 with the plain steps' context
    left out, 5.8 for the whole block alone)."""
    options = tmp_path / "adaptive.json"
    options.write_text(json.dumps({"candidates": [0, 15], "margin": 1e9, "explore_every": 2}))
    with SGLangServer(TARGET, *COMMON, *DFLASH, "--speculative-adaptive", "--speculative-adaptive-config",
                      str(options), log=tmp_path / "server.log") as srv:
        out = serve_all(srv, prompts)
    assert [o["output_ids"] for o in out] == plain
    tokens, steps = sum(len(o["output_ids"]) for o in out), sum(o["meta_info"]["spec_verify_ct"] for o in out)
    assert 2.0 <= tokens / steps <= 4.0, (tokens, steps)  # plain steps ran (the block alone: 5.8), context kept


def test_adaptive_options_of_a_launch():
    """``--speculative-adaptive-config``'s JSON: the options of the core's ``AdaptiveDraft`` by name; any other
    name is refused naming the file and the allowed names."""
    from dllm_core.drafters.adaptive import AdaptiveDraft

    assert AdaptiveDraft.of(15, {"candidates": [15, 0], "margin": 1.1}) == AdaptiveDraft(15, (0, 15), margin=1.1)
    assert AdaptiveDraft.of(15, None) == AdaptiveDraft(15)
    with pytest.raises(ValueError, match=r"^--speculative-adaptive-config a.json: unknown options \['blocks'\]; "
                                         r"allowed: \['candidates', 'margin', 'explore_every', 'time_window', "
                                         r"'accept_decay'\]$"):
        AdaptiveDraft.of(15, {"blocks": 4}, "--speculative-adaptive-config a.json")


def test_the_sglang_functions_the_adaptive_worker_overrides_keep_their_signatures():
    """The adaptive DFLASH worker overrides or wraps SGLang functions by name (``spec.OVERRIDES``): their parameters
    and defaults as written for (SGLang 0.5.23); a change fails here, not in a server."""
    import importlib
    import inspect

    from integrations.sglang.spec import OVERRIDES

    def params(target: str) -> str:
        module, cls, fn = target.rsplit(".", 2)
        sig = inspect.signature(getattr(getattr(importlib.import_module(module), cls), fn))
        return ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in sig.parameters.values())

    assert [params(t) for t in OVERRIDES] == [
        "self, batch",  # DFlashDraftInputV2.prepare_for_decode (AROUND: prepare_decode)
        "self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None",  # DFlashWorkerV2's
        "self, num_correct_drafts_per_req, batch_size=0"]  # DFlashWorkerV2.on_verify_complete_cpu


def test_step_clock_charges_each_interval_to_the_step_computed_in_it(monkeypatch):
    """The adapter's measurements (``StepClock.dispatched`` / ``result``, SGLang's overlap scheduling: a step is
    dispatched before the previous one's result): on a CPU, which computes a step as it is dispatched, the time between
    two results (the process's CPU time) is that of the one decode step dispatched meanwhile; on a GPU, of the step
    whose result it is. An interval holding a prefill, or no step, or two, measures nothing; the drafts accepted always
    count."""
    from types import SimpleNamespace

    from dllm_core.drafters import adaptive

    now = [0.0]
    monkeypatch.setattr(adaptive, "time", SimpleNamespace(perf_counter=lambda: now[0], process_time=lambda: now[0]))

    def play(synchronous: bool, script) -> tuple[dict, list[int]]:
        clock, ks = adaptive.StepClock(adaptive.AdaptiveDraft(15, (0, 15)).new(), synchronous), []
        for seconds, dispatch, accepted in script:  # one scheduler iteration: dispatch a step, then a result
            now[0] += seconds
            if dispatch is not None:
                ks.append(clock.dispatched(dispatch))
            if accepted is not None:
                clock.result(accepted)
        return {key: round(t, 6) for key, t in clock.lengths.time.items()}, ks

    # (each length is timed twice before the next is tried; a cell's time is the minimum of its window)
    cpu = [(0.010, 2, None), (0.011, 2, [0, 0]), (0.012, 2, [0, 0]), (0.013, 2, [0, 0]), (0.030, 2, [0, 0]),
           (0.001, None, [3, 15])]
    assert play(True, cpu) == ({(2, 0): 0.012, (2, 15): 0.030}, [0, 0, 0, 0, 15])
    gpu = [(0.0, 2, None), (0.010, 2, [0, 0]), (0.011, 2, [0, 0]), (0.010, 2, [0, 0]), (0.030, 0, [3, 15]),
           (0.5, 2, None), (0.020, None, [0, 0])]
    assert play(False, gpu) == ({(2, 0): 0.010, (2, 15): 0.030}, [0, 0, 0, 15, 0, 15])


def test_dflash_serves_bfloat16(prompts, tmp_path):
    """``--dtype bfloat16``: every request answers in full (MAX_NEW tokens or a stop), blocks accepted. (Its
    answers are bfloat16 decoding's, not float32's, so no equality with ``plain``.)"""
    with SGLangServer(TARGET, "--dtype", "bfloat16", *DFLASH, log=tmp_path / "server.log") as srv:
        out = serve_all(srv, prompts)
    for o in out:
        reason = o["meta_info"]["finish_reason"]["type"]
        assert reason == "stop" or len(o["output_ids"]) == MAX_NEW, o["meta_info"]
    assert_blocks_accepted(out)


def test_dflash_dtype_rule_at_launch():
    """The drafter runs in the server's dtype (the core's rule); a dtype it cannot run in is refused at launch
    naming ``--dtype`` and the allowed values. Without the plugin's embeddings hook SGLang feeds the drafter
    bfloat16, so only bfloat16 would be served."""
    import torch

    from integrations.sglang.dtypes import check_dflash_dtype

    assert check_dflash_dtype(torch.float32, embeds_follow=True) is torch.float32
    assert check_dflash_dtype(torch.float16, embeds_follow=True) is torch.float16
    assert check_dflash_dtype(torch.bfloat16, embeds_follow=False) is torch.bfloat16
    with pytest.raises(ValueError, match=r"^--dtype float32 with --speculative-algorithm DFLASH: this SGLang hands "
                                         r"the drafter bfloat16 embeddings .*; allowed: \['bfloat16'\]"):
        check_dflash_dtype(torch.float32, embeds_follow=False)
    with pytest.raises(ValueError, match=r"^--dtype: a drafter runs in its target's dtype, got float64; allowed: "
                                         r"\['float32', 'bfloat16', 'float16'\]$"):
        check_dflash_dtype(torch.float64, embeds_follow=True)


def test_tokenswift_is_lossless(prompts, plain, tmp_path):
    """``--speculative-algorithm TOKENSWIFT`` (our plugin's registration, SGLang's NGRAM tree verification)
    with the shipped heads: 16 concurrent greedy answers equal plain decoding's; drafts are accepted (the
    mean accepted length per verify step, from SGLang's metrics, is above 1: the embedded loop reaches
    about 1.5 tokens per step on these prompts with 7-node trees)."""
    flags = ("--speculative-algorithm", "TOKENSWIFT", "--speculative-num-draft-tokens", "8",
             "--speculative-draft-model-path", str(ROOT / "models" / "tokenswift-qwen3-tasks"))
    with SGLangServer(TARGET, *COMMON, *flags, log=tmp_path / "server.log") as srv:
        out = serve_all(srv, prompts)
    assert [o["output_ids"] for o in out] == plain
    accept = [o["meta_info"]["spec_accept_length"] for o in out]
    assert statistics.mean(accept) > 1.2, accept


def test_stand_in_tree_metadata_matches_sglangs_host_derivation(monkeypatch):
    """The harness's ``reconstruct_indices_from_tree_mask`` (NGRAM / TOKENSWIFT verify metadata) gives the
    first-child / next-sibling links SGLang derives on the host from the same masks, and depth positions."""
    import numpy as np
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "sglang_harness"))  # ngram_worker imports sgl_kernel on CPU
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask
    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    rng, bs, n = np.random.default_rng(0), 3, 9
    masks, depths = np.zeros((bs, n, n), dtype=bool), np.zeros((bs, n), dtype=np.int64)
    for b in range(bs):
        for i in range(n):  # node i hangs below a random earlier node (node 0: the root)
            parent = rng.integers(0, i) if i else -1
            masks[b, i] = masks[b, parent] if i else False
            masks[b, i, i] = True
            depths[b, i] = depths[b, parent] + 1 if i else 0
    seq_lens = torch.tensor([5, 0, 17])
    out = [torch.empty(bs * n, dtype=torch.int64) for _ in range(4)]
    reconstruct_indices_from_tree_mask(torch.from_numpy(masks.reshape(-1)), seq_lens, *out, bs, n)
    positions, index, next_token, next_sibling = (t.view(bs, n) for t in out)
    want_token, want_sibling = _derive_tree_links(masks.reshape(-1), bs, n)
    assert torch.equal(next_token, want_token) and torch.equal(next_sibling, want_sibling)
    assert torch.equal(positions, torch.from_numpy(depths) + seq_lens[:, None])
    assert torch.equal(index, torch.arange(bs * n).view(bs, n))


def test_tokenswift_adaptive_draft_length_is_lossless(prompts, plain, tmp_path):
    """``--speculative-adaptive`` with TOKENSWIFT (``integrations/sglang/tokenswift.py``: trees of k + 1 nodes, the
    accepted tokens handed back at the launch's width): with options that alternate plain steps (k = 0) and the
    whole tree, 16 concurrent greedy answers equal plain decoding's (the lengths between: ``test_tokenswift.py::
    test_a_narrower_verify_takes_the_trees_first_nodes``; the benchmark's runs compare every answer)."""
    flags = ("--speculative-algorithm", "TOKENSWIFT", "--speculative-num-draft-tokens", "8",
             "--speculative-draft-model-path", str(ROOT / "models" / "tokenswift-qwen3-tasks"), "--speculative-adaptive")
    options = tmp_path / "adaptive.json"
    options.write_text(json.dumps({"candidates": [0, 7], "margin": 1e9, "explore_every": 2}))
    with SGLangServer(TARGET, *COMMON, *flags, "--speculative-adaptive-config", str(options),
                      log=tmp_path / "server.log") as srv:
        assert [o["output_ids"] for o in serve_all(srv, prompts)] == plain
    log = (tmp_path / "server.log").read_text()  # the adaptive worker served, with the option file's policy
    assert "TOKENSWIFT at the core's adaptive draft length" in log and "candidates=(0, 7), margin=1000000000.0" in log
