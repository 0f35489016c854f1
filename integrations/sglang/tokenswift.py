"""TokenSwift as an SGLang speculative algorithm: ``--speculative-algorithm TOKENSWIFT``.

``register()`` (idempotent; call it from the SGLang plugin entry point) puts ``TOKENSWIFT`` into SGLang's
registry through the public ``SpeculativeAlgorithm.register``. It behaves as the built-in NGRAM algorithm for
the scheduler (``is_ngram()``: tree verification in one target forward, no draft KV cache, NGRAM's
server-argument handling) while its worker - a subclass of SGLang's ``NGRAMWorker``, built when the server
creates it - drafts TokenSwift trees:

    --speculative-algorithm TOKENSWIFT --speculative-num-draft-tokens 16
    --speculative-draft-model-path HEADS_DIR   (optional: dllm train-tokenswift output; without it n-grams only)

Per request, ``TreeDrafter`` keeps dllm_core's ``NGramTable`` of the request's tokens and builds the trie of
the heads' best paths and the top-k n-grams keyed on the newest token (``dllm_core.drafters.tokenswift``'s
``candidate_paths`` / ``build_tree``), packed in NGRAM's verify format: ``draft_token_num`` tokens with the
root (newest token) first and a [D, D] ancestor mask. The heads' h0 is the target's final hidden state at the
last accepted node of the previous verification (or the last prefill row), captured by a forward hook on the
target model; SGLang's own verifier then accepts the longest path matching the target.

On this CPU-only machine SGLang's runtime does not start (CUDA kernels), so the registration and the tree
packing are what the tests exercise; the worker glue is written against SGLang 0.5.23's NGRAMWorker.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dllm_core.drafters.tokenswift.draft import candidate_paths
from dllm_core.drafters.tokenswift.ngram import NGramTable
from dllm_core.drafters.tokenswift.tree import Tree, build_tree

NAME = "TOKENSWIFT"


# --- drafting (pure, CPU-testable) -------------------------------------------------------------------------------
@dataclass
class _Request:
    table: NGramTable
    seen: int = 0
    tree: Tree | None = None
    tree_len: int = 0                  # token count when the tree was drafted (its root is token tree_len-1)
    hidden: torch.Tensor | None = None  # [D, H] verify rows of the last tree, or [1, H] the last prefill row
    extras: dict = field(default_factory=dict)


class TreeDrafter:
    """Per-request TokenSwift trees in SGLang's NGRAM verify format."""

    def __init__(self, draft_token_num: int, ngram_n: int = 4, ngram_topk: int = 8, heads=None, lm_head=None,
                 head_topk: int = 2, head_paths: int = 4):
        if draft_token_num < 2:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 2 for TOKENSWIFT, got {draft_token_num}")
        self.d, self.n, self.topk = draft_token_num, ngram_n, ngram_topk
        self.heads, self.lm_head = heads, lm_head
        self.head_topk, self.head_paths = head_topk, head_paths
        self.reqs: dict[str, _Request] = {}

    def _state(self, rid: str, tokens: list[int]) -> _Request:
        st = self.reqs.get(rid)
        if st is None or len(tokens) < st.seen:
            st = self.reqs[rid] = _Request(NGramTable(self.n))
        if len(tokens) > st.seen:
            st.table.update(tokens[st.seen:])
            st.seen = len(tokens)
        return st

    def set_hidden(self, rid: str, rows: torch.Tensor) -> None:
        """Rows of the newest target forward for ``rid``: [D, H] (verify) or [1, H] (last prefill row)."""
        st = self.reqs.setdefault(rid, _Request(NGramTable(self.n)))
        st.hidden = rows

    def h0(self, rid: str, tokens: list[int]) -> torch.Tensor | None:
        """The hidden state that produced the newest token: the accepted path's last node of the last tree
        (found by walking it with the tokens emitted since), or the last prefill row."""
        st = self.reqs.get(rid)
        if st is None or st.hidden is None:
            return None
        if st.hidden.shape[0] == 1 or st.tree is None:
            return st.hidden[-1]
        node, children = 0, {}
        for i in range(1, st.tree.size):
            children[(int(st.tree.parents[i]), int(st.tree.tokens[i]))] = i
        for t in tokens[st.tree_len:-1]:  # accepted drafts; the newest token is the target's own after them
            nxt = children.get((node, int(t)))
            if nxt is None:
                return None
            node = nxt
        return st.hidden[node] if node < st.hidden.shape[0] else None

    @torch.inference_mode()
    def draft(self, rid: str, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """-> (tokens [D] int64: root first, mask [D, D] bool: mask[i, j] = j is i or an ancestor of i)."""
        st = self._state(rid, tokens)
        root = int(tokens[-1])
        h0 = self.h0(rid, tokens) if self.heads is not None else None
        if h0 is not None:
            levels = self.lm_head(self.heads(h0[None].to(next(self.heads.parameters()).dtype))[0, 1:])
            paths = candidate_paths(levels.float(), st.table, root, False, self.head_topk, self.head_paths,
                                    self.topk)
        else:
            paths = [list(rest) for rest in st.table.top(root, self.topk)]
        tree = build_tree(root, paths, self.d - 1)
        st.tree, st.tree_len, st.hidden = tree, len(tokens), None
        return pack_tree(tree, self.d)

    def erase(self, rids) -> None:
        for rid in rids:
            self.reqs.pop(rid, None)


def pack_tree(tree: Tree, d: int) -> tuple[np.ndarray, np.ndarray]:
    """A trie of <= d nodes as NGRAM's fixed-width verify input; missing nodes become extra children of the
    root repeating the root token (verified like any candidate, so they can only be accepted if correct)."""
    n = tree.size
    if n > d:
        raise ValueError(f"tree of {n} nodes does not fit {d} draft tokens")
    tokens = np.full(d, int(tree.tokens[0]), dtype=np.int64)
    tokens[:n] = tree.tokens.cpu().numpy()
    mask = np.zeros((d, d), dtype=bool)
    mask[:n, :n] = tree.ancestors.cpu().numpy()
    mask[n:, 0] = True
    mask[np.arange(n, d), np.arange(n, d)] = True
    return tokens, mask


# --- SGLang glue ------------------------------------------------------------------------------------------------
def _spec_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class TokenSwiftSpecAlgo(CustomSpecAlgo):
        """NGRAM for the scheduler (tree verify, no draft KV), TokenSwift's worker for the drafts."""

        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False

        def handle_server_args(self, server_args) -> None:
            SpeculativeAlgorithm.NGRAM.handle_server_args(server_args)

    return TokenSwiftSpecAlgo


def worker_class(server_args=None):
    """The worker factory SGLang calls at server start: an ``NGRAMWorker`` drafting TokenSwift trees."""
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    class TokenSwiftWorker(NGRAMWorker):
        def __init__(self, server_args, gpu_id, nccl_port, target_worker):
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
            model = self.model_runner.model
            heads, lm_head = None, None
            path = getattr(server_args, "speculative_draft_model_path", None)
            if path:
                from dllm_core.drafters.tokenswift.heads import load_heads

                w = model.lm_head.weight
                heads = load_heads(path, w.device, w.dtype)
                lm_head = lambda h: torch.nn.functional.linear(h, w)  # noqa: E731 (single-rank vocab)
                model.model.register_forward_hook(self._capture)
            self.drafter = TreeDrafter(self.draft_token_num, heads=heads, lm_head=lm_head)
            self._hidden: torch.Tensor | None = None

        def _capture(self, module, args, output) -> None:
            self._hidden = (output[0] if isinstance(output, tuple) else output).detach()

        def _prepare_draft_tokens(self, batch):
            use_prev = self.enable_overlap and not batch.grammar_needs_sync()
            prev_ids, prev_lens, stride = [], [0] * len(batch.reqs), self.draft_token_num
            if use_prev:
                prev_ids = batch.spec_info.accept_tokens.cpu().tolist()
                prev_lens = batch.spec_info.accept_lens.cpu().tolist()
            self.prev_token_ids, self.prev_accept_lens = prev_ids, prev_lens
            drafts, masks = [], []
            for i, req in enumerate(batch.reqs):
                extra = prev_ids[i * stride:i * stride + prev_lens[i]] if use_prev else []
                tokens = list(req.origin_input_ids_unpadded) + list(req.output_ids) + extra
                t, m = self.drafter.draft(req.rid, tokens)
                drafts.append(t)
                masks.append(m.flatten())
            return np.concatenate(drafts), np.concatenate(masks)

        def _update_ngram_corpus(self, batch):
            pass  # TreeDrafter updates each request's table from its full token list when drafting

        def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
            rids = [r.rid for r in batch.reqs]
            extend = not batch.forward_mode.is_decode()
            lens = list(batch.extend_lens) if extend and batch.extend_lens is not None else None
            self.drafter.erase(self._prev_decode_rids - set(rids) if not extend else ())  # left the batch
            out = super().forward_batch_generation(batch, on_publish=on_publish, pp_proxy_tensors=pp_proxy_tensors)
            if self._hidden is not None and self.drafter.heads is not None:
                if extend and lens is not None:
                    ends = np.cumsum(lens)
                    for rid, e in zip(rids, ends):
                        self.drafter.set_hidden(rid, self._hidden[e - 1:e])
                elif not extend:
                    d = self.draft_token_num
                    for i, rid in enumerate(rids):
                        self.drafter.set_hidden(rid, self._hidden[i * d:(i + 1) * d])
            return out

    return TokenSwiftWorker


def register() -> None:
    """Register ``TOKENSWIFT`` in SGLang's speculative-algorithm registry (idempotent)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        SpeculativeAlgorithm.from_string(NAME)
        return  # already registered in this process
    except ValueError:
        pass
    SpeculativeAlgorithm.register(NAME, supports_overlap=True, spec_class=_spec_class())(worker_class)
