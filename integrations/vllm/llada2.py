"""LLaDA2.0 / 2.1 (``llada2_moe``) on vLLM's own Bailing-MoE V2 layers (Ling 2.0's checkpoint layout), served through
the diffusion pathway with LLaDA2's block-causal semantics: a canvas is one grid block (the prompt's tail recomputed
beside it as the ``StepContext``'s ``RowLayout`` rows), a prompt prefill's attention recomputed block-causally
(``StepContext.prefill`` names the rows); ``docs/architecture.md`` ("LLaDA2").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm_core.engine.generate import block_causal_mask
from dllm_core.models import LLaDA2MoeModelLM

from vllm.config import VllmConfig
from vllm.model_executor.models.bailing_moe import BailingMoeV2ForCausalLM

from .model import attention_of, step_context


class LLaDA2ForDiffusion(BailingMoeV2ForCausalLM):
    """vLLM's Bailing-MoE V2 model serving LLaDA2 checkpoints block-causally (see the module docstring)."""

    native = LLaDA2MoeModelLM
    shift_logits = False

    @staticmethod
    def get_model_state_cls():
        from .state import DllmModelState

        return DllmModelState

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.args = self.native.parse_config(self.config.to_dict())
        self.block_causal = self.config.block_size
        self.dllm = None  # the core's CanvasLifecycle, set by DllmModelState
        self._masks: dict[int, torch.Tensor] = {}  # the step's block-causal prefill masks by length (all layers)
        for layer in self.model.layers:
            layer.attention.attn.register_forward_hook(self._prefill_hook(layer.attention))

    @property
    def layers(self):
        return self.model.layers

    @property
    def feature_shape(self) -> tuple[int, int]:
        """(layers, K/V width per rank) of the response-side feature store."""
        return len(self.layers), self.layers[0].attention.kv_size_per_rank

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)  # [N, d]
        ctx, n = step_context(self), x.shape[0]
        lay = None if ctx is None else ctx.layout
        if lay is not None:  # the prompt tail of a canvas's grid block, recomputed beside it: [N_ext, d]
            x, positions = lay.extend(x, positions, self.embed)
        self._masks = {}
        with attention_of(ctx):
            h = self.model(None, positions, None, inputs_embeds=x)
        if ctx is not None:  # every row runs every layer
            ctx.count(torch.full((h.shape[0],), len(self.layers), device=h.device))
        return h if lay is None else lay.back(h, n)

    def _prefill_hook(self, attention):
        """A forward hook on a layer's vLLM ``Attention``: the rows of the step's prompt prefills get their
        block-causal attention output (vLLM has just written their K/V to the paged cache)."""
        heads, kv_heads, hd, scale = attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.scale

        def hook(module, args, out):
            ctx = step_context(self)
            if ctx is None or not ctx.prefill:
                return out
            q, k, v = args[:3]
            for start, n in ctx.prefill:  # rows [start, start + n): positions 0 .. n - 1 of one request
                rows = slice(start, start + n)
                mask = self._masks.get(n)
                if mask is None:
                    pos = torch.arange(n, device=q.device)[None]
                    mask = self._masks[n] = block_causal_mask(torch.ones_like(pos, dtype=torch.bool), pos,
                                                              self.block_causal)  # [1, 1, n, n]
                qs = q[rows].view(n, heads, hd).transpose(0, 1)[None]  # [1, H, n, hd]
                ks, vs = (t[rows].view(n, kv_heads, hd).transpose(0, 1)[None] for t in (k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
                out[rows] = o[0].transpose(0, 1).reshape(n, heads * hd).to(out.dtype)
            return out

        return hook
