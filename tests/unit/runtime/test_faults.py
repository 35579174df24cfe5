"""The crash faults: parsed and checked when the config is made, a no-op by default."""

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.runtime import faults


def test_parse():
    assert faults.parse_crash_faults("forward:4;data:2:host-oom;save:6:oom:1") == [
        ["forward", "4"], ["data", "2", "host-oom"], ["save", "6", "oom", "1"]]


@pytest.mark.parametrize("text", ["nowhere:4", "forward", "forward:x", "forward:4:boom",
                                  "forward:4:oom:one", "forward:4:oom:1:2"])
def test_parse_refuses(text):
    with pytest.raises(UsageError, match="MEGATRON_EXT_FAULTS"):
        faults.parse_crash_faults(text)


def test_knob(monkeypatch):
    monkeypatch.setenv(faults.CRASH_ENV, "optimizer:3")
    assert faults.FaultConfig().crash == [["optimizer", "3"]]
    monkeypatch.delenv(faults.CRASH_ENV)
    assert faults.FaultConfig().crash == []


def test_check_at_the_iteration_and_rank():
    crashes = faults.Crashes([["forward", "3"], ["optimizer", "2", "oom", "1"]], rank=0)
    crashes.check("forward", 2)
    crashes.check("optimizer", 2)  # rank 1's
    with pytest.raises(RuntimeError, match="injected fault at forward"):
        crashes.check("forward", 3)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        faults.Crashes([["optimizer", "2", "oom", "1"]], rank=1).check("optimizer", 2)
    with pytest.raises(MemoryError, match="Unable to allocate"):
        faults.Crashes([["data", "1", "host-oom"]]).check("data", 1)


def test_thread_places_fire_once_after_the_iteration():
    crashes = faults.Crashes([["offload-io", "3"]])
    crashes.reached(2)
    crashes.check("offload-io")
    crashes.reached(4)
    with pytest.raises(RuntimeError):
        crashes.check("offload-io")
    crashes.check("offload-io")  # once


def test_armed_is_a_no_op_by_default():
    faults.crash_point("forward", 1)
    tensor = torch.ones(2, requires_grad=True)
    assert faults.crashes_in_backward(tensor, 1) is tensor


def test_backward_raises_inside_autograd():
    faults.arm(faults.Crashes([["backward", "2"]]))
    try:
        x = torch.ones(3, requires_grad=True)
        faults.crashes_in_backward(x * 2, 1).sum().backward()  # another iteration
        assert x.grad.tolist() == [2.0, 2.0, 2.0]
        with pytest.raises(RuntimeError, match="injected fault at backward"):
            faults.crashes_in_backward(x * 2, 2).sum().backward()
    finally:
        faults.arm(faults.Crashes())


def test_save_fault_fires_in_check_save():
    faults.arm(faults.Crashes([["save", "4"]]))
    try:
        faults.Faults().check_save(2)
        with pytest.raises(RuntimeError, match="injected fault at save"):
            faults.Faults().check_save(4)
    finally:
        faults.arm(faults.Crashes())


def test_crashes_pickle():
    import pickle

    crashes = pickle.loads(pickle.dumps(faults.Crashes([["data", "2"]], rank=1)))
    with pytest.raises(RuntimeError):
        crashes.check("data", 2)
