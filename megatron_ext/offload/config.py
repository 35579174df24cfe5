"""The offload engine's config (``--offload-*`` flags)."""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Union

from megatron_ext.errors import UsageError
from megatron_ext.offload.jobdir import check_run_id
from megatron_ext.runtime.fields import knob, option

TRACE_ENV = "MEGATRON_EXT_OFFLOAD_TRACE"
# Test hooks of the device tier's ``auto`` sizing (CPU runs have no device memory to
# measure): the device's usable memory in GB, and the peak of a training iteration besides
# the offload engine's device states, as "STEP:GB,STEP:GB" (from STEP on).
MEMORY_LIMIT_ENV = "MEGATRON_EXT_DEVICE_MEMORY_LIMIT_GB"
MEMORY_PEAK_ENV = "MEGATRON_EXT_DEVICE_PEAK_GB"
# Test hook: a fixed share of the host subgroups' elements to stream through the device
# (CPU runs stream nothing by themselves: their "device" is the CPU).
STREAM_SHARE_ENV = "MEGATRON_EXT_OFFLOAD_STREAM_SHARE"
# The machine's capacities as the ``auto`` sizes see them, injected (tests; the memory plan
# reads the same variables): the node's MemAvailable, and each path's free space.
MEM_AVAILABLE_ENV = "MEGATRON_EXT_MEMAVAILABLE_GB"
PATH_FREE_ENV = "MEGATRON_EXT_PATH_FREE_GB"
# Knobs that describe the machine rather than the engine: a run without --offload-optimizer
# may carry them (the memory plan of any run reads them).
MACHINE_KNOBS = ("offload_mem_available_gb", "offload_path_free_gb")
HOST_RESERVE_DIVISOR = 10
"""Without --offload-host-reserve-gb, a tenth of MemAvailable is left free
(:meth:`OffloadConfig.host_reserve_bytes`)."""


def parse_gb(text: str) -> float:
    """A finite number >= 0 (GB, or a share before it is capped)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise ValueError("give a number >= 0")
    return value


def parse_peaks(text: str) -> List[List[float]]:
    """``STEP:GB,STEP:GB``: [from step, GB] pairs, in the order given.

    Lists, not tuples: the run's config goes through JSON (wandb, the metrics) unchanged.
    """
    peaks = []
    for item in text.split(","):
        if item:
            step, _, value = item.partition(":")
            if not step.strip().isdigit():
                raise ValueError("give STEP:GB pairs separated by commas, e.g. 1:0.5,6:0.8")
            peaks.append([int(step), parse_gb(value)])
    return peaks


def parse_gb_list(text: str) -> List[float]:
    """``GB,GB,...``: one number >= 0 per item."""
    try:
        return [parse_gb(item) for item in text.split(",")]
    except ValueError:
        raise ValueError("give one number of GB (>= 0) per --offload-paths entry, separated "
                         "by commas, e.g. 60,500") from None


def parse_size_or_auto(text: str) -> Union[float, str]:
    """``auto`` or a number (GB); checked by the section."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        return text  # refused in one line by __post_init__


def parse_share(text: str) -> float:
    """A share of elements: a number >= 0, capped at 1."""
    return min(1.0, parse_gb(text))


@dataclasses.dataclass
class OffloadConfig:
    """Tiered offload of the distributed optimizer's fp32 states (MLP-Offload techniques)."""

    offload_optimizer: bool = False
    """Move the fp32 master weights and Adam moments of this rank's distributed-optimizer
    shard off the model's device: into a host cache and, with --offload-paths, into files
    on a third tier of directories. CPU Adam updates them subgroup by subgroup; the GPU
    keeps only the training-dtype weights and gradients. Needs --use-distributed-optimizer.
    With --zenflow: the states of ZenFlow's CPU side (the delayed columns) go there instead,
    with the columns selected at step 1 kept for the run."""
    offload_paths: List[str] = option(default_factory=list, nargs="+",
                                      metavar="DIR[@READ_GBPS,WRITE_GBPS]")
    """Directories of the third tier (node-local NVMe, parallel-file-system scratch, ...).
    Subgroups that do not fit in the host cache live there as files, placed in proportion
    to each path's bandwidth: measured by a short probe at start, or given as
    DIR@READ_GBPS,WRITE_GBPS (tools/probe_tiers.py prints the value to use). Each job
    writes under DIR/megatron_ext-USER/JOB/rankNNNNN (owner-only). With no path, every
    state stays in host memory."""
    offload_host_cache_gb: Union[float, str] = option("auto", metavar="G|auto",
                                                      parse=parse_size_or_auto)
    """Host memory, in GB per rank, for subgroup states (the cache, including the buffers
    being fetched and flushed; 12 bytes per element). auto (default): from the node's
    MemAvailable at start, less --offload-host-reserve-gb and the pipeline's own buffers,
    shared by the ranks of the node: as many subgroups as fit, and --offload-paths hold the
    rest (with no path, a run whose states do not fit is refused in one line). On a CPU run
    (CI: the host is also the "device") auto keeps everything in host memory without
    --offload-paths and three subgroups with them (the minimum that overlaps fetch, update
    and flush), unless MEGATRON_EXT_MEMAVAILABLE_GB is set. Pinned on GPU machines. The
    pipeline adds up to 12 bytes per element of one subgroup (gradient staging and an fp32
    scratch) and one state buffer; auto counts them. When the paths cannot hold every
    subgroup, the cache keeps those that do not fit, without a file, as long as three
    buffers are left for the pipeline. 0: no host cache: every state lives in a file on
    --offload-paths (needed) and host memory holds only the pipeline's three buffers."""
    offload_host_reserve_gb: Optional[float] = option(None, metavar="G")
    """With --offload-host-cache-gb auto: host memory, in GB per node, left free beyond
    what the engine takes (the page cache of the paths' I/O, data loaders, checkpoints,
    other processes). Default: a tenth of MemAvailable."""
    offload_subgroup_size: int = 100_000_000
    """Elements per subgroup: the unit of fetch, update and flush (12 bytes of state per
    element). Smaller subgroups pipeline more finely but do more, smaller I/O."""
    offload_placement: str = option("bandwidth", choices=("bandwidth", "round-robin"))
    """How subgroups are spread over --offload-paths: bandwidth (each path's share of bytes
    proportional to its bandwidth, interleaved; MLP-Offload's rule) or round-robin."""
    offload_rebalance: bool = option(True, negate="--no-offload-rebalance")
    """Keep every subgroup on the path it was placed on at start, even when a path slows
    down. Without this flag the engine tracks each path's observed throughput every step
    and moves subgroups off a path that slows down (contention), with hysteresis."""
    offload_alternate_order: bool = option(True, negate="--no-offload-alternate-order")
    """Walk the subgroups in ascending order on every step, so each step starts on
    subgroups the previous one evicted from the host cache. Without this flag the order
    alternates (ascending, then descending), so each step starts on the subgroups the
    previous one left in the cache."""
    offload_delayed_grad_conversion: bool = option(
        True, negate="--no-offload-delayed-grad-conversion")
    """Convert the whole shard's gradients to fp32 before the update and, for subgroups
    outside the host cache, write them to and read them back from the tier (what
    ZeRO-Infinity does). Without this flag gradients move to the host in the training
    dtype and are converted to fp32 inside their subgroup's update."""
    offload_concurrency_control: bool = option(True, negate="--no-offload-concurrency-control")
    """Let every process of a node do I/O on a path at the same time. Without this flag
    one process of a node at a time does I/O on a given path (a node-local file lock the
    kernel releases if its holder dies); threads within the process still share it."""
    offload_io_threads: int = 4
    """Threads per file read or write."""
    offload_direct_io: bool = False
    """Open state files with O_DIRECT (bypass the page cache; aligned buffers, unaligned
    tails handled). Falls back to buffered I/O where the file system refuses it."""
    offload_checksum: str = option("xxh3", choices=("xxh3", "crc32c", "none"))
    """Checksum written with each state file and verified on every read."""
    offload_device_cache_gb: str = option("auto", metavar="G|auto")
    """GPU memory, in GB per rank, for the device tier: subgroups whose states stay on the
    GPU and are updated there by a fused Adam, with no PCIe traffic. Placement fills it
    first, then the host cache, then --offload-paths. 0: no device tier. auto (default):
    the memory plan's GPU budget (free memory less weights, gradients, the activation
    estimate and a reserve) before the first step, so the host cache and the paths need to
    hold only the rest; then sized again at the first step from the measured peak of
    forward and backward (the caching allocator's reserved peak, within the memory it can
    hold: the CUDA context and other processes left out) plus
    --offload-device-reserve-gb, growing or shrinking; one log line says what it chose,
    and subgroups move back down to the host when a later peak would not fit. Without a
    budget from the plan, the first step sizes it alone. On a CPU run (no GPU) auto means
    no device tier; a fixed size keeps its states in host memory (CI exercises the same
    code). With --zenflow auto means none (ZenFlow keeps its own GPU states)."""
    offload_device_reserve_gb: float = 4.0
    """With --offload-device-cache-gb auto: GPU memory, in GB, left free beyond the
    measured peak (allocator fragmentation, evaluation, checkpointing)."""
    offload_gpu_update: bool = option(True, negate="--no-offload-gpu-update")
    """Update some of the host-memory subgroups on the GPU: states H2D, fused Adam, states
    D2H, both copy directions in flight on their own streams, while CPU Adam updates the
    others; the split follows the measured throughputs every step so both sides end
    together. Off: CPU Adam updates every host-memory subgroup (ablation). GPU runs only."""
    store_param_remainders: bool = option(True, negate="--no-store-param-remainders")
    """Store each fp32 master whole (4 bytes: 12 bytes of state per element, 8 with bf16
    moments), the ablation. Without this flag, with --bf16 and fp32 masters (the default
    --main-params-dtype), each master is stored and moved as its 16-bit remainder beside
    the bf16 parameter (megatron-core's store_param_remainders semantics; the missing bit
    rides in the sign bit of exp_avg_sq): 10 bytes per element on every tier, 6 with bf16
    moments, the same results bit for bit, and the Adam math stays fp32. With fp32 or fp16
    parameters (or --main-params-dtype fp16) remainders would not be exact and are not
    used. Checkpoints say how they were stored; a resume with the other setting converts."""
    offload_run_id: Optional[str] = None
    """Name of this job's directory under each path: one directory name of letters, digits,
    '.', '_' and '-'. Default: the Slurm job id, else torchrun's run id, else a fresh id.
    One job at a time may use a run id (a second one refuses to start)."""

    offload_trace: Optional[str] = knob(None, env=TRACE_ENV, parse=str, metavar="FILE")
    """Append one line per state-file read and write (pid, rank, op, path, start, end,
    bytes) to FILE: the tests' view of the I/O timeline."""
    offload_device_memory_limit_gb: Optional[float] = knob(None, env=MEMORY_LIMIT_ENV,
                                                           parse=parse_gb, metavar="GB")
    """Test hook of --offload-device-cache-gb auto: the device's usable memory in GB, in
    place of the GPU's (a CPU run has none to measure)."""
    offload_device_peak_gb: List[List[float]] = knob(
        [], env=MEMORY_PEAK_ENV, parse=parse_peaks, metavar="STEP:GB,...")
    """Test hook of --offload-device-cache-gb auto, with the memory limit hook: the peak of
    an iteration besides the engine's device states, in GB, from each STEP on."""
    offload_stream_share: Optional[float] = knob(None, env=STREAM_SHARE_ENV,
                                                 parse=parse_share, metavar="SHARE")
    """Test hook: a fixed share (0-1) of the host subgroups' elements to stream through
    the device each step, in place of the measured split (a CPU run streams none)."""
    offload_mem_available_gb: Optional[float] = knob(None, env=MEM_AVAILABLE_ENV,
                                                     parse=parse_gb, metavar="GB")
    """The node's MemAvailable in GB, in place of /proc/meminfo's, for
    --offload-host-cache-gb auto (and the memory plan). On a CPU run it also turns the
    host cache's auto sizing on."""
    offload_path_free_gb: List[float] = knob([], env=PATH_FREE_ENV, parse=parse_gb_list,
                                             metavar="GB,GB,...")
    """Each --offload-paths entry's free space in GB (one per path, in order), in place of
    the file system's (statvfs), for the room auto placement gives each path (and the
    memory plan)."""

    def __post_init__(self):
        if self.offload_subgroup_size <= 0:
            raise UsageError("--offload-subgroup-size must be positive")
        if self.offload_io_threads <= 0:
            raise UsageError("--offload-io-threads must be positive")
        self._check_host_cache()
        if self.offload_host_reserve_gb is not None and not self.offload_host_reserve_gb >= 0:
            raise UsageError("--offload-host-reserve-gb must be >= 0")
        if self.offload_run_id is not None:
            check_run_id(self.offload_run_id)
        self.device_cache_bytes()
        if self.offload_device_reserve_gb < 0:
            raise UsageError("--offload-device-reserve-gb must be >= 0")
        if not self.offload_optimizer:
            changed = [f.name for f in dataclasses.fields(self)
                       if f.name != "offload_optimizer" and f.name not in MACHINE_KNOBS
                       and getattr(self, f.name) != (
                           f.default if f.default is not dataclasses.MISSING
                           else f.default_factory())]
            if changed:
                raise UsageError(f"--{changed[0].replace('_', '-')} needs --offload-optimizer")
        if self.offload_paths:
            from megatron_ext.offload.paths import parse_tier_spec

            seen = {}
            for text in self.offload_paths:
                path = parse_tier_spec(text).path
                real = os.path.realpath(path)
                if real in seen:
                    raise UsageError(f"--offload-paths lists {seen[real]} and {path}, the same "
                                     "directory: give each path once (two entries would split "
                                     "its bandwidth)")
                seen[real] = path
                if os.path.exists(path) and not os.path.isdir(path):
                    raise UsageError(f"--offload-paths {path}: is a file, not a directory; give "
                                     "a directory (each job writes in its own subdirectory "
                                     "there)")
                if not os.path.isdir(path):
                    raise UsageError(f"--offload-paths {path}: no such directory; create it (each "
                                     "job writes in its own subdirectory there)")
                if not os.access(path, os.W_OK | os.X_OK):
                    raise UsageError(f"--offload-paths {path}: not writable by this user")
        if (self.offload_paths and self.offload_path_free_gb
                and len(self.offload_path_free_gb) != len(self.offload_paths)):
            raise UsageError(f"{PATH_FREE_ENV} gives {len(self.offload_path_free_gb)} free "
                             f"sizes for {len(self.offload_paths)} --offload-paths: give one "
                             "per path, in order")

    def _check_host_cache(self) -> None:
        value = self.offload_host_cache_gb
        if value is None:  # a caller from before auto: None meant the default
            value = self.offload_host_cache_gb = "auto"
        if isinstance(value, str) and value.strip().lower() == "auto":
            self.offload_host_cache_gb = "auto"
            return
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UsageError(f"--offload-host-cache-gb {value}: give a size in GB or auto") \
                from None
        if not number >= 0 or number == float("inf"):
            raise UsageError(f"--offload-host-cache-gb {number:g}: give a size in GB (>= 0; 0 for "
                             "no host cache, the states in files on --offload-paths) or auto")
        self.offload_host_cache_gb = number

    @property
    def host_cache_auto(self) -> bool:
        """Whether --offload-host-cache-gb is auto."""
        return self.offload_host_cache_gb == "auto"

    @property
    def no_host_cache(self) -> bool:
        """Whether --offload-host-cache-gb is 0: the pipeline's buffers only, no cache."""
        return not self.host_cache_auto and float(self.offload_host_cache_gb) == 0

    def host_cache_bytes(self) -> Optional[int]:
        """--offload-host-cache-gb in bytes; None for auto, 0 for no host cache."""
        if self.host_cache_auto:
            return None
        return int(round(float(self.offload_host_cache_gb) * 1e9))

    @property
    def device_cache_auto(self) -> bool:
        """Whether --offload-device-cache-gb is auto."""
        return str(self.offload_device_cache_gb).strip().lower() == "auto"

    def device_cache_bytes(self) -> int:
        """The fixed device-tier size in bytes (0 with auto: sized at the first step)."""
        if self.device_cache_auto:
            return 0
        try:
            value = float(self.offload_device_cache_gb)
        except ValueError:
            value = -1.0
        if not value >= 0 or value == float("inf"):
            raise UsageError(f"--offload-device-cache-gb {self.offload_device_cache_gb}: give a "
                             "size in GB (>= 0) or auto")
        return int(round(value * 1e9))

    def host_reserve_bytes(self, mem_available: int) -> int:
        """The node's host memory left free with --offload-host-cache-gb auto, in bytes.

        --offload-host-reserve-gb, else a tenth of the node's ``mem_available``. The one
        rule of the engine's cache (offload/capacity.py) and the memory plan (memory/plan.py).
        """
        if self.offload_host_reserve_gb is not None:
            return int(round(self.offload_host_reserve_gb * 1e9))
        return mem_available // HOST_RESERVE_DIVISOR
