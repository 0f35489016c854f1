"""LLaDA-8B and Dream-7B as SGLang dLLM models in SGLang's layers (``RadixAttention`` ``ENCODER_ONLY``), sizes and key
names from dllm_core; a forward runs the core's ``StepContext`` of the step (``context``, set by the algorithm: its
cached layers, or for a policy over the whole response its packed rows, ``response.ResponseForward``) and Dream's
prefix row (``prefix_row.py``)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Iterable

import torch
from torch import nn

from dllm_core.models import ModelArgs
from dllm_core.models import transformer as core
from dllm_core.models.host_layers import packed_name, packed_value, rank_heads

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.dp_attention import attn_tp_all_reduce
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import add_prefix

from .response import ResponseForward
from .prefix_row import PrefixRows


class DiffusionMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate/up fused into one column-parallel linear."""

    def __init__(self, a: ModelArgs, quant_config=None, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(a.dim, [a.ffn_dim] * 2, bias=False, quant_config=quant_config,
                                                       prefix=add_prefix("gate_up_proj", prefix))
        self.down_proj = RowParallelLinear(a.ffn_dim, a.dim, bias=False, reduce_results=True,
                                           quant_config=quant_config, prefix=add_prefix("down_proj", prefix))
        self.act = SiluAndMul()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)[0]))[0]


class DiffusionAttention(nn.Module):
    """Bidirectional attention over [paged prefix K/V ; the block] (``ENCODER_ONLY``)."""

    def __init__(self, a: ModelArgs, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        tp = get_parallel().attn_tp_size
        self.heads = self.n_heads, self.n_kv, self.head_dim = rank_heads(a, tp, "--tp-size")  # LayerOps: (Hq, Hkv, D)
        self.q_size, self.kv_size = self.n_heads * a.head_dim, self.n_kv * a.head_dim
        self.reduce = attn_tp_all_reduce if tp > 1 else None  # LayerOps.reduce: a pick's sums over every rank's heads
        self.qkv_proj = QKVParallelLinear(a.dim, a.head_dim, a.n_heads, a.n_kv_heads, bias=a.qkv_bias,
                                          quant_config=quant_config, prefix=add_prefix("qkv_proj", prefix),
                                          parallel_group="attn_tp")
        self.o_proj = RowParallelLinear(a.n_heads * a.head_dim, a.dim, bias=False, reduce_results=True,
                                        quant_config=quant_config, prefix=add_prefix("o_proj", prefix),
                                        parallel_group="attn_tp")
        self.rotary_emb = get_rope(a.head_dim, rotary_dim=a.head_dim, max_position=a.max_seq_len,
                                   base=a.rope_theta)
        self.attn = RadixAttention(self.n_heads, a.head_dim, a.head_dim ** -0.5, num_kv_heads=self.n_kv,
                                   layer_id=layer_id, attn_type=AttentionType.ENCODER_ONLY,
                                   prefix=add_prefix("attn", prefix))

    def qkv(self, positions: torch.Tensor, h: torch.Tensor):
        """Normed h [N, d] -> q [N, Hq*D], k [N, Hkv*D] (RoPE applied), v [N, Hkv*D]."""
        qkv, _ = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v

    def value(self, h: torch.Tensor) -> torch.Tensor:
        """The V projection alone (dLLM-Cache's V-verify): normed h [N, d] -> [N, Hkv*D]."""
        return packed_value(h, self.qkv_proj, self.q_size + self.kv_size, self.q_size + 2 * self.kv_size)

    def forward(self, q, k, v, forward_batch: ForwardBatch) -> torch.Tensor:
        """Attention (writes k/v into the paged cache at ``out_cache_loc``) + output projection."""
        return self.o_proj(self.attn(q, k, v, forward_batch))[0]


class DiffusionLayer(nn.Module):
    """Pre-norm block: out = x + attn(norm(x)) + ffn(norm(x + attn))."""

    def __init__(self, a: ModelArgs, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(a.dim, eps=a.norm_eps)
        self.self_attn = DiffusionAttention(a, layer_id, quant_config, add_prefix("self_attn", prefix))
        self.ffn_norm = RMSNorm(a.dim, eps=a.norm_eps)
        self.mlp = DiffusionMLP(a, quant_config, add_prefix("mlp", prefix))

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ffn_norm(h))

    def ops(self, fb: ForwardBatch) -> SimpleNamespace:
        """This layer as dllm_core's ``LayerOps`` (flat token rows, pre-norm x) for one forward batch."""
        att = self.self_attn

        def attend(q, k, v, rows):  # SGLang's kernels take the block whole: the other queries are dropped
            full = q.new_zeros(k.shape[0], q.shape[-1]).index_copy_(0, rows, q)
            return att.o_proj(att.attn(full, k, v, fb).view(k.shape[0], -1)[rows])[0]

        return SimpleNamespace(qkv=lambda x, pos: att.qkv(pos, self.attn_norm(x)), heads=att.heads,
                               value=lambda x: att.value(self.attn_norm(x)), attend=attend, ffn=self.ffn,
                               reduce=att.reduce)

    def forward(self, positions, x, forward_batch: ForwardBatch) -> torch.Tensor:
        h = x + self.self_attn(*self.self_attn.qkv(positions, self.attn_norm(x)), forward_batch)
        return h + self.ffn(h)


# a layer's (packed) linear -> its submodule here
WHERE = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj", "gate_up_proj": "mlp.gate_up_proj",
         "down_proj": "mlp.down_proj"}
SHARDS = {"q": 0, "k": 1, "v": 2}  # QKVParallelLinear's shard ids -> BitsAndBytes' shard index


class DiffusionLMForSGLang(nn.Module):
    """Shared body of the two architectures; ``core_cls`` is the dllm_core model class."""

    core_cls: type[core.DiffusionLM] = core.DiffusionLM

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        if get_parallel().pp_group.world_size != 1:
            raise ValueError(f"{type(self).__name__} does not support pipeline parallelism (--pp-size 1)")
        self.config, self.quant_config = config, quant_config
        self.args = a = self.core_cls.parse_config(config.to_dict(), "config.json")
        self.embed = VocabParallelEmbedding(a.vocab_size, a.dim, quant_config=quant_config, prefix="embed")
        self.layers = nn.ModuleList(DiffusionLayer(a, i, quant_config, f"layers.{i}") for i in range(a.n_layers))
        self.norm = RMSNorm(a.dim, eps=a.norm_eps)
        self.lm_head = ParallelLMHead(a.vocab_size, a.dim, quant_config=quant_config, prefix="lm_head")
        self.logits_processor = LogitsProcessor(config, return_full_logits=True)
        self.context = None  # the core's StepContext of the next forward (set by the algorithm; None: run it whole)
        self.response_forward = ResponseForward(self)
        self.prefix_rows = PrefixRows(self) if self.core_cls.shift_logits else None

    start_layer = 0  # (SGLang's layer range of this rank: every layer)
    end_layer = property(lambda self: self.args.n_layers)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def hidden(self, input_ids, positions, fb: ForwardBatch, input_embeds=None, ctx=None) -> torch.Tensor:
        """Final-layer hidden states (before the final norm) of the block tokens: [N, d]."""
        h = self.embed(input_ids) if input_embeds is None else input_embeds
        if ctx is None:
            for layer in self.layers:
                h = layer(positions, h, fb)
            return h
        return ctx.run(self.layers, h, positions, lambda layer, x: layer(positions, x, fb), lambda layer: layer.ops(fb))

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch: ForwardBatch, input_embeds=None, pp_proxy_tensors=None):
        ctx, self.context = self.context, None
        if ctx is not None and ctx.packed is not None and forward_batch.forward_mode.is_dllm_extend():
            return self.response_forward.forward(input_ids, forward_batch, ctx)  # whole responses: the packed rows
        prefix = self.prefix_rows.rows(positions, forward_batch) if self.prefix_rows is not None else None
        h = self.norm(self.hidden(input_ids, positions, forward_batch, input_embeds, ctx))
        if prefix is not None:  # Dream: one more logit row per request, for block position 0
            h = torch.cat([h, self.norm(prefix)])
        out = self.logits_processor(input_ids, h, self.lm_head, forward_batch)
        if prefix is not None:
            n = input_ids.shape[0]
            out.full_logits = PrefixRows.shift(out.full_logits[:n], out.full_logits[n:])
        return out

    @property
    def bitsandbytes_stacked_params_mapping(self) -> dict[str, tuple[str, int]]:
        """SGLang's BitsAndBytes loader (``--load-format bitsandbytes``) files each projection's quant state under
        ``key.replace(name, (parameter, shard index))``; its in-flight quantization renames a checkpoint key
        ``X.weight`` to ``X.qweight``, so the name ``X.q`` maps to this model's ``parameter.`` (+ ``weight``)."""
        out = {}
        for hf, native in self.core_cls.from_hf_map(self.args).items():
            target, shard = self.sglang_name(native)
            if target.split(".")[-2] in WHERE:
                out[hf.removesuffix("weight") + "q"] = (target.removesuffix("weight"), SHARDS.get(shard, shard or 0))
        return out

    @property
    def default_bitsandbytes_target_modules(self) -> list[str]:
        return [name[:-1] for name in self.bitsandbytes_stacked_params_mapping]  # "X." of each "X.weight"

    @staticmethod
    def sglang_name(name: str) -> tuple[str, object]:
        """dllm_core parameter name -> (this model's parameter name, shard id or None)."""
        return packed_name(name, WHERE)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors (LLaDA / Dream key names) through each parameter's ``weight_loader`` (TP sharding)."""
        params, loaded = dict(self.named_parameters()), set()
        weights = ((n[:-8] + ".weight" if n.endswith(".qweight") else n, w) for n, w in weights)  # BitsAndBytes
        for name, w in self.core_cls.native_weights(self.args, weights, type(self).__name__):
            if name == "embed.weight" and self.args.tied_embeddings:
                self._load(params["lm_head.weight"], w, None)
                loaded.add("lm_head.weight")
            target, shard = self.sglang_name(name)
            self._load(params[target], w, shard)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"{type(self).__name__}: checkpoint lacks {missing[:5]}")
        return loaded

    @staticmethod
    def _load(param, w, shard) -> None:
        getattr(param, "weight_loader", default_weight_loader)(param, w, *(() if shard is None else (shard,)))


class LLaDAModelLM(DiffusionLMForSGLang):  # LLaDA-8B Base / Instruct / 1.5 (logits not shifted)
    core_cls = core.LLaDAModelLM


class DreamModel(DiffusionLMForSGLang):  # Dream-v0-7B Base / Instruct (logit row i predicts position i + 1)
    core_cls = core.DreamModel


EntryClass = [LLaDAModelLM, DreamModel]
