"""``--profile``: torch.profiler over a range of iterations, on the chosen ranks.

Writes ``<--profile-dir>/rank<R>-iter<A>-<B>.txt`` (operators and labelled ranges such as
``zenflow/send_delayed_grads`` by total CPU time, then by device time) and a Chrome trace
``.json`` of the same iterations (open it in chrome://tracing or Perfetto).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

log = logging.getLogger(__name__)

ROWS = 60


class Profiler:
    """Starts before iteration --profile-step-start, stops after --profile-step-end."""

    def __init__(self, cfg, rank: int, is_cpu: bool):
        self.cfg = cfg
        self.active = bool(cfg.profile) and rank in cfg.profile_ranks
        self.rank = rank
        self.is_cpu = is_cpu
        self._prof: Optional[torch.profiler.profile] = None
        self._last = 0

    def before(self, iteration: int) -> None:
        """Called before the ``iteration``-th step (1-based)."""
        if self.active and iteration == self.cfg.profile_step_start and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if not self.is_cpu:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()

    def after(self, iteration: int) -> None:
        """Called after the ``iteration``-th step."""
        self._last = iteration
        if self._prof is not None and iteration >= self.cfg.profile_step_end:
            self._finish(iteration)

    def _finish(self, last: int) -> None:
        prof, self._prof = self._prof, None
        if not self.is_cpu:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        os.makedirs(self.cfg.profile_dir, exist_ok=True)
        stem = os.path.join(self.cfg.profile_dir,
                            f"rank{self.rank}-iter{self.cfg.profile_step_start}-{last}")
        averages = prof.key_averages()
        tables = [averages.table(sort_by="cpu_time_total", row_limit=ROWS)]
        if not self.is_cpu:
            tables.append(averages.table(sort_by="device_time_total", row_limit=ROWS))
        with open(stem + ".txt", "w") as f:
            f.write(f"iterations {self.cfg.profile_step_start}-{last}, rank {self.rank}\n\n")
            f.write("\n\n".join(tables))
        prof.export_chrome_trace(stem + ".json")
        log.info("profile of iterations %d-%d written to %s.txt and .json",
                 self.cfg.profile_step_start, last, stem)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None:  # training ended inside the range
            self._finish(self._last)
