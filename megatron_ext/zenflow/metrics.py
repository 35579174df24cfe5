"""The ZenFlow engine's counters between two metric records (``zenflow/*``)."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from megatron_ext.runtime.to_host import ToHost


class EngineStats:
    """Seconds, bytes and rho of the steps since the last record, and the loop's waits."""

    def __init__(self):
        self.counts: dict = {}
        """steps, rho (a float, or a 0-dim tensor on the device), stall_s, gpu_update_s,
        d2h_bytes, h2d_bytes, uploads_ready, d2h_copies, since (the interval's start)."""
        self.step_stall = 0.0
        """The loop's waits in the step under way (the auto interval leaves them out)."""
        self._rho_copy: Optional[ToHost] = None
        """The GPU's running rho sum on its way to the host (read by :meth:`rho_sum`)."""
        self.reset()

    def reset(self) -> None:
        """A new interval (the counts in place: the engine's parts hold this object)."""
        self.counts.clear()
        self.counts.update({"steps": 0, "rho": 0.0, "stall_s": 0.0, "gpu_update_s": 0.0,
                            "d2h_bytes": 0.0, "h2d_bytes": 0.0, "uploads_ready": 0,
                            "d2h_copies": 0, "since": time.perf_counter()})

    def wait(self, fn: Callable[[], object]) -> None:
        """Calls ``fn`` (a wait for the CPU side) and counts its time as a stall."""
        start = time.perf_counter()
        fn()
        waited = time.perf_counter() - start
        self.counts["stall_s"] += waited
        self.step_stall += waited

    def add_rho(self, rho) -> None:
        """Adds a step's rho to the metrics' sum.

        A sum on the GPU starts its copy to the host now, before the step's D2H is
        queued: :meth:`rho_sum` reads that copy, not the GPU (a read after the D2H would
        wait for all of it).
        """
        total = self.counts["rho"] + rho
        self.counts["rho"] = total
        if isinstance(total, torch.Tensor):
            self._rho_copy = ToHost(total)

    def rho_sum(self) -> float:
        """The interval's rho sum, on the host."""
        total = self.counts["rho"]
        return float(self._rho_copy.get()) if isinstance(total, torch.Tensor) else float(total)
