"""bench/peers/megatron_lm_launch.py: the pure parts of the launcher of Megatron-LM's training."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "peers"))

import megatron_lm_launch  # noqa: E402


def _ask_from(module_name: str, is_available) -> bool:
    """Calls ``is_available()`` from code whose module is ``module_name``."""
    scope = {"__name__": module_name, "is_available": is_available}
    exec("answer = is_available()", scope)
    return scope["answer"]


@pytest.mark.parametrize(("caller", "expected"), [
    ("megatron.training.initialize", True),  # asserts a GPU at start-up
    ("megatron.core.utils", True),
    ("__main__", True),
    ("torch", False),  # torch's own checks get the real answer
    ("torch.accelerator", False),  # the DataLoader's pin_memory, Adam's graph-capture check
    ("torch.optim.optimizer", False),
    ("torchvision", True),  # not torch
])
def test_is_available_answers_by_caller(caller, expected):
    is_available = megatron_lm_launch._megatron_sees_a_gpu(lambda: False)
    assert _ask_from(caller, is_available) is expected


@pytest.mark.parametrize(("value", "wanted"), [
    (None, {1, 2}), ("1,2", {1, 2}), ("2", {2}), (" 1 ", {1}), ("none", set()),
])
def test_resume_fixes_wanted(monkeypatch, value, wanted):
    if value is None:
        monkeypatch.delenv("MLM_RESUME_FIXES", raising=False)
    else:
        monkeypatch.setenv("MLM_RESUME_FIXES", value)
    assert megatron_lm_launch._fixes_wanted() == wanted


@pytest.mark.parametrize("value", ["3", "1,3", "all", ""])
def test_resume_fixes_refuse_other_values(monkeypatch, value):
    monkeypatch.setenv("MLM_RESUME_FIXES", value)
    with pytest.raises(SystemExit, match="MLM_RESUME_FIXES"):
        megatron_lm_launch._fixes_wanted()
