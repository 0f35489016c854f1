"""Checkpoint layout, loading errors and the layer interface cache policies rely on."""
import json

import pytest
import torch
from safetensors import safe_open

from dllm_core import load_model
from dllm_core.models import DreamModel, LLaDAModelLM
from dllm_core.models.layers import write_kv
from dllm_core.testing import build_tiny_checkpoint

LLADA_KEYS = ["model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"] + [
    f"model.transformer.blocks.1.{k}.weight" for k in
    ("attn_norm", "ff_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")]
DREAM_KEYS = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
    f"model.layers.1.{k}" for k in (
        "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
        "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")]


def keys(d):
    with safe_open(d / "model.safetensors", "pt") as f:
        return set(f.keys())


def test_real_key_names_round_trip(llada_dir, dream_dir, llada, dream):
    lk, dk = keys(llada_dir), keys(dream_dir)
    assert set(LLADA_KEYS) <= lk and len(lk) == 3 + 9 * 2
    assert set(DREAM_KEYS) <= dk and len(dk) == 3 + 12 * 2
    with safe_open(llada_dir / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("model.transformer.blocks.1.ff_proj.weight"), llada.layers[1].gate_proj.weight)
    with safe_open(dream_dir / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.k_proj.bias"), dream.layers[0].k_proj.bias)
    assert isinstance(llada, LLaDAModelLM) and isinstance(dream, DreamModel)
    assert dream.args.n_kv_heads == 2 and dream.args.n_heads == 4 and dream.shift_logits and not llada.shift_logits


def test_config_fields_are_the_real_ones(llada_dir, dream_dir):
    c = json.loads((llada_dir / "config.json").read_text())
    for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size", "embedding_size",
              "max_sequence_length", "rope_theta", "weight_tying", "include_bias", "block_type", "mask_token_id"):
        assert k in c
    c = json.loads((dream_dir / "config.json").read_text())
    for k in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "intermediate_size", "mask_token_id"):
        assert k in c


def test_sharded_equals_single(tmp_path, llada):
    d = build_tiny_checkpoint(tmp_path / "sharded", "llada", shard_size=30_000)
    assert (d / "model.safetensors.index.json").is_file() and not (d / "model.safetensors").exists()
    m = load_model(d)
    for (n, a), (_, b) in zip(m.named_parameters(), llada.named_parameters()):
        assert torch.equal(a, b), n


def test_dtype_and_device(llada_dir):
    m = load_model(llada_dir, "cpu", torch.bfloat16)
    assert m.layers[0].q_proj.weight.dtype == torch.bfloat16 and m.lm_head.weight.device.type == "cpu"


def test_missing_and_corrupt_weights(tmp_path):
    d = build_tiny_checkpoint(tmp_path / "m", "dream")
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="--model: weight file .* corrupt"):
        load_model(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="--model: .* has no weights"):
        load_model(d)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "nowhere")


def test_missing_shard_and_wrong_arch(tmp_path):
    d = build_tiny_checkpoint(tmp_path / "s", "llada", shard_size=30_000)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shards listed in model.safetensors.index.json are missing"):
        load_model(d)
    d = build_tiny_checkpoint(tmp_path / "a", "llada")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="architectures .*GPT2LMHeadModel.* not supported; allowed"):
        load_model(d)
    (d / "config.json").write_text(json.dumps({**cfg, "n_layers": 3}))
    with pytest.raises(ValueError, match="missing keys .*blocks.2"):
        load_model(d)


def test_window_against_supplied_kv_matches_full_forward(model):
    """The cache interface: run layers on a subset of positions against K/V supplied for the
    others (filled from a full pass) and get the full pass's rows back."""
    ids = torch.randint(0, 200, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    rope, h = model.rope(pos), model.embed(ids)
    bufs, full = [], h
    for layer in model.layers:
        q, k, v = layer.qkv(full, rope)
        bufs.append((k.clone(), v.clone()))
        full = layer(full, rope, None)
    lo, hi = 4, 9
    sub = model.embed(ids[:, lo:hi])
    sub_rope = tuple(r[:, lo:hi] for r in rope)
    for layer, kv in zip(model.layers, bufs):
        sub = layer(sub, sub_rope, None, kv=kv, at=lo)
    torch.testing.assert_close(sub, full[:, lo:hi], rtol=1e-5, atol=1e-5)
    idx = torch.tensor([[1, 5], [7, 2]])
    buf = torch.zeros(2, 1, 10, 3)
    write_kv(buf, idx, torch.ones(2, 1, 2, 3))
    assert buf.sum(dim=(1, 3)).nonzero().tolist() == [[0, 1], [0, 5], [1, 2], [1, 7]]
