"""LLaDA (``LLaDAModelLM``) and Dream (``DreamModel``) as one bidirectional transformer.

Both are pre-norm RMSNorm / RoPE / SwiGLU stacks with non-causal attention; they differ in the
checkpoint key names, QKV biases, GQA, and Dream's one-position logit shift.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from .config import ModelArgs, dream_args, llada_args
from .layers import Block, RMSNorm, RotaryEmbedding


class DiffusionLM(nn.Module):
    """Masked diffusion LM. ``forward`` is the plain full-sequence pass; cache policies drive
    ``embed`` / ``rope`` / ``layers[i]`` / ``logits`` directly."""

    shift_logits = False           # Dream: prediction for position i is the logit row at i - 1
    hf_keys: dict[str, str] = {}   # internal name -> HF name ("{i}" = layer index)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rotary = self.rotary_for(args)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def block_causal(self) -> int:
        """0: bidirectional attention over the whole sequence; n: block-causal over blocks of n positions
        on the absolute position grid (LLaDA2)."""
        return 0

    @classmethod
    def rotary_for(cls, args: ModelArgs) -> RotaryEmbedding:
        """RoPE over each head's dimensions (LLaDA2 overrides: its rotary part only)."""
        return RotaryEmbedding(args.head_dim, args.rope_theta)

    @classmethod
    def fold_hf(cls, sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        """Checkpoint tensors (HF names) -> one tensor per ``hf_keys`` name (identity but for LLaDA2's experts)."""
        return sd

    @classmethod
    def unfold_hf(cls, sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        """Inverse of ``fold_hf``: the published layout written by ``save_model``."""
        return sd

    def rope(self, pos: torch.Tensor):
        """pos [B, n] -> (cos, sin) [B, n, D]."""
        return self.rotary(pos, self.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, in float32: [B, n, d] -> [B, n, V]."""
        return self.lm_head(self.norm(h)).float()

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """ids/pos [B, T], mask [B, 1, 1, T] -> raw (unshifted) logits [B, T, V]."""
        h, rope = self.embed(ids), self.rope(pos)
        for layer in self.layers:
            h = layer(h, rope, mask)
        return self.logits(h)

    # ---- checkpoint key names -------------------------------------------------------------
    @classmethod
    def _patterns(cls):
        return [(re.compile("^" + re.escape(k).replace(r"\{i\}", r"(\d+)") + "$"), v) for k, v in cls.hf_keys.items()]

    @classmethod
    def to_hf(cls, name: str) -> str:
        for pat, tmpl in cls._patterns():
            m = pat.match(name)
            if m:
                return tmpl.format(i=m.group(1)) if m.groups() else tmpl
        raise KeyError(name)

    @classmethod
    def from_hf_map(cls, args: ModelArgs) -> dict[str, str]:
        """HF key -> internal parameter name for every parameter of this architecture."""
        return {cls.to_hf(n): n for n, _ in cls(args).to("meta").named_parameters()
                if not (args.tied_embeddings and n == "lm_head.weight")}

    @classmethod
    def native_weights(cls, args: ModelArgs, weights, owner: str):
        """Stream HF checkpoint tensors as (internal name, tensor); keys the architecture does not
        have are an error naming ``owner`` (RoPE ``inv_freq`` buffers some checkpoints carry are skipped)."""
        names, unknown = cls.from_hf_map(args), []
        for hf, w in weights:
            if hf in names:
                yield names[hf], w
            elif "rotary_emb.inv_freq" not in hf:
                unknown.append(hf)
        if unknown:
            raise ValueError(f"{owner}: unexpected checkpoint keys {unknown[:5]}")


def shift_right(first: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Dream's shifted logits of a block: the row predicting position i is row i - 1 of the forward,
    so the block's first prediction comes from the position before it. first [B, V] + rows
    [B, L, V] (the block's own rows) -> [B, L, V]."""
    return torch.cat([first[:, None], rows[:, :-1]], 1)


_LAYER = ["q_proj", "k_proj", "v_proj"]


class LLaDAModelLM(DiffusionLM):
    """LLaDA-8B (Base/Instruct/1.5) with its OLMo-style key names; logits are not shifted."""

    hf_keys = {
        "embed.weight": "model.transformer.wte.weight",
        "norm.weight": "model.transformer.ln_f.weight",
        "lm_head.weight": "model.transformer.ff_out.weight",
        "layers.{i}.attn_norm.weight": "model.transformer.blocks.{i}.attn_norm.weight",
        "layers.{i}.ffn_norm.weight": "model.transformer.blocks.{i}.ff_norm.weight",
        "layers.{i}.o_proj.weight": "model.transformer.blocks.{i}.attn_out.weight",
        "layers.{i}.gate_proj.weight": "model.transformer.blocks.{i}.ff_proj.weight",
        "layers.{i}.up_proj.weight": "model.transformer.blocks.{i}.up_proj.weight",
        "layers.{i}.down_proj.weight": "model.transformer.blocks.{i}.ff_out.weight",
        **{f"layers.{{i}}.{p}.{w}": f"model.transformer.blocks.{{i}}.{p}.{w}" for p in _LAYER for w in ("weight", "bias")},
    }
    parse_config = staticmethod(llada_args)


class DreamModel(DiffusionLM):
    """Dream-v0-7B with Qwen2 key names; logits shifted by one position."""

    shift_logits = True
    hf_keys = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
        "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
        "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "layers.{i}.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
        **{f"layers.{{i}}.{p}.weight": f"model.layers.{{i}}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
        **{f"layers.{{i}}.{p}.{w}": f"model.layers.{{i}}.self_attn.{p}.{w}" for p in _LAYER for w in ("weight", "bias")},
    }
    parse_config = staticmethod(dream_args)


ARCHITECTURES: dict[str, type[DiffusionLM]] = {"LLaDAModelLM": LLaDAModelLM, "DreamModel": DreamModel}
