"""The embedded reference engine."""
from .config import GenerationConfig
from .generate import GenerationResult, build_canvas, generate

__all__ = ["GenerationConfig", "GenerationResult", "build_canvas", "generate"]
