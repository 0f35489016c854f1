"""Model hyper-parameters read from an HF ``config.json`` (LLaDA or Dream field names)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    """Architecture-neutral sizes of a bidirectional diffusion transformer."""

    arch: str                 # "LLaDAModelLM" | "DreamModel"
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int           # rows of the embedding / LM head (LLaDA: embedding_size)
    max_seq_len: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    tied_embeddings: bool
    mask_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    bos_token_id: int | None

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"config: {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"config: hidden size {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"config: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _req(cfg: dict, key: str, path: str):
    if key not in cfg:
        raise ValueError(f"{path}: required field '{key}' is missing")
    return cfg[key]


def rope_theta(cfg: dict, default: float) -> float:
    """RoPE's base: ``rope_theta``, or inside ``rope_parameters`` (where transformers 5 configs keep it)."""
    return float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or default)


def llada_args(cfg: dict, path: str = "config.json") -> ModelArgs:
    """Map LLaDA's OLMo-style field names (d_model, n_layers, mlp_hidden_size, ...)."""
    n_heads = _req(cfg, "n_heads", path)
    if cfg.get("include_bias"):
        raise ValueError(f"{path}: include_bias=true is not supported (LLaDA checkpoints use false)")
    return ModelArgs(
        arch="LLaDAModelLM", dim=_req(cfg, "d_model", path), n_layers=_req(cfg, "n_layers", path),
        n_heads=n_heads, n_kv_heads=cfg.get("n_kv_heads") or n_heads,
        ffn_dim=_req(cfg, "mlp_hidden_size", path),
        vocab_size=cfg.get("embedding_size") or _req(cfg, "vocab_size", path),
        max_seq_len=cfg.get("max_sequence_length", 4096), rope_theta=rope_theta(cfg, 10000.0),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), qkv_bias=False,
        tied_embeddings=bool(cfg.get("weight_tying", False)), mask_token_id=cfg.get("mask_token_id"),
        eos_token_id=cfg.get("eos_token_id"), pad_token_id=cfg.get("pad_token_id"),
        bos_token_id=cfg.get("bos_token_id"))


def dream_args(cfg: dict, path: str = "config.json") -> ModelArgs:
    """Map Dream's Qwen2-style field names (hidden_size, num_hidden_layers, ...)."""
    n_heads = _req(cfg, "num_attention_heads", path)
    return ModelArgs(
        arch="DreamModel", dim=_req(cfg, "hidden_size", path), n_layers=_req(cfg, "num_hidden_layers", path),
        n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        ffn_dim=_req(cfg, "intermediate_size", path), vocab_size=_req(cfg, "vocab_size", path),
        max_seq_len=cfg.get("max_position_embeddings", 32768), rope_theta=rope_theta(cfg, 10000.0),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), qkv_bias=True,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), mask_token_id=cfg.get("mask_token_id"),
        eos_token_id=cfg.get("eos_token_id"), pad_token_id=cfg.get("pad_token_id"),
        bos_token_id=cfg.get("bos_token_id"))
