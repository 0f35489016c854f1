"""Native LLaDA / Dream / LLaDA2 models and their checkpoint loader."""
from .config import ModelArgs
from .device import available_devices, check_device
from .llada2 import LLaDA2Args, LLaDA2MoeModelLM
from .loader import ARCHITECTURES, load_model, read_config, save_model
from .transformer import DiffusionLM, DreamModel, LLaDAModelLM, shift_right

__all__ = ["ARCHITECTURES", "DiffusionLM", "DreamModel", "LLaDA2Args", "LLaDA2MoeModelLM", "LLaDAModelLM", "ModelArgs",
           "available_devices", "check_device", "load_model", "read_config", "save_model", "shift_right"]
