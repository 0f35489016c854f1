"""Prompt admission for LLaDA / Dream in vLLM's vocabulary: vLLM's HF renderer plus dllm_core's
prompt rule (``mask_in_prompt``), so a prompt holding the mask token is a validation error (HTTP 400
from the OpenAI server, which keeps serving) before it is queued. Selected through the ``dllm``
tokenizer mode (vLLM's cached HF tokenizer + this renderer) that the config hook sets."""
from __future__ import annotations

from dllm_core.engine.step import mask_in_prompt

from vllm.exceptions import VLLMValidationError
from vllm.renderers.hf import HfRenderer

MODE = "dllm"


class DllmRenderer(HfRenderer):
    def validate_token_ids(self, token_ids, *, parameter: str | None = None) -> None:
        mask_id = getattr(self.model_config.hf_config, "mask_token_id", None)
        if token_ids and mask_id is not None and (err := mask_in_prompt(token_ids, mask_id)):
            raise VLLMValidationError(err, parameter=parameter or "prompt")
        super().validate_token_ids(token_ids, parameter=parameter)
