"""The virtual third tier: tier specs, a bandwidth probe, placement and rebalancing.

``--offload-paths`` names several directories (node-local NVMe, parallel-file-system
scratch, ...) that together hold the optimizer-state subgroups the host cache cannot. Each
step every non-cached subgroup is read once and written once, so a path's useful speed is
its *effective* bandwidth for one read plus one write of the same bytes, and the step's
I/O ends when the slowest path (relative to what it holds) ends.

This module keeps the decisions apart from the I/O:

* :func:`parse_tier_spec` / :func:`format_tier_spec`: ``DIR[@READ_GBPS[,WRITE_GBPS]]``;
* :func:`probe_bandwidth`: the one function here that does I/O (a short read/write probe);
* :func:`place_subgroups`: MLP-Offload's bandwidth-proportional placement
  (T_i = M * B_i / sum B), interleaved, with optional per-path capacity;
* :class:`Rebalancer`: beyond the paper, moves subgroups off a path whose observed
  throughput drops (contention), with hysteresis; it is fed timings, it reads no clock;
* :func:`check_free_space`: the "clear error before any state is lost" check.

Units: bandwidths in GB/s (10**9 bytes per second); sizes in bytes; the probe's sizes in
MiB (2**20 bytes), because O_DIRECT needs block-aligned transfers.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import math
import mmap
import os
import secrets
import shutil
import statistics
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import List, Optional, Sequence, Tuple

from megatron_ext.errors import UsageError

__all__ = [
    "TierSpec",
    "TierFullError",
    "ProbeResult",
    "Rebalancer",
    "parse_tier_spec",
    "format_tier_spec",
    "probe_bandwidth",
    "probe_plan",
    "place_subgroups",
    "check_free_space",
    "PLACEMENT_POLICIES",
    "TierKind",
    "Tier",
    "Updater",
    "UpdateRates",
    "device_budget",
    "fixed_device_subgroups",
    "resize_device_tier",
    "split_updates",
    "stream_rate",
    "stream_share",
]

PLACEMENT_POLICIES = ("bandwidth", "round-robin")
_GB = 1e9
_MIB = 1 << 20
_BANDWIDTH_FORMAT = "bandwidths must be positive numbers in GB/s, as DIR@READ_GBPS,WRITE_GBPS"


class TierFullError(UsageError):
    """The tier paths lack the free space that the subgroups need.

    Attributes:
        needed_bytes: the bytes that had to fit (all subgroups, or the one that did not).
        free_bytes: the free bytes of each path considered (``None``: unlimited).
    """

    def __init__(self, message: str, needed_bytes: int,
                 free_bytes: Sequence[Optional[int]]):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = list(free_bytes)


# ------------------------------------------------------------------------ tier specs


@dataclass
class TierSpec:
    """One directory of the virtual tier and its bandwidths, when known.

    Attributes:
        path: the directory that holds this tier's subgroup files.
        read_gbps: sequential read bandwidth in GB/s; ``None`` until given or probed.
        write_gbps: sequential write bandwidth in GB/s; ``None`` until given or probed.
    """

    path: str
    read_gbps: Optional[float] = None
    write_gbps: Optional[float] = None

    def __post_init__(self):
        for name in ("read_gbps", "write_gbps"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"TierSpec.{name} must be a positive number, got {value!r}")

    @property
    def effective_gbps(self) -> Optional[float]:
        """GB/s for one read plus one write of the same bytes: 1 / (1/R + 1/W).

        This is what a step costs per subgroup byte on this path (read, update, write
        back); ``None`` unless both bandwidths are known.
        """
        if self.read_gbps is None or self.write_gbps is None:
            return None
        return 1.0 / (1.0 / self.read_gbps + 1.0 / self.write_gbps)


def parse_tier_spec(text: str, flag: str = "--offload-paths") -> TierSpec:
    """Parses one ``--offload-paths`` item: ``DIR``, ``DIR@GBPS`` or ``DIR@READ,WRITE``.

    The text is split at its last ``@``. What follows is a bandwidth spec unless it
    contains a ``/``: then the ``@`` belongs to the directory (``/scratch/u@site/run``).
    A directory whose *last* component contains ``@`` is written with a trailing ``/``
    (``/scratch/u@site/``, or ``/scratch/u@site/@2,1`` with bandwidths);
    :func:`format_tier_spec` does so. One number means read = write.

    Args:
        text: the item as given on the command line.
        flag: the flag named in error messages.

    Returns:
        The spec; bandwidths are ``None`` when not given.

    Raises:
        UsageError: empty directory, or bandwidths that are not positive finite numbers.
    """
    if not text.strip():
        raise UsageError(f"{flag}: empty directory name")
    head, sep, tail = text.rpartition("@")
    if not sep or "/" in tail:
        return TierSpec(path=text)
    if not head:
        raise UsageError(f"{flag} {text}: missing directory before '@' "
                         "(expected DIR@READ_GBPS,WRITE_GBPS)")
    parts = tail.split(",")
    values = [_positive_float(part) for part in parts]
    if len(parts) > 2 or any(value is None for value in values):
        hint = ""
        if not any(ch.isdigit() for ch in tail):
            hint = " (a directory whose name contains '@' is written with a trailing '/')"
        raise UsageError(f"{flag} {text}: {_BANDWIDTH_FORMAT}{hint}")
    read_gbps = values[0]
    write_gbps = values[1] if len(values) == 2 else read_gbps
    return TierSpec(path=head, read_gbps=read_gbps, write_gbps=write_gbps)


def format_tier_spec(spec: TierSpec) -> str:
    """The ``--offload-paths`` item that :func:`parse_tier_spec` reads back as ``spec``.

    Bandwidths are written with 2 decimals (3 significant digits below 0.01 GB/s, so that a
    slow path is not written as the invalid 0.00), and only when both are known.
    """
    path = spec.path
    if "@" in path and "/" not in path.rpartition("@")[2]:
        path += "/"
    if spec.read_gbps is None or spec.write_gbps is None:
        return path
    return f"{path}@{_format_gbps(spec.read_gbps)},{_format_gbps(spec.write_gbps)}"


def _format_gbps(value: float) -> str:
    return f"{value:.2f}" if value >= 0.01 else f"{value:.3g}"


def _positive_float(text: str) -> Optional[float]:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


# ------------------------------------------------------------------------ bandwidth probe


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe_bandwidth` measured.

    Attributes:
        read_gbps: read bandwidth in GB/s, with the file not in the page cache.
        write_gbps: write bandwidth in GB/s, fsync included.
        direct_io_used: whether O_DIRECT was used (asked for and supported by the path).
        size_mb: MiB written and read back (per pass).
        repeats: passes measured; the bandwidths are the medians of the passes.
    """

    read_gbps: float
    write_gbps: float
    direct_io_used: bool
    size_mb: int
    repeats: int = 1

    def tier_spec(self, path: str) -> TierSpec:
        """A :class:`TierSpec` for ``path`` with these bandwidths."""
        return TierSpec(path, self.read_gbps, self.write_gbps)


# At most this many MiB per probe pass: the default subgroup (1.2 GB of state) would make
# the start-up probe (3 passes, each written and read) take longer than it is worth.
PROBE_MAX_MB = 128
PROBE_BLOCK_MB = 8  # the engine's chunk (io.MIN_CHUNK) for files up to 2 GiB
PROBE_REPEATS = 3


def probe_plan(subgroup_size: int, bytes_per_element: int = 12) -> Tuple[int, int]:
    """(size_mb, block_mb) of a start-up probe that moves data as the engine will.

    The engine moves one subgroup's state file per transfer, in chunks of 8 MiB (one
    chunk for a smaller file) split over its I/O threads: a probe pass is one such file,
    capped at PROBE_MAX_MB, so a run with tiny subgroups (the CPU tests) probes briefly.

    >>> probe_plan(100_000_000)
    (128, 8)
    >>> probe_plan(10_000)
    (1, 1)
    """
    size_mb = min(PROBE_MAX_MB, max(1, -(-subgroup_size * bytes_per_element // _MIB)))
    return size_mb, min(PROBE_BLOCK_MB, size_mb)


def probe_bandwidth(path: str, size_mb: int = 256, block_mb: int = 8, threads: int = 4,
                    direct_io: bool = False, repeats: int = 1) -> ProbeResult:
    """Measures the sequential write and read bandwidth of the directory ``path``.

    A file of ``size_mb`` MiB is written by ``threads`` threads (each a contiguous range, in
    ``block_mb`` MiB ``pwrite`` calls from a page-aligned buffer of random bytes, so that a
    compressing file system cannot shortcut it) and fsynced; then read back the same way.
    Without O_DIRECT the file's pages are dropped from the page cache after the fsync, so
    the read measures the device rather than memory (on tmpfs memory *is* the device).
    With ``repeats`` > 1 the write and read are repeated on the same file (later writes
    overwrite its blocks, as the engine overwrites its recycled state files) and each
    bandwidth is the median of the passes: one pass read 0.38-1.62 GB/s on one disk from
    run to run.

    The file is created with mode 0600, ``O_EXCL | O_NOFOLLOW``, under a random name, and
    unlinked right after it is opened: the probe works on the open descriptor, so neither
    an error (ENOSPC, EIO), Ctrl-C nor even SIGKILL leaves a file behind (NFS shows a
    ``.nfs*`` name until the descriptor closes).

    Args:
        path: an existing, writable directory.
        size_mb: MiB to write and read; rounded up to whole blocks.
        block_mb: MiB per ``pwrite``/``preadv`` call.
        threads: concurrent I/O threads, as the offload engine uses several per file.
        direct_io: use O_DIRECT when the file system supports it; otherwise (EINVAL, as
            on some tmpfs and network file systems) buffered I/O, reported in the result.
        repeats: passes to measure (the result is their median).

    Returns:
        The bandwidths, whether O_DIRECT was used, and the size probed.

    Raises:
        ValueError: a size, block or thread count below 1.
        OSError: the directory cannot be written or read (ENOENT, EACCES, ENOSPC, ...).
    """
    for name, value in (("size_mb", size_mb), ("block_mb", block_mb), ("threads", threads),
                        ("repeats", repeats)):
        if value < 1:
            raise ValueError(f"probe_bandwidth: {name} must be >= 1, got {value}")
    block = block_mb * _MIB
    num_blocks = -(-size_mb * _MIB // block)
    total = num_blocks * block
    name = os.path.join(path, f".probe_tiers-{os.getpid()}-{secrets.token_hex(6)}.tmp")
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.unlink(name)
        use_direct = direct_io and _set_direct(fd, True)
        source = mmap.mmap(-1, block)
        try:
            source.write(os.urandom(block))
            passes = []
            for _ in range(repeats):
                try:
                    passes.append(_probe_fd(fd, source, block, num_blocks, threads, use_direct))
                except OSError as err:
                    # Some file systems accept the O_DIRECT flag and reject the first transfer.
                    if not (use_direct and err.errno == errno.EINVAL):
                        raise
                    _set_direct(fd, False)
                    use_direct = False
                    passes.append(_probe_fd(fd, source, block, num_blocks, threads, False))
            write_s = statistics.median(w for w, _ in passes)
            read_s = statistics.median(r for _, r in passes)
        finally:
            _close_buffer(source)
    finally:
        os.close(fd)
    return ProbeResult(read_gbps=total / _GB / max(read_s, 1e-9),
                       write_gbps=total / _GB / max(write_s, 1e-9),
                       direct_io_used=use_direct, size_mb=total // _MIB, repeats=repeats)


def _set_direct(fd: int, on: bool) -> bool:
    """Turns O_DIRECT on or off for ``fd``; False when the file system refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    flags = flags | os.O_DIRECT if on else flags & ~os.O_DIRECT
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    return True


def _probe_fd(fd: int, source: mmap.mmap, block: int, num_blocks: int, threads: int,
              direct: bool) -> Tuple[float, float]:
    """Writes then reads ``num_blocks`` blocks of ``fd``; (write seconds, read seconds)."""
    start = time.perf_counter()
    _run_threads(threads, num_blocks, lambda first, count, stop: _write_range(
        fd, source, block, first, count, stop))
    os.fsync(fd)
    write_s = time.perf_counter() - start
    if not direct:
        # Only clean pages can be dropped, hence after the fsync.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    _run_threads(threads, num_blocks, lambda first, count, stop: _read_range(
        fd, block, first, count, stop))
    return write_s, time.perf_counter() - start


def _run_threads(threads: int, num_blocks: int, work) -> None:
    """Runs ``work(first_block, count, stop)`` on contiguous ranges, one thread each.

    The threads are always joined before returning or raising, even on Ctrl-C: the caller
    closes the descriptor next, and a thread still using a closed descriptor number could
    write into whatever file is opened with that number meanwhile.
    """
    stop = threading.Event()
    errors: List[BaseException] = []

    def run(first: int, count: int) -> None:
        try:
            work(first, count, stop)
        except BaseException as err:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(err)
            stop.set()

    per_thread, extra = divmod(num_blocks, threads)
    workers, first = [], 0
    for index in range(threads):
        count = per_thread + (1 if index < extra else 0)
        if count:
            workers.append(threading.Thread(target=run, args=(first, count), daemon=True))
            first += count
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        stop.set()
        for worker in workers:
            if worker.is_alive():
                worker.join()
    if errors:
        raise errors[0]


def _write_range(fd: int, source: mmap.mmap, block: int, first: int, count: int,
                 stop: threading.Event) -> None:
    view = memoryview(source)
    try:
        for index in range(first, first + count):
            if stop.is_set():
                return
            offset, done = index * block, 0
            while done < block:
                done += os.pwrite(fd, view[done:], offset + done)
    finally:
        view.release()


def _read_range(fd: int, block: int, first: int, count: int, stop: threading.Event) -> None:
    # preadv into an mmap, not os.pread: O_DIRECT needs a page-aligned destination, and
    # os.pread allocates an unaligned bytes object per call.
    buffer = mmap.mmap(-1, block)
    view = memoryview(buffer)
    try:
        for index in range(first, first + count):
            if stop.is_set():
                return
            offset, done = index * block, 0
            while done < block:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got == 0:
                    raise OSError(errno.EIO, "probe file shorter than written")
                done += got
    finally:
        view.release()
        _close_buffer(buffer)


def _close_buffer(buffer: mmap.mmap) -> None:
    try:
        buffer.close()
    except BufferError:
        # A slice of it is still referenced, by the traceback of an I/O error being
        # raised; the mapping is freed with that slice, and the error must not be masked.
        pass


def check_free_space(path: str, needed_bytes: int) -> int:
    """Free bytes of ``path``'s file system, or a clear error when short of ``needed_bytes``.

    "Free" is what an unprivileged process may use (``f_bavail``, as ``shutil.disk_usage``
    reports), not the blocks reserved for root.

    Args:
        path: a directory of the tier.
        needed_bytes: the bytes about to be written there.

    Returns:
        The free bytes.

    Raises:
        UsageError: ``path`` does not exist.
        TierFullError: fewer than ``needed_bytes`` are free.
    """
    try:
        free = shutil.disk_usage(path).free
    except FileNotFoundError:
        raise UsageError(f"--offload-paths {path}: directory not found") from None
    if needed_bytes > free:
        raise TierFullError(
            f"--offload-paths {path}: needs {_human_bytes(needed_bytes)} but only "
            f"{_human_bytes(free)} is free; free space, or add a path or host cache",
            needed_bytes, [free])
    return free


def _human_bytes(num: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(num) < 1000:
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1000
    return f"{num:.2f} TB"


# ------------------------------------------------------------------------ placement


def place_subgroups(sizes: Sequence[int], weights: Sequence[float], policy: str = "bandwidth",
                    capacity: Optional[Sequence[Optional[int]]] = None, *,
                    names: Optional[Sequence[str]] = None) -> List[int]:
    """Assigns each subgroup to a tier path.

    ``"bandwidth"`` (MLP-Offload's rule): path i receives a share of the bytes proportional
    to ``weights[i]`` (T_i = M * B_i / sum B). Subgroups are taken in order and each goes to
    the path with the largest deficit, ``target_i - assigned_i``, where the target counts the
    bytes placed so far including this subgroup (a smooth weighted round-robin, by bytes).
    Ties go to a path other than the previous subgroup's, then to the larger weight, then to
    the lower index: weights 1:1 alternate, 3:1 repeat 0,0,1,0, 1:1:1 repeat 0,1,2. A final
    pass makes the same moves as :class:`Rebalancer` would (see there), so every path ends
    within one subgroup of its target and a Rebalancer with these weights starts with
    nothing to move. Arithmetic is exact (fractions): the result does not depend on
    floating-point rounding.

    ``"round-robin"``: subgroup k goes to path ``k % len(weights)``; weights only have to
    be valid.

    With ``capacity``, a path never receives more than its bytes. The targets are filled
    like water: a path whose proportional share exceeds its capacity is capped at it, and
    the rest is shared by the others in proportion to their weights (round-robin: the next
    path in cyclic order that has room). A path of weight 0 receives nothing.

    Args:
        sizes: bytes of each subgroup (any unit, the same as ``capacity``).
        weights: relative bandwidth of each path (e.g. effective GB/s), >= 0.
        policy: ``"bandwidth"`` or ``"round-robin"``.
        capacity: free bytes per path; ``None`` (or a ``None`` entry) is unlimited.
        names: path names for error messages (default ``path 0``, ``path 1``, ...).

    Returns:
        The path index of each subgroup.

    Raises:
        ValueError: no weights, a negative or non-finite weight, all weights 0, a negative
            size, an unknown policy, or ``capacity``/``names`` of the wrong length.
        TierFullError: the subgroups do not fit in the paths' capacity.
    """
    fractions = _weights_as_fractions(weights)
    n = len(fractions)
    if policy not in PLACEMENT_POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; "
                         f"expected one of {', '.join(PLACEMENT_POLICIES)}")
    if any(size < 0 for size in sizes):
        raise ValueError("subgroup sizes must be >= 0")
    free = _free_list(capacity, n)
    labels = list(names) if names is not None else [f"path {i}" for i in range(n)]
    if len(labels) != n:
        raise ValueError(f"names has {len(labels)} entries for {n} paths")
    usable = [i for i in range(n) if fractions[i] > 0]
    total = sum(sizes)
    if all(free[i] is not None for i in usable):
        room = sum(free[i] for i in usable)
        if total > room:
            raise TierFullError(
                f"offload tier paths too small: {len(sizes)} subgroups need "
                f"{_human_bytes(total)} but only {_human_bytes(room)} is free "
                f"({_describe_free(labels, free, usable)}); free space, or add a path or "
                "host cache", total, free)
    targets = _water_fill(fractions, free, total) if total else fractions
    target_sum = sum(targets)

    assigned = [0] * n
    deficit = [Fraction(0)] * n  # (target - assigned) * target_sum, kept exact
    result: List[int] = []
    previous = -1
    for index, size in enumerate(sizes):
        for i in range(n):
            deficit[i] += size * targets[i]
        fits = [i for i in usable if free[i] is None or assigned[i] + size <= free[i]]
        if not fits:
            left = _left(free, assigned)
            raise TierFullError(
                f"offload tier paths too small: subgroup {index} ({_human_bytes(size)}) "
                f"fits on no path ({_describe_free(labels, left, usable)}); "
                "free space, or add a path or host cache", size, left)
        if policy == "round-robin":
            choice = min(fits, key=lambda i: (i - index) % n)
        else:
            choice = min(fits, key=lambda i: (-deficit[i], i == previous, -fractions[i], i))
        assigned[choice] += size
        deficit[choice] -= size * target_sum
        result.append(choice)
        previous = choice
    if policy == "bandwidth":
        for subgroup, _, receiver in _balancing_moves(result, sizes, targets,
                                                      _left(free, assigned), None, True):
            result[subgroup] = receiver
    return result


def _water_fill(weights: Sequence[Fraction], free: Sequence[Optional[int]],
                total: int) -> List[Fraction]:
    """Target bytes per path: proportional to ``weights``, capped at ``free``.

    The bytes a capped path cannot take go to the uncapped ones, again in proportion to
    their weights, until no target exceeds its path's capacity.
    """
    targets = [Fraction(0)] * len(weights)
    open_paths = [i for i, w in enumerate(weights) if w > 0]
    remaining = Fraction(total)
    while open_paths:
        weight_sum = sum(weights[i] for i in open_paths)
        capped = [i for i in open_paths if free[i] is not None
                  and remaining * weights[i] / weight_sum > free[i]]
        if not capped:
            for i in open_paths:
                targets[i] = remaining * weights[i] / weight_sum
            break
        for i in capped:
            targets[i] = Fraction(free[i])
            remaining -= free[i]
            open_paths.remove(i)
    return targets


def _weights_as_fractions(weights: Sequence[float]) -> List[Fraction]:
    if len(weights) == 0:
        raise ValueError("no tier paths: weights is empty")
    for weight in weights:
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"tier weights must be finite and >= 0, got {list(weights)}")
    if not any(weight > 0 for weight in weights):
        raise ValueError(f"tier weights are all 0: {list(weights)}")
    return [Fraction(weight) for weight in weights]


def _free_list(capacity: Optional[Sequence[Optional[int]]], n: int) -> List[Optional[int]]:
    if capacity is None:
        return [None] * n
    if len(capacity) != n:
        raise ValueError(f"capacity has {len(capacity)} entries for {n} paths")
    return list(capacity)


def _left(free: Sequence[Optional[int]], used: Sequence[int]) -> List[Optional[int]]:
    return [None if f is None else f - u for f, u in zip(free, used)]


def _describe_free(labels: Sequence[str], free: Sequence[Optional[int]],
                   usable: Sequence[int]) -> str:
    parts = [f"{labels[i]}: " + ("unlimited" if free[i] is None else _human_bytes(free[i]))
             for i in usable]
    return "free " + ", ".join(parts)


# ------------------------------------------------------------------------ rebalancing


class Rebalancer:
    """Moves subgroups off a tier path whose observed throughput drops, with hysteresis.

    The caller reports each step's I/O per path (:meth:`observe`: bytes and the seconds
    spent on them) and calls :meth:`end_step`, which returns the moves to make. Pure logic:
    no clock, no I/O; the caller applies the moves to its assignment (a move costs little,
    since every non-cached subgroup is read and written each step anyway: read from the
    old path, write to the new one).

    The rule, per :meth:`end_step`:

    1. Each path observed this step updates its throughput estimate, an EWMA of
       bytes / seconds (GB/s) with weight ``alpha`` on the new value.
    2. A path is *slow* when its estimate relative to its weight (observed / expected) is
       below ``slow_ratio`` times that of the other paths pooled (their summed estimates
       over their summed weights). Only paths with weight > 0 and an estimate take part.
    3. When a path has been slow for ``patience`` consecutive steps, the weights become the
       estimates (paths without one keep their weight, scaled like the others), so the
       target bytes per path follow observed bandwidth; the streaks restart.
    4. Then, every step, up to ``max_moves`` subgroups move toward the targets (each
       path's weight share of the bytes on the paths): from the path most over its target
       (after a slowdown, the slow path) to the path most under it (the one fastest
       relative to its load) that has room, and only if the gap between the two exceeds
       the subgroup's size. Each move strictly lowers the sum of squared distances to the
       targets, so moving back is never a gain, and moving stops at the latest once every
       path is within one subgroup of its target. Among the donor's subgroups that
       qualify, the one that makes the shortest run of consecutive subgroups on the
       receiver moves (then the highest index), to keep the interleaving.
       :func:`place_subgroups` ends with the same rule, so its placement starts with
       nothing to move.

    Hysteresis: weights change only after ``patience`` steps beyond ``slow_ratio``, so equal
    or noisy throughputs (within that ratio) never move anything, and a move is never
    undone unless the throughputs change again. The weights are relative: any scale (probe
    effective GB/s, or read+write bytes per second) works, as only ratios are compared.

    Limitation: a path that loses all its subgroups is no longer observed, so its recovery
    is not seen; that takes a throughput below ``1 / (number of subgroups)`` of the total.
    """

    def __init__(self, weights: Sequence[float], *, alpha: float = 0.5,
                 slow_ratio: float = 0.7, patience: int = 2, max_moves: int = 1):
        _weights_as_fractions(weights)
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0 < slow_ratio < 1:
            raise ValueError(f"slow_ratio must be in (0, 1), got {slow_ratio}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if max_moves < 0:
            raise ValueError(f"max_moves must be >= 0, got {max_moves}")
        self._weights = [float(weight) for weight in weights]
        self._alpha = alpha
        self._slow_ratio = slow_ratio
        self._patience = patience
        self._max_moves = max_moves
        n = len(self._weights)
        self._estimate: List[Optional[float]] = [None] * n
        self._step_bytes = [0] * n
        self._step_seconds = [0.0] * n
        self._streak = [0] * n
        self._reweights = 0

    @property
    def weights(self) -> List[float]:
        """The current relative weight of each path (a copy)."""
        return list(self._weights)

    @property
    def reweight_count(self) -> int:
        """How many times the weights were reset to the observed throughputs."""
        return self._reweights

    def observed_gbps(self, path: int) -> Optional[float]:
        """The EWMA throughput of ``path`` in GB/s, ``None`` before its first observation."""
        self._check_path(path)
        return self._estimate[path]

    def observe(self, path: int, nbytes: int, seconds: float) -> None:
        """Adds ``nbytes`` moved on ``path`` in ``seconds`` to the current step's totals."""
        self._check_path(path)
        if nbytes < 0 or not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"observe: need nbytes >= 0 and finite seconds >= 0, "
                             f"got {nbytes}, {seconds}")
        self._step_bytes[path] += nbytes
        self._step_seconds[path] += seconds

    def end_step(self, assignment: Sequence[int], sizes: Sequence[int], *,
                 free_bytes: Optional[Sequence[Optional[int]]] = None
                 ) -> List[Tuple[int, int, int]]:
        """Closes a step: updates the estimates and returns the moves to make.

        Args:
            assignment: the path of each subgroup; a negative entry is a subgroup that is
                on no path (kept in the host cache) and is never moved.
            sizes: bytes of each subgroup.
            free_bytes: free bytes per path (``None``: unlimited); a move never puts more
                on a path than this.

        Returns:
            ``(subgroup, from_path, to_path)`` for each move, at most ``max_moves``, each
            subgroup at most once. ``assignment`` is not modified.
        """
        n = len(self._weights)
        if len(assignment) != len(sizes):
            raise ValueError(f"assignment has {len(assignment)} entries, sizes {len(sizes)}")
        if any(path >= n for path in assignment):
            raise ValueError(f"assignment names a path >= {n}")
        for path in range(n):
            nbytes, seconds = self._step_bytes[path], self._step_seconds[path]
            if nbytes > 0 and seconds > 0:
                rate = nbytes / seconds / _GB
                old = self._estimate[path]
                self._estimate[path] = rate if old is None else (
                    self._alpha * rate + (1 - self._alpha) * old)
        self._step_bytes = [0] * n
        self._step_seconds = [0.0] * n
        self._update_streaks()
        if any(streak >= self._patience for streak in self._streak):
            self._reweight()
        weights = [Fraction(w) for w in self._weights]
        return _balancing_moves(assignment, sizes, weights, _free_list(free_bytes, n),
                                self._max_moves, False)

    def _check_path(self, path: int) -> None:
        if not 0 <= path < len(self._weights):
            raise ValueError(f"path {path} out of range 0..{len(self._weights) - 1}")

    def _active(self) -> List[int]:
        return [i for i, (w, e) in enumerate(zip(self._weights, self._estimate))
                if w > 0 and e is not None]

    def _update_streaks(self) -> None:
        active = self._active()
        streak = [0] * len(self._weights)
        if len(active) >= 2:
            total_est = sum(self._estimate[i] for i in active)
            total_w = sum(self._weights[i] for i in active)
            for i in active:
                others = (total_est - self._estimate[i]) / (total_w - self._weights[i])
                if self._estimate[i] / self._weights[i] < self._slow_ratio * others:
                    streak[i] = self._streak[i] + 1
        self._streak = streak

    def _reweight(self) -> None:
        active = self._active()
        scale = (sum(self._estimate[i] for i in active)
                 / sum(self._weights[i] for i in active))
        self._weights = [
            0.0 if w == 0 else (self._estimate[i] if i in active else w * scale)
            for i, w in enumerate(self._weights)]
        self._streak = [0] * len(self._weights)
        self._reweights += 1


def _balancing_moves(assignment: Sequence[int], sizes: Sequence[int],
                     weights: Sequence[Fraction], free: Sequence[Optional[int]],
                     max_moves: Optional[int], repeat: bool) -> List[Tuple[int, int, int]]:
    """Moves that bring each path's bytes to within one subgroup of its target.

    The target of path i is its weight's share of the bytes on the paths. With
    ``excess_i = bytes_i - target_i``: the donor is the path most over its target, the
    receiver the path most under it (among those with room); a subgroup of size s moves
    only if ``excess_donor - excess_receiver > s``. Each move strictly lowers the sum of
    squared excesses, so moving back is never allowed and the moves end, at the latest
    when every path is within s of its target.

    Args:
        assignment: path of each subgroup; negative entries are on no path.
        sizes: bytes of each subgroup.
        weights: relative weight of each path (exact).
        free: room left per path (``None``: unlimited).
        max_moves: the most moves to return; ``None`` for as many as it takes.
        repeat: whether a subgroup may move more than once.

    Returns:
        ``(subgroup, from_path, to_path)`` in the order to make them.
    """
    n = len(weights)
    weight_sum = sum(weights)
    where = list(assignment)
    loads = [0] * n
    members: List[List[int]] = [[] for _ in range(n)]
    for subgroup, path in enumerate(where):
        if path >= 0:
            loads[path] += sizes[subgroup]
            members[path].append(subgroup)
    on_paths = sum(loads)
    room = list(free)
    # Excess scaled by weight_sum, so that it stays an exact integer-valued comparison.
    excess = [loads[i] * weight_sum - on_paths * weights[i] for i in range(n)]

    moves: List[Tuple[int, int, int]] = []
    while max_moves is None or len(moves) < max_moves:
        candidates = []
        # The donors in order of excess: the most loaded one may hold only subgroups too
        # large to move, while the next one's would still even things out.
        for donor in sorted((i for i in range(n) if members[i]), key=lambda i: (-excess[i], i)):
            for subgroup in members[donor]:
                size = sizes[subgroup]
                receivers = [r for r in range(n) if r != donor and weights[r] > 0
                             and (room[r] is None or size <= room[r])]
                if not receivers:
                    continue
                receiver = min(receivers, key=lambda r: (excess[r], r))
                if excess[donor] - excess[receiver] > size * weight_sum:
                    # Consecutive subgroups on different paths overlap their I/O, so
                    # prefer the subgroup that makes the shortest run on the receiver.
                    candidates.append(
                        (_run_length(where, subgroup, receiver), -subgroup, receiver))
            if candidates:
                break
        if not candidates:
            break
        _, negated, receiver = min(candidates)
        subgroup, size = -negated, sizes[-negated]
        donor = where[subgroup]
        members[donor].remove(subgroup)
        if repeat:
            members[receiver].append(subgroup)
        where[subgroup] = receiver
        excess[donor] -= size * weight_sum
        excess[receiver] += size * weight_sum
        if room[receiver] is not None:
            room[receiver] -= size
        moves.append((subgroup, donor, receiver))
    return moves


def _run_length(where: Sequence[int], subgroup: int, path: int) -> int:
    """Length of the run of consecutive subgroups on ``path`` once ``subgroup`` joins it."""
    run = 1
    for step in (-1, 1):
        index = subgroup + step
        while 0 <= index < len(where) and where[index] == path:
            run += 1
            index += step
    return run


# ------------------------------------------------------------------------ the tier model
#
# The hierarchy of a rank's optimizer-state subgroups: spare GPU memory (the device tier),
# the pinned host cache, and the paths above. The engine runs the pipeline; the decisions
# (where a subgroup lives, who updates it) are the pure functions and records below.


class TierKind(enum.Enum):
    """Where a subgroup's state lives."""

    DEVICE = "device"
    """In the model device's memory, updated there by a fused Adam; no PCIe traffic."""
    HOST = "host"
    """In the host cache (pinned on GPU machines), with or without a file on a path."""
    PATH = "path"
    """In a file on one of the --offload-paths (fetched into the host cache to update)."""


@dataclass(frozen=True)
class Tier:
    """A subgroup's place in the hierarchy: a kind and, for PATH, the path index."""

    kind: TierKind
    path: Optional[int] = None

    def __str__(self) -> str:
        return self.kind.value if self.path is None else f"path{self.path}"


DEVICE_TIER = Tier(TierKind.DEVICE)
HOST_TIER = Tier(TierKind.HOST)


class Updater(enum.Enum):
    """Who runs a subgroup's Adam step."""

    DEVICE = "device"
    """Its states are on the device: the fused device Adam, in place."""
    CPU = "cpu"
    """CPU Adam on the host buffer (torch's fused CPU AdamW on GPU machines)."""
    STREAM = "stream"
    """States H2D, the fused device Adam, states D2H (copies on their own streams)."""


def spread(count: int, n: int) -> List[int]:
    """``count`` of the indices ``0..n-1``, evenly spread.

    The first one sits at the middle of its stretch, so that device-tier subgroups
    interleave with those that need I/O.
    """
    if not 0 <= count <= n:
        raise ValueError(f"spread: count {count} not in [0, {n}]")
    return [(2 * k + 1) * n // (2 * count) for k in range(count)]


def fixed_device_subgroups(sizes: Sequence[int], budget_bytes: int) -> List[int]:
    """The subgroups a device tier of ``budget_bytes`` holds (placement fills it first).

    As many subgroups as fit, taking the largest count ``k`` whose ``k`` evenly spread
    subgroups (:func:`spread`) fit in the budget.

    Args:
        sizes: bytes of each subgroup's state.
        budget_bytes: bytes of device memory for states.

    Returns:
        The chosen subgroup indices, ascending.
    """
    if budget_bytes <= 0 or not sizes:
        return []
    best: List[int] = []
    lo, hi = 0, len(sizes)
    while lo <= hi:
        mid = (lo + hi) // 2
        chosen = spread(mid, len(sizes))
        if sum(sizes[i] for i in chosen) <= budget_bytes:
            best, lo = chosen, mid + 1
        else:
            hi = mid - 1
    return best


def device_budget(limit_bytes: int, peak_bytes: int, state_bytes: int,
                  reserve_bytes: int) -> int:
    """Bytes of device memory the device tier may hold (``auto`` sizing).

    ``peak_bytes`` is the peak allocated memory of a training iteration as measured, which
    includes the device tier's own ``state_bytes`` (they stay allocated throughout): what
    the rest of the iteration needs is the difference, and the tier gets what is left of
    ``limit_bytes`` after it and a safety ``reserve_bytes`` (fragmentation, evaluation,
    checkpointing, other processes).
    """
    others = max(0, peak_bytes - state_bytes)
    return max(0, limit_bytes - reserve_bytes - others)


def resize_device_tier(members: Sequence[int], sizes: Sequence[int], budget_bytes: int,
                       candidates: Sequence[int]) -> Tuple[List[int], List[int]]:
    """Which subgroups join or leave the device tier to fit ``budget_bytes``.

    Args:
        members: the device tier's subgroups, in the order they joined.
        sizes: bytes of each subgroup's state.
        budget_bytes: what the tier may hold now (:func:`device_budget`).
        candidates: subgroups that may join, most wanted first; empty once the tier is
            sized (it then only gives memory back).

    Returns:
        (joining, leaving): subgroups to move up, in order, while they fit; or subgroups
        to move down (the last to join leave first) until the rest fits.
    """
    used = sum(sizes[i] for i in members)
    if used > budget_bytes:
        leaving = []
        for index in reversed(members):
            if used <= budget_bytes:
                break
            leaving.append(index)
            used -= sizes[index]
        return [], leaving
    joining = []
    for index in candidates:
        if index in members:
            continue
        if used + sizes[index] > budget_bytes:
            continue
        joining.append(index)
        used += sizes[index]
    return joining, []


def stream_rate(bytes_per_element: float, h2d_gbps: float, d2h_gbps: float,
                device_rate: float) -> float:
    """Elements per second of the streamed update when its three stages overlap.

    States go up and come back in full (``bytes_per_element`` each way, on two copy
    streams), so the pipeline runs at its slowest stage: a copy direction or the device's
    Adam (``device_rate`` elements/s).
    """
    return min(h2d_gbps * _GB / bytes_per_element, d2h_gbps * _GB / bytes_per_element,
               device_rate)


def stream_share(cpu_rate: Optional[float], stream_elements_rate: Optional[float],
                 prior: float = 0.5) -> float:
    """The share of the host subgroups' elements to stream, so both sides end together.

    With CPU Adam at ``c`` and the stream at ``s`` elements/s, streaming a share ``f`` of
    ``N`` elements takes ``f N / s`` and the CPU's part ``(1 - f) N / c``: equal at
    ``f = s / (s + c)``. ``prior`` until both rates are measured.
    """
    if not cpu_rate or not stream_elements_rate:
        return prior
    return stream_elements_rate / (stream_elements_rate + cpu_rate)


def split_updates(sizes: Sequence[int], share: float) -> List[bool]:
    """Which of the host subgroups (in the step's order) are streamed: True = streamed.

    Error diffusion over the elements: subgroup ``k`` is streamed when that keeps the
    streamed elements so far closest to ``share`` of all elements so far, so the two kinds
    interleave and both sides start at once. ``share`` 0 streams none, 1 all.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"split_updates: share must be in [0, 1], got {share}")
    out: List[bool] = []
    total = streamed = 0
    for size in sizes:
        total += size
        with_it = abs(streamed + size - share * total)
        without = abs(streamed - share * total)
        take = with_it < without or (with_it == without and share >= 0.5)
        if share == 0.0:
            take = False
        elif share == 1.0:
            take = True
        out.append(take)
        if take:
            streamed += size
    return out


class UpdateRates:
    """Measured update throughputs (elements/s), smoothed: CPU Adam and the stream.

    Fed timings by the engine, reads no clock.
    """

    def __init__(self, alpha: float = 0.5):
        self.alpha = alpha
        self.cpu: Optional[float] = None
        self.stream: Optional[float] = None

    def _mix(self, old: Optional[float], elements: int, seconds: float) -> Optional[float]:
        if elements <= 0 or seconds <= 0:
            return old
        rate = elements / seconds
        return rate if old is None else self.alpha * rate + (1 - self.alpha) * old

    def observe(self, cpu_elements: int, cpu_seconds: float, stream_elements: int,
                stream_seconds: float) -> None:
        """One step's totals of each side."""
        self.cpu = self._mix(self.cpu, cpu_elements, cpu_seconds)
        self.stream = self._mix(self.stream, stream_elements, stream_seconds)

    def share(self, prior: float = 0.5) -> float:
        """The streamed share for the next step (:func:`stream_share`)."""
        return stream_share(self.cpu, self.stream, prior)
