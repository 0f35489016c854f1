"""Dream's shifted logits in SGLang's block forward: block position 0 (at s) is predicted from position s - 1's
final hidden state, recomputed once per block from the paged K/V of [0, s) before the forward and kept per request
slot (as the core's ``CanvasCache``), so that the forward reads no host value and SGLang's graphs capture it; the
token at s - 1 from the batch's ``Req``s (``response.BATCH``, the plugin's ``ForwardBatch.init_new`` hook)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm_core.models import shift_right

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_req_to_token_pool

from .response import BATCH

def pool_attention(q: torch.Tensor, req_idx: torch.Tensor, kv_len: list[int], attn, runner) -> torch.Tensor:
    """One query per request over its paged K/V [0, kv_len) (``runner``: SGLang's model runner, its pools):
    q [n, Hq*D] -> [n, Hq*D]."""
    pool, T = runner.token_to_kv_pool, max(kv_len)
    if pool.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"DreamModel: the prefix row needs an unquantized KV cache, got --kv-cache-dtype {pool.dtype}")
    slots = runner.req_to_token_pool.req_to_token[req_idx, :T].long()  # [n, T]
    k = pool.get_key_buffer(attn.layer_id)[slots].to(q.dtype)  # [n, T, Hkv, D]
    v = pool.get_value_buffer(attn.layer_id)[slots].to(q.dtype)
    keep = torch.arange(T, device=q.device)[None] < torch.tensor(kv_len, device=q.device)[:, None]  # [n, T]
    qh = q.view(q.shape[0], attn.tp_q_head_num, 1, attn.head_dim)
    o = F.scaled_dot_product_attention(qh, k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None],
                                       scale=attn.scaling, enable_gqa=attn.tp_q_head_num != attn.tp_k_head_num)
    return o.flatten(1)


def last_prefix_ids(reqs: list, rows: list[int]) -> list[int]:
    """The token at position s - 1 of each request ``reqs[b]`` (b in ``rows``) whose block starts at s > 0."""
    return [int(reqs[b].full_untruncated_fill_ids[reqs[b].dllm_block_offset - 1]) for b in rows]


class PrefixRows:
    """Final hidden state of each request's last prefix position, per request slot: brought up to date before the
    forward (``prepare``, SGLang's ``prepare_for_forward``: host reads, recomputes), read in it on the device alone
    (``rows``: what a graph capture holds)."""

    def __init__(self, model):
        self.model = model
        self.h: torch.Tensor | None = None  # [S, d]
        self.tag: torch.Tensor | None = None  # [S, 2] (position, slot generation), CPU
        self.ready = None  # the forward batch ``prepare`` saw last

    def _alloc(self, pool) -> torch.Tensor:
        if self.h is None:
            S = pool.req_to_token.shape[0]
            self.h = self.model.embed.weight.new_zeros(S, self.model.args.dim)
            self.tag = torch.full((S, 2), -1, dtype=torch.long)
        return self.h

    def prepare(self, fb: ForwardBatch) -> None:
        """Recompute the rows of a dLLM block forward's requests whose block moved (or slot was reused)."""
        self.ready = fb
        if not fb.forward_mode.is_dllm_extend():
            return
        B, slots = fb.batch_size, fb.req_pool_indices.tolist()
        reqs, pool = BATCH.requests(slots), BATCH.runner.req_to_token_pool
        self._alloc(pool)
        starts, gens = fb.positions.view(B, -1)[:, 0].tolist(), pool.req_generation[slots].tolist()
        need = [b for b in range(B) if starts[b] > 0 and self.tag[slots[b]].tolist() != [starts[b] - 1, gens[b]]]
        if need:
            ids = last_prefix_ids(reqs, need)
            self._recompute(torch.tensor(ids, device=fb.positions.device), [starts[b] - 1 for b in need],
                            [slots[b] for b in need])
            for b in need:
                self.tag[slots[b]] = torch.tensor([starts[b] - 1, gens[b]])

    def rows(self, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor | None:
        """[B, d] pre-norm hidden of position s - 1 per row (zeros where s == 0), device ops alone; None outside a
        dLLM block forward. A forward SGLang did not prepare is prepared here (not while a graph is captured)."""
        if not fb.forward_mode.is_dllm_extend():
            return None
        if self.ready is not fb and not torch.cuda.is_current_stream_capturing():
            self.prepare(fb)
        h = self._alloc(get_req_to_token_pool())[fb.req_pool_indices.long()]
        return torch.where(positions.view(fb.batch_size, -1)[:, :1] > 0, h, 0)

    def _recompute(self, ids: torch.Tensor, pos: list[int], slots: list[int]) -> None:
        """Run positions ``pos`` (tokens ``ids``) through every layer against the paged K/V [0, pos]."""
        p, req, x = torch.tensor(pos, device=ids.device), torch.tensor(slots, device=ids.device), self.model.embed(ids)
        kv_len = [i + 1 for i in pos]
        for layer in self.model.layers:
            x = x + layer.o_proj(pool_attention(layer.qkv(x, p)[0], req, kv_len, layer.attn, BATCH.runner))[0]
            x = x + layer.ffn(x)
        self.h[req] = x

    @staticmethod
    def shift(raw: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """Block logits [B*L, V] + prefix-row logits [B, V] -> Dream's shifted rows [B*L, V]."""
        return shift_right(prefix, raw.view(prefix.shape[0], -1, raw.shape[-1])).flatten(0, 1)
