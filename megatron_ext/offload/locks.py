"""Node-local concurrency control: one process of a node does I/O on a tier at a time.

Ranks of a node share its NVMe and its link to the parallel file system; when they all
stream state files at once, each gets a slice of the bandwidth and all of them wait for
the slowest. A :class:`NodeLocks` lock per tier path serializes whole subgroup transfers
across the node's processes (and across the threads of one process), while the I/O
threads inside one transfer still run in parallel.

The lock is ``fcntl.flock`` on a lock file: the kernel drops it when its holder dies,
SIGKILL included, so a crashed rank never stalls the others. The lock files live in a
node-local directory (``/dev/shm`` when usable) on purpose: the lock coordinates the
ranks of one node, and lock files on a shared filesystem would serialize every node.

This module imports no torch, so that lightweight tools and test helper processes start fast.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import tempfile
import threading
import time
import weakref
from typing import Dict, Iterator, Optional

from megatron_ext.errors import UsageError

_LIVE: "weakref.WeakSet[NodeLocks]" = weakref.WeakSet()


def default_lock_dir() -> str:
    """``/dev/shm/megatron_ext-locks-{uid}`` when /dev/shm is usable, else under the temp dir."""
    name = f"megatron_ext-locks-{os.geteuid()}"
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return os.path.join("/dev/shm", name)
    return os.path.join(tempfile.gettempdir(), name)


class _PathLock:
    """The lock of one tier path in this process: its lock file and its holders."""

    def __init__(self, fd: int):
        self.fd = fd
        # flock does not exclude threads sharing one open file, so threads queue here
        # first; reentrant, with a depth, so that a nested hold does not drop the flock.
        self.mutex = threading.RLock()
        self.depth = 0


class NodeLocks:
    """Exclusive node-wide locks, one per tier path.

    Attributes:
        enabled: False makes :meth:`hold` a no-op.
        lock_dir: Directory of the lock files.
        wait_s: Total seconds spent waiting in :meth:`hold`, for the engine's reports.
    """

    def __init__(self, enabled: bool = True, lock_dir: Optional[str] = None):
        """Creates the lock directory (mode 0o700) when enabled.

        Args:
            enabled: Take locks at all; False lets every process do I/O at any time.
            lock_dir: Node-local directory of the lock files; see :func:`default_lock_dir`.

        Raises:
            UsageError: The lock directory is a symlink, not a directory, or another user's.
        """
        self.enabled = enabled
        self.lock_dir = os.path.abspath(lock_dir or default_lock_dir())
        self.wait_s = 0.0
        self._locks: Dict[str, _PathLock] = {}
        self._guard = threading.Lock()
        if enabled:
            _private_dir(self.lock_dir)
        _LIVE.add(self)

    def lock_path(self, tier_path: str) -> str:
        """The lock file of a tier path: named by a hash of the path's real path."""
        key = os.path.realpath(tier_path).encode()
        return os.path.join(self.lock_dir, hashlib.sha256(key).hexdigest()[:32] + ".lock")

    @contextlib.contextmanager
    def hold(self, tier_path: str) -> Iterator[None]:
        """Holds the tier's lock for the ``with`` body, blocking until it is free.

        Excludes other processes of the node and other threads of this process;
        a thread that already holds the lock may nest.

        Args:
            tier_path: The tier's directory; paths that resolve to one directory share a lock.
        """
        if not self.enabled:
            yield
            return
        lock = self._lock(tier_path)
        t_start = time.monotonic()
        with lock.mutex:
            if lock.depth == 0:
                fcntl.flock(lock.fd, fcntl.LOCK_EX)
            waited = time.monotonic() - t_start
            with self._guard:
                self.wait_s += waited
            lock.depth += 1
            try:
                yield
            finally:
                lock.depth -= 1
                if lock.depth == 0:
                    fcntl.flock(lock.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Closes the lock files, which releases any lock still held."""
        with self._guard:
            locks, self._locks = self._locks, {}
        for lock in locks.values():
            os.close(lock.fd)

    def _lock(self, tier_path: str) -> _PathLock:
        path = self.lock_path(tier_path)
        with self._guard:
            lock = self._locks.get(path)
            if lock is None:
                lock = self._locks[path] = _PathLock(_open_lock_file(path))
            return lock

    def _forget_after_fork(self) -> None:
        # A forked child shares the parent's open lock files: closing them in the child
        # keeps a long-lived child (a data loader worker) from keeping a lock alive after
        # its parent died.
        for lock in self._locks.values():
            with contextlib.suppress(OSError):
                os.close(lock.fd)
        self._locks = {}
        self._guard = threading.Lock()


def _after_fork_in_child() -> None:
    for locks in list(_LIVE):
        locks._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _private_dir(path: str) -> None:
    """Creates ``path`` with mode 0o700 if missing and checks that it is our directory."""
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"lock directory {path} is a symlink or not a directory: remove it")
    if st.st_uid != os.geteuid():
        raise UsageError(f"lock directory {path} is owned by uid {st.st_uid}, not by this user "
                         f"(uid {os.geteuid()}): remove it, or pass a lock directory of your own")
    if st.st_mode & 0o077:
        # Ours but open to others, who could plant lock files in it; ours to tighten.
        os.chmod(path, 0o700)


def _open_lock_file(path: str) -> int:
    """Opens (creating, mode 0o600) a lock file that must be a regular file of ours."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UsageError(f"lock file {path} is a symlink: remove it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise UsageError(f"lock file {path} is not a regular file of this user (uid "
                         f"{os.geteuid()}; owner uid {st.st_uid}): remove it")
    return fd
