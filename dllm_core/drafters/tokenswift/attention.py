"""Target attention for TokenSwift forwards, plugged in through transformers' ``AttentionInterface``.

Two things the stock ``sdpa`` path lacks:
- with a mask (the tree mask of verification) it repeats K/V for grouped-query attention, copying the
  whole cache every layer; here torch SDPA's native ``enable_gqa`` is used with and without a mask;
- the draft-side dynamic cache ranks entries by query.key, so a forward can hand in a dict
  (``ts_queries=``) that receives every layer's post-RoPE query [B, Hq, q, D].

Masks are passed to the model as ``attention_mask={"full_attention": mask}`` (bool [B|1, 1, q, kv], True =
attend) or ``None`` (q == 1: attend to everything; q == kv: causal prefill into an empty cache).
``use_tokenswift_attention(model)`` switches the model to this function for a ``with`` block.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

NAME = "tokenswift_sdpa"


def tokenswift_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         ts_queries: dict | None = None, **_) -> tuple[torch.Tensor, None]:
    """query [B, Hq, q, D], key/value [B, Hkv, kv, D] -> ([B, q, Hq, D], None)."""
    if ts_queries is not None:
        ts_queries[module.layer_idx] = query
    b, hq, q_len, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    causal = attention_mask is None and q_len > 1
    if causal and q_len != kv_len:
        raise ValueError(f"tokenswift attention: {q_len} queries over {kv_len} keys need an explicit mask")
    if causal or (attention_mask is not None and attention_mask.shape[1] != 1):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, is_causal=causal, enable_gqa=hkv != hq)
        return out.transpose(1, 2).contiguous(), None
    # the mask is shared by all heads: fold each group's g query heads into the query axis, so every K/V head
    # is read once for its whole group ([B, Hkv, g*q, D] x [B, Hkv, kv, D]; faster than enable_gqa on CPU)
    g = hq // hkv
    folded = query.reshape(b, hkv, g * q_len, d)
    mask = None if attention_mask is None else attention_mask.repeat(1, 1, g, 1)  # [B|1, 1, g*q, kv]
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.view(b, hq, q_len, d).transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, tokenswift_attention)


_ACTIVE: dict[int, list] = {}  # id(model) -> [open blocks, implementation to restore]


@contextmanager
def use_tokenswift_attention(model):
    """Run ``model`` (a transformers causal LM) with ``tokenswift_attention`` inside the block. Re-entrant
    (decoders advanced in turns on one model each hold a block): the last block to close restores."""
    register()
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"TokenSwift: only full-attention targets are supported, got layer types {sorted(layer_types)}")
    entry = _ACTIVE.setdefault(id(model), [0, model.config._attn_implementation])
    entry[0] += 1
    model.config._attn_implementation = NAME
    try:
        yield model
    finally:
        entry[0] -= 1
        if entry[0] == 0:
            model.config._attn_implementation = entry[1]
            del _ACTIVE[id(model)]
