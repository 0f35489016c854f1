"""TokenSwift in SGLang: ``TOKENSWIFT`` registered through SGLang's speculative registry by
``integrations.sglang.tokenswift.register()`` in a fresh process, and the per-request tree drafter's
output in SGLang's NGRAM verify format (the drafting itself is dllm_core's, see test_tokenswift.py)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dllm_core.drafters.tokenswift import HeadsConfig, TokenSwiftHeads
from integrations.sglang.tokenswift import TreeDrafter

ROOT = Path(__file__).resolve().parents[1]

FRESH = r"""
import json
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S
out = {}
try:
    S.from_string("TOKENSWIFT")
    out["before"] = "registered"
except ValueError as e:
    out["before"] = str(e)
from integrations.sglang.tokenswift import register, worker_class
register()
register()  # idempotent
algo = S.from_string("tokenswift")
out.update(name=algo.name, ngram=algo.is_ngram(), speculative=algo.is_speculative(), draft_kv=algo.has_draft_kv(),
           eagle=algo.is_eagle(), overlap=algo.supports_overlap, factory=algo.factory is worker_class,
           builtin_ngram=S.from_string("NGRAM").is_ngram())
print("RESULT " + json.dumps(out))
"""


def test_sglang_registration_in_fresh_process():
    pytest.importorskip("sglang")
    proc = subprocess.run([sys.executable, "-c", FRESH], cwd=ROOT, capture_output=True, text=True, timeout=240)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    assert got == {"before": "Unknown speculative algorithm name: TOKENSWIFT", "name": "TOKENSWIFT", "ngram": True,
                   "speculative": True, "draft_kv": False, "eagle": False, "overlap": True, "factory": True,
                   "builtin_ngram": True}


def _parents_from_mask(mask: np.ndarray) -> list[int]:
    """SGLang's reading of the mask: a node's parent is its largest ancestor below itself."""
    out = []
    for i in range(mask.shape[0]):
        anc = [j for j in range(i) if mask[i, j]]
        out.append(max(anc) if anc else -1)
    return out


def test_tree_drafter_ngram_trees_in_ngram_verify_format():
    d = TreeDrafter(draft_token_num=8, ngram_n=3, ngram_topk=4)
    history = [5, 1, 2, 5, 1, 3, 5, 1, 2, 7, 5]
    tokens, mask = d.draft("r1", history)
    assert tokens.shape == (8,) and mask.shape == (8, 8) and tokens.dtype == np.int64 and mask.dtype == bool
    # root = newest token; continuations of "5": (1, 2) twice, (1, 3) once -> trie 5 -> 1 -> {2, 3}
    assert tokens[:4].tolist() == [5, 1, 2, 3]
    assert _parents_from_mask(mask)[:4] == [-1, 0, 1, 1]
    assert mask.diagonal().all() and not np.triu(mask, 1).any()  # self-attention, parents before children
    assert tokens[4:].tolist() == [5] * 4 and _parents_from_mask(mask)[4:] == [0] * 4  # padding: root children
    assert (mask.sum(1) - 1)[:4].tolist() == [0, 1, 2, 2]  # depths


def test_tree_drafter_maps_its_arguments_onto_the_core_options():
    from dllm_core.drafters.tokenswift.config import DraftOptions

    assert TreeDrafter(draft_token_num=8).opts == DraftOptions(max_nodes=7)  # the core's defaults otherwise
    assert TreeDrafter(draft_token_num=4, head_topk=2).opts == DraftOptions(head_topk=2, max_nodes=3)
    with pytest.raises(ValueError, match="--head-paths must be >= 1"):
        TreeDrafter(draft_token_num=4, head_paths=0)
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens must be >= 2"):
        TreeDrafter(draft_token_num=1)


def test_tree_drafter_feeds_heads_the_last_accepted_node():
    """h0 = the verify row of the deepest accepted node of the previous tree (or the last prefill row)."""
    torch.manual_seed(0)
    hidden, vocab = 8, 16
    heads = TokenSwiftHeads(HeadsConfig(hidden, vocab, 2))
    lm = torch.nn.Linear(hidden, vocab, bias=False)
    seen = []

    def lm_head(h):
        seen.append(h)
        return lm(h)

    d = TreeDrafter(draft_token_num=6, ngram_n=2, ngram_topk=2, heads=heads, lm_head=lm_head)
    prompt = [1, 2, 3, 1, 2]
    d.set_hidden("r", torch.full((1, hidden), 7.0))  # prefill: last row
    tokens, _ = d.draft("r", prompt)
    assert torch.equal(seen[-1][0], heads(torch.full((1, hidden), 7.0))[0, 1])  # h1 from the prefill row
    req = d.requests["r"]
    tree = req.tree
    rows = torch.arange(6, dtype=torch.float32)[:, None].expand(6, hidden)  # verify row i = node i
    d.set_hidden("r", rows.clone())
    child = int(tree.tokens[1])  # accept node 1, then the target's own token 9
    assert torch.equal(req.h0(prompt + [child, 9]), rows[1])
    assert torch.equal(req.h0(prompt + [9]), rows[0])  # nothing accepted: the root's row
    assert req.h0(prompt + [99, 9]) is None  # not a path of the tree
    d.draft("r", prompt + [child, 9])
    assert torch.equal(seen[-1][0], heads(rows[1][None])[0, 1])  # the next draft's heads ran on that row
    d.erase(["r"])
    assert "r" not in d.requests
