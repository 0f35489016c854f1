"""Speculative decoding through SGLang's real server runtime on this CPU (test-only harness
``tests/sglang_harness``), as users launch it:

* ``--speculative-algorithm DFLASH --speculative-draft-model-path models/dflash-qwen3-tasks``: greedy output
  identical to the same server without speculation; acceptance read from SGLang's own per-request metrics;
* ``--speculative-algorithm TOKENSWIFT`` (registered by our plugin) with the shipped TokenSwift heads:
  lossless against plain decoding.

The plain-decoding server (``models/qwen3-tasks``) is launched once for the module.
"""
import concurrent.futures as cf
import statistics
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.speculative.dflash_worker_v2")

from dllm_core import load_tokenizer  # noqa: E402
from dllm_core.tasks import make_task  # noqa: E402
from dllm_core.tasks.evaluate import prompts_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
from sglang_harness.server import SGLangServer  # noqa: E402

TARGET = ROOT / "models" / "qwen3-tasks"
COMMON = ()  # dtype "auto": the checkpoints' bfloat16 (the drafter's config.json names the target's dtype)
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
    with SGLangServer(TARGET, *COMMON, log=tmp_path_factory.mktemp("ar") / "server.log") as srv:
        yield [o["output_ids"] for o in serve_all(srv, prompts)]


def test_dflash_is_lossless_and_accepts_blocks(prompts, plain, tmp_path):
    """16 concurrent greedy requests: every answer equals plain decoding's; SGLang reports each request's
    mean accepted length per verify step (the bonus token included) above 2."""
    with SGLangServer(TARGET, *COMMON, *DFLASH, log=tmp_path / "server.log") as srv:
        out = serve_all(srv, prompts)
    assert [o["output_ids"] for o in out] == plain
    accept = [o["meta_info"]["spec_accept_length"] for o in out]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in out)
    assert statistics.mean(accept) > 2.0, accept


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
