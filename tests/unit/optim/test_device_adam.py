"""When the device tier takes the one-pass kernel (its arithmetic: tests/gpu)."""

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.optim import device_adam


def test_the_kernel_is_the_default_where_triton_and_cuda_are(monkeypatch):
    monkeypatch.delenv(device_adam.DEVICE_ADAM_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert device_adam.choice() == "fused"
    assert device_adam.enabled(torch.device("cuda")) == (device_adam.triton is not None)
    assert not device_adam.enabled(torch.device("cpu"))


def test_torch_keeps_torchs_passes(monkeypatch):
    monkeypatch.setenv(device_adam.DEVICE_ADAM_ENV, "torch")
    assert device_adam.choice() == "torch"
    assert not device_adam.enabled(torch.device("cuda"))


def test_a_cpu_device_never_takes_it(monkeypatch):
    monkeypatch.setenv(device_adam.DEVICE_ADAM_ENV, "fused")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert device_adam.choice() == "fused"
    assert not device_adam.enabled(torch.device("cpu"))


def test_an_unknown_choice_is_one_line(monkeypatch):
    monkeypatch.setenv(device_adam.DEVICE_ADAM_ENV, "fast")
    with pytest.raises(UsageError, match="MEGATRON_EXT_DEVICE_ADAM='fast': use one of torch, fused"):
        device_adam.choice()
