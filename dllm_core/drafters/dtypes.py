"""The dtype a drafter runs in: its target's.

A drafter (DFlash layers, TokenSwift heads) reads the target's hidden states and embeddings and feeds the target's
LM head, so it runs in the dtype the target runs in (a server's ``--dtype``), whatever its checkpoint's
``config.json`` names: that field records the dtype the target was trained in, for hosts that resolve dtype
``auto`` from it. Hosts load and feed their drafters through ``drafter_dtype``.
"""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_label(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def drafter_dtype(target_dtype: torch.dtype | str, option: str) -> torch.dtype:
    """The dtype a drafter runs in beside a target running in ``target_dtype`` (a torch dtype or its name): the
    same one. A dtype no drafter runs in raises ``ValueError`` naming ``option`` (the host's dtype option) and the
    allowed values."""
    name = dtype_label(target_dtype)
    if name not in DTYPES:
        raise ValueError(f"{option}: a drafter runs in its target's dtype, got {name}; allowed: {list(DTYPES)}")
    return DTYPES[name]
