"""ZenFlow's config (``--zenflow*`` flags)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import knob, option
from megatron_ext.zenflow.cpu_affinity import check_cpus

AUTO_MAX_INTERVAL = 16
"""The longest window ``--zenflow-update-interval auto`` opens."""

STAGING_SLOTS = 3
"""Steps of delayed grads that may wait in pinned memory for the accumulate thread (each
slot holds one step's delayed grads in the training dtype: 2 bytes x (1-k) x parameters)."""

CPUS_ENV = "MEGATRON_EXT_ZENFLOW_CPUS"
THREADS_ENV = "MEGATRON_EXT_ZENFLOW_THREADS"
STAGING_ENV = "MEGATRON_EXT_ZENFLOW_STAGING_SLOTS"
FREE_BYTES_ENV = "MEGATRON_EXT_ZENFLOW_DEVICE_FREE_BYTES"
JITTER_ENV = "MEGATRON_EXT_ZENFLOW_JITTER"
NO_HOST_KERNELS_ENV = "MEGATRON_EXT_NO_HOST_KERNELS"
CACHE_SUBGROUP_ENV = "MEGATRON_EXT_ZENFLOW_CACHE_SUBGROUP_SIZE"


def _whole_number(what: str):
    """A parse of a whole number >= 1 whose error names ``what`` it counts."""
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"give a whole number of {what}, at least 1")
        return int(text)
    return parse


def _bytes(text: str) -> int:
    if not text.isdigit():
        raise ValueError("give a number of bytes")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise ValueError("give a number of seconds >= 0")
    return value


def _disabled(text: str) -> bool:
    return text != "0"


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
    zenflow_cpu_states: str = option("auto", choices=("auto", "host", "tiers"))
    """Where the CPU side keeps its fp32 masters and Adam moments (the delayed columns').
    tiers: in the offload engine's host cache and --offload-paths files (needs
    --offload-optimizer; the accumulators and the weights waiting for the model stay in
    host memory); host: in host memory (12 bytes per delayed element); auto: tiers when
    --offload-optimizer is given; else host when the memory plan finds room for it beside
    the run's other host buffers and the node's reserve (a tenth of MemAvailable), and
    otherwise the offload engine's host cache without files (10 bytes per element with
    bf16 weights, 6 with bf16 moments), which the log says at start-up."""

    zenflow_cpus: str = knob("", env=CPUS_ENV, parse=check_cpus, metavar="CPUS")
    """The CPUs of the CPU side's threads (accumulation, Adam, and the workers they start),
    e.g. 2-15 or 1,3,8-11, or all; they must be CPUs this process may use. Unset: on a GPU,
    all of them but the first 2 per training process sharing them and those CPUs' cores'
    hyperthread siblings (none left out when too few would remain); on a CPU run, all."""
    zenflow_threads: Optional[int] = knob(None, env=THREADS_ENV,
                                          parse=_whole_number("threads"))
    """Threads of one accumulation of the delayed gradients on the host. Unset: half of
    torch's thread count, at most the CPU side's CPUs."""
    zenflow_staging_slots: int = knob(STAGING_SLOTS, env=STAGING_ENV,
                                      parse=_whole_number("slots"))
    """Steps of delayed gradients that may wait in pinned memory for the accumulate thread
    (at least 1; up to slots - 1 are added in one pass). Each slot is 2 bytes x (1-k) x the
    parameters: fewer save host memory on large models, at the price of more waiting."""
    zenflow_device_free_bytes: Optional[int] = knob(None, env=FREE_BYTES_ENV, parse=_bytes)
    """Test hook: the free device memory (bytes) --zenflow-accumulate auto sees instead of
    measuring it; lets a CPU-only run take either branch of the auto rule."""
    zenflow_jitter: float = knob(0.0, env=JITTER_ENV, parse=_seconds)
    """Test hook: a maximum delay in seconds, slept at random before each task of the CPU
    side's threads."""
    zenflow_cache_subgroup_size: Optional[int] = knob(None, env=CACHE_SUBGROUP_ENV,
                                                      parse=_whole_number("elements"))
    """Test hook: the subgroup size (elements) of the offload engine that takes the CPU
    side's states when the memory plan moves them to its host cache without
    --offload-optimizer (--zenflow-cpu-states auto); unset, the default
    --offload-subgroup-size. A tiny model's states fit in one default subgroup, whose
    pipeline buffers cost more host memory than the move saves: smaller subgroups let a CPU
    test take that path."""
    zenflow_no_host_kernels: bool = knob(False, env=NO_HOST_KERNELS_ENV, parse=_disabled)
    """The host accumulation uses torch's ops instead of the one-pass C kernel
    (runtime/host_kernels.py), for comparisons; the same results bit for bit. The variable
    disables it with any value but 0."""

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
        if self.zenflow_cpu_states not in ("auto", "host", "tiers"):
            raise UsageError(f"--zenflow-cpu-states {self.zenflow_cpu_states}: give auto, host "
                             "or tiers")
        if not self.zenflow:
            # Knobs (hidden, from the environment) are not flags the user gave here.
            changed = [f.name for f in dataclasses.fields(self) if f.name != "zenflow"
                       and not f.metadata.get("hidden") and getattr(self, f.name) != f.default]
            if changed:
                raise UsageError(f"--{changed[0].replace('_', '-')} needs --zenflow")

    cpu_states_auto = False
    """Whether --zenflow-cpu-states was auto and settled to host without --offload-optimizer:
    the memory plan may then move the states to the offload engine's host cache
    (``ZenFlowMode.refit``). Not a field: not a flag."""

    def resolve_cpu_states(self, offload_optimizer: bool) -> None:
        """Settles ``auto`` of --zenflow-cpu-states: tiers with --offload-optimizer, else host.

        Called once, by the run's config (which knows the offload flags); with --zenflow
        only. Refuses tiers without --offload-optimizer. Without it, the memory plan may
        still choose the tiers' host cache where host memory is short (``ZenFlowMode.refit``).
        """
        if not self.zenflow:
            return
        if self.zenflow_cpu_states == "auto":
            self.zenflow_cpu_states = "tiers" if offload_optimizer else "host"
            self.cpu_states_auto = not offload_optimizer
        if self.zenflow_cpu_states == "tiers" and not offload_optimizer:
            raise UsageError("--zenflow-cpu-states tiers keeps ZenFlow's CPU-side states in the "
                             "offload tiers: add --offload-optimizer (and --offload-paths)")

    @property
    def fixed_interval(self) -> Optional[int]:
        """S, or None for auto."""
        text = self.zenflow_update_interval
        return None if text == "auto" else int(text)
