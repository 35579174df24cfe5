"""megatron-core's timers with the loop's GPU wait (megatron_ext/training/timers.py)."""

import time

import pytest
from megatron.core.timers import DummyTimer

from megatron_ext.training.timers import SyncTimer, SyncTimers


def test_timers_wait_with_the_given_function_and_add_up():
    waits = []
    timers = SyncTimers(lambda: waits.append(1), log_level=2, log_option="max")
    timer = timers("forward-compute", log_level=2)
    assert isinstance(timer, SyncTimer)
    for _ in range(2):
        timer.start()
        time.sleep(0.01)
        timer.stop()
    assert len(waits) == 4  # once at every start and stop, never torch.cuda.synchronize()
    assert timers("forward-compute") is timer
    elapsed = timer.elapsed(reset=True)
    assert 0.02 <= elapsed < 1.0
    assert timer.elapsed(reset=True) == 0.0


def test_timers_above_the_level_stay_dummies_and_do_not_wait():
    waits = []
    timers = SyncTimers(lambda: waits.append(1), log_level=1, log_option="max")
    timer = timers("backward-compute", log_level=2)
    assert isinstance(timer, DummyTimer)
    timer.start()
    timer.stop()
    assert waits == []


def test_timer_misuse_is_refused_as_megatron_core_does():
    timer = SyncTimer("x", lambda: None)
    with pytest.raises(AssertionError, match="is not started"):
        timer.stop()
    timer.start()
    with pytest.raises(AssertionError, match="already been started"):
        timer.start()
