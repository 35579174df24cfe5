"""ZenFlow's config (``--zenflow*`` flags)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import option

AUTO_MAX_INTERVAL = 16
"""The longest window ``--zenflow-update-interval auto`` opens."""


@dataclasses.dataclass
class ZenFlowConfig:
    """ZenFlow selective updates (fine-tuning mode): important columns on the GPU every step."""

    zenflow: bool = False
    """ZenFlow selective updates. For every 2-D weight, the top --zenflow-topk-ratio of its
    input columns by gradient energy keep their fp32 master and Adam moments on the GPU and
    are updated every step, as are all 1-D parameters (norms, biases); the other columns'
    gradients go to the host in the training dtype, accumulate in fp32, and the CPU updates
    them asynchronously once per window of --zenflow-update-interval steps while the GPU
    trains on (their new values enter the model at the next window boundary). Meant for
    fine-tuning (--finetune --load CKPT) but runs from scratch too. Needs
    --use-distributed-optimizer."""
    zenflow_topk_ratio: float = 0.1
    """Share of each 2-D weight's input columns that are updated on the GPU every step
    (0 < R <= 1; at least one column per matrix)."""
    zenflow_select_interval: int = 100
    """Re-select the important columns every N steps (at the first window boundary at or
    after N steps since the last selection; the selection of step 1 is the first). Must be
    at least the update interval."""
    zenflow_update_interval: str = option("4", metavar="{S,auto}")
    """Steps per window of the asynchronous CPU update (S; the CPU applies the mean
    gradient of the window). auto: each window's length follows the share rho of gradient
    energy in the delayed columns over the previous window, S = min(16, max(1,
    floor(1/rho))): the delay grows while the delayed columns carry little of the
    gradient and shrinks when they carry much. Never shorter, though, than the steps the
    CPU's Adam pass over the delayed columns takes (measured: the last one's time over
    the time per step, with a 1.25 margin; at most 16), so that a window's boundary does
    not wait for it; the window lengths then depend on the machine's speed."""
    zenflow_full_warmup_steps: int = 0
    """Steps at the start (after a load too: counted from the first step of the run) with
    plain synchronous updates of every column (the CPU updates its columns inside the
    step) before the asynchronous windows begin."""
    zenflow_accumulate: str = option("auto", choices=("auto", "device", "host"))
    """Where the delayed columns' gradients are summed over a window. device: in one fp32
    accumulator on the GPU (4 bytes of GPU memory per delayed element; one add per step
    there, and one copy of the window's mean to the host at its end instead of one copy
    per step); host: each step's gradients go to the host and the CPU adds them there.
    auto: device when the GPU's free memory, measured at the first step (after the first
    forward-backward), exceeds the accumulator by a margin (1 GiB or a twentieth of the
    GPU's memory, whichever is larger), else host; host on a CPU-only run. Both places
    give the same results bit for bit."""

    def __post_init__(self):
        if not 0.0 < self.zenflow_topk_ratio <= 1.0:
            raise UsageError(f"--zenflow-topk-ratio {self.zenflow_topk_ratio}: must be in (0, 1]")
        if self.zenflow_select_interval <= 0:
            raise UsageError("--zenflow-select-interval must be positive")
        if self.zenflow_full_warmup_steps < 0:
            raise UsageError("--zenflow-full-warmup-steps must be >= 0")
        text = str(self.zenflow_update_interval).strip().lower()
        if text != "auto":
            try:
                value = int(text)
            except ValueError:
                raise UsageError(f"--zenflow-update-interval {self.zenflow_update_interval}: "
                                 "give a number of steps or auto") from None
            if value <= 0:
                raise UsageError("--zenflow-update-interval must be positive (or auto)")
            if self.zenflow_select_interval < value:
                raise UsageError(f"--zenflow-select-interval {self.zenflow_select_interval} is "
                                 f"shorter than --zenflow-update-interval {value}: columns "
                                 "change sides only at window boundaries")
        self.zenflow_update_interval = text
        if self.zenflow_accumulate not in ("auto", "device", "host"):
            raise UsageError(f"--zenflow-accumulate {self.zenflow_accumulate}: give auto, "
                             "device or host")
        if not self.zenflow:
            changed = [f.name for f in dataclasses.fields(self) if f.name != "zenflow"
                       and getattr(self, f.name) != f.default]
            if changed:
                raise UsageError(f"--{changed[0].replace('_', '-')} needs --zenflow")

    @property
    def fixed_interval(self) -> Optional[int]:
        """S, or None for auto."""
        text = self.zenflow_update_interval
        return None if text == "auto" else int(text)
