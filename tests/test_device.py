"""A device the machine lacks is reported as such (and the available ones named) before any weight file is
read, not as a corrupt checkpoint from deep inside safetensors."""
from pathlib import Path

import pytest
import torch

from dllm_core.cli import main
from dllm_core.models import available_devices, check_device, load_model

LLADA = Path(__file__).resolve().parents[1] / "models" / "llada-tasks"


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as one without a usable CUDA device (also on a GPU machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_is_always_available():
    assert available_devices()[0] == "cpu"
    assert check_device("cpu") == torch.device("cpu")


def test_cuda_without_cuda_names_the_available_devices(no_cuda):
    with pytest.raises(ValueError) as e:
        check_device("cuda")
    msg = str(e.value)
    assert msg.startswith("--device cuda: CUDA is not available (")
    assert msg.endswith(f"available devices: {available_devices()}") and "'cpu'" in msg
    with pytest.raises(ValueError, match=r"^device cuda:1: CUDA is not available"):
        check_device("cuda:1", "device")


def test_cuda_index_beyond_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert check_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match=r"--device cuda:3: this machine has 1 CUDA device\(s\); available devices: "
                                         r"\['cpu', 'cuda:0'"):
        check_device("cuda:3")


def test_unknown_and_absent_devices():
    with pytest.raises(ValueError, match=r"--device 'gpu' is not a torch device .*available devices: \['cpu'"):
        check_device("gpu")
    if "xpu" not in available_devices():
        with pytest.raises(ValueError, match=r"--device xpu: XPU is not available on this machine"):
            check_device("xpu")


def test_load_model_checks_before_reading_weights(no_cuda, tmp_path):
    with pytest.raises(ValueError, match="CUDA is not available"):  # the directory is not even looked at
        load_model(tmp_path / "missing", "cuda")


@pytest.mark.skipif(not (LLADA / "config.json").is_file(), reason="models/llada-tasks not shipped")
def test_dllm_generate_device_cuda(no_cuda, capsys):
    code = main(["generate", "--model", str(LLADA), "--prompt", "hi", "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2
    assert "dllm generate: error: --device cuda: CUDA is not available" in err
    assert f"available devices: {available_devices()}" in err
    assert "corrupt" not in err and "pin_memory" not in err
