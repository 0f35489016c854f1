"""TokenSwift as an SGLang speculative algorithm (``--speculative-algorithm TOKENSWIFT``), registered through
``SpeculativeAlgorithm.register``: NGRAM for the scheduler, a ``NGRAMWorker`` drafting the core's ``TokenSwiftDrafter``
trees in NGRAM's verify format; ``docs/tokenswift.md`` has the rest."""
from __future__ import annotations

import numpy as np
import torch

from dllm_core.drafters.tokenswift.config import DraftOptions
from dllm_core.drafters.tokenswift.drafter import TokenSwiftDrafter
from dllm_core.drafters.tokenswift.tree import padded

NAME = "TOKENSWIFT"


class TreeDrafter(TokenSwiftDrafter):
    """dllm_core's drafter, trees of at most ``draft_token_num`` nodes in NGRAM's verify format (``DraftOptions``)."""

    def __init__(self, draft_token_num: int, heads=None, lm_head=None, **options):
        if draft_token_num < 2:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 2 for TOKENSWIFT, got {draft_token_num}")
        super().__init__(DraftOptions(max_nodes=draft_token_num - 1, **options), heads, lm_head)
        self.d = draft_token_num

    def draft(self, rid: str, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """-> (tokens [D] int64: root first, mask [D, D] bool: mask[i, j] = j is i or an ancestor of i)."""
        ids, mask = padded(self.tree(rid, tokens), self.d)
        return ids.numpy(), mask.numpy()


def _spec_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class TokenSwiftSpecAlgo(CustomSpecAlgo):
        """NGRAM for the scheduler (tree verify, no draft KV), TokenSwift's worker for the drafts; scheduler queries
        ``CustomSpecAlgo`` does not define (0.5.23: ``create_future_map``, ``need_topk``, ...) answered as NGRAM's."""

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            return getattr(SpeculativeAlgorithm.NGRAM, name)

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
            model, heads, lm_head = self.model_runner.model, None, None
            path = getattr(server_args, "speculative_draft_model_path", None)
            if path:
                from dllm_core.drafters.dtypes import drafter_dtype
                from dllm_core.drafters.tokenswift.heads import load_heads

                w = model.lm_head.weight
                heads = load_heads(path, w.device, drafter_dtype(w.dtype, "--dtype"))
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
            drafts = [self.drafter.draft(r.rid, list(r.origin_input_ids_unpadded) + list(r.output_ids) + (
                prev_ids[i * stride:i * stride + prev_lens[i]] if use_prev else [])) for i, r in enumerate(batch.reqs)]
            return np.concatenate([t for t, _ in drafts]), np.concatenate([m.flatten() for _, m in drafts])

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
                    for rid, e in zip(rids, np.cumsum(lens)):
                        self.drafter.set_hidden(rid, self._hidden[e - 1:e])
                elif not extend:
                    for rid, h in zip(rids, self._hidden.split(self.draft_token_num)):
                        self.drafter.set_hidden(rid, h)
            return out

    return TokenSwiftWorker


def register() -> None:
    """Register ``TOKENSWIFT`` in SGLang's speculative-algorithm registry (idempotent)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        SpeculativeAlgorithm.from_string(NAME)  # already registered in this process
    except ValueError:
        SpeculativeAlgorithm.register(NAME, supports_overlap=True, spec_class=_spec_class())(worker_class)
