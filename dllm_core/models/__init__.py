"""Native LLaDA / Dream models and their checkpoint loader."""
from .config import ModelArgs
from .loader import load_model, read_config, save_model
from .transformer import ARCHITECTURES, DiffusionLM, DreamModel, LLaDAModelLM, shift_right

__all__ = ["ARCHITECTURES", "DiffusionLM", "DreamModel", "LLaDAModelLM", "ModelArgs",
           "load_model", "read_config", "save_model", "shift_right"]
