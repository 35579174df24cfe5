"""The store of one rank's subgroup states: host buffers, device states and files.

:class:`SubgroupStore` keeps each subgroup's bytes where the tier plan says: a device
tensor (the device tier), a buffer of the host cache (:mod:`.cache`), a file on one of the
paths (:mod:`.io`, under this job's directories, :mod:`.jobdir`), or both a buffer and a
file. It reads and writes the files (checksummed, one I/O operation per path and node at a
time, :mod:`.locks`), spills a write to another path when a path fails, counts bytes and
seconds for the metrics and the rebalancer, traces each operation for the tests, and runs
the fetches and flushes of the pipeline on its own threads. The test suite's faults
(:mod:`megatron_ext.runtime.faults`) are injected here, where the I/O happens.
"""

from __future__ import annotations

import contextlib
import errno
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
from megatron_ext.offload.blockio import aligned_empty
from megatron_ext.offload.cache import Entry, HostCache
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.io import StateFileIO
from megatron_ext.offload.jobdir import JobDirs
from megatron_ext.offload.locks import NodeLocks
from megatron_ext.offload.paths import TierSpec, check_free_space
from megatron_ext.offload.plan import TierPlan
from megatron_ext.offload.state_format import OffloadStateError, secure_makedirs
from megatron_ext.offload.states import StateLayout
from megatron_ext.offload.subgroups import Subgroup
from megatron_ext.runtime.faults import Faults, crash_point

log = logging.getLogger(__name__)

# Errors of a path (not of the data) after which a write may go to another path.
_PATH_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.ENOENT, errno.EROFS, errno.EACCES,
                errno.EIO, errno.ENOTDIR, errno.ESTALE}


class StepStats:
    """Seconds and bytes of one logging interval (the engine's metrics)."""

    def __init__(self, n_paths: int):
        self.lock = threading.Lock()
        self.n_paths = n_paths
        self.reset()

    def reset(self) -> None:
        """Starts a new interval."""
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
        """Adds ``seconds`` to phase ``key`` (from any thread)."""
        with self.lock:
            self.time[key] += seconds

    def path_metrics(self, steps: int, subgroups: Sequence[int]) -> Dict[str, float]:
        """Per-step bytes and GB/s of each path, ``subgroups`` placed on each, total bytes."""
        record: Dict[str, float] = {}
        total_bytes = 0
        for i in range(self.n_paths):
            moved = self.read_bytes[i] + self.write_bytes[i]
            total_bytes += moved
            record[f"offload/path{i}_bytes"] = moved / steps
            record[f"offload/path{i}_read_bytes"] = self.read_bytes[i] / steps
            record[f"offload/path{i}_write_bytes"] = self.write_bytes[i] / steps
            record[f"offload/path{i}_read_gbps"] = (self.read_bytes[i] / self.read_s[i] / 1e9
                                                    if self.read_s[i] else 0.0)
            record[f"offload/path{i}_write_gbps"] = (
                self.write_bytes[i] / self.write_s[i] / 1e9 if self.write_s[i] else 0.0)
            record[f"offload/path{i}_subgroups"] = subgroups[i]
        record["offload/io_bytes"] = total_bytes / steps
        return record


class SubgroupStore:
    """Where each subgroup's state is, and the reads, writes and moves that keep it there.

    Attributes:
        cache: the host cache of subgroup buffers.
        location: the path of each subgroup's current file (None: never written).
        version: the step of the state each subgroup's file holds (checked on every read).
        step_count: the optimizer step the states are at (the faults go by it).
        rank_dirs: this rank's directory on each path.
    """

    def __init__(self, cfg: OffloadConfig, tiers: Sequence[TierSpec], jobdirs: JobDirs,
                 plan: TierPlan, *, rank: int, device: torch.device,
                 subgroups: Sequence[Subgroup], layout: StateLayout, stats: StepStats,
                 faults: Faults, wait_readers: Callable[[], None] = lambda: None):
        """Opens the store over checked and locked job directories.

        Args:
            cfg: the engine's config (I/O threads, O_DIRECT, checksum, locks, trace).
            tiers: the paths.
            jobdirs: this rank's directories on them (the store closes them).
            plan: the tier plan (placement, device tier, capacity of the host cache).
            rank: this rank.
            device: the model's device (pinned host buffers when it is a GPU).
            subgroups: the rank's subgroups.
            layout: the dtypes of the states.
            stats: the metrics' counters.
            faults: the test suite's injected faults (none by default).
            wait_readers: waits until no copy still reads a host state buffer (the new
                masters crossing to the device); called before a buffer is reused.
        """
        self.tiers = list(tiers)
        self.plan = plan
        self.rank, self.device = rank, device
        self.is_cuda = device.type == "cuda"
        self.subgroups, self.layout = list(subgroups), layout
        # Bytes of each subgroup's state (its file's payload), in the layout's dtypes.
        self.sizes = [layout.nbytes(sg.numel) for sg in self.subgroups]
        self.buffer_bytes = layout.nbytes(max((sg.numel for sg in self.subgroups), default=0))
        self.stats = stats
        self.faults = faults
        self.step_count = 0
        self._trace_path = cfg.offload_trace
        self._wait_readers = wait_readers
        self.io = StateFileIO(threads=cfg.offload_io_threads, direct_io=cfg.offload_direct_io,
                              checksum=cfg.offload_checksum)
        # One I/O operation per path at a time on this node (its threads inside it).
        self.locks = NodeLocks(enabled=cfg.offload_concurrency_control)
        # DIR/megatron_ext-USER/JOB/rankNNNNN per path: checked, locked (see jobdir.py).
        self.jobdirs = jobdirs
        self.rank_dirs = jobdirs.rank_dirs
        self.bad_paths: set = set()
        self.location: List[Optional[int]] = [None] * len(self.subgroups)
        self.version: List[int] = [0] * len(self.subgroups)
        self.cache = HostCache(plan.capacity, self._alloc_state)
        self._device_states: Dict[int, torch.Tensor] = {}
        self._flushes: List[Future] = []
        self._flushing: Dict[int, Future] = {}
        """Each subgroup's latest flush (done or not): a fetch of it waits for that write."""
        self._io_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offload-fetch")
        self._flush_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offload-flush")
        self._busy: Dict[int, object] = {}
        """Host buffers a streamed update is still copying into (CUDA events)."""

    # ----------------------------------------------------------------- buffers

    def _alloc_state(self) -> torch.Tensor:
        return aligned_empty(self.buffer_bytes, dtype=torch.uint8, pin=self.is_cuda)

    def views(self, buffer: torch.Tensor, index: int) -> List[torch.Tensor]:
        """[master, exp_avg, exp_avg_sq] of subgroup ``index`` in a state buffer."""
        return self.layout.views(buffer, self.subgroups[index].numel)

    def device_state(self, index: int) -> torch.Tensor:
        """Subgroup ``index``'s state on the model's device (allocated on first use)."""
        state = self._device_states.get(index)
        if state is None:
            state = torch.empty(self.sizes[index], dtype=torch.uint8, device=self.device)
            self._device_states[index] = state
        return state

    def device_state_bytes(self) -> int:
        """Bytes the device tier really holds in GPU memory (the tensors' own device)."""
        return sum(t.numel() * t.element_size() for t in self._device_states.values()
                   if t.is_cuda)

    def _drop_buffer(self, buffer: torch.Tensor) -> None:
        """A host buffer no subgroup needs: freed when the cache has no fixed budget."""
        if self.cache.capacity is None:
            self.cache.discard(buffer)
        else:
            self.cache.release(buffer)

    def drop_cached(self) -> None:
        """Empties the host cache without writing anything (its states are replaced)."""
        for index in list(range(len(self.subgroups))):
            if index in self.cache:
                self.cache.release(self.cache.pop(index).buffer)

    def forget_files(self, step: int) -> None:
        """No subgroup has a file now; the states about to be filled are of ``step``."""
        self.location = [None] * len(self.subgroups)
        self.version = [step] * len(self.subgroups)

    # ----------------------------------------------------------------- files

    def file(self, subgroup: int, path: int, kind: str = "state") -> str:
        """The file of a subgroup's ``kind`` ("state" or "grad") on path ``path``."""
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

    def read(self, subgroup: int, buffer: torch.Tensor, kind: str = "state",
             path: Optional[int] = None) -> None:
        """Reads a subgroup's file into ``buffer``: its state, or its gradients from ``path``."""
        crash_point("offload-io")
        if kind == "state":
            path = self.location[subgroup]
        sg = self.subgroups[subgroup]
        out = buffer[:self.sizes[subgroup]] if kind == "state" else buffer[:sg.numel]
        name = self.file(subgroup, path, kind)
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

    def write(self, subgroup: int, buffer: torch.Tensor, kind: str = "state") -> int:
        """Writes a subgroup's file to its home path; spills to another path on a path error.

        Returns:
            The path the file is on.
        """
        crash_point("offload-io")
        sg = self.subgroups[subgroup]
        payload = buffer[:self.sizes[subgroup]] if kind == "state" else buffer[:sg.numel]
        nbytes = payload.numel() * payload.element_size()
        if kind == "state" and subgroup in self.plan.resident:
            raise RuntimeError(f"offload: subgroup {subgroup} lives in the host cache only")
        while True:
            path = self.plan.home[subgroup]
            name = self.file(subgroup, path, kind)
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
        if kind == "state":
            old = self.location[subgroup]
            self.location[subgroup] = path
            if old is not None and old != path:
                with contextlib.suppress(OSError):
                    os.unlink(self.file(subgroup, old, kind))
        return path

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
        self.plan.observe_io(path, nbytes, seconds)

    def _spill(self, subgroup: int, path: int, nbytes: int, err: OSError) -> None:
        """Moves a subgroup's home off a failing path, or fails loudly."""
        self.bad_paths.add(path)
        for other in range(len(self.tiers)):
            if other in self.bad_paths:
                continue
            try:
                secure_makedirs(self.rank_dirs[other])
                free = check_free_space(self.tiers[other].path, nbytes)
            except (OSError, UsageError):
                self.bad_paths.add(other)
                continue
            if free >= 2 * nbytes:
                log.warning("offload: writing subgroup %d of rank %d to %s failed (%s); it and "
                            "the other subgroups of that path now go to %s", subgroup, self.rank,
                            self.tiers[path].path, err.strerror, self.tiers[other].path)
                self.plan.evacuate(path, other)
                return
        raise OffloadStateError(
            f"offload: cannot write the state of subgroup {subgroup} of rank {self.rank} "
            f"({nbytes / 1e6:.0f} MB): {self.tiers[path].path}: {err.strerror}, and no other "
            "--offload-paths has room; the last checkpoint is intact: free space or add a path "
            "and resume with --load")

    # ----------------------------------------------------------------- injected faults

    def start_step(self) -> None:
        """The faults of the start of a step (``vanish``: a rank directory disappears)."""
        for index, step in self.faults.get("vanish"):
            if int(step) == self.step_count:
                shutil.rmtree(self.rank_dirs[int(index)], ignore_errors=True)

    def _inject_write_faults(self, name: str, path: int, payload: torch.Tensor) -> None:
        if not self.faults.rules:
            return
        for (index,) in self.faults.get("enospc"):
            if int(index) == path:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        for (step,) in self.faults.get("kill-in-flush"):
            if self.step_count >= int(step):
                partial = f"{os.path.dirname(name)}/.{os.path.basename(name)}.tmp-{os.getpid()}-k"
                with open(partial, "wb") as f:
                    f.write(payload.view(torch.uint8).numpy()[:payload.numel() * 2].tobytes())
                    f.flush()
                    os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)

    def _inject_corruption(self, name: str) -> None:
        for (step,) in self.faults.get("corrupt-after-flush"):
            if self.step_count == int(step):
                with open(name, "r+b") as f:
                    f.seek(4096 + 100)
                    byte = f.read(1)
                    f.seek(4096 + 100)
                    f.write(bytes([byte[0] ^ 0x40]))

    def _throttle(self, path: int, start: float) -> None:
        for index, factor, step in self.faults.get("slow"):
            if int(index) == path and self.step_count >= int(step):
                time.sleep((float(factor) - 1.0) * (time.perf_counter() - start))

    # ----------------------------------------------------------------- fetch and flush

    def take_buffer(self, protect: Sequence[int]) -> tuple:
        """A free state buffer, and the flush that must finish before it is reused."""
        if self.cache.can_allocate():
            return self.cache.allocate(), None
        victim = self.cache.victim([*protect, *self.plan.resident])
        if victim is None:
            raise RuntimeError("offload cache has no evictable buffer (capacity too small)")
        entry = self.cache.pop(victim)
        self.settle(victim)
        # Its masters may still be crossing to the device.
        self._wait_readers()
        if not entry.dirty:
            return entry.buffer, None
        flush = self._flush_pool.submit(self.write, victim, entry.buffer)
        self._flushes.append(flush)
        self._flushing[victim] = flush
        return entry.buffer, flush

    def start_fetch(self, subgroup: int, protect: Sequence[int]) -> Future:
        """Reads subgroup ``subgroup``'s file into a free buffer on the fetch thread.

        The read waits for the flush of the buffer it reuses, and for a flush of the
        subgroup's own newer state that may still be under way: a subgroup evicted at the
        end of one step can be fetched again at the start of the next, and reading its file
        before that write lands would read the previous step's state.
        """
        buffer, flush = self.take_buffer(protect)
        own = self._flushing.get(subgroup)

        def fetch() -> torch.Tensor:
            for pending in (flush, own):
                if pending is not None:
                    pending.result()
            self.read(subgroup, buffer)
            return buffer
        return self._io_pool.submit(fetch)

    def mark_busy(self, index: int, event: object) -> None:
        """A device copy into subgroup ``index``'s host buffer ends at ``event``."""
        self._busy[index] = event

    def settle(self, index: int) -> None:
        """Waits until no streamed update is still copying into subgroup ``index``'s buffer."""
        event = self._busy.pop(index, None)
        if event is not None:
            event.synchronize()

    def wait_io(self) -> None:
        """Waits for every background flush; raises the first error one of them hit."""
        for index in list(self._busy):
            self.settle(index)
        flushes, self._flushes = self._flushes, []
        self._flushing = {}
        for flush in flushes:
            flush.result()

    def acquire(self, index: int) -> torch.Tensor:
        """Subgroup ``index``'s state buffer: its device state, or a host buffer (fetched)."""
        if self.plan.on_device(index):
            return self.device_state(index)
        if index in self.cache:
            self.settle(index)
            return self.cache.get(index).buffer
        buffer = self.start_fetch(index, protect=(index,)).result()
        self.cache.insert(index, buffer, dirty=False)
        return buffer

    def entry(self, index: int, pending: Dict[int, Future]) -> Entry:
        """Subgroup ``index``'s cache entry for its update: prefetched, cached or read now."""
        wait = time.perf_counter()
        self.stats.needed += 1
        if index in pending:
            buffer = pending.pop(index).result()
            self.cache.insert(index, buffer, dirty=False)
        elif index in self.cache:
            self.stats.hits += 1
        else:
            self.acquire(index)
        self.stats.add("stall", time.perf_counter() - wait)
        entry = self.cache.get(index)
        self.settle(index)
        return entry

    # ----------------------------------------------------------------- filling and moving

    def fill(self, sources: Callable[[int, torch.Tensor], None], order: Sequence[int],
             before: Optional[Callable[[int], None]] = None, device_direct: bool = False,
             device_slot: Optional[torch.Tensor] = None) -> None:
        """Fills every subgroup's state in ``order``, writing out what the cache cannot keep.

        ``sources(index, buffer)`` writes subgroup ``index``'s state into a host buffer, or
        with ``device_direct`` into a buffer on the device (a source of torch ops on device
        data: the model's weights): a device-tier subgroup's device state itself, and,
        given ``device_slot`` (a device buffer of ``buffer_bytes``: the streamed update's
        slot, so no memory beyond what the plan counts), a host subgroup's state is built
        there and copied to its pinned host buffer once: no pageable round trip per piece,
        no encoding on the host (the Llama-3-8B first step spent ~1.5 s per 1 GB subgroup
        so, 129 s for 81 subgroups). Without a slot (CPU updates only) the host builds it.
        ``before(index)``, if given, is called first (a source frees what it no longer
        needs before the buffer is taken).
        """
        staging = None
        build = device_slot if device_direct else None  # None: in the host buffer itself
        for index in order:
            if before is not None:
                before(index)
            if self.plan.on_device(index) and device_direct:
                sources(index, self.device_state(index))
                continue
            if self.plan.on_device(index):
                # Through one host buffer: the sources write host memory.
                if staging is None:
                    staging = aligned_empty(self.buffer_bytes, pin=self.is_cuda)
                sources(index, staging)
                self.device_state(index).copy_(staging[:self.sizes[index]])
                continue
            buffer, flush = self.take_buffer(protect=())
            if flush is not None:
                flush.result()
            if build is not None:
                size = self.sizes[index]
                sources(index, build[:size])
                buffer[:size].copy_(build[:size])  # synchronous: the slot is reused next
            else:
                sources(index, buffer)
            self.cache.insert(index, buffer, dirty=True)
        self.wait_io()

    def promote(self, index: int) -> None:
        """Moves subgroup ``index``'s state up to the device (its host buffer and file go)."""
        buffer = self.acquire(index)
        self.settle(index)
        self.device_state(index).copy_(buffer[:self.sizes[index]])
        self._drop_buffer(self.cache.pop(index).buffer)
        if self.location[index] is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.file(index, self.location[index]))
            self.location[index] = None

    def demote(self, index: int) -> bool:
        """Moves subgroup ``index``'s device state into the host cache (gives memory back).

        Returns:
            Whether it had a state to move (none before the states are filled).
        """
        state = self._device_states.pop(index, None)
        if state is None:
            return False
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        buffer, flush = self.take_buffer(protect=())
        if flush is not None:
            flush.result()
        buffer[:self.sizes[index]].copy_(state)
        self.cache.insert(index, buffer, dirty=True)
        return True

    def close(self, remove_files: bool = True) -> None:
        """Stops the threads, frees the device states, lets go of the job directories."""
        with contextlib.suppress(Exception):
            self.wait_io()
        self._io_pool.shutdown(wait=True)
        self._flush_pool.shutdown(wait=True)
        self._device_states.clear()
        self.jobdirs.close(remove=remove_files)
        self.locks.close()
