"""Drafters for lossless speculative decoding of causal targets: DFlash (block-diffusion drafter), the
shared verification (``verify.py``), the one AR sampling module (``sampling.py``) later drafters reuse and the
dtype rule every host follows (``dtypes.py``: a drafter runs in its target's dtype)."""
from .config import DFlashConfig, spread_layer_ids
from .dflash import DFlashDrafter, load_drafter, save_drafter
from .dtypes import drafter_dtype
from .speculative import DecodeResult, SpecConfig, ar_generate, speculative_generate
from .sampling import Emitter, SamplingParams, probs_from_logits, target_choice
from .verify import Acceptance, accept_chain, accept_greedy, accept_sampled

__all__ = ["Acceptance", "DFlashConfig", "DFlashDrafter", "DecodeResult", "Emitter", "SamplingParams", "SpecConfig",
           "accept_chain", "accept_greedy", "accept_sampled", "ar_generate", "drafter_dtype", "load_drafter",
           "probs_from_logits", "save_drafter", "speculative_generate", "spread_layer_ids", "target_choice"]
