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

The auto interval has a lower bound too (:func:`adam_floor`): a window is never shorter
than the CPU's Adam pass over the delayed columns takes, measured (the last finished
update's time over the time per step of the window that closes, with ``ADAM_SLACK``),
so that the boundary, which waits for the previous window's update, does not wait. The
engine takes the largest bound over the ranks that share rho. Since it is measured, the
window lengths of an auto run depend on the machine's speed (a fixed interval does not).
"""

from __future__ import annotations

import dataclasses
import math

from megatron_ext.zenflow.config import AUTO_MAX_INTERVAL, ZenFlowConfig

AUTO_FIRST_INTERVAL = 4
ADAM_SLACK = 1.25
"""The CPU update is expected to take up to this factor of its last measured time."""


def adam_floor(adam_s: float, step_s: float, max_interval: int = AUTO_MAX_INTERVAL,
               slack: float = ADAM_SLACK) -> int:
    """The fewest steps of a window during which the CPU's Adam pass finishes.

    ``ceil(slack * adam_s / step_s)`` steps, at least 1 and at most ``max_interval`` (the
    longest window auto opens: a slower CPU update then makes the boundary wait rather
    than the delay grow without end). 1 when either time is unknown (zero, not finite).

    Args:
        adam_s: the CPU update's time (seconds, its thread's wall time).
        step_s: the time per step without the waits for the CPU side (seconds).
        max_interval: the largest result.
        slack: the factor on ``adam_s``.
    """
    if not (math.isfinite(adam_s) and math.isfinite(step_s)) or adam_s <= 0 or step_s <= 0:
        return 1
    return max(1, min(max_interval, math.ceil(slack * adam_s / step_s)))


def auto_interval(mean_rho: float, floor: int = 1, max_interval: int = AUTO_MAX_INTERVAL
                  ) -> int:
    """The next window's length: ``min(max, max(1, floor(1 / rho), floor))``."""
    rule = (max_interval if mean_rho <= 1.0 / max_interval
            else max(1, min(max_interval, math.floor(1.0 / mean_rho))))
    return max(rule, min(floor, max_interval))


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

    def end_step(self, plan: StepPlan, rho: float, floor: int = 1) -> None:
        """Records the step's rho; at a window's end, sets the next window's length.

        ``floor``: the auto interval's lower bound (:func:`adam_floor`).
        """
        if plan.sync:
            return
        self.rho_sum += rho
        if not plan.closes_window:
            return
        if self.cfg.fixed_interval is None:
            self.window_length = auto_interval(self.rho_sum / self.in_window, floor)
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
