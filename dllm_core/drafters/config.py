"""DFlash drafter hyper-parameters and their ``config.json`` form (what vLLM 0.32 / SGLang 0.5.23 load).

The drafter is a short stack of Qwen3 layers: it borrows the target's sizes (hidden, heads, head_dim,
rope, vocab) and adds ``block_size``, ``num_target_layers`` and ``dflash_config`` {mask_token_id,
target_layer_ids}. ``target_layer_ids`` are 0-based target layers whose *outputs* feed the drafter.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .dtypes import DTYPES, dtype_label

ARCHITECTURE = "DFlashDraftModel"


def spread_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """``num_features`` distinct target layers spread evenly between layer 1 and N-3 (the reference rule;
    the whole stack 0..N-1 when that range is too short); N // 2 for one."""
    if num_features < 1:
        raise ValueError(f"--target-layer-ids: need at least one target layer, got {num_features}")
    if num_features == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end - start + 1 < num_features:
        start, end = 0, num_target_layers - 1
    if end - start + 1 < num_features:
        raise ValueError(f"--target-layer-ids: a {num_target_layers}-layer target has no {num_features} "
                         f"distinct layers")
    return tuple(round(start + i * (end - start) / (num_features - 1)) for i in range(num_features))


def dtype_name(target_cfg) -> str:
    """The target config's dtype as config.json spells it (float32 when it names none)."""
    d = getattr(target_cfg, "dtype", None) or getattr(target_cfg, "torch_dtype", None) or "float32"
    return dtype_label(d)


@dataclass(frozen=True)
class DFlashConfig:
    """Sizes of a DFlash drafter; attention/MLP sizes equal the target's so its embedding/head are shared."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    dtype: str = "float32"  # the target's training dtype (hosts resolve dtype "auto" from it); it runs in the
    # dtype its target runs in (dtypes.drafter_dtype)
    extra: dict = field(default_factory=dict, compare=False)  # other target fields kept in config.json

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dflash config: dtype {self.dtype!r} not supported; allowed: {list(DTYPES)}")
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"dflash config: {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"dflash config: block_size must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"dflash config: num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        if not self.target_layer_ids:
            raise ValueError("dflash config: target_layer_ids must be non-empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"dflash config: target_layer_ids {bad} outside [0, {self.num_target_layers})")
        if list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            # vLLM captures each target layer once, in layer order, and concatenates in that order
            raise ValueError(f"dflash config: target_layer_ids must be strictly increasing (distinct, in layer "
                             f"order), got {list(self.target_layer_ids)}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"dflash config: mask_token_id {self.mask_token_id} outside [0, {self.vocab_size})")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def for_target(cls, target_cfg, num_layers: int, block_size: int, mask_token_id: int,
                   target_layer_ids: tuple[int, ...] | None = None) -> DFlashConfig:
        """Drafter config matching a transformers Qwen3/Llama-style target config."""
        n = target_cfg.num_hidden_layers
        ids = tuple(target_layer_ids) if target_layer_ids else spread_layer_ids(n, num_layers)
        rope = getattr(target_cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"target rope_type {rope.get('rope_type')!r} not supported; allowed: ['default']")
        heads = target_cfg.num_attention_heads
        return cls(
            hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=heads,
            num_key_value_heads=getattr(target_cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // heads,
            vocab_size=target_cfg.vocab_size, num_target_layers=n, target_layer_ids=ids,
            mask_token_id=mask_token_id, block_size=block_size, rms_norm_eps=target_cfg.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(target_cfg, "rope_theta", 10000.0))),
            max_position_embeddings=target_cfg.max_position_embeddings,
            attention_bias=bool(getattr(target_cfg, "attention_bias", False)), dtype=dtype_name(target_cfg))

    def to_hf(self) -> dict:
        """``config.json`` content: Qwen3 fields + ``block_size``, ``num_target_layers``, ``dflash_config``."""
        cfg = dict(self.extra)
        cfg.update({
            "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": self.attention_bias, "attention_dropout": 0.0, "tie_word_embeddings": False,
            "use_sliding_window": False, "sliding_window": None,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
            "dtype": self.dtype,
        })
        return cfg

    @classmethod
    def from_hf(cls, cfg: dict, path: str = "config.json") -> DFlashConfig:
        """Parse a DFlash ``config.json`` (fields may sit in ``dflash_config`` or at the top level)."""
        archs = cfg.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise ValueError(f"{path}: architectures {archs} is not a DFlash drafter; allowed: [{ARCHITECTURE!r}]")
        dcfg = cfg.get("dflash_config") or {}

        def pick(key):
            val = dcfg.get(key, cfg.get(key))
            if val is None:
                raise ValueError(f"{path}: required field {key!r} (in dflash_config or top level) is missing")
            return val

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{path}: hidden_act {act!r} not supported; allowed: ['silu']")
        rope = cfg.get("rope_parameters") or {}
        heads = cfg["num_attention_heads"]
        known = set(cls.__dataclass_fields__) | {"architectures", "model_type", "rope_parameters", "dflash_config",
                                                 "hidden_act", "layer_types", "tie_word_embeddings", "dtype"}
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab_size=cfg["vocab_size"],
            num_target_layers=int(pick("num_target_layers")), target_layer_ids=tuple(pick("target_layer_ids")),
            mask_token_id=int(pick("mask_token_id")), block_size=int(dcfg.get("block_size", cfg.get("block_size", 16))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1000000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
            attention_bias=bool(cfg.get("attention_bias", False)), dtype=str(cfg.get("dtype", "float32")),
            extra={k: v for k, v in cfg.items() if k not in known})
