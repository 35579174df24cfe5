"""Aligned host buffers and threaded block I/O, with O_DIRECT where the file system takes it.

What the offload engine's state files (:mod:`.io`) and the bandwidth probe (:mod:`.probe`)
both move their bytes with, so that the probe measures the engine's own I/O: buffers whose
data starts on an ``ALIGN`` boundary (optionally page-locked), O_DIRECT opens with a
fallback, whole ``pwrite``/``preadv`` transfers, and the pool of I/O threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import fcntl
import os
import threading
from typing import Callable, List, Optional

import torch

ALIGN = 4096
"""O_DIRECT's alignment of buffers, offsets and sizes (the header block of a state file)."""


def round_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8, pin: bool = False) -> torch.Tensor:
    """An uninitialized CPU tensor of ``nbytes`` bytes whose data starts on an ALIGN boundary.

    The storage behind it extends to a multiple of ALIGN past the start, so O_DIRECT may
    transfer whole blocks into it.

    Args:
        nbytes: Size in bytes, a multiple of ``dtype``'s item size.
        dtype: Element type; the tensor has ``nbytes // itemsize`` elements.
        pin: Page-locked memory, for fast host-device copies (needs CUDA).

    Returns:
        A 1-D contiguous tensor with ``data_ptr() % ALIGN == 0``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes < 0 or nbytes % itemsize:
        raise ValueError(f"aligned_empty: {nbytes} bytes is not a multiple of {dtype}'s size")
    # The raw allocation's start is arbitrary, so reserve a whole ALIGN of slack to slide.
    raw = torch.empty(round_up(nbytes) + ALIGN, dtype=torch.uint8)
    if pin:
        _register_pinned(raw)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes].view(dtype)


def _register_pinned(raw: torch.Tensor) -> None:
    """Page-locks an existing allocation (cudaHostRegister) for the life of the process.

    ``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator,
    which rounds every block up to a power of two: a 1.2 GB subgroup buffer takes 2 GB,
    and a 6.7B model's states (80 GB) asked for 136 GB and were killed for host memory on
    the 125 GiB H200 machine (2026-11-30). Registering the exact allocation costs nothing
    extra. The allocation is kept here so that it is never freed while registered (the
    engine holds its buffers until the process ends anyway).
    """
    cudart = torch.cuda.cudart()
    ptr, size = raw.data_ptr(), raw.numel()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed with CUDA error {int(err)}")
    _REGISTERED.append(raw)


_REGISTERED: List[torch.Tensor] = []


def open_direct(path: str, flags: int, mode: int) -> Optional[int]:
    """Opens ``path`` with O_DIRECT added to ``flags``; None where the file system refuses it.

    A refusal is EINVAL at open (older tmpfs, some network file systems); any other error
    is raised.
    """
    try:
        return os.open(path, flags | os.O_DIRECT, mode)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        # Linux creates the inode before it checks O_DIRECT support, so a refused
        # O_EXCL create leaves our empty file behind.
        if flags & os.O_CREAT:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return None


def drop_direct(fd: int) -> None:
    """Turns O_DIRECT off for ``fd``.

    For a file system that takes the flag at open and refuses the first transfer (EINVAL
    from pwrite or preadv): the same descriptor goes on with buffered I/O.
    """
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    """Writes all of ``buf`` at ``offset`` (one pwrite may write less than asked)."""
    while len(buf):
        written = os.pwrite(fd, buf, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite returned {written}")
        buf = buf[written:]
        offset += written


def pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """Reads into all of ``buf`` from ``offset``, or up to the end of the file.

    Returns:
        The bytes read: ``len(buf)`` unless the file ends first.
    """
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


class IOThreads:
    """A pool of I/O threads that runs one call's chunk tasks, started on first use.

    The state files and the bandwidth probe (:mod:`megatron_ext.offload.probe`) both move
    their chunks through it, so that the probe measures the engine's concurrency.

    Attributes:
        threads: the pool's size; with 1 (or a single task) the tasks run inline.
    """

    def __init__(self, threads: int, name: str):
        """A pool of ``threads`` threads named ``name``-N, not started yet."""
        self.threads = threads
        self._name = name
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()

    def run(self, tasks: List[Callable[[], None]]) -> None:
        """Runs the chunk tasks on the pool; returns only when none is still running.

        Raises:
            The error of the first failed task (in task order), once no task runs.
        """
        if self.threads == 1 or len(tasks) <= 1:
            for task in tasks:
                task()
            return
        with self._pool_lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)
            pool = self._pool
        futures = [pool.submit(task) for task in tasks]
        try:
            cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
        finally:
            # The caller closes the fd next; a task still running could then write into
            # whatever file reuses that fd number.
            for future in futures:
                future.cancel()
            cf.wait(futures)
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()

    def close(self) -> None:
        """Stops the threads; the pool starts new ones if used again."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
