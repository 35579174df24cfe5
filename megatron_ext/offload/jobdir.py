"""The offload job directories: ``DIR/megatron_ext-USER/JOB/rankNNNNN``, safe on shared paths.

An offload path is often a shared scratch directory (``/tmp``, a parallel file system), so
whatever the engine creates or enters below it could have been planted by another user.
The rules, kept by :class:`JobDirs`:

- **Every component below DIR** (``megatron_ext-USER``, ``JOB``, ``rankNNNNN``) is a real
  directory, not a symlink, owned by this user, with no group or other permission bits
  (0700; created so when missing, whatever the umask). Anything else is refused in one
  line (:class:`~megatron_ext.errors.UsageError`). The components are opened one by one
  with ``O_NOFOLLOW`` relative to their parent, so a symlink is never followed. DIR itself
  is the user's choice; it is refused only when others may write to it without the sticky
  bit (then anyone could swap ``megatron_ext-USER`` for their own).
- **A run id is one path component** of ``[A-Za-z0-9._-]``, not ``.`` or ``..``
  (:func:`check_run_id`), whether given with ``--offload-run-id`` or taken from the
  environment (Slurm's job id, torchrun's run id).
- **One job per run id.** Each rank holds an exclusive ``flock`` on
  ``rankNNNNN/.lock`` for the engine's life. The ranks of one job have distinct rank
  numbers, so they never refuse each other, on one node or on a path shared by several
  nodes; a second job with the same run id finds the lock of (at least) its rank 0 held
  and refuses before it touches a file. The kernel drops a flock when its holder dies
  (SIGKILL included), so a requeued job of the same id takes its directory over.
- **Stale directories.** A rank directory whose lock is free belongs to no running job
  (its process was killed, or its node crashed); at start each rank removes this user's
  stale rank directories on its paths, then the job directories left empty. The lock file
  names its holder's host: a directory locked from another host is never removed (on a
  file system whose flock is node-local, e.g. Lustre's ``localflock``, a free lock there
  says nothing).
- **A full path at start** (ENOSPC or EDQUOT while a component or the lock file is
  created or written) is skipped with a warning when another listed path could be set up,
  and what was created on it is removed again; with no usable path left the run is refused
  in one line (:attr:`JobDirs.bases` are the paths kept, :attr:`JobDirs.skipped` the others).
- **At the end** a rank removes its rank directory, then the job directory and
  ``megatron_ext-USER`` when they are empty (other ranks and jobs share them).
- Set-up, the end and the stale scan of one user's directory are serialized by a flock on
  ``megatron_ext-USER/.setup.lock``, so a scan never sees a directory half set up; a
  rank unlinks it at its end, holding it (a waiter then finds the name gone or another
  file there, and starts over), so that an empty ``megatron_ext-USER`` can go too.

Cross-node exclusion on a shared path is as good as that file system's flock (cluster-wide
on NFSv4, GPFS, Lustre with ``-o flock``). This module imports no torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import stat
import time
import uuid
import weakref
from typing import Iterator, List, Mapping, Tuple

from megatron_ext.errors import UsageError

log = logging.getLogger(__name__)

RUN_ID_RE = re.compile(r"[A-Za-z0-9._-]+")
LOCK_NAME = ".lock"
SETUP_LOCK_NAME = ".setup.lock"
_RANK_RE = re.compile(r"rank\d{5}")
# A path that cannot take even a lock file: skipped at start when another path can.
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_OWN = "give --offload-paths a directory of your own"


def check_run_id(run_id: str, source: str = "--offload-run-id") -> str:
    """Returns ``run_id`` if it is one safe path component.

    Args:
        run_id: the id.
        source: where it came from, for the message (a flag or an environment variable).

    Raises:
        UsageError: empty, ``.``/``..``, or a character outside ``[A-Za-z0-9._-]``.
    """
    if not RUN_ID_RE.fullmatch(run_id or "") or run_id in (".", ".."):
        hint = ("" if source.startswith("--") else
                ": set --offload-run-id to a name of your own")
        raise UsageError(f"{source} {run_id!r}: a run id is one directory name of letters, "
                         f"digits, '.', '_' and '-' (not '.' or '..'){hint}")
    return run_id


def default_run_id(environ: Mapping[str, str]) -> str:
    """The run id without --offload-run-id: the Slurm job id, else torchrun's, else fresh.

    Raises:
        UsageError: an id from the environment is not one safe directory name.
    """
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = environ.get(name)
        if value and value != "none":
            return f"{name.split('_')[0].lower()}-{check_run_id(value, name)}"
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def user_name() -> str:
    """The name of this process's user (the uid where it has none)."""
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _refuse_unsafe(path: str, st: os.stat_result) -> None:
    """Refuses a component that is not a 0700 directory of this user."""
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(f"offload directory {path} is a symlink: refusing to follow it (it may "
                         f"have been planted by someone else); remove it, or {_OWN}")
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"offload directory {path} exists and is not a directory: remove it, "
                         f"or {_OWN}")
    if st.st_uid != os.geteuid():
        raise UsageError(f"offload directory {path} is owned by {_owner(st.st_uid)}, not by "
                         f"this user ({_owner(os.geteuid())}): {_OWN}")
    if st.st_mode & 0o077:
        raise UsageError(f"offload directory {path} has mode {stat.S_IMODE(st.st_mode):04o}: "
                         f"others may read or replace its state files; run chmod 700 {path}")


def _enter(parent_fd: int, name: str, path: str) -> Tuple[int, bool]:
    """(fd, created) of the checked directory ``name`` under ``parent_fd``, made if missing."""
    created = False
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        created = True
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            _refuse_unsafe(path, os.stat(name, dir_fd=parent_fd, follow_symlinks=False))
        raise
    try:
        if created:
            os.fchmod(fd, 0o700)  # mkdir's mode went through the umask
        _refuse_unsafe(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd, created


def _open_base(path: str) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    st = os.fstat(fd)
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        os.close(fd)
        raise UsageError(f"--offload-paths {path} is writable by every user and has no sticky "
                         f"bit: anyone could replace the job directories there; chmod +t {path} "
                         f"or {_OWN}")
    return fd


def _same_entry(dir_fd: int, name: str, fd: int) -> bool:
    """Whether ``name`` in ``dir_fd`` is still the file or directory open as ``fd``."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


@contextlib.contextmanager
def _user_dir(base_fd: int, base: str) -> Iterator[Tuple[int, str]]:
    """(fd, path) of DIR/megatron_ext-USER, holding its set-up lock."""
    name = f"megatron_ext-{user_name()}"
    path = os.path.join(base, name)
    while True:
        fd, _ = _enter(base_fd, name, path)
        lock = -1
        try:
            lock = os.open(SETUP_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600,
                           dir_fd=fd)
            fcntl.flock(lock, fcntl.LOCK_EX)
            # The last one out unlinks the lock file and the directory: then start over.
            if _same_entry(fd, SETUP_LOCK_NAME, lock) and _same_entry(base_fd, name, fd):
                yield fd, path
                return
        finally:
            if lock >= 0:
                os.close(lock)
            os.close(fd)


def _holder(lock_fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(lock_fd, 256, 0).decode(errors="replace").strip()
    return ""


class _RankDir:
    """One rank directory of this process on one path, with its lock held."""

    def __init__(self, base: str, path: str, lock_fd: int):
        self.base, self.path, self.lock_fd = base, path, lock_fd


class JobDirs:
    """The rank directories of one engine, one per path, locked for the engine's life.

    Attributes:
        bases: the paths set up, in the order given (a full one skipped).
        rank_dirs: ``DIR/megatron_ext-USER/JOB/rankNNNNN`` per path of :attr:`bases`.
        skipped: ``(path, reason)`` of each path skipped because it is full.
    """

    def __init__(self, bases: List[str], run_id: str, rank: int):
        """Sets up and locks this rank's directory on each path.

        Raises:
            UsageError: a component is unsafe, another running job holds the run id, or
                every path is full.
        """
        check_run_id(run_id)
        self.run_id, self.rank = run_id, rank
        self.host = socket.gethostname()
        self._held: List[_RankDir] = []
        self.skipped: List[Tuple[str, str]] = []
        # An engine that fails in its constructor, or is never closed, still lets go.
        self._finalizer = weakref.finalize(self, _release, self._held, run_id, True)
        try:
            for base in bases:
                try:
                    self._held.append(self._acquire(base))
                except OSError as err:
                    if err.errno not in FULL_ERRNOS:
                        raise
                    self.skipped.append((base, err.strerror or os.strerror(err.errno)))
            if self.skipped and not self._held:
                raise UsageError(
                    "--offload-paths: no path has room for the job directory ("
                    + "; ".join(f"{path}: {why}" for path, why in self.skipped)
                    + "): free space there, or give a path with room")
        except BaseException:
            self.close(remove=True)
            raise
        for path, why in self.skipped:
            log.warning("offload: --offload-paths %s skipped: %s while setting up the job "
                        "directory; the run uses %s", path, why,
                        ", ".join(held.base for held in self._held))
        self.bases = [held.base for held in self._held]
        self.rank_dirs = [held.path for held in self._held]

    # ------------------------------------------------------------------ set-up

    def _acquire(self, base: str) -> _RankDir:
        base_fd = _open_base(base)
        try:
            with _user_dir(base_fd, base) as (user_fd, user_path):
                self._remove_stale(user_fd, user_path)
                try:
                    return self._enter_rank_dir(base, user_fd, user_path)
                except OSError as err:
                    if err.errno in FULL_ERRNOS:
                        # Skipped: leave nothing of this run on the full path.
                        with contextlib.suppress(OSError):
                            _tidy(base_fd, user_fd, user_path, self.run_id,
                                  f"rank{self.rank:05d}")
                    raise
        finally:
            os.close(base_fd)

    def _enter_rank_dir(self, base: str, user_fd: int, user_path: str) -> _RankDir:
        job_path = os.path.join(user_path, self.run_id)
        job_fd, _ = _enter(user_fd, self.run_id, job_path)
        try:
            name = f"rank{self.rank:05d}"
            path = os.path.join(job_path, name)
            rank_fd, _ = _enter(job_fd, name, path)
            try:
                lock = self._lock(rank_fd, path)
                # A requeued job of the same id finds its previous incarnation's
                # files: the state comes from the checkpoint, so they are stale.
                for entry in os.listdir(rank_fd):
                    if entry.startswith(("sg", ".sg")):
                        os.unlink(entry, dir_fd=rank_fd)
                return _RankDir(base, path, lock)
            finally:
                os.close(rank_fd)
        finally:
            os.close(job_fd)

    def _lock(self, rank_fd: int, path: str) -> int:
        try:
            lock = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600,
                           dir_fd=rank_fd)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise UsageError(f"offload lock file {os.path.join(path, LOCK_NAME)} is a symlink: "
                             f"refusing to follow it; {_OWN}") from None
        try:
            st = os.fstat(lock)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise UsageError(f"offload lock file {os.path.join(path, LOCK_NAME)} is not a "
                                 f"regular file of this user: {_OWN}")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(lock).split()
                who = f" (host {holder[0]}, pid {holder[1]})" if len(holder) >= 2 else ""
                raise UsageError(
                    f"offload job directory {os.path.dirname(path)} is in use by another running "
                    f"job{who} with the same run id {self.run_id!r}: give this job its own "
                    "--offload-run-id, or wait until that job ends") from None
            try:
                os.ftruncate(lock, 0)
                os.pwrite(lock, f"{self.host} {os.getpid()} rank{self.rank:05d}\n".encode(), 0)
            except OSError as err:
                if err.errno in FULL_ERRNOS:
                    # Still held: unlinked now, no other run can have opened it meanwhile.
                    with contextlib.suppress(OSError):
                        os.unlink(LOCK_NAME, dir_fd=rank_fd)
                raise
            return lock
        except BaseException:
            os.close(lock)
            raise

    def _remove_stale(self, user_fd: int, user_path: str) -> None:
        """Removes this user's rank directories whose lock is free (holder dead)."""
        for job in os.listdir(user_fd):
            if job == SETUP_LOCK_NAME:
                continue
            try:
                job_fd = os.open(job, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                 dir_fd=user_fd)
            except OSError:
                continue  # not a directory of ours: not ours to remove either
            try:
                if os.fstat(job_fd).st_uid != os.geteuid():
                    continue
                removed = [name for name in os.listdir(job_fd)
                           if _RANK_RE.fullmatch(name) and self._remove_if_stale(job_fd, name)]
                if removed:
                    log.warning("offload: removed %s of %s: stale (its job is no longer "
                                "running)", ", ".join(sorted(removed)),
                                os.path.join(user_path, job))
            finally:
                os.close(job_fd)
            with contextlib.suppress(OSError):
                os.rmdir(job, dir_fd=user_fd)  # only when empty

    def _remove_if_stale(self, job_fd: int, name: str) -> bool:
        try:
            rank_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=job_fd)
        except OSError:
            return False
        lock = -1
        try:
            if os.fstat(rank_fd).st_uid != os.geteuid():
                return False
            try:
                lock = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW, dir_fd=rank_fd)
            except FileNotFoundError:
                pass  # left by a version without locks
            except OSError:
                return False
            if lock >= 0:
                holder = _holder(lock).split()
                if holder and holder[0] != self.host:
                    return False  # locked from another host: its flock may not reach here
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False  # a running job's
            shutil.rmtree(name, dir_fd=job_fd, ignore_errors=True)
            return True
        finally:
            if lock >= 0:
                os.close(lock)
            os.close(rank_fd)

    # ------------------------------------------------------------------ the end

    def close(self, remove: bool = True) -> None:
        """Releases the locks.

        Args:
            remove: also delete the rank directories, and their parents left empty.
        """
        self._finalizer.detach()
        _release(self._held, self.run_id, remove)


def _release(held: List[_RankDir], run_id: str, remove: bool) -> None:
    while held:
        rank_dir = held.pop()
        try:
            if remove:
                _remove(rank_dir, run_id)
        finally:
            os.close(rank_dir.lock_fd)


def _remove(rank_dir: _RankDir, run_id: str) -> None:
    try:
        base_fd = _open_base(rank_dir.base)
    except (OSError, UsageError):
        return
    try:
        with _user_dir(base_fd, rank_dir.base) as (user_fd, user_path):
            with contextlib.suppress(OSError):
                job_fd = os.open(run_id, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                 dir_fd=user_fd)
                try:
                    shutil.rmtree(os.path.basename(rank_dir.path), dir_fd=job_fd,
                                  ignore_errors=True)
                finally:
                    os.close(job_fd)
            _tidy(base_fd, user_fd, user_path, run_id)
    except (OSError, UsageError) as err:
        log.warning("offload: could not remove %s: %s", rank_dir.path, err)
    finally:
        os.close(base_fd)


def _tidy(base_fd: int, user_fd: int, user_path: str, run_id: str, rank_name: str = "") -> None:
    """Removes what is left empty: ``rank_name`` (if given), the job directory, the user's.

    Called holding the set-up lock of ``user_path``.
    """
    if rank_name:
        with contextlib.suppress(OSError):
            job_fd = os.open(run_id, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                             dir_fd=user_fd)
            try:
                os.rmdir(rank_name, dir_fd=job_fd)  # only when empty
            finally:
                os.close(job_fd)
    with contextlib.suppress(OSError):
        os.rmdir(run_id, dir_fd=user_fd)  # only when empty: other ranks share it
    # Unlinked while we hold it: a waiter sees the name gone and starts over.
    os.unlink(SETUP_LOCK_NAME, dir_fd=user_fd)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.basename(user_path), dir_fd=base_fd)  # only when empty
