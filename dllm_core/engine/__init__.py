"""The embedded reference engine."""
from .config import GenerationConfig
from .generate import GenerationResult, build_canvas, generate, generate_in_canvases
from .step import StepPlan, denoise_step, plan_step, take_step

__all__ = ["GenerationConfig", "GenerationResult", "StepPlan", "build_canvas", "denoise_step",
           "generate", "generate_in_canvases", "plan_step", "take_step"]
