"""A cache policy written outside the engines, for the host-contract test: it serves through the embedded engine,
vLLM and SGLang by its import path (``--cache tests.toy_policy.EveryThirdUpper``) with no engine code of its own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dllm_core.cache import LayerSchedule


@dataclass(frozen=True)
class EveryThirdUpper(LayerSchedule):
    """Layers below ``upper`` are recomputed at every step; from ``upper`` up, every position at steps 0,
    ``every``, 2 ``every``, ... and nothing in between (their cached features are reused)."""

    name: ClassVar[str] = "every_third_upper"
    every: int = 3
    upper: int = 1

    def recomputes(self, c: int, layer: int, prompt: bool) -> tuple[bool, bool]:
        return c % self.every == 0 or layer < self.upper, False


TOY = "tests.toy_policy.EveryThirdUpper:upper=1"
