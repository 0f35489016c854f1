"""TokenSwift as an SGLang speculative algorithm (``--speculative-algorithm TOKENSWIFT``), registered through
``SpeculativeAlgorithm.register``: NGRAM for the scheduler, a ``NGRAMWorker`` drafting the core's ``TokenSwiftDrafter``
trees in NGRAM's verify format; ``docs/tokenswift.md`` has the rest."""
from __future__ import annotations

import logging
from contextlib import nullcontext
from unittest.mock import patch

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

    def draft(self, rid: str, tokens: list[int], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """-> (tokens [W] int64: root first, mask [W, W] bool: mask[i, j] = j is i or an ancestor of i); W = D or
        ``width`` (the tree's first W nodes: a parent comes before its children)."""
        ids, mask = padded(self.tree(rid, tokens), self.d)
        w = width or self.d
        return ids[:w].numpy(), mask[:w, :w].numpy()


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

        def _new_tokens(self, batch) -> list[list[int]]:
            """Per request, its tokens accepted at the previous step and not yet in ``output_ids`` (overlap only)."""
            use_prev = self.enable_overlap and not batch.grammar_needs_sync()
            prev_ids, prev_lens, stride = [], [0] * len(batch.reqs), self.speculative_num_draft_tokens
            if use_prev:
                prev_ids = batch.spec_info.accept_tokens.cpu().tolist()
                prev_lens = batch.spec_info.accept_lens.cpu().tolist()
            self.prev_token_ids, self.prev_accept_lens = prev_ids, prev_lens
            return [prev_ids[i * stride:i * stride + prev_lens[i]] if use_prev else [] for i in range(len(batch.reqs))]

        def _roots(self, batch) -> np.ndarray:
            """[bs] int64: each request's last token (a tree's root)."""
            new = self._new_tokens(batch)
            return np.array([(n or r.output_ids or r.origin_input_ids_unpadded)[-1] for n, r in zip(new, batch.reqs)],
                            dtype=np.int64)

        def _prepare_draft_tokens(self, batch):
            if self.draft_token_num == 1:  # the root alone (the adaptive length's k = 0 with logprobs or a grammar)
                roots = self._roots(batch)
                return roots, np.ones(len(roots), dtype=bool)
            new = self._new_tokens(batch)
            drafts = [self.drafter.draft(r.rid, list(r.origin_input_ids_unpadded) + list(r.output_ids) + n,
                                         self.draft_token_num) for n, r in zip(new, batch.reqs)]
            return np.concatenate([t for t, _ in drafts]), np.concatenate([m.flatten() for _, m in drafts])

        def _update_ngram_corpus(self, batch):
            pass  # TreeDrafter updates each request's table from its full token list when drafting

        def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None, plain=False):
            """NGRAM's step with the drafter's bookkeeping; ``plain``: a decode step without drafts, run as SGLang's
            plain decode forward (``plain_step``)."""
            rids = [r.rid for r in batch.reqs]
            extend = not batch.forward_mode.is_decode()
            lens = list(batch.extend_lens) if extend and batch.extend_lens is not None else None
            self.drafter.erase(self._prev_decode_rids - set(rids) if not extend else ())  # left the batch
            out = plain_step(self, batch, on_publish) if plain else super().forward_batch_generation(
                batch, on_publish=on_publish, pp_proxy_tensors=pp_proxy_tensors)
            if self._hidden is not None and self.drafter.heads is not None:
                if extend and lens is not None:
                    for rid, e in zip(rids, np.cumsum(lens)):
                        self.drafter.set_hidden(rid, self._hidden[e - 1:e])
                elif not extend:
                    for rid, h in zip(rids, self._hidden.split(1 if plain else self.draft_token_num)):
                        self.drafter.set_hidden(rid, h)
            return out

    if getattr(server_args, "speculative_adaptive", False):
        return adaptive(TokenSwiftWorker)
    return TokenSwiftWorker


NGRAM_WIDTH = ("draft_token_num", "draft_tokens", "retrieve_indexes", "retrieve_next_token", "retrieve_next_sibling",
               "positions", "tree_mask", "draft_tokens_batch", "tree_mask_batch", "retrieve_indexes_batch",
               "retrieve_next_token_batch", "retrieve_next_sibling_batch", "positions_batch")


def adaptive(worker):
    """TOKENSWIFT at the core's adaptive draft length (``--speculative-adaptive``): each decode step verifies a tree
    of k + 1 nodes (the tree's first k + 1; k = 0: the bonus token alone), the accepted tokens handed back at the
    launch's width, as every other step's."""
    from sglang.srt.speculative import ngram_worker

    from .spec import at_width, decodes_plainly, step_clock

    class AdaptiveTokenSwiftWorker(worker):
        def __init__(self, server_args, *args, **kwargs):
            super().__init__(server_args, *args, **kwargs)
            self.dllm_clock, self.dllm_widths = step_clock(server_args, self.draft_token_num - 1, self.device), {}
            logging.getLogger(__name__).info("TOKENSWIFT at the core's adaptive draft length: %s",
                                             self.dllm_clock.lengths.opts)

        def _sized(self, width: int) -> dict:
            self.draft_token_num = width
            self._init_preallocated_tensors()
            return {}

        def forward_batch_generation(self, batch, **kwargs):
            decode, full = batch.forward_mode.is_decode(), self.speculative_num_draft_tokens
            k = self.dllm_clock.dispatched(len(batch.reqs) if decode else 0, batch.reqs)
            if not decode or k + 1 == full:
                return super().forward_batch_generation(batch, **kwargs)
            if k == 0 and decodes_plainly(batch):
                return super().forward_batch_generation(batch, plain=True, **kwargs)
            kept = patch.object(ngram_worker, "move_accept_tokens_to_target_kvcache", lambda *a: None) if k == 0 \
                else nullcontext()  # k = 0: the root's K/V lie where the accepted token's belong
            with at_width(self, NGRAM_WIDTH, self.dllm_widths, k + 1, lambda: self._sized(k + 1)), kept:
                out = super().forward_batch_generation(batch, **kwargs)
            tokens = out.next_token_ids.view(-1, k + 1)  # [bs, k + 1] -> [bs, D], as the scheduler reads them
            out.next_token_ids = torch.cat([tokens, tokens.new_zeros(len(tokens), full - k - 1)], 1).flatten()
            out.next_draft_input.accept_tokens, out.next_draft_input.draft_token_num = out.next_token_ids, full
            return out

        def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
            self.dllm_clock.result(num_correct_drafts_per_req)

    return AdaptiveTokenSwiftWorker


def plain_step(worker, batch, on_publish=None):
    """k = 0 as SGLang's plain decode forward (``spec.decode_forward``), handed back as NGRAM's verify of the root at
    the launch's width (the accepted token first, as every other step's)."""
    from sglang.srt.speculative import ngram_worker as ngram

    from .spec import decode_forward

    roots = torch.from_numpy(worker._roots(batch)).to(worker.device)  # [bs]
    out = decode_forward(worker.target_worker, batch, roots)
    width, new_lens = worker.speculative_num_draft_tokens, batch.seq_lens + 1
    tokens = out.next_token_ids.new_zeros(len(roots), width, dtype=torch.int32)  # [bs, D]
    tokens[:, 0] = out.next_token_ids
    tokens, lens = tokens.view(-1), torch.ones_like(roots, dtype=torch.int32)
    if on_publish is not None:
        on_publish(new_lens)
    worker._prev_decode_rids = {r.rid for r in batch.reqs}
    return ngram.GenerationBatchResult(
        logits_output=out.logits_output, next_token_ids=tokens, can_run_cuda_graph=out.can_run_cuda_graph,
        accept_lens=lens, new_seq_lens=new_lens, speculative_num_draft_tokens=width,
        next_draft_input=ngram.NgramVerifyInput(draft_token_num=width, new_seq_lens=new_lens, accept_tokens=tokens,
                                                accept_lens=lens))


def register() -> None:
    """Register ``TOKENSWIFT`` in SGLang's speculative-algorithm registry (idempotent)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        SpeculativeAlgorithm.from_string(NAME)  # already registered in this process
    except ValueError:
        SpeculativeAlgorithm.register(NAME, supports_overlap=True, spec_class=_spec_class())(worker_class)
