"""One run per --save directory: a lock held for the run's life, refused in one line.

Two runs given the same ``--save`` would each write ``iter_N`` folders and move the
'latest' pointer: the later one overwrites the other's checkpoints and moves the pointer
back, while both report success. So one process per job (rank 0) holds an exclusive
``flock`` on ``SAVE/.megatron_ext-save.lock`` from start-up to its end, and a second run
finds it held and is refused before it writes anything, naming the holder (host, pid and
job id, which the holder writes into the file).

Why a flock, as the offload job directories (:mod:`megatron_ext.offload.jobdir`) use: the
kernel drops it when its holder dies, SIGKILL included, so a run resumed after a crash or
a Slurm requeue (the same job restarting) takes it over; a stale lock file is a free lock.
Nothing waits for a lock: a held one is refused at once.

- The descriptor is close-on-exec and closed in forked children (data-loader workers,
  checkpoint writer processes), so no child keeps the lock alive after the run died.
- At its end the run unlinks the file while holding the lock; a run that opened the old
  file in between finds, after locking it, that the name is gone or another file, and
  starts over (so two runs never each hold "the" lock on two different files).
- The --save directory is created at start-up (the lock lives in it); a run that created
  it and saved nothing removes it again at its end.
- Across nodes (another job's rank 0 on another node) the exclusion is as good as the file
  system's flock: cluster-wide on NFSv4, GPFS, Lustre mounted with ``-o flock``; node-local
  with Lustre's ``localflock``. Where flock is not supported at all the run goes on with a
  warning that a second run on the directory would not be refused.

This module imports no torch (the collective part is :func:`take`, which imports it late).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import weakref
from typing import Optional

from megatron_ext.errors import UsageError

log = logging.getLogger(__name__)

LOCK_NAME = ".megatron_ext-save.lock"
# flock not available on this file system (some network file systems).
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_HELD: "weakref.WeakSet[SaveLock]" = weakref.WeakSet()


def job_id(environ=os.environ) -> Optional[str]:
    """The job's id, as a scheduler or torchrun gives it (None without one)."""
    for name, label in (("SLURM_JOB_ID", "Slurm job"), ("TORCHELASTIC_RUN_ID", "torchrun run")):
        value = environ.get(name)
        if value and value != "none":
            return f"{label} {value}"
    return None


def holder_text(raw: bytes) -> str:
    """The holder a lock file names, in words ('' when it names none). Pure."""
    try:
        info = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return ""
    if not isinstance(info, dict):
        return ""
    parts = [f"{key} {info[key]}" for key in ("host", "pid") if info.get(key) is not None]
    if info.get("job"):
        parts.append(str(info["job"]))
    return ", ".join(parts)


def _same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _open(path: str, root: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UsageError(f"--save {root}: {path} is a symlink: remove it") from None
        raise UsageError(f"--save {root}: cannot create the lock file {path}: "
                         f"{err.strerror}; give a --save directory this user can write") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"--save {root}: {path} is not a regular file: remove it")
    return fd


class SaveLock:
    """The held lock of one --save directory (see the module's docstring).

    Attributes:
        root: the --save directory.
        path: its lock file.
        fd: the lock file's descriptor (-1 when flock is not supported there).
    """

    def __init__(self, root: str, created_root: bool = False):
        """Takes the lock of ``root``, creating the directory if missing.

        Raises:
            UsageError: another running job holds it, or the directory cannot be created.
        """
        self.root = root
        self.path = os.path.join(root, LOCK_NAME)
        self.fd = -1
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as err:
            raise UsageError(f"--save {root}: cannot create the directory: {err.strerror}; "
                             "give another --save") from None
        while True:
            fd = _open(self.path, root)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = holder_text(os.pread(fd, 4096, 0))
                os.close(fd)
                raise UsageError(
                    f"--save {root} is in use by another running job"
                    f"{f' ({holder})' if holder else ''}, which holds {self.path}: a second run "
                    "would overwrite its checkpoints; give this run another --save, or wait "
                    "until that job ends") from None
            except OSError as err:
                os.close(fd)
                if err.errno not in _NO_FLOCK:
                    raise
                log.warning("--save %s: the file system does not support flock (%s): a second "
                            "run given this --save would not be refused", root, err.strerror)
                break
            if _same_file(self.path, fd):
                self.fd = fd
                break
            os.close(fd)  # the holder unlinked it at its end: lock the file there now
        self._finalizer = weakref.finalize(self, _release, self.path, self.fd, root,
                                           created_root)
        _HELD.add(self)
        if self.fd >= 0:
            holder = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id()}
            # The holder's name is for the refusal message only: a full disk that cannot
            # take it still leaves the lock held (and the save will say the disk is full).
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, (json.dumps(holder) + "\n").encode(), 0)

    def release(self) -> None:
        """Unlinks the lock file and lets go (idempotent)."""
        self._finalizer()
        self.fd = -1

    def _forget_after_fork(self) -> None:
        # The child shares the open file description: closing its copy keeps a long-lived
        # child from holding the lock after the run died; the parent's copy still holds it.
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self._finalizer.detach()
        self.fd = -1


def _release(path: str, fd: int, root: str, created_root: bool) -> None:
    if fd >= 0:
        # Unlinked while held: a run that opened it meanwhile sees the name gone and retries.
        with contextlib.suppress(OSError):
            if _same_file(path, fd):
                os.unlink(path)
        os.close(fd)
    if created_root:
        with contextlib.suppress(OSError):
            os.rmdir(root)  # only when empty: nothing was saved


def _after_fork_in_child() -> None:
    for held in list(_HELD):
        held._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def take(root: Optional[str], runtime) -> Optional[SaveLock]:
    """Rank 0 takes the lock of --save ``root``; every rank refuses alike. Collective.

    Args:
        root: the --save directory (None: no lock).
        runtime: this process's Runtime (rank, host group).

    Returns:
        the held lock on rank 0; None elsewhere or without --save.

    Raises:
        UsageError: on every rank, when rank 0 could not take it.
    """
    if not root:
        return None
    held, refusal, failure = None, None, None
    if runtime.rank == 0:
        try:
            held = SaveLock(root, created_root=not os.path.exists(root))
        except UsageError as err:
            refusal = str(err)
        except Exception as err:  # noqa: BLE001 - re-raised below, once the others know
            failure = err
            refusal = f"--save {root}: rank 0 could not lock it ({type(err).__name__})"
    if runtime.world_size > 1:
        import torch

        # The others wait for rank 0's answer (rank 0 prints the refusal; under torchrun a
        # rank that exits first makes the agent stop the rest).
        box = [refusal]
        torch.distributed.broadcast_object_list(box, src=0, group=runtime.host_group)
        refusal = box[0]
    if failure is not None:
        raise failure
    if refusal is not None:
        raise UsageError(refusal)
    return held
