"""When ZenFlow steps are synchronous, when a window closes, when columns are re-selected.

Steps are counted from the first step of the run (a resumed run continues the count).
Steps ``1..W`` (``--zenflow-full-warmup-steps W``) are synchronous: every column is updated
inside the step. After them, windows of S steps follow; at the last step of a window the
CPU starts its update of the delayed columns with the window's mean gradient, and the
result enters the model at the end of the next window. Columns are selected at step 1 and
re-selected at the first synchronous step or window end at least
``--zenflow-select-interval`` steps after the previous selection.

Auto interval: the next window's length is ``min(16, max(1, floor(1 / rho)))`` where rho
is the mean, over the window that just closed, of the share of gradient energy in the
delayed columns. The first window after the warm-up has length 4 (the paper's default).
All ranks see the same all-reduced rho, so they agree on every boundary.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_ext.zenflow.config import AUTO_MAX_INTERVAL, ZenFlowConfig

AUTO_FIRST_INTERVAL = 4


@dataclasses.dataclass
class StepPlan:
    """What one step does."""

    step: int
    sync: bool
    """Every column is updated inside this step (warm-up)."""
    closes_window: bool
    """Last step of a window: the CPU update of the window starts."""
    select: bool
    """Columns are (re-)selected at this step."""


@dataclasses.dataclass
class WindowSchedule:
    """The step, window and selection counters (all in the checkpoint)."""

    cfg: ZenFlowConfig
    step: int = 0
    windows_closed: int = 0
    in_window: int = 0
    window_length: int = 0
    rho_sum: float = 0.0
    last_select: int = 0

    def __post_init__(self):
        if not self.window_length:
            self.window_length = self.cfg.fixed_interval or AUTO_FIRST_INTERVAL

    def next_step(self) -> StepPlan:
        """Advances to the next step and says what it does."""
        self.step += 1
        sync = self.step <= self.cfg.zenflow_full_warmup_steps
        closes = False
        if not sync:
            self.in_window += 1
            closes = self.in_window >= self.window_length
        due = self.last_select == 0 or self.step - self.last_select >= \
            self.cfg.zenflow_select_interval
        select = due and (sync or closes or self.last_select == 0)
        if select:
            self.last_select = self.step
        return StepPlan(self.step, sync, closes, select)

    def end_step(self, plan: StepPlan, rho: float) -> None:
        """Records the step's rho; at a window's end, sets the next window's length."""
        if plan.sync:
            return
        self.rho_sum += rho
        if not plan.closes_window:
            return
        if self.cfg.fixed_interval is None:
            mean = self.rho_sum / self.in_window
            self.window_length = (AUTO_MAX_INTERVAL if mean <= 1.0 / AUTO_MAX_INTERVAL
                                  else max(1, min(AUTO_MAX_INTERVAL, math.floor(1.0 / mean))))
        self.windows_closed += 1
        self.in_window = 0
        self.rho_sum = 0.0

    @property
    def buffer(self) -> int:
        """The accumulator the open window fills (windows alternate between two)."""
        return self.windows_closed % 2

    def state_dict(self) -> dict:
        """The counters."""
        return {k: getattr(self, k) for k in ("step", "windows_closed", "in_window",
                                              "window_length", "rho_sum", "last_select")}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`."""
        for key, value in state.items():
            setattr(self, key, value)
