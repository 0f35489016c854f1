"""TEST-ONLY: the TARGET_VERIFY attention SGLang's torch-native backend lacks (see sitecustomize.CHANGES).

A TARGET_VERIFY batch (speculative verification, DFlash's draft block) appends the same number ``n`` of
query tokens to each request after its committed prefix ``seq_lens[b]``; their K/V were just written at
``req_to_token[req, seq_len:seq_len + n]``. Each query attends to the whole prefix and, among the new
tokens, to: its ancestors and itself (``custom_mask``: NGRAM-style trees, ``[bs * n * n]`` row-major),
the tokens up to itself (a chain, causal layers) or all of them (non-causal layers).
"""
from __future__ import annotations

import torch


def target_verify_sdpa(q, o, k_buf, v_buf, req_to_token, forward_batch, scaling: float, gqa: bool,
                       causal: bool) -> None:
    """q, o: [bs * n, H, D] (o written in place); k_buf, v_buf: [slots, Hkv, D]."""
    bs = forward_batch.req_pool_indices.shape[0]
    n = q.shape[0] // bs
    tree = getattr(forward_batch.spec_info, "custom_mask", None) if n > 1 else None  # one node: itself alone
    if tree is not None:
        tree = tree.view(bs, n, n).bool()  # [bs, n, n]: tree[b, i, j] = j is i or an ancestor of i
    chain = torch.ones(n, n, dtype=torch.bool, device=q.device).tril() if causal and n > 1 else None  # else: all
    for b, (req, s) in enumerate(zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist())):
        slots = req_to_token[req, :s + n]
        k, v = k_buf[slots].movedim(0, 1)[None], v_buf[slots].movedim(0, 1)[None]  # [1, Hkv, s + n, D]
        rows = q[b * n:(b + 1) * n].movedim(0, 1)[None]  # [1, H, n, D]: batched, as the decode path calls SDPA
        new = tree[b] if tree is not None else chain
        mask = None if new is None else torch.cat(  # [n, s + n]; None: every query sees every key (n = 1 too)
            [torch.ones(n, s, dtype=torch.bool, device=q.device), new], dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            rows, k.to(rows.dtype), v.to(rows.dtype), attn_mask=mask, scale=scaling, enable_gqa=gqa)
        o[b * n:(b + 1) * n] = out[0].movedim(0, 1)
