"""Tiny, locally built LLaDA / Dream checkpoints with the real key names and config fields.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained on a few lines.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .models import DreamModel, LLaDA2MoeModelLM, LLaDAModelLM, save_model

LLADA_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|mdm_mask|>"]
DREAM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
LLADA_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
              "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
DREAM_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is 12 plus 30? The answer is 42.",
          "Sort the list: 5 3 9 1 -> 1 3 5 9.", "Hello world! Diffusion models denoise masked tokens."]


def build_tokenizer(out_dir: str | Path, flavor: str = "llada", corpus: list[str] | None = None,
                    vocab_size: int = 320, extra_specials: list[str] = (), split_digits: bool = False) -> dict[str, int]:
    """Train a byte-level BPE, write tokenizer.json + tokenizer_config.json; return special ids.
    ``split_digits`` makes every digit its own token (no number merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = (LLADA_SPECIALS if flavor == "llada" else DREAM_SPECIALS) + list(extra_specials)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus or CORPUS, trainer)
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in specials}
    if flavor == "llada":
        cfg = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "mask_token": "<|mdm_mask|>", "chat_template": LLADA_CHAT}
    else:
        cfg = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "mask_token": "<|mask|>", "chat_template": DREAM_CHAT}
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=4096)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    ids["vocab_size"] = tok.get_vocab_size()
    return ids


def llada_config(ids: dict, dim=64, n_layers=2, n_heads=4, n_kv_heads=None, ffn=128, max_len=1024) -> dict:
    v = -(-ids["vocab_size"] // 64) * 64
    return {"architectures": ["LLaDAModelLM"], "model_type": "llada", "auto_map": {}, "d_model": dim,
            "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads or n_heads,
            "mlp_hidden_size": ffn, "mlp_ratio": ffn // dim, "vocab_size": v, "embedding_size": v,
            "max_sequence_length": max_len, "rope": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "layer_norm_type": "rms", "activation_type": "silu", "block_type": "llama",
            "weight_tying": False, "include_bias": False, "alibi": False, "scale_logits": False,
            "mask_token_id": ids["<|mdm_mask|>"], "eos_token_id": ids["<|endoftext|>"],
            "pad_token_id": ids["<|endoftext|>"], "bos_token_id": ids["<|startoftext|>"], "torch_dtype": "float32"}


def dream_config(ids: dict, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=128, max_len=1024) -> dict:
    v = -(-ids["vocab_size"] // 64) * 64
    eos = ids["<|endoftext|>"]
    return {"architectures": ["DreamModel"], "model_type": "Dream", "hidden_size": dim,
            "num_hidden_layers": n_layers, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
            "intermediate_size": ffn, "vocab_size": v, "max_position_embeddings": max_len,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
            "mask_token_id": ids["<|mask|>"], "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos,
            "torch_dtype": "float32"}


def llada2_config(ids: dict, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128, experts=8,
                  top_k=2, n_group=2, topk_group=1, moe_ffn=32, shared=1, first_dense=1, block_size=8,
                  max_len=1024) -> dict:
    """A LLaDA2 (``llada2_moe``) config.json with the published field names (LLaDA2.0-mini's choices:
    partial rotary 0.5, sigmoid routing with expert bias, grouped top-k, one shared expert, first layer dense),
    tiny sizes; ``block_size`` and ``mask_token_id`` name this checkpoint's block and [MASK]."""
    v = -(-ids["vocab_size"] // 64) * 64
    eos = ids["<|endoftext|>"]
    return {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_size": dim,
            "num_hidden_layers": n_layers, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
            "head_dim": head_dim, "intermediate_size": ffn, "moe_intermediate_size": moe_ffn, "num_experts": experts,
            "num_experts_per_tok": top_k, "n_group": n_group, "topk_group": topk_group, "num_shared_experts": shared,
            "first_k_dense_replace": first_dense, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "norm_topk_prob": True, "norm_head": False,
            "partial_rotary_factor": 0.5, "rope_theta": 600000, "rms_norm_eps": 1e-6, "use_qk_norm": True,
            "use_qkv_bias": False, "use_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
            "vocab_size": v, "max_position_embeddings": max_len, "block_size": block_size,
            "mask_token_id": ids["<|mdm_mask|>"], "eos_token_id": eos, "pad_token_id": eos,
            "bos_token_id": ids["<|startoftext|>"], "torch_dtype": "float32"}


def build_tiny_checkpoint(out_dir: str | Path, arch: str = "llada", seed: int = 0, shard_size: int | None = None,
                          logit_scale: float = 8.0, **sizes) -> Path:
    """Random tiny LLaDA ("llada"), Dream ("dream") or LLaDA2 ("llada2", MoE) checkpoint + tokenizer in
    ``out_dir``. ``logit_scale`` multiplies the LM head so confidences spread over (0, 1) like a trained model's."""
    kinds = {"llada": (llada_config, LLaDAModelLM), "dream": (dream_config, DreamModel),
             "llada2": (llada2_config, LLaDA2MoeModelLM)}
    if arch not in kinds:
        raise ValueError(f"arch must be one of {sorted(kinds)}, got {arch!r}")
    d = Path(out_dir)
    ids = build_tokenizer(d, "dream" if arch == "dream" else "llada")
    make, cls = kinds[arch]
    cfg = make(ids, **sizes)
    torch.manual_seed(seed)
    model = cls(cls.parse_config(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate", "w_gate", "w_up", "w_down")):  # LLaDA2's stacked experts
                p.normal_(std=p.shape[-1] ** -0.5)
        model.embed.weight.normal_()
        model.embed.weight[cfg["mask_token_id"]].mul_(0.1)  # a near-neutral [MASK] lets context show through
        w = model.lm_head.weight
        w.mul_(logit_scale / w.norm(dim=-1, keepdim=True))  # equal-norm rows: no token wins everywhere
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    save_model(model, d, cfg, shard_size=shard_size)
    return d


class PackedHostStep:
    """A cached step of a whole-response host (SGLang's path) over an embedded model, built by the core's host
    contract: two requests (prompts 5 and 3, one canvas of 16 in blocks of 8), a first step that recomputes
    everything, two tokens committed, then this step (``run``: every layer through ``PackedStep``; a test traces
    or captures it). ``ops`` are a host's ``LayerOps`` over the embedded blocks with the core's packed attention, or
    ``make_ops(layer, step)``'s (a tensor-parallel rank's: ``kv`` its K / V width); ``buckets``: ``PackedStep``'s
    (the rows padded to the bucket set, x holding the padding rows)."""

    def __init__(self, model, spec: str, device="cpu", make_ops=None, kv: int | None = None, buckets: bool = False):
        from .cache import HostRequest, make_cache
        from .cache.executor import PartStores

        a, g = model.args, torch.Generator().manual_seed(0)
        self.model, self.device, self.buckets = model, torch.device(device), buckets
        self.prompts = [torch.randint(0, 20, (P,), generator=g).to(device) for P in (5, 3)]
        self.canvas = [torch.full((16,), a.mask_token_id, device=device) for _ in self.prompts]
        self.reqs = [HostRequest(make_cache(spec), prompt_len=len(p), device=self.device) for p in self.prompts]
        like, self.make_ops = model.embed.weight[:0], make_ops or self._ops
        kv = a.n_kv_heads * a.head_dim if kv is None else kv
        self.stores = [PartStores(a.n_layers, kv, a.dim, like) for _ in self.reqs]
        for r, p in zip(self.reqs, self.prompts):
            r.begin_canvas(len(p))
            r.begin_block()
        with torch.no_grad():
            self.plan(0)
            self.run(self.x)
            for c in self.canvas:
                c[:2] = torch.randint(0, 20, (2,), generator=g).to(device)
            self.plan(2)

    def plan(self, changed: int) -> None:
        from .cache.host import PackedStep

        plans = [r.plan(len(p), (0, 8), 0, len(p), 16, changed, c, 8)
                 for r, p, c in zip(self.reqs, self.prompts, self.canvas)]
        ends = [len(p) + 16 for p in self.prompts]
        parts = [[("prompt", 0, len(p)), ("response", len(p), e)] for p, e in zip(self.prompts, ends)]
        self.step = PackedStep(plans, ends, parts, self.stores, self.device, self.buckets)
        ids = torch.cat([torch.cat([p, c]) for p, c in zip(self.prompts, self.canvas)])
        self.x = self.step.padded(self.model.embed(ids if self.step.kept is None else ids[self.step.kept]))
        self.ops = [self.make_ops(b, self.step) for b in self.model.layers]

    def _ops(self, layer, step):
        from types import SimpleNamespace

        from .models.layers import BlockOps

        ops, rope = BlockOps(layer, None, 1, None), self.model.rotary
        qkv = lambda x, pos: tuple(t[0].transpose(0, 1).flatten(1)  # noqa: E731
                                   for t in layer.qkv(x[None], rope(pos[None], x.dtype)))
        attend = lambda q, k, v, rows: layer.o_proj(  # noqa: E731
            step.attention(q, k, v, rows, layer.n_heads, layer.n_kv, layer.head_dim ** -0.5))
        return SimpleNamespace(qkv=qkv, value=ops.value, ffn=ops.ffn, heads=ops.heads, attend=attend)

    def run(self, x: torch.Tensor, wrap=None) -> torch.Tensor:
        """Every layer of the step: x [N, d] -> [N, d] (features stored, work tallied; ``wrap`` each of its passes:
        ``executor.run_layers``)."""
        return self.step.run(self.ops, x, wrap)

    def buffers(self) -> list[torch.Tensor]:
        """Every stored feature buffer of both requests, in a fixed order."""
        return [b for st in self.stores for store in st.stores.values() for b in store.bufs]

    def features(self) -> list[torch.Tensor]:
        """Every stored feature buffer (copies)."""
        return [b.clone() for b in self.buffers()]

    def load(self, feats: list[torch.Tensor]) -> None:
        """Put back what ``features`` returned (a capture's warm-up ran the step once)."""
        for b, f in zip(self.buffers(), feats):
            b.copy_(f)
