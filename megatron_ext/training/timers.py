"""megatron-core's timers, waiting for the GPU the way the loop's own phase timers do.

megatron-core's ``Timer`` calls ``torch.cuda.synchronize()`` at every start and stop (its
schedules time each micro-batch's forward and backward, and the gradient sync). That
waits for every stream of the device, copies on an optimizer's side streams included:
ZenFlow's D2H of the delayed gradients, launched in one step's optimizer phase, would be
waited for by the next step's first forward timer. :class:`SyncTimers` gives each timer
the loop's wait instead (see ``RuntimeConfig.step_sync``): a device-wide synchronize (the same
as megatron-core's), the training stream only, or nothing (CPU runs).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from megatron.core.timers import Timer, Timers


class SyncTimer(Timer):
    """megatron-core's ``Timer`` with the wait given (``sync``) instead of its own."""

    def __init__(self, name: str, sync: Callable[[], None]):
        super().__init__(name)
        self._sync = sync

    def start(self, barrier=False):
        """Starts the timer once the GPU work launched so far is done (``sync``)."""
        assert not self._started, f"timer {self.name} has already been started"
        if barrier:
            torch.distributed.barrier(group=self._barrier_group)
        self._sync()
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier=False):
        """Adds the time since :meth:`start`, once the GPU work launched is done."""
        assert self._started, f"timer {self.name} is not started"
        if barrier:
            torch.distributed.barrier(group=self._barrier_group)
        self._sync()
        elapsed = time.time() - self._start_time
        self._elapsed += elapsed
        self._active_time += elapsed
        self._started = False


class SyncTimers(Timers):
    """megatron-core's ``Timers`` whose timers are :class:`SyncTimer` with ``sync``."""

    def __init__(self, sync: Callable[[], None], log_level: int, log_option: str):
        super().__init__(log_level, log_option)
        self._sync = sync

    def __call__(self, name, log_level=None):
        """The named timer (created on first use at ``log_level``), as megatron-core's."""
        new = name not in self._timers
        timer = super().__call__(name, log_level)
        if new and name in self._timers:  # created now (not the dummy of a higher level)
            timer = self._timers[name] = SyncTimer(name, self._sync)
        return timer
