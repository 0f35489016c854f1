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

from .model import DllmModel


class LLaDA2ForDiffusion(DllmModel, BailingMoeV2ForCausalLM):
    """vLLM's Bailing-MoE V2 model serving LLaDA2 checkpoints block-causally (see the module docstring)."""

    native = LLaDA2MoeModelLM
    shift_logits = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.args = self.native.parse_config(self.config.to_dict())
        self.block_causal = self.config.block_size

    @property
    def layers(self):
        return self.model.layers

    @property
    def feature_shape(self) -> tuple[int, int]:
        """(layers, K/V width per rank) of the response-side feature store."""
        return len(self.layers), self.layers[0].attention.kv_size_per_rank

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(ids)

    logits = BailingMoeV2ForCausalLM.compute_logits

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """vLLM's Bailing-MoE layers over the rows (normed): [N, d]; every row runs every layer."""
        h = self.model(None, positions, None, inputs_embeds=x)
        if ctx is not None:
            ctx.count(torch.full((h.shape[0],), len(self.layers), device=h.device))
        return h
