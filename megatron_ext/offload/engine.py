"""The update pipeline of the offload engine.

One rank's optimizer shard is cut into subgroups (:mod:`.subgroups`). Each subgroup's
fp32 state (master weights, exp_avg, exp_avg_sq: one buffer of 3n floats) lives in the
host cache (:mod:`.cache`) or in a file on one of the tier paths (:mod:`.tiers`,
:mod:`.io`). A step walks the subgroups (ascending, then descending on the next step:
alternating order) and for each one, overlapped with threads:

    prefetch k+1 from its path  |  update k: gradients to the host in the training dtype,
                                |  converted to fp32 here (delayed conversion), CPU Adam,
                                |  new weights back to the model in its dtype
    flush an evicted subgroup   |

Nothing fp32 of the shard stays on the model's device. The engine is device-agnostic:
with CPU tensors it runs in CI; with CUDA it uses pinned buffers, copy streams and events.
It never imports megatron-core: :mod:`.optimizer` hands it the shard's tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_ext.errors import UsageError
from megatron_ext.offload.cache import HostCache
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.io import (
    RESTART_HINT,
    SPARES_PER_SIZE,
    OffloadStateError,
    StateFileIO,
    aligned_empty,
    secure_makedirs,
)
from megatron_ext.offload.jobdir import JobDirs
from megatron_ext.offload.locks import NodeLocks
from megatron_ext.offload.paths import TierFullError, TierSpec, check_free_space
from megatron_ext.offload.placement import Rebalancer, place_subgroups
from megatron_ext.offload.states import StateLayout
from megatron_ext.offload.subgroups import Subgroup, layout_fingerprint, partition
from megatron_ext.offload.tier_model import (
    DEVICE_TIER,
    HOST_TIER,
    Tier,
    TierKind,
    Updater,
    UpdateRates,
    device_budget,
    fixed_device_subgroups,
    resize_device_tier,
    split_updates,
)
from megatron_ext.optim.adamw import adam_update, unscale_and_clip

log = logging.getLogger(__name__)

STATE_BYTES_PER_ELEMENT = 12
MANIFEST_VERSION = 1
# Errors of a path (not of the data) after which a write may go to another path.
_PATH_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.ENOENT, errno.EROFS, errno.EACCES,
                errno.EIO, errno.ENOTDIR, errno.ESTALE}
TRACE_ENV = "MEGATRON_EXT_OFFLOAD_TRACE"
FAULT_ENV = "MEGATRON_EXT_OFFLOAD_FAULT"
# Test hooks of the device tier's ``auto`` sizing (CPU runs have no device memory to
# measure): the device's usable memory in GB, and the peak of a training iteration besides
# the offload engine's device states, as "STEP:GB,STEP:GB" (from STEP on).
MEMORY_LIMIT_ENV = "MEGATRON_EXT_DEVICE_MEMORY_LIMIT_GB"
MEMORY_PEAK_ENV = "MEGATRON_EXT_DEVICE_PEAK_GB"
# Test hook: a fixed share of the host subgroups' elements to stream through the device
# (CPU runs stream nothing by themselves: their "device" is the CPU).
STREAM_SHARE_ENV = "MEGATRON_EXT_OFFLOAD_STREAM_SHARE"


@dataclasses.dataclass(frozen=True)
class _TestHooks:
    """The test hooks' values, read and checked when the engine starts (not mid-run)."""

    memory_limit_gb: Optional[float]
    peaks_gb: tuple
    """(from step, GB) pairs of $MEGATRON_EXT_DEVICE_PEAK_GB, in the order given."""
    stream_share: Optional[float]

    @classmethod
    def from_environ(cls, environ) -> "_TestHooks":
        def number(name, text):
            try:
                value = float(text)
            except ValueError:
                value = float("nan")
            if not value >= 0 or value == float("inf"):
                raise UsageError(f"{name}={environ[name]}: give a number >= 0")
            return value

        limit = environ.get(MEMORY_LIMIT_ENV)
        peaks = []
        for item in environ.get(MEMORY_PEAK_ENV, "").split(","):
            if item:
                step, _, value = item.partition(":")
                if not step.strip().isdigit():
                    raise UsageError(f"{MEMORY_PEAK_ENV}={environ[MEMORY_PEAK_ENV]}: give "
                                     "STEP:GB pairs separated by commas, e.g. 1:0.5,6:0.8")
                peaks.append((int(step), number(MEMORY_PEAK_ENV, value)))
        share = environ.get(STREAM_SHARE_ENV)
        return cls(None if limit is None else number(MEMORY_LIMIT_ENV, limit), tuple(peaks),
                   None if share is None else min(1.0, number(STREAM_SHARE_ENV, share)))


class _Faults:
    """Faults injected by the test suite through ``MEGATRON_EXT_OFFLOAD_FAULT``.

    A ';'-separated list of ``kind:arg:arg``: ``kill-in-flush:STEP`` (SIGKILL in the middle
    of a state write at STEP, leaving a partial temp file and the lock held),
    ``corrupt-after-flush:STEP`` (flip one payload byte of a file just written at STEP),
    ``enospc:PATH`` (writes to path index PATH fail with ENOSPC), ``slow:PATH:FACTOR:STEP``
    (from STEP on, I/O on PATH takes FACTOR times as long), ``vanish:PATH:STEP`` (this
    rank's directory on PATH disappears at the start of STEP).
    """

    def __init__(self, text: str):
        self.rules = [part.split(":") for part in text.split(";") if part]

    def get(self, kind: str) -> List[List[str]]:
        return [rule[1:] for rule in self.rules if rule[0] == kind]


@dataclasses.dataclass
class ShardParam:
    """One parameter's part of the rank's shard, as the engine sees it."""

    numel: int
    group: int
    """Index of its optimizer param group (lr, weight decay, betas, eps)."""
    grad: Callable[[], torch.Tensor]
    """Returns the shard's reduce-scattered gradient (training dtype, model device)."""
    out: torch.Tensor
    """Where the updated weights go: the shard's slice of the model's param buffer."""
    init: Callable[[], torch.Tensor]
    """Returns the shard's current model weights (to build fp32 masters from)."""


class _StepStats:
    """Seconds and bytes of one logging interval."""

    def __init__(self, n_paths: int):
        self.lock = threading.Lock()
        self.n_paths = n_paths
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.time = {k: 0.0 for k in ("fetch", "convert", "update", "writeback", "flush",
                                      "stall", "device_update", "stream_issue")}
        self.device_subgroups = 0
        self.streamed_subgroups = 0
        self.hits = 0
        self.needed = 0
        self.read_bytes = [0] * self.n_paths
        self.read_s = [0.0] * self.n_paths
        self.write_bytes = [0] * self.n_paths
        self.write_s = [0.0] * self.n_paths

    def add(self, key: str, seconds: float) -> None:
        with self.lock:
            self.time[key] += seconds


class OffloadEngine:
    """Owns the fp32 state of one rank's shard and updates it subgroup by subgroup."""

    def __init__(self, cfg: OffloadConfig, params: Sequence[ShardParam], *, rank: int,
                 device: torch.device, tiers: Sequence[TierSpec], run_id: str,
                 model_dtype: torch.dtype, grad_dtype: torch.dtype,
                 layout: Optional[StateLayout] = None):
        self.cfg = cfg
        self.layout = layout or StateLayout()
        self.params = list(params)
        self.rank = rank
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.model_dtype, self.grad_dtype = model_dtype, grad_dtype
        numels = [p.numel for p in self.params]
        groups = [p.group for p in self.params]
        self.subgroups: List[Subgroup] = partition(numels, groups, cfg.offload_subgroup_size)
        self.fingerprint = layout_fingerprint(numels, groups, cfg.offload_subgroup_size)
        self.max_numel = max((sg.numel for sg in self.subgroups), default=0)
        self._param_pieces: Optional[Dict[int, list]] = None
        self.total_numel = sum(numels)
        self.step_count = 0
        self.initialized = False
        # torch's fused CPU AdamW is several times faster; its rounding differs from the
        # reference implementation in the last bit, and on a CPU run the reference is what
        # megatron-core's own optimizer uses, so CPU runs stay bit-identical to it.
        self.fused_adam = self.is_cuda
        self._trace_path = os.environ.get(TRACE_ENV)
        self._faults = _Faults(os.environ.get(FAULT_ENV, ""))
        self._hooks = _TestHooks.from_environ(os.environ)

        self.tiers = list(tiers)
        self.stats = _StepStats(len(self.tiers))
        self.io = StateFileIO(threads=cfg.offload_io_threads, direct_io=cfg.offload_direct_io,
                              checksum=cfg.offload_checksum)
        # One I/O operation per path at a time on this node (its threads inside it).
        self.locks = NodeLocks(enabled=cfg.offload_concurrency_control)
        self._lock_wait_seen = 0.0
        # DIR/megatron_ext-USER/JOB/rankNNNNN per path: checked, locked (see jobdir.py).
        self.jobdirs = JobDirs([t.path for t in self.tiers], run_id, rank)
        self.rank_dirs = self.jobdirs.rank_dirs
        self._bad_paths: set = set()
        # Bytes of each subgroup's state (its file's payload), in the layout's dtypes.
        self.sizes = [self.layout.nbytes(sg.numel) for sg in self.subgroups]
        self.buffer_bytes = self.layout.nbytes(self.max_numel)
        # The device tier: subgroups whose state lives on the model's device, in the order
        # they joined; a fixed size is placed now, ``auto`` at the first step.
        self.device_auto = cfg.device_cache_auto
        self.device_members: List[int] = (
            [] if self.device_auto else fixed_device_subgroups(self.sizes,
                                                               cfg.device_cache_bytes()))
        self._device_set = set(self.device_members)
        self._device_states: Dict[int, torch.Tensor] = {}
        self.device_sized = not self.device_auto
        if self.device_auto and not self.is_cuda and self._hooks.memory_limit_gb is None:
            raise UsageError("--offload-device-cache-gb auto measures GPU memory and this run "
                             "is on the CPU: give a size in GB (the CPU's 'device' tier is "
                             "host memory)")
        self.capacity = self._cache_capacity()
        self.resident: frozenset = frozenset()
        """Subgroups that live in the host cache only (no file): home -1, never evicted."""
        if self.tiers:
            weights = [t.effective_gbps for t in self.tiers]
            # Room for the recycled spares and one temporary file per path besides the states.
            reserve = (SPARES_PER_SIZE + 1) * max(self.sizes, default=0)
            free = [max(0, check_free_space(t.path, 0) - reserve) for t in self.tiers]
            try:
                self.home = self._place(weights, free)
            except TierFullError as err:
                if not self.device_auto:
                    raise
                raise TierFullError(
                    f"{err}; with --offload-device-cache-gb auto the host cache and the paths "
                    "must hold every subgroup until the first step sizes the device tier: "
                    "give the device tier a size in GB instead", err.needed_bytes,
                    err.free_bytes) from None
            self.rebalancer = (Rebalancer(weights) if cfg.offload_rebalance and len(self.tiers) > 1
                               else None)
        else:
            self.home = [None] * len(self.subgroups)
            self.rebalancer = None
        # Where each subgroup's current file is (None: never written), and the step of
        # the state it holds (checked against the file's header on every read).
        self.location: List[Optional[int]] = [None] * len(self.subgroups)
        self.version: List[int] = [0] * len(self.subgroups)
        self.cache = HostCache(self.capacity, self._alloc_state)
        # Without delayed conversion: each subgroup's fp32 gradients of this step, in host
        # memory (a tensor) or in a file on the path of that index (an int).
        self._grad_files: Dict[int, object] = {}
        self._flushes: List[Future] = []
        self._io_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offload-fetch")
        self._flush_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offload-flush")
        self._scratch = torch.empty(self.max_numel, dtype=torch.float32)
        self.rates = UpdateRates()
        self._step_counts = {"cpu_elements": 0, "cpu_s": 0.0, "stream_elements": 0,
                             "stream_s": 0.0}
        self._stream_marks: List[tuple] = []
        self._busy: Dict[int, object] = {}
        """Host buffers a streamed update is still copying into (CUDA events)."""
        self._stream_next = 0
        self._stream_slots: List[torch.Tensor] = []
        self._slot_free: List[object] = [None, None]
        self._device_grad: Optional[torch.Tensor] = None
        if self.is_cuda and (self.device_auto or self.device_members
                             or cfg.offload_gpu_update):
            # Allocated now so that ``auto`` sizing measures them in the first peak.
            self._device_grad = torch.empty(self.max_numel, dtype=torch.float32,
                                            device=device)
            if cfg.offload_gpu_update:
                self._stream_slots = [torch.empty(self.buffer_bytes, dtype=torch.uint8,
                                                  device=device) for _ in range(2)]
                self._sh2d = torch.cuda.Stream(device)
                self._sd2h = torch.cuda.Stream(device)
        if self.is_cuda and self.device_auto:
            # megatron-core's optimizer made fp32 masters of the whole shard on the device
            # and the base class freed them: that transient is no training peak.
            torch.cuda.reset_peak_memory_stats(device)
        if self.is_cuda:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)
            self._grad_stage = [torch.empty(self.max_numel, dtype=grad_dtype, pin_memory=True)
                                for _ in range(2)]
            self._grad_events = [None, None]
            # New fp32 masters cross to the device straight from their pinned state buffer
            # and are cast there: a CPU cast pass over the shard costs more than the extra
            # PCIe bytes (measured on the H200 machine, 2026-11-30).
            self._out_stage = [torch.empty(self.max_numel, dtype=self.layout.master,
                                           device=device) for _ in range(2)]
            self._out_events = [None, None]

    # ----------------------------------------------------------------- setup helpers

    def _cache_capacity(self) -> Optional[int]:
        cfg = self.cfg
        # Subgroups of the device tier need no host buffer.
        n = len(self.subgroups) - len(self.device_members)
        per_buffer = self.buffer_bytes
        if cfg.offload_host_cache_gb is None:
            return None if not self.tiers else min(n, 3)
        fits = int(round(cfg.offload_host_cache_gb * 1e9) // max(per_buffer, 1))
        if not self.tiers:
            if fits < n:
                raise UsageError(
                    f"--offload-host-cache-gb {cfg.offload_host_cache_gb:g} holds {fits} of the "
                    f"{n} subgroups of this rank and there is no --offload-paths for the rest: "
                    f"give at least {_gb(n * per_buffer)} GB, or add --offload-paths DIR")
            return None
        if fits < min(n, 3):
            raise UsageError(
                f"--offload-host-cache-gb {cfg.offload_host_cache_gb:g} holds {fits} subgroups of "
                f"{_gb(per_buffer)} GB; the pipeline needs 3: give at least "
                f"{_gb(3 * per_buffer)} GB or a smaller --offload-subgroup-size")
        return min(n, fits)

    def _place(self, weights: List[float], free: List[int]) -> List[int]:
        """Each subgroup's path, -1 for those the host cache keeps without a file.

        Normally every subgroup has a file and the cache is a cache. When the paths cannot
        hold them all, the cache keeps the fewest subgroups that let the rest fit, as long
        as three buffers are left for the pipeline; they are taken from the middle of the
        order (with the alternating order, the cache reuses the subgroups at both ends).
        """
        n = len(self.subgroups)
        # A fixed device tier's subgroups have no file (home -1, not resident either).
        hosted = [i for i in range(n) if i not in self._device_set]
        spare = 0 if self.capacity is None else max(0, self.capacity - min(len(hosted), 3))
        lack = sum(self.sizes[i] for i in hosted) - sum(free)
        first = max(0, lack // max(self.sizes, default=1)) if lack > 0 else 0
        error = None
        for kept in range(min(first, spare), spare + 1):
            lo = (len(hosted) - kept) // 2
            resident = set(hosted[lo:lo + kept])
            others = [i for i in hosted if i not in resident]
            try:
                homes = place_subgroups([self.sizes[i] for i in others], weights,
                                        self.cfg.offload_placement, capacity=free)
            except TierFullError as err:
                error = err
                continue
            self.resident = frozenset(resident)
            home = [-1] * n
            for index, path in zip(others, homes):
                home[index] = path
            if resident:
                log.info("offload: rank %d keeps %d of %d subgroups (%.2f GB) in the host cache "
                         "only: the paths hold the other %.2f GB", self.rank, kept, n,
                         sum(self.sizes[i] for i in resident) / 1e9,
                         sum(self.sizes[i] for i in others) / 1e9)
            return home
        raise TierFullError(f"{error} (the host cache can keep at most {spare} of the {n} "
                            "subgroups besides the pipeline's 3: a larger "
                            "--offload-host-cache-gb helps too)", error.needed_bytes,
                            error.free_bytes)

    def _alloc_state(self) -> torch.Tensor:
        return aligned_empty(self.buffer_bytes, dtype=torch.uint8, pin=self.is_cuda)

    def _views(self, buffer: torch.Tensor, index: int) -> List[torch.Tensor]:
        """[master, exp_avg, exp_avg_sq] of subgroup ``index`` in a state buffer."""
        return self.layout.views(buffer, self.subgroups[index].numel)

    # ----------------------------------------------------------------- the tier model

    def tier_of(self, index: int) -> Tier:
        """Where subgroup ``index``'s state lives now."""
        if index in self._device_set:
            return DEVICE_TIER
        if index in self.cache or self.location[index] is None:
            return HOST_TIER
        return Tier(TierKind.PATH, self.location[index])

    def device_bytes(self) -> int:
        """Bytes of state in the device tier."""
        return sum(self.sizes[i] for i in self.device_members)

    def _device_state(self, index: int) -> torch.Tensor:
        state = self._device_states.get(index)
        if state is None:
            state = torch.empty(self.sizes[index], dtype=torch.uint8, device=self.device)
            self._device_states[index] = state
        return state

    def _drop_buffer(self, buffer: torch.Tensor) -> None:
        """A host buffer no subgroup needs: freed when the cache has no fixed budget."""
        if self.capacity is None:
            self.cache.discard(buffer)
        else:
            self.cache.release(buffer)

    def _memory(self) -> tuple:
        """(usable device bytes, peak allocated bytes of the iterations so far)."""
        limit_gb = self._hooks.memory_limit_gb
        if limit_gb is not None:
            peak_gb = 0.0
            for step, value in self._hooks.peaks_gb:
                if step <= self.step_count + 1:
                    peak_gb = value
            return int(limit_gb * 1e9), int(peak_gb * 1e9) + self.device_bytes()
        return (torch.cuda.mem_get_info(self.device)[1],
                torch.cuda.max_memory_allocated(self.device))

    def _size_device_tier(self) -> None:
        """``auto``: fills the device tier once from the measured peak, gives back later."""
        if not self.device_auto:
            return
        limit, peak = self._memory()
        reserve = int(self.cfg.offload_device_reserve_gb * 1e9)
        others = max(0, peak - self.device_bytes())  # what the iteration needs besides
        budget = device_budget(limit, peak, self.device_bytes(), reserve)
        candidates = [] if self.device_sized else self._promotion_order()
        joining, leaving = resize_device_tier(self.device_members, self.sizes, budget,
                                              candidates)
        for index in joining:
            self._move_up(index)
        for index in leaving:
            self._move_down(index)
        if not self.device_sized:
            self.device_sized = True
            log.info("offload: rank %d device tier (auto): %d of %d subgroups, %s GB "
                        "(device memory %s GB, peak besides it %s GB, reserve %s GB)",
                        self.rank, len(self.device_members), len(self.subgroups),
                        _gb(self.device_bytes()), _gb(limit), _gb(others), _gb(reserve))
        elif leaving:
            log.warning("offload: rank %d device tier gives back %d subgroups (%s GB) to the "
                        "host: the peak grew to %s GB; it keeps %d (%s GB)", self.rank,
                        len(leaving), _gb(sum(self.sizes[i] for i in leaving)), _gb(peak),
                        len(self.device_members), _gb(self.device_bytes()))

    def _promotion_order(self) -> List[int]:
        """Subgroups to move up, most wanted first.

        Those on paths (their I/O goes away), then the host's, each kind evenly spread.
        """
        hosted = [i for i in range(len(self.subgroups)) if i not in self._device_set]
        on_paths = [i for i in hosted if self.home[i] is not None and self.home[i] >= 0
                    and i not in self.resident]
        in_host = [i for i in hosted if i not in on_paths]

        def interleaved(ids: List[int]) -> List[int]:
            # Bit-reversed positions (0, n/2, n/4, 3n/4, ...): every prefix is spread out.
            bits = max(1, (len(ids) - 1).bit_length())
            return [ids[k] for k in sorted(range(len(ids)),
                                           key=lambda k: int(f"{k:0{bits}b}"[::-1], 2))]
        return interleaved(on_paths) + interleaved(in_host)

    def _move_up(self, index: int) -> None:
        """Subgroup ``index`` joins the device tier (its host buffer and file go away)."""
        if self.initialized:
            buffer = self._acquire_sync(index)
            self._settle(index)
            self._device_state(index).copy_(buffer[:self.sizes[index]])
            self._drop_buffer(self.cache.pop(index).buffer)
            if self.location[index] is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._file(index, self.location[index]))
                self.location[index] = None
        self.resident = self.resident - {index}
        self.device_members.append(index)
        self._device_set.add(index)

    def _move_down(self, index: int) -> None:
        """Subgroup ``index`` leaves the device tier for the host cache (gives memory back)."""
        state = self._device_states.pop(index, None)
        self.device_members.remove(index)
        self._device_set.discard(index)
        if state is None:
            return
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        buffer, flush = self._take_buffer(protect=())
        if flush is not None:
            flush.result()
        buffer[:self.sizes[index]].copy_(state)
        self.cache.insert(index, buffer, dirty=True)
        if self.home[index] is None or self.home[index] < 0:
            # No path to flush it to: the host keeps it.
            self.resident = self.resident | {index}

    # ----------------------------------------------------------------- order

    def order(self, step: int) -> List[int]:
        """Subgroup order of ``step`` (1-based): with alternation, descending on odd steps."""
        ids = list(range(len(self.subgroups)))
        if self.cfg.offload_alternate_order and step % 2 == 1:
            ids.reverse()
        return ids

    # ----------------------------------------------------------------- files and I/O

    def _file(self, subgroup: int, path: int, kind: str = "state") -> str:
        return os.path.join(self.rank_dirs[path], f"sg{subgroup:05d}.{kind}")

    def _trace(self, op: str, path: int, start: float, end: float, nbytes: int) -> None:
        if not self._trace_path:
            return
        line = (f"{os.getpid()} {self.rank} {op} {self.tiers[path].path} {start:.6f} "
                f"{end:.6f} {nbytes}\n")
        fd = os.open(self._trace_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _read(self, subgroup: int, buffer: torch.Tensor, kind: str = "state") -> None:
        path = self.location[subgroup] if kind == "state" else self._grad_files[subgroup]
        sg = self.subgroups[subgroup]
        out = buffer[:self.sizes[subgroup]] if kind == "state" else buffer[:sg.numel]
        name = self._file(subgroup, path, kind)
        with self.locks.hold(self.tiers[path].path):
            start = time.perf_counter()
            t0 = time.monotonic()
            step = self.io.read(name, out, rank=self.rank, subgroup=subgroup, elements=sg.numel)
            self._throttle(path, start)
            seconds = time.perf_counter() - start
            self._trace("read", path, t0, time.monotonic(), out.numel() * out.element_size())
        if kind == "state" and step != self.version[subgroup]:
            raise OffloadStateError(f"offload state file {name} belongs to step {step}, expected "
                                    f"{self.version[subgroup]}: restart from the last checkpoint")
        self._account("read", path, out.numel() * out.element_size(), seconds)

    def _write(self, subgroup: int, buffer: torch.Tensor, kind: str = "state") -> None:
        """Writes a subgroup's file to its home path; spills to another path on a path error."""
        sg = self.subgroups[subgroup]
        payload = buffer[:self.sizes[subgroup]] if kind == "state" else buffer[:sg.numel]
        nbytes = payload.numel() * payload.element_size()
        if kind == "state" and subgroup in self.resident:
            raise RuntimeError(f"offload: subgroup {subgroup} lives in the host cache only")
        while True:
            path = self.home[subgroup]
            name = self._file(subgroup, path, kind)
            try:
                with self.locks.hold(self.tiers[path].path):
                    start = time.perf_counter()
                    t0 = time.monotonic()
                    self._inject_write_faults(name, path, payload)
                    self.io.write(name, payload, rank=self.rank, subgroup=subgroup,
                                  elements=sg.numel, step=self.version[subgroup])
                    self._throttle(path, start)
                    seconds = time.perf_counter() - start
                    self._trace("write", path, t0, time.monotonic(), nbytes)
                    self._inject_corruption(name)
                break
            except OSError as err:
                if err.errno not in _PATH_ERRNOS:
                    raise
                self._spill(subgroup, path, nbytes, err)
        self._account("write", path, nbytes, seconds)
        if kind == "grad":
            self._grad_files[subgroup] = path
        else:
            old = self.location[subgroup]
            self.location[subgroup] = path
            if old is not None and old != path:
                with contextlib.suppress(OSError):
                    os.unlink(self._file(subgroup, old, kind))

    def _account(self, op: str, path: int, nbytes: int, seconds: float) -> None:
        """Counts one read or write in the metrics and in the rebalancer's observations."""
        s = self.stats
        with s.lock:
            if op == "read":
                s.read_bytes[path] += nbytes
                s.read_s[path] += seconds
                s.time["fetch"] += seconds
            else:
                s.write_bytes[path] += nbytes
                s.write_s[path] += seconds
                s.time["flush"] += seconds
        if self.rebalancer is not None:
            self.rebalancer.observe(path, nbytes, seconds)

    def _inject_write_faults(self, name: str, path: int, payload: torch.Tensor) -> None:
        if not self._faults.rules:
            return
        for (index,) in self._faults.get("enospc"):
            if int(index) == path:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        for (step,) in self._faults.get("kill-in-flush"):
            if self.step_count >= int(step):
                partial = f"{os.path.dirname(name)}/.{os.path.basename(name)}.tmp-{os.getpid()}-k"
                with open(partial, "wb") as f:
                    f.write(payload.view(torch.uint8).numpy()[:payload.numel() * 2].tobytes())
                    f.flush()
                    os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)

    def _inject_corruption(self, name: str) -> None:
        for (step,) in self._faults.get("corrupt-after-flush"):
            if self.step_count == int(step):
                with open(name, "r+b") as f:
                    f.seek(4096 + 100)
                    byte = f.read(1)
                    f.seek(4096 + 100)
                    f.write(bytes([byte[0] ^ 0x40]))

    def _throttle(self, path: int, start: float) -> None:
        for index, factor, step in self._faults.get("slow"):
            if int(index) == path and self.step_count >= int(step):
                time.sleep((float(factor) - 1.0) * (time.perf_counter() - start))

    def _spill(self, subgroup: int, path: int, nbytes: int, err: OSError) -> None:
        """Moves a subgroup's home off a failing path, or fails loudly."""
        self._bad_paths.add(path)
        for other in range(len(self.tiers)):
            if other in self._bad_paths:
                continue
            try:
                secure_makedirs(self.rank_dirs[other])
                free = check_free_space(self.tiers[other].path, nbytes)
            except (OSError, UsageError):
                self._bad_paths.add(other)
                continue
            if free >= 2 * nbytes:
                log.warning("offload: writing subgroup %d of rank %d to %s failed (%s); it and "
                            "the other subgroups of that path now go to %s", subgroup, self.rank,
                            self.tiers[path].path, err.strerror, self.tiers[other].path)
                for index, home in enumerate(self.home):
                    if home == path:
                        self.home[index] = other
                return
        raise OffloadStateError(
            f"offload: cannot write the state of subgroup {subgroup} of rank {self.rank} "
            f"({nbytes / 1e6:.0f} MB): {self.tiers[path].path}: {err.strerror}, and no other "
            "--offload-paths has room; the last checkpoint is intact: free space or add a path "
            "and resume with --load")

    def _take_buffer(self, protect: Sequence[int]) -> tuple:
        """A free state buffer, and the flush that must finish before it is reused."""
        if self.cache.can_allocate():
            return self.cache.allocate(), None
        victim = self.cache.victim([*protect, *self.resident])
        if victim is None:
            raise RuntimeError("offload cache has no evictable buffer (capacity too small)")
        entry = self.cache.pop(victim)
        self._settle(victim)
        if self.is_cuda:
            # Its masters may still be crossing to the device.
            for event in self._out_events:
                if event is not None:
                    event.synchronize()
        if not entry.dirty:
            return entry.buffer, None
        flush = self._flush_pool.submit(self._write, victim, entry.buffer)
        self._flushes.append(flush)
        return entry.buffer, flush

    def _start_fetch(self, subgroup: int, protect: Sequence[int]) -> Future:
        buffer, flush = self._take_buffer(protect)

        def fetch() -> torch.Tensor:
            if flush is not None:
                flush.result()
            self._read(subgroup, buffer)
            return buffer
        return self._io_pool.submit(fetch)

    def _settle(self, index: int) -> None:
        """Waits until no streamed update is still copying into subgroup ``index``'s buffer."""
        event = self._busy.pop(index, None)
        if event is not None:
            event.synchronize()

    def wait_io(self) -> None:
        """Waits for every background flush; raises the first error one of them hit."""
        for index in list(self._busy):
            self._settle(index)
        flushes, self._flushes = self._flushes, []
        for flush in flushes:
            flush.result()

    # ----------------------------------------------------------------- initialization

    def _fill(self, sources: Callable[[int, torch.Tensor], None]) -> None:
        """Fills every subgroup's state, writing out what the cache cannot keep.

        The fill runs opposite to the next step's order, so that step starts on the
        subgroups that stayed in the cache.
        """
        staging = None
        for index in reversed(self.order(self.step_count + 1)):
            if index in self._device_set:
                # Through one host buffer: the sources write host memory.
                if staging is None:
                    staging = aligned_empty(self.buffer_bytes, pin=self.is_cuda)
                sources(index, staging)
                self._device_state(index).copy_(staging[:self.sizes[index]])
                continue
            buffer, flush = self._take_buffer(protect=())
            if flush is not None:
                flush.result()
            sources(index, buffer)
            self.cache.insert(index, buffer, dirty=True)
        self.wait_io()
        self.initialized = True

    def initialize_from_model(self) -> None:
        """fp32 masters from the model's current weights; zero moments."""
        def fill(param: int, start: int, length: int, views: List[torch.Tensor]) -> None:
            views[0].copy_(self.params[param].init().reshape(-1)[start:start + length])
            views[1].zero_()
            views[2].zero_()
        self.initialize_from(fill)

    def initialize_from(self, fill: Callable[[int, int, int, List[torch.Tensor]], None],
                        step: int = 0) -> None:
        """Every state from ``fill(param, start, length, [master, exp_avg, exp_avg_sq])``.

        ``fill`` writes elements ``[start, start + length)`` of shard parameter ``param``
        into the three fp32 views; it is called piece by piece, a subgroup at a time, and
        what the cache cannot keep is written out as it goes. ``step``: the Adam steps the
        states have taken (their bias correction continues from it).
        """
        self.step_count = step
        self.version = [step] * len(self.subgroups)

        def source(index: int, buffer: torch.Tensor) -> None:
            sg = self.subgroups[index]
            views = self._views(buffer, index)
            for piece in sg.pieces:
                fill(piece.param, piece.start, piece.length,
                     [view[piece.offset:piece.offset + piece.length] for view in views])
        self._fill(source)

    def read_states(self, param: int, start: int, length: int,
                    outs: Sequence[torch.Tensor]) -> None:
        """Copies some of one shard parameter's states into ``outs``.

        Elements ``[start, start + length)`` of parameter ``param``'s master, exp_avg and
        exp_avg_sq go into the three tensors ``outs``; subgroups are fetched as needed.
        """
        if self._param_pieces is None:
            self._param_pieces = {}
            for index, sg in enumerate(self.subgroups):
                for piece in sg.pieces:
                    self._param_pieces.setdefault(piece.param, []).append((index, piece))
        for index, piece in self._param_pieces.get(param, ()):
            lo, hi = max(start, piece.start), min(start + length, piece.start + piece.length)
            if lo >= hi:
                continue
            views = self._views(self._acquire_sync(index), index)
            at = piece.offset + lo - piece.start
            for view, out in zip(views, outs):
                out[lo - start:hi - start].copy_(view[at:at + hi - lo])

    def reset_masters_from_model(self) -> None:
        """Rebuilds the fp32 masters from the model's weights, keeping the moments."""
        if not self.initialized:
            return
        for index, sg in enumerate(self.subgroups):
            master = self._views(self._acquire_sync(index), index)[0]
            for piece in sg.pieces:
                src = self.params[piece.param].init().reshape(-1)
                master[piece.offset:piece.offset + piece.length].copy_(
                    src[piece.start:piece.start + piece.length])
            if index not in self._device_set:
                self.cache.get(index).dirty = True
        self.wait_io()

    def _acquire_sync(self, index: int) -> torch.Tensor:
        """Subgroup ``index``'s state buffer: its device state, or a host buffer (fetched)."""
        if index in self._device_set:
            return self._device_state(index)
        if index in self.cache:
            self._settle(index)
            return self.cache.get(index).buffer
        buffer = self._start_fetch(index, protect=(index,)).result()
        self.cache.insert(index, buffer, dirty=False)
        return buffer

    # ----------------------------------------------------------------- the step

    def step(self, hparams: Sequence[dict], inv_scale: Optional[torch.Tensor],
             clip_coeff: Optional[float]) -> None:
        """One optimizer step over all subgroups.

        Args:
            hparams: the optimizer's param groups (lr, betas, eps, weight_decay), by index.
            inv_scale: fp16 loss-scale inverse to unscale the gradients with, or None.
            clip_coeff: the gradient-clipping factor (< 1) or None.
        """
        # ``auto``: the first step sizes the device tier before the states exist (the
        # forward and backward of this iteration are the peak it measures).
        self._size_device_tier()
        if not self.initialized:
            self.initialize_from_model()
        self._observe_stream()
        self.step_count += 1
        for index, step in self._faults.get("vanish"):
            if int(step) == self.step_count:
                shutil.rmtree(self.rank_dirs[int(index)], ignore_errors=True)
        order = self.order(self.step_count)
        plan = self.plan(order)
        cpu_order = [i for i in order if plan[i] is Updater.CPU]
        slot_of = {index: k % 2 for k, index in enumerate(cpu_order)}
        next_cpu = dict(zip(cpu_order, cpu_order[1:]))
        host_order = [i for i in order if plan[i] is not Updater.DEVICE]
        if self.is_cuda:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
            if torch.is_tensor(inv_scale):
                inv_scale_device = inv_scale.to(self.device, non_blocking=True)
        if not (self.is_cuda and torch.is_tensor(inv_scale)):
            inv_scale_device = inv_scale
        if not self.cfg.offload_delayed_grad_conversion:
            self._stage_fp32_grads(cpu_order, inv_scale, clip_coeff)
        depth = (1 if self.capacity is None
                 else max(1, min(2, self.capacity - len(self.resident) - 2)))
        pending: Dict[int, Future] = {}
        if self.is_cuda and self.cfg.offload_delayed_grad_conversion and cpu_order:
            self._issue_grad_copy(cpu_order[0], 0)
        position = {index: k for k, index in enumerate(host_order)}
        for index in order:
            if plan[index] is Updater.DEVICE:
                start = time.perf_counter()
                self._update_on_device(index, self._device_state(index), hparams,
                                       inv_scale_device, clip_coeff)
                self.stats.add("device_update", time.perf_counter() - start)
                self.stats.device_subgroups += 1
                continue
            k = position[index]
            ahead = host_order[k + 1:k + 1 + depth]
            for nxt in ahead:
                if nxt not in self.cache and nxt not in pending:
                    pending[nxt] = self._start_fetch(
                        nxt, protect=[index, *ahead, *pending])
            wait = time.perf_counter()
            self.stats.needed += 1
            if index in pending:
                buffer = pending.pop(index).result()
                self.cache.insert(index, buffer, dirty=False)
            elif index in self.cache:
                self.stats.hits += 1
            else:
                self._acquire_sync(index)
            self.stats.add("stall", time.perf_counter() - wait)
            entry = self.cache.get(index)
            self._settle(index)
            if plan[index] is Updater.STREAM:
                start = time.perf_counter()
                self._update_streamed(index, entry.buffer, hparams, inv_scale_device,
                                      clip_coeff)
                self.stats.add("stream_issue", time.perf_counter() - start)
                self.stats.streamed_subgroups += 1
                entry.dirty = True
                continue
            if self.is_cuda and self.cfg.offload_delayed_grad_conversion and index in next_cpu:
                self._issue_grad_copy(next_cpu[index], slot_of[next_cpu[index]])
            self._update(index, entry.buffer, slot_of[index], hparams, inv_scale, clip_coeff)
            entry.dirty = True
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._h2d)
        self._grad_files.clear()
        if self.rebalancer is not None:
            for index, source, target in self.rebalancer.end_step(self.home, self.sizes):
                if target in self._bad_paths:
                    continue
                log.info("offload: rank %d moves subgroup %d from %s to %s (observed "
                         "throughput)", self.rank, index, self.tiers[source].path,
                         self.tiers[target].path)
                self.home[index] = target
        self.stats.steps += 1

    def _issue_grad_copy(self, index: int, slot: int) -> None:
        """Starts the D2H copy of a subgroup's gradients (training dtype) into pinned memory."""
        stage = self._grad_stage[slot]
        with torch.cuda.stream(self._d2h):
            for piece in self.subgroups[index].pieces:
                src = self.params[piece.param].grad().reshape(-1)
                stage[piece.offset:piece.offset + piece.length].copy_(
                    src[piece.start:piece.start + piece.length], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._d2h)
        self._grad_events[slot] = event

    def _grads_fp32(self, index: int, slot: int, inv_scale, clip_coeff) -> torch.Tensor:
        """The subgroup's fp32 gradients, unscaled and clipped like megatron-core's."""
        sg = self.subgroups[index]
        grads = self._scratch[:sg.numel]
        if not self.cfg.offload_delayed_grad_conversion:
            staged = self._grad_files[index]
            if isinstance(staged, int):
                self._read(index, grads, kind="grad")
            else:
                grads.copy_(staged)
            return grads
        if self.is_cuda:
            self._grad_events[slot].synchronize()
            grads.copy_(self._grad_stage[slot][:sg.numel])
        else:
            for piece in sg.pieces:
                src = self.params[piece.param].grad().reshape(-1)
                grads[piece.offset:piece.offset + piece.length].copy_(
                    src[piece.start:piece.start + piece.length])
        unscale_and_clip(grads, inv_scale, clip_coeff)
        return grads

    def _stage_fp32_grads(self, order, inv_scale, clip_coeff) -> None:
        """Without delayed conversion: the shard's fp32 gradients first, as ZeRO-Infinity does.

        Each subgroup's gradients become fp32 on the model's device, cross to the host in
        fp32 and, for subgroups outside the cache, go to the tier and come back in the update.
        """
        start = time.perf_counter()
        for index in order:
            sg = self.subgroups[index]
            host = torch.empty(sg.numel, dtype=torch.float32)
            for piece in sg.pieces:
                src = self.params[piece.param].grad().reshape(-1)
                part = src[piece.start:piece.start + piece.length].float()
                unscale_and_clip(part, inv_scale, clip_coeff)
                host[piece.offset:piece.offset + piece.length].copy_(part)
            if self.tiers and index not in self.cache:
                self._write(index, host, kind="grad")
            else:
                self._grad_files[index] = host
        self.stats.add("convert", time.perf_counter() - start)

    def _update(self, index: int, buffer: torch.Tensor, slot: int, hparams, inv_scale,
                clip_coeff) -> None:
        sg = self.subgroups[index]
        n = sg.numel
        t0 = time.perf_counter()
        grads = self._grads_fp32(index, slot, inv_scale, clip_coeff)
        t1 = time.perf_counter()
        master = self._adam(index, buffer, grads, hparams)
        self.version[index] = self.step_count
        t2 = time.perf_counter()
        self._write_back(index, master, slot)
        t3 = time.perf_counter()
        with self.stats.lock:
            self.stats.time["convert"] += t1 - t0
            self.stats.time["update"] += t2 - t1
            self.stats.time["writeback"] += t3 - t2
        self._step_counts["cpu_elements"] += n
        self._step_counts["cpu_s"] += t2 - t0

    def _adam(self, index: int, buffer: torch.Tensor, grads: torch.Tensor,
              hparams) -> torch.Tensor:
        """Subgroup ``index``'s Adam step on its state buffer (host or device); its master.

        One function for every tier and updater, so that on a CPU run all of them do the
        same arithmetic (torch's reference AdamW, megatron-core's): bit for bit equal.
        States stored in fp16/bf16 are widened to fp32 for the math and rounded back.
        """
        sg = self.subgroups[index]
        states = self._views(buffer, index)
        on_device = buffer.is_cuda
        for group, offset, length in sg.runs:
            span = slice(offset, offset + length)
            parts = [t[span] if t.dtype == torch.float32 else t[span].float() for t in states]
            if on_device:
                _device_adam(parts[0], grads[span], parts[1], parts[2], self.step_count,
                             hparams[group])
            else:
                adam_update(parts[0], grads[span], parts[1], parts[2], self.step_count,
                            hparams[group], fused=self.fused_adam)
            for state, part in zip(states, parts):
                if state.dtype != torch.float32:
                    state[span].copy_(part)
        return states[0]

    def _device_grads(self, index: int, inv_scale, clip_coeff) -> torch.Tensor:
        """The subgroup's fp32 gradients on the model's device, unscaled and clipped."""
        sg = self.subgroups[index]
        if self._device_grad is None:
            self._device_grad = torch.empty(self.max_numel, dtype=torch.float32,
                                            device=self.device)
        grads = self._device_grad[:sg.numel]
        for piece in sg.pieces:
            src = self.params[piece.param].grad().reshape(-1)
            grads[piece.offset:piece.offset + piece.length].copy_(
                src[piece.start:piece.start + piece.length])
        return unscale_and_clip(grads, inv_scale, clip_coeff)

    def _update_on_device(self, index: int, state: torch.Tensor, hparams, inv_scale,
                          clip_coeff) -> None:
        """The device's update of a state buffer on the device (current stream).

        The gradients never leave it; the new weights go straight into the model's buffer.
        """
        grads = self._device_grads(index, inv_scale, clip_coeff)
        master = self._adam(index, state, grads, hparams)
        self.version[index] = self.step_count
        for piece in self.subgroups[index].pieces:
            self.params[piece.param].out[piece.start:piece.start + piece.length].copy_(
                master[piece.offset:piece.offset + piece.length])

    def _update_streamed(self, index: int, buffer: torch.Tensor, hparams, inv_scale,
                         clip_coeff) -> None:
        """A host subgroup updated by the device: states H2D, fused Adam, states D2H.

        On CUDA the copies run on their own streams (both directions in flight at once,
        two device slots alternating) and nothing here waits for them: the host buffer is
        marked busy until its D2H ends. On the CPU the same steps run in order.
        """
        nbytes = self.sizes[index]
        host = buffer[:nbytes]
        if not self.is_cuda:
            start = time.perf_counter()
            if not self._stream_slots:
                self._stream_slots = [torch.empty(self.buffer_bytes, dtype=torch.uint8,
                                                  device=self.device)]
            slot = self._stream_slots[0][:nbytes]
            slot.copy_(host)
            self._update_on_device(index, slot, hparams, inv_scale, clip_coeff)
            host.copy_(slot)
            self._step_counts["stream_elements"] += self.subgroups[index].numel
            self._step_counts["stream_s"] += time.perf_counter() - start
            return
        k = self._stream_next
        self._stream_next ^= 1
        slot = self._stream_slots[k][:nbytes]
        current = torch.cuda.current_stream(self.device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
        with torch.cuda.stream(self._sh2d):
            if self._slot_free[k] is not None:
                self._sh2d.wait_event(self._slot_free[k])
            marks[0].record(self._sh2d)
            slot.copy_(host, non_blocking=True)
            marks[1].record(self._sh2d)
        current.wait_event(marks[1])
        marks[2].record(current)
        self._update_on_device(index, slot, hparams, inv_scale, clip_coeff)
        marks[3].record(current)
        with torch.cuda.stream(self._sd2h):
            self._sd2h.wait_event(marks[3])
            marks[4].record(self._sd2h)
            host.copy_(slot, non_blocking=True)
            marks[5].record(self._sd2h)
        self._slot_free[k] = marks[5]
        self._busy[index] = marks[5]
        self._stream_marks.append((self.subgroups[index].numel, marks))

    def _observe_stream(self) -> None:
        """Feeds the last step's measured update throughputs to the split model."""
        counts = self._step_counts
        stream_elements, stream_s = counts["stream_elements"], counts["stream_s"]
        if self._stream_marks:
            # The pipeline runs at its slowest stage: H2D, the device's Adam, or D2H.
            stages = [0.0, 0.0, 0.0]
            for elements, marks in self._stream_marks:
                marks[5].synchronize()
                stream_elements += elements
                for k in range(3):
                    stages[k] += marks[2 * k].elapsed_time(marks[2 * k + 1]) / 1000
            stream_s = max(stages)
            self._stream_marks = []
        self.rates.observe(counts["cpu_elements"], counts["cpu_s"], stream_elements, stream_s)
        self._step_counts = {"cpu_elements": 0, "cpu_s": 0.0, "stream_elements": 0,
                             "stream_s": 0.0}

    def stream_share(self) -> float:
        """The share of the host subgroups' elements the device updates this step."""
        if not self.cfg.offload_gpu_update:
            return 0.0
        forced = self._hooks.stream_share
        if forced is not None:
            return forced
        if not self.is_cuda:
            # The "device" is the CPU itself: streaming would only add copies.
            return 0.0
        return self.rates.share()

    def plan(self, order: Sequence[int]) -> Dict[int, Updater]:
        """Who updates each subgroup this step (the tier model's decision)."""
        hosted = [i for i in order if i not in self._device_set]
        streamed = split_updates([self.subgroups[i].numel for i in hosted],
                                 self.stream_share())
        plan = {i: Updater.DEVICE for i in self._device_set}
        plan.update({i: Updater.STREAM if s else Updater.CPU for i, s in zip(hosted, streamed)})
        return plan

    def _write_back(self, index: int, master: torch.Tensor, slot: int) -> None:
        """New weights into the model's param buffer, in the model's dtype."""
        sg = self.subgroups[index]
        if not self.is_cuda:
            for piece in sg.pieces:
                self.params[piece.param].out[piece.start:piece.start + piece.length].copy_(
                    master[piece.offset:piece.offset + piece.length])
            return
        if self._out_events[slot] is not None:
            self._out_events[slot].synchronize()
        stage = self._out_stage[slot][:sg.numel]
        with torch.cuda.stream(self._h2d):
            stage.copy_(master, non_blocking=True)
            for piece in sg.pieces:
                self.params[piece.param].out[piece.start:piece.start + piece.length].copy_(
                    stage[piece.offset:piece.offset + piece.length], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._h2d)
        self._out_events[slot] = event

    def write_all_params(self) -> None:
        """Copies every fp32 master into the model (used after a load)."""
        for index in range(len(self.subgroups)):
            master = self._views(self._acquire_sync(index), index)[0]
            if index in self._device_set:
                for piece in self.subgroups[index].pieces:
                    self.params[piece.param].out[piece.start:piece.start + piece.length].copy_(
                        master[piece.offset:piece.offset + piece.length])
                continue
            self._write_back(index, master, 0)
            if self.is_cuda:
                torch.cuda.current_stream(self.device).wait_stream(self._h2d)
                self._out_events[0].synchronize()
        self.wait_io()

    # ----------------------------------------------------------------- checkpoints

    def save(self, directory: str, extra: dict) -> None:
        """Puts this rank's state files under ``directory`` with a manifest.

        Cached subgroups are written there directly; the others are hard-linked from their
        path (a tier file is never rewritten in place while linked: the io layer recycles
        only replaced files that nothing else links), or copied where a link is impossible
        (another file system).
        """
        if not self.initialized:
            self.initialize_from_model()
        self.wait_io()
        rank_dir = os.path.join(directory, f"rank{self.rank:05d}")
        secure_makedirs(rank_dir)
        entries = []
        staging = None
        for index, sg in enumerate(self.subgroups):
            name = f"sg{index:05d}.state"
            target = os.path.join(rank_dir, name)
            if index in self._device_set or index in self.cache:
                if index in self._device_set:
                    buffer = self._device_state(index)
                    if buffer.is_cuda:
                        if staging is None:
                            staging = aligned_empty(self.buffer_bytes, pin=True)
                        staging[:self.sizes[index]].copy_(buffer)
                        buffer = staging
                else:
                    buffer = self.cache.get(index).buffer
                self.io.write(target, buffer[:self.sizes[index]], rank=self.rank,
                              subgroup=index, elements=sg.numel, step=self.version[index])
                how = "written"
            else:
                source = self._file(index, self.location[index])
                try:
                    os.link(source, target)
                    how = "linked"
                except OSError:
                    shutil.copyfile(source, target)
                    with open(target, "rb") as f:
                        os.fsync(f.fileno())
                    how = "copied"
            entries.append({"subgroup": index, "elements": sg.numel, "file": name, "how": how})
        manifest = {"version": MANIFEST_VERSION, "rank": self.rank, "step": self.step_count,
                    "fingerprint": self.fingerprint,
                    "subgroup_size": self.cfg.offload_subgroup_size,
                    "checksum": self.cfg.offload_checksum, "state_dtypes": self.layout.names,
                    "subgroups": entries, **extra}
        _write_json_atomic(os.path.join(rank_dir, "manifest.json"), manifest)

    def load(self, directory: str, expect: dict) -> None:
        """Restores this rank's state from a checkpoint's offload directory."""
        rank_dir = os.path.join(directory, f"rank{self.rank:05d}")
        manifest_path = os.path.join(rank_dir, "manifest.json")
        if not os.path.isfile(manifest_path):
            raise UsageError(f"checkpoint has no offloaded optimizer state for rank {self.rank} "
                             f"({manifest_path} missing): it was saved with another world size "
                             "or without --offload-optimizer; use --no-load-optim to start the "
                             "optimizer fresh")
        with open(manifest_path) as f:
            manifest = json.load(f)
        for key, value in expect.items():
            if manifest.get(key) != value:
                raise UsageError(
                    f"{manifest_path}: saved with {key}={manifest.get(key)}, this run has "
                    f"{value}: resume with the same parallel layout, or --no-load-optim")
        if manifest.get("fingerprint") != self.fingerprint:
            raise UsageError(
                f"{manifest_path}: the optimizer shard layout differs (model, parallel layout or "
                "--offload-subgroup-size changed): resume with the same settings, or "
                "--no-load-optim")
        saved_dtypes = manifest.get("state_dtypes", ["fp32", "fp32", "fp32"])
        if saved_dtypes != self.layout.names:
            raise UsageError(
                f"{manifest_path}: optimizer states saved as {'/'.join(saved_dtypes)} "
                f"(master/exp_avg/exp_avg_sq), this run stores {'/'.join(self.layout.names)}: "
                "resume with the same --main-params-dtype/--exp-avg-dtype/--exp-avg-sq-dtype, "
                "or --no-load-optim")
        self.wait_io()
        for index in list(range(len(self.subgroups))):
            if index in self.cache:
                self.cache.release(self.cache.pop(index).buffer)
        self.step_count = manifest["step"]
        self.location = [None] * len(self.subgroups)
        self.version = [self.step_count] * len(self.subgroups)
        saved_checksum = manifest.get("checksum", self.cfg.offload_checksum)
        reader = StateFileIO(threads=self.cfg.offload_io_threads,
                             direct_io=self.cfg.offload_direct_io, checksum=saved_checksum)

        def source(index: int, buffer: torch.Tensor) -> None:
            sg = self.subgroups[index]
            name = os.path.join(rank_dir, manifest["subgroups"][index]["file"])
            try:
                step = reader.read(name, buffer[:self.sizes[index]], rank=self.rank,
                                   subgroup=index, elements=sg.numel)
            except OffloadStateError as err:
                # The io layer's advice is to resume from a checkpoint: this is one.
                raise OffloadStateError(f"{str(err).split(': ' + RESTART_HINT)[0]}: the "
                                        "checkpoint is damaged; resume from an earlier one, or "
                                        "use --no-load-optim to start the optimizer fresh"
                                        ) from None
            if step != self.step_count:
                raise OffloadStateError(f"{name}: state of step {step}, the manifest says "
                                        f"{self.step_count}: the checkpoint is inconsistent")
        self._fill(source)

    # ----------------------------------------------------------------- metrics, shutdown

    def metrics(self) -> Dict[str, float]:
        """Per-iteration averages since the last call (then reset)."""
        s = self.stats
        steps = max(s.steps, 1)
        # Phases of the main thread (they add up to the optimizer step, less bookkeeping)
        # are *_s; the I/O threads' busy time, which runs alongside, is *_bg_s.
        record = {f"offload/{k}_s": s.time[k] / steps
                  for k in ("stall", "convert", "update", "writeback")}
        record["offload/fetch_bg_s"] = s.time["fetch"] / steps
        record["offload/flush_bg_s"] = s.time["flush"] / steps
        record["offload/lock_wait_bg_s"] = (self.locks.wait_s - self._lock_wait_seen) / steps
        self._lock_wait_seen = self.locks.wait_s
        record["offload/cache_hit_rate"] = s.hits / s.needed if s.needed else 1.0
        host = self.cache.allocated * self.buffer_bytes
        record["offload/host_cache_gib"] = host / 2**30
        record["offload/device_tier_gib"] = self.device_bytes() / 2**30
        # What the tier really holds in GPU memory (the tensors' own device, not the plan).
        record["offload/device_tier_cuda_gib"] = sum(
            t.numel() * t.element_size() for t in self._device_states.values()
            if t.is_cuda) / 2**30
        record["offload/device_subgroups_n"] = len(self.device_members)
        record["offload/device_update_s"] = s.time["device_update"] / steps
        record["offload/stream_issue_s"] = s.time["stream_issue"] / steps
        record["offload/streamed_subgroups"] = s.streamed_subgroups / steps
        record["offload/state_bytes_per_element"] = self.layout.bytes_per_element
        total_bytes = 0
        for i in range(len(self.tiers)):
            moved = s.read_bytes[i] + s.write_bytes[i]
            total_bytes += moved
            record[f"offload/path{i}_bytes"] = moved / steps
            record[f"offload/path{i}_read_bytes"] = s.read_bytes[i] / steps
            record[f"offload/path{i}_write_bytes"] = s.write_bytes[i] / steps
            record[f"offload/path{i}_read_gbps"] = (s.read_bytes[i] / s.read_s[i] / 1e9
                                                    if s.read_s[i] else 0.0)
            record[f"offload/path{i}_write_gbps"] = (s.write_bytes[i] / s.write_s[i] / 1e9
                                                     if s.write_s[i] else 0.0)
            record[f"offload/path{i}_subgroups"] = sum(1 for h in self.home if h == i)
        record["offload/io_bytes"] = total_bytes / steps
        s.reset()
        return record

    def close(self, remove_files: bool = True) -> None:
        """Stops the threads and removes this rank's tier files."""
        with contextlib.suppress(Exception):
            self.wait_io()
        self._io_pool.shutdown(wait=True)
        self._flush_pool.shutdown(wait=True)
        self._device_states.clear()
        self.jobdirs.close(remove=remove_files)
        self.locks.close()


def _gb(nbytes: float) -> str:
    """Bytes as GB for messages: two decimals, or three significant digits below 0.01."""
    value = nbytes / 1e9
    return f"{value:.2f}" if value >= 0.01 else f"{value:.3g}"


def _write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _device_adam(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, step: int, hp: dict) -> None:
    """Torch's fused CUDA AdamW in place, queued on the current stream without a host sync.

    Like :func:`megatron_ext.optim.adamw.adam_update` for CUDA tensors, but the step
    tensor is made on the device by a fill kernel: a host-to-device copy of it would wait
    for the stream and serialize the GPU's work with the CPU Adam running meanwhile.
    """
    if master.numel() == 0:
        return
    from torch.optim.adam import adam

    beta1, beta2 = hp["betas"]
    step_tensor = torch.full((), float(step - 1), dtype=torch.float32, device=master.device)
    adam([master], [grad], [exp_avg], [exp_avg_sq], [], [step_tensor], foreach=False,
         fused=True, capturable=False, differentiable=False, has_complex=False,
         amsgrad=False, beta1=beta1, beta2=beta2, lr=hp["lr"],
         weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False,
         decoupled_weight_decay=True)
