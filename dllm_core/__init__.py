"""dllm_core: engine-agnostic masked-diffusion LM serving pieces (models, samplers, cache policies,
the reference decoding loop)."""
from .cache import make_cache
from .engine import GenerationConfig, GenerationResult, generate
from .models import DreamModel, LLaDAModelLM, load_model
from .sampling import make_sampler
from .tokenizer import encode_prompt, load_tokenizer

__all__ = ["DreamModel", "GenerationConfig", "GenerationResult", "LLaDAModelLM", "encode_prompt", "generate",
           "load_model", "load_tokenizer", "make_cache", "make_sampler"]
