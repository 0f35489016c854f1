"""The torch devices this machine offers, and the check every loader runs before it touches a weight file.

Without it a CUDA device asked for on a machine without one surfaces deep inside safetensors
(``pin_memory=True requires a CUDA ...``) and reads like a broken checkpoint."""
from __future__ import annotations

import torch


def available_devices() -> list[str]:
    """Devices usable here: ``cpu``, then ``cuda:0`` ... ``cuda:n-1`` and ``mps`` when present."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def _cuda_missing() -> str:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    return "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"


def check_device(device: str | torch.device, option: str = "--device") -> torch.device:
    """``device`` as a ``torch.device`` when this machine has it; otherwise a ValueError naming ``option``,
    why the device is unusable and the devices that are available."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{option} {device!r} is not a torch device ({e}); available devices: "
                         f"{available_devices()}") from None
    have = available_devices()
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{option} {device}: CUDA is not available ({_cuda_missing()}); available devices: {have}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{option} {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                             f"available devices: {have}")
        return dev
    if str(dev) in have or (dev.type in have and dev.index in (None, 0)):
        return dev
    raise ValueError(f"{option} {device}: {dev.type.upper()} is not available on this machine; "
                     f"available devices: {have}")
