"""Import-only stub of ``torchvision`` for the CPU test venv.

Why: the only torchvision wheels reachable here (PyPI / /opt/pypi-more) are
CUDA builds whose ``_C.so`` cannot load against ``torch==2.13.0+cpu``
(``RuntimeError: operator torchvision::nms does not exist``).  SGLang's
``sglang.srt.configs`` package imports multimodal helpers that do
``import torchvision.transforms`` at module level, so without *some*
torchvision nothing under ``sglang.srt`` imports.

This stub makes every ``torchvision`` / ``torchvision.*`` import succeed.
Any attribute is a placeholder; *calling* one raises ``RuntimeError``.
It is put on ``sys.path`` (last) by ``.venv/.../zz_dllm_stubs.pth``,
written by ``scripts/setup_env.sh``; a real torchvision, if installed,
wins because site-packages comes first.
"""
from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"
IS_STUB = True


class _Missing:
    """Placeholder for any torchvision attribute (subclassable, not callable)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} is unavailable: torchvision is an import-only stub "
            "in this CPU test environment (scripts/stubs/torchvision)."
        )

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision stub {self._name}>"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "InterpolationMode":
            return InterpolationMode
        return _Missing(f"{self.__name__}.{attr}")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []  # every stub module is a package, so any depth imports
        return mod

    def exec_module(self, module):
        module.IS_STUB = True


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.append(_StubFinder())


def __getattr__(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Missing(f"{__name__}.{attr}")
