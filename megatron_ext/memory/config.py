"""The memory plan's config (``--plan-*`` flags) and its test knobs of the machine.

The conventions of every section are in :mod:`megatron_ext.config`. The knobs stand in for
what :mod:`megatron_ext.memory.machine` measures (free GPU memory, ``MemAvailable``, each
path's free space, the --save disk's), so that CPU tests can make a run too big for an
injected machine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import knob, option

GPU_FREE_ENV = "MEGATRON_EXT_GPU_FREE_GB"
MEMAVAILABLE_ENV = "MEGATRON_EXT_MEMAVAILABLE_GB"
PATH_FREE_ENV = "MEGATRON_EXT_PATH_FREE_GB"
SAVE_FREE_ENV = "MEGATRON_EXT_SAVE_FREE_GB"


def parse_gb(text: str) -> float:
    """A finite number of GB, >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError("give a number of GB >= 0")
    return value


def parse_gb_list(text: str) -> List[float]:
    """``GB,GB,...``: one number of GB per path, in the order of --offload-paths."""
    return [parse_gb(item) for item in text.split(",") if item.strip()]


def parse_stage_weights(text: str) -> str:
    """auto, always or never."""
    if text not in ("auto", "always", "never"):
        raise ValueError("give auto, always or never")
    return text


@dataclasses.dataclass
class PlanConfig:
    """The memory plan made before the first step (see docs/memory.md)."""

    plan_tflops: Optional[float] = option(None, metavar="TFLOPS")
    """Achieved TFLOP/s per GPU (model FLOPs of forward and backward, recomputation included)
    with which the start-up memory plan predicts the forward+backward time. Default: the
    figure measured on this project's H200 runs on an H200, none elsewhere (the plan then
    gives no step time)."""
    plan_check: bool = option(True, negate="--no-plan-check")
    """Start even when the memory plan says the run does not fit: the plan's table is
    logged and its refusal becomes a warning. The plan is an estimate (activations above
    all); without this flag a run the plan says cannot fit stops before the first step,
    in one line that names the numbers and the flag that fixes it."""

    plan_gpu_free_gb: Optional[float] = knob(None, env=GPU_FREE_ENV, parse=parse_gb,
                                             metavar="GB")
    """Test hook: the free GPU memory (GB) the memory plan sees instead of measuring it;
    on a CPU run it makes the plan check the "GPU" tier against this size."""
    plan_memavailable_gb: Optional[float] = knob(None, env=MEMAVAILABLE_ENV, parse=parse_gb,
                                                 metavar="GB")
    """Test hook: the host's MemAvailable (GB) the memory plan sees instead of
    /proc/meminfo."""
    plan_path_free_gb: List[float] = knob([], env=PATH_FREE_ENV, parse=parse_gb_list,
                                          metavar="GB,...")
    """Test hook: each --offload-paths directory's free space (GB, one per path, in order)
    the memory plan sees instead of statvfs."""
    plan_save_free_gb: Optional[float] = knob(None, env=SAVE_FREE_ENV, parse=parse_gb,
                                              metavar="GB")
    """Test hook: the free space (GB) of the --save directory's disk the memory plan checks
    one checkpoint against, instead of statvfs."""

    plan_stage_weights: str = knob("auto", env="MEGATRON_EXT_STAGE_WEIGHTS",
                                   parse=parse_stage_weights, metavar="auto|always|never")
    """Test hook: whether a GPU run's weights wait in host memory while megatron-core's DDP
    builds its parameter and gradient buffers (with --use-distributed-optimizer only, whose
    parameter buffer takes the weights back): auto, when the free GPU memory is short of
    those buffers beside the weights (the start-up would otherwise hold the weights three
    times: 25.6B bf16 parameters on an H200); always; never."""

    def __post_init__(self):
        if self.plan_tflops is not None and not self.plan_tflops > 0:
            raise UsageError(f"--plan-tflops {self.plan_tflops}: must be positive")
