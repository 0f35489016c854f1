"""LLaDA-8B and Dream-7B as SGLang dLLM models in SGLang's layers (``RadixAttention`` ``ENCODER_ONLY``), sizes and key
names from dllm_core; a forward runs the core's ``StepContext`` of the step (``context``, set by the algorithm: its
cached layers, or for a policy over the whole response its packed rows, ``response.ResponseForward``) and Dream's
prefix row (``prefix_row.py``)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from dllm_core.models import ModelArgs
from dllm_core.models import transformer as core
from dllm_core.models.host_layers import HostBlock, load_host_weights, packed_name, packed_shards, rank_heads

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


class DiffusionLayer(HostBlock, nn.Module):
    """Pre-norm bidirectional attention over [paged prefix K/V ; the block] (``ENCODER_ONLY``) + SwiGLU in SGLang's
    layers (the core's ``LayerOps`` from ``HostBlock``; ``paged`` takes the forward batch)."""

    def __init__(self, a: ModelArgs, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        tp, qc = get_parallel().attn_tp_size, quant_config
        self.heads = Hq, Hkv, _ = rank_heads(a, tp, "--tp-size")
        self.reduce = attn_tp_all_reduce if tp > 1 else None  # LayerOps.reduce: a pick's sums over every rank's heads
        self.attn_norm = RMSNorm(a.dim, eps=a.norm_eps)
        self.qkv_proj = QKVParallelLinear(a.dim, a.head_dim, a.n_heads, a.n_kv_heads, bias=a.qkv_bias, quant_config=qc,
                                          prefix=add_prefix("qkv_proj", prefix), parallel_group="attn_tp")
        self.o_proj = RowParallelLinear(a.n_heads * a.head_dim, a.dim, bias=False, reduce_results=True,
                                        quant_config=qc, prefix=add_prefix("o_proj", prefix), parallel_group="attn_tp")
        self.rotary_emb = get_rope(a.head_dim, rotary_dim=a.head_dim, max_position=a.max_seq_len, base=a.rope_theta)
        self.attn = RadixAttention(Hq, a.head_dim, a.head_dim ** -0.5, num_kv_heads=Hkv, layer_id=layer_id,
                                   attn_type=AttentionType.ENCODER_ONLY, prefix=add_prefix("attn", prefix))
        self.ffn_norm = RMSNorm(a.dim, eps=a.norm_eps)
        self.gate_up_proj = MergedColumnParallelLinear(a.dim, [a.ffn_dim] * 2, bias=False, quant_config=qc,
                                                       prefix=add_prefix("gate_up_proj", prefix))
        self.down_proj = RowParallelLinear(a.ffn_dim, a.dim, bias=False, reduce_results=True, quant_config=qc,
                                           prefix=add_prefix("down_proj", prefix))
        self.act = SiluAndMul()

    def paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """SGLang's attention of every row of the batch (it writes k / v at ``out_cache_loc``): -> [N, Hq*D]."""
        return self.attn(q, k, v, fb)


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
    def prepare_for_forward(self, fb: ForwardBatch) -> None:
        """(SGLang calls it before every forward, a graph's replay too) Dream's prefix rows brought up to date."""
        if self.prefix_rows is not None and (self.context is None or self.context.packed is None):
            self.prefix_rows.prepare(fb)

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
        return {hf.removesuffix("weight") + "q": (target.removesuffix("weight"), shard)
                for hf, (target, shard) in packed_shards(self.core_cls, self.args).items()}

    @property
    def default_bitsandbytes_target_modules(self) -> list[str]:
        return [name[:-1] for name in self.bitsandbytes_stacked_params_mapping]  # "X." of each "X.weight"

    sglang_name = staticmethod(packed_name)  # dllm_core parameter name -> (this model's name, shard id or None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors (LLaDA / Dream key names) through each parameter's ``weight_loader`` (TP sharding)."""
        weights = ((n[:-8] + ".weight" if n.endswith(".qweight") else n, w) for n, w in weights)  # BitsAndBytes
        return load_host_weights(self, self.core_cls, weights, default_weight_loader)


class LLaDAModelLM(DiffusionLMForSGLang):  # LLaDA-8B Base / Instruct / 1.5 (logits not shifted)
    core_cls = core.LLaDAModelLM


class DreamModel(DiffusionLMForSGLang):  # Dream-v0-7B Base / Instruct (logit row i predicts position i + 1)
    core_cls = core.DreamModel


EntryClass = [LLaDAModelLM, DreamModel]
