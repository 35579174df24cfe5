"""bench/peers/megatron_lm_compare.py: torch_dist checkpoints compared tensor by tensor."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "peers"))

import megatron_lm_compare  # noqa: E402


def _refuse_to_unpickle():
    raise AssertionError("a pickled object of the checkpoint was unpickled")


class _Trap:
    """Pickles fine; unpickling it fails the test."""

    def __reduce__(self):
        return (_refuse_to_unpickle, ())


def _save(folder: Path, tensors: dict) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({**tensors, "common_state": _Trap()}, checkpoint_id=str(folder), no_dist=True)
    return str(folder)


def _tensors():
    torch.manual_seed(0)
    return {"decoder.weight": torch.randn(4, 3).to(torch.bfloat16),
            "optimizer.exp_avg": torch.randn(7)}


def _run(monkeypatch, capsys, a: str, b: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["megatron_lm_compare.py", a, b])
    with pytest.raises(SystemExit) as exit_info:
        megatron_lm_compare.main()
    return exit_info.value.code, capsys.readouterr().out


def test_equal_checkpoints_pass_without_unpickling(tmp_path, monkeypatch, capsys):
    a = _save(tmp_path / "a", _tensors())
    b = _save(tmp_path / "b", _tensors())
    assert set(megatron_lm_compare.read_tensors(a)) == {"decoder.weight", "optimizer.exp_avg"}
    code, out = _run(monkeypatch, capsys, a, b)
    assert code == 0
    assert "2 tensors bitwise equal, 0 not: bitwise equal" in out


def test_one_element_and_a_missing_key_are_named(tmp_path, monkeypatch, capsys):
    a = _save(tmp_path / "a", _tensors())
    changed = _tensors()
    changed["optimizer.exp_avg"][3] += 2.0 ** -20  # a change in the last bits only
    del changed["decoder.weight"]
    b = _save(tmp_path / "b", changed)
    code, out = _run(monkeypatch, capsys, a, b)
    assert code == 1
    assert "only in the first: decoder.weight" in out
    assert "optimizer.exp_avg: 1 of 7 elements differ" in out
    assert "0 tensors bitwise equal, 2 not" in out


def test_dtype_difference_is_a_difference(tmp_path):
    a = {"w": torch.zeros(2)}
    lines, equal = megatron_lm_compare.compare(a, {"w": torch.zeros(2, dtype=torch.bfloat16)})
    assert equal == 0 and lines == ["w: (2,) torch.float32 against (2,) torch.bfloat16"]
