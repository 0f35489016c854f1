"""TEST-ONLY stand-in for the CPU build of ``sgl_kernel`` (see ../README.md).

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 imports a few ``sgl_kernel`` CPU helpers at module level;
no CPU wheel of sgl-kernel is published. This package provides those names: the index bookkeeping the
runtime calls on every request in plain torch (the contracts of the Triton kernels SGLang uses on GPUs),
every other name as a function raising ``NotImplementedError`` when called. It registers no
``torch.ops.sgl_kernel`` op, so SGLang's AMX check stays False and every layer takes its torch-native path.
"""
from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+dllm-serve-test-stand-in"


def _packed(rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each packed location [n], requests in order, request i's columns [starts[i], ends[i])
    (vectorized: the Triton kernels' one pass, not a Python loop per request)."""
    n = (ends.long() - starts.long()).clamp_min(0)
    off = n.cumsum(0) - n  # each request's first packed location
    total = int(n.sum())
    return (torch.repeat_interleave(rows.long(), n, output_size=total),
            torch.arange(total) + torch.repeat_interleave(starts.long() - off, n, output_size=total))


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """req_to_token[r, s:e] = the request's packed slice of out_cache_loc (requests in order)."""
    r, c = _packed(req_pool_indices, start_offset, end_offset)
    req_to_token[r, c] = out_cache_loc[:r.shape[0]].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """The inverse gather: out_cache_loc (packed) = req_to_token[r, s:e] per request."""
    r, c = _packed(req_pool_indices, start_offset, end_offset)
    out_cache_loc[:r.shape[0]] = req_to_token[r, c].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, num_cols):
    """Request i's topk * num_cols slots from seq_lens[i] on, packed at i * topk * num_cols."""
    n = topk * num_cols
    for i, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[r, s:s + n].to(out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For each KV buffer (base address data_ptrs[i], rows of strides[i] bytes): row tgt <- row src."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src].clone()


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Pack out_cache_loc[i] for every accepted index i (accept_index flattened, -1 = none) in order."""
    idx = accept_index.flatten()
    idx = idx[idx >= 0]
    accept_out_cache_loc[:idx.numel()] = out_cache_loc[idx].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_tokens[b] = the last accepted token of request b (accept_lens counts the bonus)."""
    rows = torch.arange(accept_lens.numel(), device=accept_lens.device)
    bonus_tokens.copy_(accept_tokens.flatten()[rows * accept_stride + accept_lens.long() - 1])


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """Greedy tree verification: from the root, descend to the child whose draft token is the target's
    prediction at the last accepted node while one exists. accept_index[b] gets the accepted nodes'
    global indices (root first), accept_token_num[b] their count without the root, predicts the target's
    token at every accepted node."""
    steps, n = accept_index.shape[1], candidates.shape[1]
    target = target_predict.flatten()
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, steps):
            want, child = int(target[last]), int(retrive_next_token[b, node])
            while child != -1 and int(candidates[b, child]) != want:
                child = int(retrive_next_sibling[b, child])
            if child == -1:
                break
            predicts[last] = want
            accepted, node, last = accepted + 1, child, int(retrive_index[b, child])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = target[last]


def _not_in_stand_in(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not provided by the test stand-in "
                                  "(tests/sglang_harness/sgl_kernel); this SGLang path needs the CPU kernels")

    call.__name__ = name
    return call


# names SGLang imports at module level on CPU whose paths the tests do not take
for _name in ("rotate_input_ids_cpu", "build_tree_kernel_efficient_cpu", "build_draft_decode_metadata_cpu"):
    globals()[_name] = _not_in_stand_in(_name)
del _name
