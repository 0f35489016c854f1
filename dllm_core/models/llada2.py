"""LLaDA2.0 / LLaDA2.1 (``LLaDA2MoeModelLM``, ``model_type: llada2_moe``): a block-diffusion MoE transformer.

Trained block-causally: a position attends to every position of its own block and of the blocks before it
(blocks of ``block_size`` on the absolute position grid, prompt included), never to a later block, so the
K/V of finished blocks are final and a prefix cache is exact. The layer keeps the ``Block`` interface
(``qkv`` / ``value`` / ``attend`` / ``ffn``) so every cache policy and the executor drive it unchanged.

Checkpoint layout (the published one, no remote code): ``model.word_embeddings``, per layer
``attention.query_key_value`` (fused Q|K|V rows), ``attention.query_layernorm`` / ``key_layernorm`` (per-head
RMSNorm), ``attention.dense``, ``input_layernorm`` / ``post_attention_layernorm``; the first
``first_k_dense_replace`` layers have a dense SwiGLU ``mlp``, the others a routed MoE: ``mlp.gate.weight``
(+ ``mlp.gate.expert_bias``), ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts``;
``model.norm``, ``lm_head``. Experts are held stacked ([E, I, d]) and run as grouped matmuls over the
tokens sorted by expert (``F.grouped_mm``); the merged 3-D expert layout (``mlp.experts.gate_proj``) loads too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs, _req, rope_theta
from .layers import Block, RMSNorm, Rope, RotaryEmbedding
from .transformer import DiffusionLM

MASK_ID = 156895    # LLaDA2's [MASK] (the published tokenizer); config.json may name another
BLOCK_SIZE = 32     # the block length LLaDA2.0 / 2.1 were trained with
PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LLaDA2Args(ModelArgs):
    """``ModelArgs`` + LLaDA2's attention and MoE fields (config.json names in the comments)."""

    head_size: int = 0           # head_dim
    rotary_dim: int = 0          # head_dim * partial_rotary_factor (or rotary_dim)
    qk_norm: bool = True         # use_qk_norm
    n_experts: int = 0           # num_experts (0: every layer dense)
    top_k: int = 1               # num_experts_per_tok
    n_group: int = 1             # n_group
    topk_group: int = 1          # topk_group
    moe_ffn_dim: int = 0         # moe_intermediate_size
    shared_ffn_dim: int = 0      # moe_intermediate_size (or moe_shared_expert_intermediate_size) x num_shared_experts
    first_dense: int = 0         # first_k_dense_replace
    routed_scale: float = 1.0    # routed_scaling_factor
    norm_topk: bool = True       # norm_topk_prob
    expert_bias: bool = True     # moe_router_enable_expert_bias
    norm_head: bool = False      # norm_head: LM head rows L2-normalised at load
    block_size: int = BLOCK_SIZE

    def __post_init__(self):
        super().__post_init__()
        if self.rotary_dim < 2 or self.rotary_dim > self.head_size or self.rotary_dim % 2:
            raise ValueError(f"config: rotary dim {self.rotary_dim} must be even and in [2, head_dim {self.head_size}]")
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                raise ValueError(f"config: num_experts_per_tok {self.top_k} must be in [1, num_experts "
                                 f"{self.n_experts}]")
            if self.n_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"config: n_group {self.n_group} must divide num_experts {self.n_experts} and "
                                 f"topk_group {self.topk_group} be in [1, n_group]")
            if self.n_group > 1 and self.n_experts // self.n_group < 2:
                raise ValueError(f"config: grouped routing scores a group by its top-2 experts; n_group "
                                 f"{self.n_group} leaves {self.n_experts // self.n_group} per group")
        if self.block_size < 1:
            raise ValueError(f"config: block_size must be >= 1, got {self.block_size}")

    @property
    def head_dim(self) -> int:
        return self.head_size


def llada2_args(cfg: dict, path: str = "config.json") -> LLaDA2Args:
    """Map LLaDA2's config.json (the BailingMoeV2 field names)."""
    for key, allowed in (("hidden_act", "silu"), ("score_function", "sigmoid")):
        if cfg.get(key, allowed) != allowed:
            raise ValueError(f"{path}: {key}={cfg[key]!r} is not supported; allowed: {allowed!r}")
    if cfg.get("use_bias"):
        raise ValueError(f"{path}: use_bias=true is not supported (LLaDA2 checkpoints use false)")
    n_heads, dim = _req(cfg, "num_attention_heads", path), _req(cfg, "hidden_size", path)
    head = cfg.get("head_dim") or dim // n_heads
    rot = int(head * cfg["partial_rotary_factor"]) if "partial_rotary_factor" in cfg else cfg.get("rotary_dim", head)
    n_exp = cfg.get("num_experts") or 0
    moe_ffn = cfg.get("moe_intermediate_size", 0)
    shared = (cfg.get("moe_shared_expert_intermediate_size") or moe_ffn) * (cfg.get("num_shared_experts") or 0)
    return LLaDA2Args(
        arch="LLaDA2MoeModelLM", dim=dim, n_layers=_req(cfg, "num_hidden_layers", path), n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads, ffn_dim=_req(cfg, "intermediate_size", path),
        vocab_size=_req(cfg, "vocab_size", path), max_seq_len=cfg.get("max_position_embeddings", 32768),
        rope_theta=rope_theta(cfg, 600000.0), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(cfg.get("use_qkv_bias", False)), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mask_token_id=cfg.get("mask_token_id", MASK_ID), eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"), bos_token_id=cfg.get("bos_token_id"),
        head_size=head, rotary_dim=rot, qk_norm=bool(cfg.get("use_qk_norm", True)), n_experts=n_exp,
        top_k=cfg.get("num_experts_per_tok", 1), n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1, moe_ffn_dim=moe_ffn, shared_ffn_dim=shared,
        first_dense=cfg.get("first_k_dense_replace", 0), routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
        norm_topk=bool(cfg.get("norm_topk_prob", True)), expert_bias=bool(cfg.get("moe_router_enable_expert_bias", True)),
        norm_head=bool(cfg.get("norm_head", False)), block_size=cfg.get("block_size", BLOCK_SIZE))


class SwiGLU(nn.Module):
    """gate/up/down SwiGLU MLP (a dense layer's MLP and the shared expert)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Routed experts + shared expert. Routing (in float32, as the checkpoint was trained): sigmoid scores,
    the expert bias added for the choice only, groups ranked by the sum of their top-2 biased scores
    (``topk_group`` of ``n_group`` kept), the top-k experts of those, weights = the unbiased scores
    (renormalised when ``norm_topk``) x ``routed_scale``."""

    def __init__(self, a: LLaDA2Args):
        super().__init__()
        self.a = a
        E, d, i = a.n_experts, a.dim, a.moe_ffn_dim
        self.gate = nn.Parameter(torch.empty(E, d))
        self.expert_bias = nn.Parameter(torch.zeros(E)) if a.expert_bias else None
        self.w_gate, self.w_up = nn.Parameter(torch.empty(E, i, d)), nn.Parameter(torch.empty(E, i, d))
        self.w_down = nn.Parameter(torch.empty(E, d, i))
        self.shared = SwiGLU(d, a.shared_ffn_dim) if a.shared_ffn_dim else None
        self.load: torch.Tensor | None = None  # [E] tokens routed to each expert in the last training forward

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> expert ids [N, K], weights [N, K] (float32)."""
        a = self.a
        scores = F.linear(x.float(), self.gate.float()).sigmoid()  # [N, E]
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if a.n_group > 1:
            groups = choice.view(len(x), a.n_group, a.n_experts // a.n_group)  # [N, G, E/G]
            best = groups.topk(2, -1).values.sum(-1).topk(a.topk_group, -1).indices  # [N, topk_group]
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)  # [N, G]
            choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        idx = choice.topk(a.top_k, -1).indices  # [N, K]
        if self.training:  # tokens per expert, for the load balancing of the expert bias
            self.load = torch.zeros(a.n_experts, device=x.device).index_add_(0, idx.flatten(), torch.ones(idx.numel(), device=x.device))
        w = scores.gather(1, idx)
        if a.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * a.routed_scale

    def experts(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, d], idx/w [N, K] -> sum_k w_k * expert_{idx_k}(x) [N, d]: the N*K (token, expert) pairs
        sorted by expert run as one grouped matmul per projection (fixed shapes, no host sync)."""
        N, K = idx.shape
        flat = idx.flatten()  # [N*K]
        order = flat.argsort(stable=True)
        offs = torch.zeros(self.a.n_experts, dtype=torch.int32, device=x.device)
        offs = offs.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
        xs = x[order // K]  # [N*K, d], grouped by expert
        g = F.grouped_mm(xs, self.w_gate.transpose(1, 2), offs=offs)  # [N*K, I]
        u = F.grouped_mm(xs, self.w_up.transpose(1, 2), offs=offs)
        y = F.grouped_mm(F.silu(g) * u, self.w_down.transpose(1, 2), offs=offs)  # [N*K, d]
        y = torch.empty_like(y).index_copy_(0, order, y).view(N, K, x.shape[-1])  # back to (token, k) order
        return (y.float() * w[..., None]).sum(1).to(x.dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[B, n, d] -> [B, n, d]."""
        x = h.flatten(0, -2)
        out = self.experts(x, *self.route(x))
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view_as(h)


class LLaDA2Block(Block):
    """Fused-QKV attention with per-head Q/K RMSNorm and partial RoPE, then a dense or MoE MLP."""

    def __init__(self, a: LLaDA2Args, layer: int):
        nn.Module.__init__(self)
        self.n_heads, self.n_kv, self.head_dim, self.rot = a.n_heads, a.n_kv_heads, a.head_dim, a.rotary_dim
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.qkv_proj = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=a.qkv_bias)
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else nn.Identity()
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.mlp = MoE(a) if a.n_experts and layer >= a.first_dense else SwiGLU(a.dim, a.ffn_dim)

    def _rope(self, t: torch.Tensor, rope: Rope) -> torch.Tensor:
        """RoPE (rotate-half) on the first ``rotary_dim`` dims of each head, the rest passed through."""
        cos, sin = (c[:, None] for c in rope)  # [B, 1, n, rot]
        r, rest = t[..., :self.rot], t[..., self.rot:]
        r1, r2 = r.chunk(2, -1)
        return torch.cat([r * cos + torch.cat([-r2, r1], -1) * sin, rest], -1)

    def _split(self, x: torch.Tensor):
        qkv = self.qkv_proj(self.attn_norm(x)).unflatten(-1, (self.n_heads + 2 * self.n_kv, self.head_dim))
        q, k, v = qkv.split([self.n_heads, self.n_kv, self.n_kv], -2)  # [B, n, h, D]
        return q, k, v

    def qkv(self, x: torch.Tensor, rope: Rope):
        """x [B, n, d] -> q [B, H, n, D], k/v [B, Hkv, n, D] (Q/K normed, then RoPE)."""
        q, k, v = self._split(x)
        q = self._rope(self.q_norm(q).transpose(1, 2), rope)
        k = self._rope(self.k_norm(k).transpose(1, 2), rope)
        return q, k, v.transpose(1, 2)

    def value(self, x: torch.Tensor) -> torch.Tensor:
        return self._split(x)[2].transpose(1, 2)

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ffn_norm(h))


_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class LLaDA2MoeModelLM(DiffusionLM):
    """LLaDA2.0 / LLaDA2.1 (mini 16B, flash 100B): block-causal attention (``block_causal`` = the
    checkpoint's block size), logits not shifted."""

    hf_keys = {
        "embed.weight": "model.word_embeddings.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
        "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
        "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "layers.{i}.qkv_proj.weight": "model.layers.{i}.attention.query_key_value.weight",
        "layers.{i}.qkv_proj.bias": "model.layers.{i}.attention.query_key_value.bias",
        "layers.{i}.q_norm.weight": "model.layers.{i}.attention.query_layernorm.weight",
        "layers.{i}.k_norm.weight": "model.layers.{i}.attention.key_layernorm.weight",
        "layers.{i}.o_proj.weight": "model.layers.{i}.attention.dense.weight",
        **{f"layers.{{i}}.mlp.{p}.weight": f"model.layers.{{i}}.mlp.{p}.weight" for p in PROJ},
        "layers.{i}.mlp.gate": "model.layers.{i}.mlp.gate.weight",
        "layers.{i}.mlp.expert_bias": "model.layers.{i}.mlp.gate.expert_bias",
        "layers.{i}.mlp.w_gate": "model.layers.{i}.mlp.experts.gate_proj",
        "layers.{i}.mlp.w_up": "model.layers.{i}.mlp.experts.up_proj",
        "layers.{i}.mlp.w_down": "model.layers.{i}.mlp.experts.down_proj",
        **{f"layers.{{i}}.mlp.shared.{p}.weight": f"model.layers.{{i}}.mlp.shared_experts.{p}.weight" for p in PROJ},
    }
    parse_config = staticmethod(llada2_args)

    def __init__(self, args: LLaDA2Args):
        nn.Module.__init__(self)
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(LLaDA2Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rotary = self.rotary_for(args)

    @property
    def block_causal(self) -> int:
        return self.args.block_size

    @classmethod
    def rotary_for(cls, args: LLaDA2Args) -> RotaryEmbedding:
        return RotaryEmbedding(args.rotary_dim, args.rope_theta)  # the first rotary_dim dims of each head

    @classmethod
    def fold_hf(cls, sd: dict[str, torch.Tensor], args: LLaDA2Args) -> dict[str, torch.Tensor]:
        """Per-expert checkpoint tensors (``mlp.experts.{e}.gate_proj.weight``) -> the merged 3-D layout
        (``mlp.experts.gate_proj`` [E, ...]); ``norm_head`` checkpoints get their LM head normalised."""
        out, experts = {}, {}
        for k, v in sd.items():
            m = _EXPERT.match(k)
            if m:
                experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = v
            else:
                out[k] = v
        for k, parts in experts.items():
            if sorted(parts) != list(range(args.n_experts)):
                raise ValueError(f"checkpoint: {k} has experts {sorted(parts)[:8]}..., expected 0..{args.n_experts - 1}")
            out[k] = torch.stack([parts[e] for e in range(args.n_experts)])
        if args.norm_head and "lm_head.weight" in out:
            out["lm_head.weight"] = F.normalize(out["lm_head.weight"].float(), dim=0, eps=1e-7).to(out["lm_head.weight"].dtype)
        return out

    @classmethod
    def unfold_hf(cls, sd: dict[str, torch.Tensor], args: LLaDA2Args) -> dict[str, torch.Tensor]:
        """The published per-expert layout for saving (inverse of ``fold_hf``)."""
        out = {}
        for k, v in sd.items():
            head, _, proj = k.rpartition(".")
            if head.endswith(".mlp.experts") and proj in PROJ:
                out.update({f"{head}.{e}.{proj}.weight": v[e].contiguous() for e in range(v.shape[0])})
            else:
                out[k] = v
        return out
