"""The bandwidth probe of a tier path, measured through the engine's own I/O.

A path given without bandwidths (``--offload-paths DIR``) is probed once at start-up, and
``tools/probe_tiers.py`` probes paths ahead of a job; placement (:mod:`.placement`)
weighs the paths by what the probe measured. The probe moves bytes as the state files do,
with :mod:`.io`'s block I/O: aligned buffers, O_DIRECT where the file system takes it,
chunks written and read by a pool of I/O threads. It holds:

* :class:`ProbeResult`: the read and write bandwidths of one probe;
* :func:`probe_plan`: the size and block of a start-up probe, from the subgroup size;
* :func:`probe_bandwidth`: the probe itself, the one function here that does I/O.

Units: bandwidths in GB/s (10**9 bytes per second); the probe's sizes in MiB (2**20 bytes),
because O_DIRECT needs block-aligned transfers.
"""

from __future__ import annotations

import errno
import os
import queue
import secrets
import statistics
import time
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from megatron_ext.offload.blockio import (
    IOThreads,
    aligned_empty,
    drop_direct,
    open_direct,
    pread_full,
    pwrite_all,
)
from megatron_ext.offload.paths import TierSpec
from megatron_ext.offload.state_format import MIN_CHUNK

__all__ = [
    "PROBE_BLOCK_MB",
    "PROBE_MAX_MB",
    "PROBE_REPEATS",
    "ProbeResult",
    "probe_bandwidth",
    "probe_plan",
]

_GB = 1e9
_MIB = 1 << 20

# At most this many MiB per probe pass: the default subgroup (1.2 GB of state) would make
# the start-up probe (3 passes, each written and read) take longer than it is worth.
PROBE_MAX_MB = 128
PROBE_BLOCK_MB = MIN_CHUNK // _MIB  # the engine's chunk (8 MiB) for files up to 2 GiB
PROBE_REPEATS = 3


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

    A file of ``size_mb`` MiB is written in ``block_mb`` MiB blocks from an aligned buffer
    of random bytes (so that a compressing file system cannot shortcut it), the blocks
    spread over ``threads`` I/O threads as the engine spreads a state file's chunks, and
    fsynced; then read back the same way into aligned buffers. Without O_DIRECT the file's
    pages are dropped from the page cache after the fsync, so the read measures the device
    rather than memory (on tmpfs memory *is* the device). With ``repeats`` > 1 the write
    and read are repeated on the same file (later writes overwrite its blocks, as the
    engine overwrites its recycled state files) and each bandwidth is the median of the
    passes: one pass read 0.38-1.62 GB/s on one disk from run to run.

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
    fd, use_direct = _open_unlinked(path, direct_io)
    workers = IOThreads(threads, "probe-io")
    try:
        source = aligned_empty(block).numpy()
        source[:] = np.frombuffer(os.urandom(block), dtype=np.uint8)
        # One read buffer per thread that can run at once, allocated before the timing
        # (as the engine reads into its host cache's buffers).
        buffers: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(min(threads, num_blocks)):
            buffers.put(aligned_empty(block).numpy())
        passes = []
        for _ in range(repeats):
            try:
                passes.append(_probe_fd(fd, source, buffers, num_blocks, workers, use_direct))
            except OSError as err:
                # Some file systems accept the O_DIRECT flag and reject the first transfer.
                if not (use_direct and err.errno == errno.EINVAL):
                    raise
                drop_direct(fd)
                use_direct = False
                passes.append(_probe_fd(fd, source, buffers, num_blocks, workers, False))
        write_s = statistics.median(w for w, _ in passes)
        read_s = statistics.median(r for _, r in passes)
    finally:
        workers.close()
        os.close(fd)
    return ProbeResult(read_gbps=total / _GB / max(read_s, 1e-9),
                       write_gbps=total / _GB / max(write_s, 1e-9),
                       direct_io_used=use_direct, size_mb=total // _MIB, repeats=repeats)


def _open_unlinked(directory: str, direct_io: bool) -> Tuple[int, bool]:
    """A new file in ``directory``, already unlinked: (fd, whether O_DIRECT is on)."""
    name = os.path.join(directory, f".probe_tiers-{os.getpid()}-{secrets.token_hex(6)}.tmp")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = open_direct(name, flags, 0o600) if direct_io else None
    direct = fd is not None
    if fd is None:
        fd = os.open(name, flags, 0o600)
    try:
        os.unlink(name)
    except BaseException:
        os.close(fd)
        raise
    return fd, direct


def _probe_fd(fd: int, source: np.ndarray, buffers: queue.SimpleQueue, num_blocks: int,
              workers: IOThreads, direct: bool) -> Tuple[float, float]:
    """Writes then reads ``num_blocks`` blocks of ``fd``; (write seconds, read seconds)."""
    block = len(source)
    start = time.perf_counter()
    workers.run([lambda i=i: pwrite_all(fd, memoryview(source), i * block)
                 for i in range(num_blocks)])
    os.fsync(fd)
    write_s = time.perf_counter() - start
    if not direct:
        # Only clean pages can be dropped, hence after the fsync.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    workers.run([lambda i=i: _read_block(fd, buffers, i * block) for i in range(num_blocks)])
    return write_s, time.perf_counter() - start


def _read_block(fd: int, buffers: queue.SimpleQueue, offset: int) -> None:
    """Reads one block at ``offset`` into a free buffer (the data is not looked at)."""
    buffer = buffers.get()
    try:
        if pread_full(fd, memoryview(buffer), offset) < len(buffer):
            raise OSError(errno.EIO, "probe file shorter than written")
    finally:
        buffers.put(buffer)
