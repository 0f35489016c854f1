"""``dllm train-ar``: a small Qwen3-architecture causal LM (``transformers.Qwen3ForCausalLM``) on the
same tasks and tokenizer; next-token loss on response tokens only. Saved with ``save_pretrained``
(safetensors) plus the tokenizer and a generation config that stops at EOT / EOS, so vLLM and SGLang
load it as a plain Qwen3 model (the target for speculative drafters)."""
from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

from .common import add_train_args, dtype_of, eval_fn, init_from, setup, train_config
from .config import TrainConfig
from .data import ChatEncoder, ar_batch, draw, stream_keys
from .loop import train

DEFAULTS = TrainConfig(out="models/qwen3-tasks", tasks="arithmetic;sort;retrieval:min_pairs=4;count:min_span=1,span=60",
                       batch="32,16,2,2", steps=1500, n_kv_heads=2)


def qwen3_config(cfg: TrainConfig, ids: dict):
    """``Qwen3Config`` of the given sizes (tied embeddings keep the checkpoint small)."""
    from transformers import Qwen3Config

    v = -(-ids["vocab_size"] // 64) * 64
    return Qwen3Config(vocab_size=v, hidden_size=cfg.dim, intermediate_size=cfg.ffn, num_hidden_layers=cfg.n_layers,
                       num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
                       head_dim=cfg.dim // cfg.n_heads, max_position_embeddings=cfg.max_len, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=ids["bos"], eos_token_id=ids["eot"],
                       pad_token_id=ids["eos"], dtype=cfg.save_dtype, architectures=["Qwen3ForCausalLM"])


def build(cfg: TrainConfig, ids: dict):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(qwen3_config(cfg, ids)).to(device=cfg.device, dtype=torch.float32)
    if cfg.init:
        from ..tasks.evaluate import load_ar

        init_from(model, cfg, load_ar(cfg.init, cfg.device).state_dict())
    return model


def ar_loss(model, x: torch.Tensor, att: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over labelled (response) positions."""
    logits = model(input_ids=x, attention_mask=att).logits[:, :-1].float()  # [B, T-1, V]
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def save(model, cfg: TrainConfig, ids: dict) -> None:
    from transformers import GenerationConfig

    model.config.dtype = cfg.save_dtype
    model.generation_config = GenerationConfig(bos_token_id=ids["bos"], eos_token_id=[ids["eot"], ids["eos"]],
                                               pad_token_id=ids["eos"], do_sample=False)
    model.to(dtype_of(cfg)).save_pretrained(cfg.out, safe_serialization=True)
    model.float()


def cmd_train_ar(a) -> int:
    from ..tasks.evaluate import run_ar

    cfg = train_config(a)
    tok, ids = setup(cfg)
    model = build(cfg, ids)
    tasks, sizes, enc = cfg.task_list(), cfg.batch_sizes, ChatEncoder(tok, ids["eot"])

    def loss_fn(step: int, micro: int = 0):
        total, n = 0.0, 0
        for task, b, key in zip(tasks, sizes, stream_keys(tasks)):
            x, att, lab = ar_batch(enc, draw(task, b, cfg.seed, step, key), ids, cfg.device)
            total = total + ar_loss(model, x, att, lab)
            n += x.numel()
        return total / len(tasks), n

    evaluate = eval_fn(cfg, lambda t, exs: run_ar(model, tok, t, exs, batch_size=16))
    t0 = time.perf_counter()
    summary = train(cfg, model, loss_fn, evaluate, desc="train-ar")
    save(model, cfg, ids)
    print(json.dumps({**summary, "wall_seconds": time.perf_counter() - t0, "out": cfg.out}))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train-ar", help="train a small Qwen3-architecture causal LM on the task suite")
    add_train_args(p, DEFAULTS)
    p.set_defaults(func=cmd_train_ar)
