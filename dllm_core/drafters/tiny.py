"""Tiny locally built Qwen3 target + DFlash drafter pairs for tests and demos (nothing is downloaded)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..testing import build_tokenizer
from .config import DFlashConfig
from .dflash import DFlashDrafter, init_weights, save_drafter


def build_tiny_target(out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 4, heads: int = 4,
                      kv_heads: int = 2, head_dim: int = 32, ffn: int = 128, init_std: float = 0.1,
                      logit_scale: float = 8.0) -> Path:
    """Random ``Qwen3ForCausalLM`` + byte-level BPE tokenizer (``<|mask|>`` special) saved in HF layout.

    head_dim 32: the smallest size vLLM's CPU attention supports."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = Path(out_dir)
    ids = build_tokenizer(d, "dream")
    eos = ids["<|endoftext|>"]
    cfg = Qwen3Config(vocab_size=-(-ids["vocab_size"] // 64) * 64, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=1024, initializer_range=init_std,
                      tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)  # peaked next-token distributions: no near-ties in argmax
    model.save_pretrained(d)
    return d


def tiny_mask_id(target_dir: str | Path) -> int:
    from ..tokenizer import load_tokenizer, special_id

    return special_id(load_tokenizer(target_dir), "<|mask|>")


def build_tiny_drafter(out_dir: str | Path, target_dir: str | Path, layers: int = 2, block_size: int = 16,
                       seed: int = 0, std: float = 0.05, target_layer_ids: tuple[int, ...] = (1, 2)) -> Path:
    """Randomly initialised drafter for the target in ``target_dir``, saved in the checkpoint format."""
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(str(target_dir), local_files_only=True)
    cfg = DFlashConfig.for_target(tcfg, layers, block_size, tiny_mask_id(target_dir), target_layer_ids)
    return save_drafter(init_weights(DFlashDrafter(cfg), std=std, seed=seed), out_dir)
