"""DFlash drafter (Chen, Liang, Liu - Z-Lab, 2026): a few Qwen3 layers that denoise a whole block in one
forward, conditioned on the frozen target's hidden features.

Per forward, for a block x of Q tokens (position 0 = last verified token, the rest = mask token) and C new
context tokens with target features f [C, k*H] (k target layers concatenated)::

    ctx = hidden_norm(fc(f))                          # fused context  [B, C, H]
    every layer:  q = q_norm(q_proj(x))               # queries from the block only
                  K = k_norm(k_proj([ctx ; x]))       # context K/V injected into every layer
                  V = v_proj([ctx ; x])
                  attention is non-causal over [cached ctx ; ctx ; block]
    h = norm(x)  ->  logits = target.lm_head(h)       # no embedding / head of its own

The context K/V go into the draft KV cache (a transformers ``DynamicCache``), which the caller crops
back to the accepted prefix after each draft. Weight names equal the checkpoint's (see ``save_drafter``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import RMSNorm, Rope, RotaryEmbedding, apply_rope
from .config import DFlashConfig

WEIGHTS = "model.safetensors"


class DFlashAttention(nn.Module):
    """Qwen3 attention (q_norm/k_norm per head) whose K/V also cover the fused target context."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        return t.unflatten(-1, (n, self.head_dim))  # [B, T, h, D]

    def forward(self, x, ctx, rope_q: Rope, rope_kv: Rope, mask, cache, layer_idx: int) -> torch.Tensor:
        """x [B, Q, H] block, ctx [B, C, H] fused context -> [B, Q, H].

        rope_q covers the Q block positions, rope_kv the C + Q new key positions; ``cache`` (DynamicCache or
        None) prepends earlier context K/V; ``mask`` [B, 1, Q, T] bool (True = may attend) or None (full)."""
        q = self.q_norm(self._heads(self.q_proj(x), self.n_heads)).transpose(1, 2)  # [B, Hq, Q, D]
        kv_in = torch.cat([ctx, x], 1)  # [B, C+Q, H]
        k = self.k_norm(self._heads(self.k_proj(kv_in), self.n_kv)).transpose(1, 2)  # [B, Hkv, C+Q, D]
        v = self._heads(self.v_proj(kv_in), self.n_kv).transpose(1, 2)
        q, k = apply_rope(q, rope_q), apply_rope(k, rope_kv)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)  # [B, Hkv, T, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(o.transpose(1, 2).flatten(2))


class DFlashMLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; the context enters the attention un-normalised (already fused)."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = DFlashMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, mask, cache, layer_idx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, mask, cache, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter's own weights; the target's embedding and LM head are borrowed via ``bind(target)``."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self._shared: tuple[nn.Module, nn.Module] | None = None  # (embedding, lm_head): not our parameters

    # --- shared frozen target pieces -------------------------------------------------------------------
    def bind(self, target: nn.Module) -> DFlashDrafter:
        """Borrow ``target``'s input embedding and LM head (kept out of this module's parameters)."""
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed.weight.shape != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(f"drafter expects a target embedding of shape ({self.cfg.vocab_size}, "
                             f"{self.cfg.hidden_size}), got {tuple(embed.weight.shape)}")
        n = target.config.num_hidden_layers
        if n != self.cfg.num_target_layers:
            raise ValueError(f"drafter was built for a target with {self.cfg.num_target_layers} layers, got {n}")
        self._shared = (embed, head)
        return self

    def _target(self) -> tuple[nn.Module, nn.Module]:
        if self._shared is None:
            raise RuntimeError("DFlashDrafter: call bind(target) first (it shares the target's embedding/head)")
        return self._shared

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token embedding: ids [B, Q] -> [B, Q, H]."""
        return self._target()[0](ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Target LM head on drafter states: [B, Q, H] -> [B, Q, V]."""
        return self._target()[1](h)

    def features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Concatenate the outputs of ``target_layer_ids`` from a transformers ``hidden_states`` tuple
        (entry 0 = embeddings, entry i+1 = output of layer i): -> [B, T, k*H]."""
        return torch.cat([hidden_states[i + 1] for i in self.cfg.target_layer_ids], -1)

    # --- forward ------------------------------------------------------------------------------------------
    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [B, C, k*H] -> fused context [B, C, H]."""
        return self.hidden_norm(self.fc(feats))

    def forward(self, x: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, cache=None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Denoise a block.

        x [B, Q, H] block embeddings; feats [B, C, k*H] target features of the C context tokens not yet in
        ``cache``; pos [B, C+Q] positions of those context tokens then of the block; mask [B, 1, Q, T] bool
        or None (every query sees every key). Returns the final-normed states [B, Q, H]."""
        q_len = x.shape[1]
        ctx = self.fuse(feats).to(x.dtype)
        cos, sin = self.rotary(pos, x.dtype)  # [B, C+Q, D]
        rope_q = (cos[:, -q_len:], sin[:, -q_len:])
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_q, (cos, sin), mask, cache, i)
        return self.norm(x)


def init_weights(model: DFlashDrafter, std: float = 0.02, seed: int = 0) -> DFlashDrafter:
    """Qwen3-style init: normal(0, std) linears, unit norms."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def save_drafter(model: DFlashDrafter, out_dir: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (names ``layers.{i}.self_attn.q_proj.weight``, ...,
    ``norm.weight``, ``fc.weight``, ``hidden_norm.weight``) - the layout vLLM and SGLang load."""
    from safetensors.torch import save_file

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(d / WEIGHTS), metadata={"format": "pt"})
    return d


def read_drafter_config(drafter_dir: str | Path) -> DFlashConfig:
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--drafter: {drafter_dir} has no config.json")
    try:
        return DFlashConfig.from_hf(json.loads(path.read_text()), str(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"--drafter: {path} is not valid JSON: {e}") from None


def load_drafter(drafter_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Load a DFlash checkpoint (ours or any with the same names); key sets must match exactly."""
    from safetensors.torch import load_file

    d = Path(drafter_dir)
    cfg = read_drafter_config(d)
    if not (d / WEIGHTS).is_file():
        raise FileNotFoundError(f"--drafter: {d} has no {WEIGHTS}")
    sd = load_file(str(d / WEIGHTS), device=str(device))
    model = DFlashDrafter(cfg)
    names = set(model.state_dict())
    missing, unexpected = sorted(names - set(sd)), sorted(set(sd) - names)
    if missing or unexpected:
        raise ValueError(f"--drafter: {d} does not match DFlashDraftModel: missing keys {missing[:5]}, "
                         f"unexpected keys {unexpected[:5]}")
    model.load_state_dict(sd)
    model = model.to(device=device, dtype=dtype)
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(device)  # keep inv_freq in float32
    return model.eval().requires_grad_(False)
