"""Drafters for lossless speculative decoding of causal targets: DFlash (block-diffusion drafter) and the
shared verification (``verify.py``) later drafters reuse."""
from .config import DFlashConfig, spread_layer_ids
from .dflash import DFlashDrafter, load_drafter, save_drafter
from .speculative import DecodeResult, SpecConfig, ar_generate, speculative_generate
from .verify import Acceptance, SamplingParams, accept_chain, accept_greedy, accept_sampled, probs_from_logits

__all__ = ["Acceptance", "DFlashConfig", "DFlashDrafter", "DecodeResult", "SamplingParams", "SpecConfig",
           "accept_chain", "accept_greedy", "accept_sampled", "ar_generate", "load_drafter", "probs_from_logits",
           "save_drafter", "speculative_generate", "spread_layer_ids"]
