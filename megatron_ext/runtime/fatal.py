"""When a run fails: one ``error:`` line for the whole job, every rank ended, nothing left.

A failed run used to hang: the traceback printed, then the interpreter's exit waited on
what the run had started: data-loader workers (they ignore SIGTERM, so that a job-wide
signal cannot break the save at the signal, and multiprocessing's exit handler terminates
them with SIGTERM and joins them forever), non-daemon thread pools with a task stuck, and
the other ranks sat in a collective until the distributed timeout. Here a failure ends the
process in a bounded time:

1. :func:`announce`: the line is printed by one rank of the job (the first that fails: a
   counter in the job's rendezvous store), flushed, and only then the store is told, so
   that no launcher kills the printing rank first because another rank exited (torchrun
   kills the group when one process ends). A rank that was not first waits until the line
   is out before it exits.
2. The other ranks' :class:`PeerWatch` (a daemon thread polling the store) sees the flag and
   ends its process too, even when its main thread is blocked in an all-reduce that will
   only time out in minutes (NCCL does not notice a dead peer; gloo does, but not always
   promptly). A flag in the store, not an abort of the process group: it works the same for
   gloo and nccl, needs no collective, and a rank whose store server (rank 0 outside
   torchrun) is gone takes that as a failure too.
3. The run's own teardown runs with a bound (:func:`bounded`); then :func:`exit_now` kills
   what is left of the process's children (the loader workers, the checkpoint writer's
   processes), flushes, and leaves with ``os._exit``. A checkpoint being written is a
   ``.tmp`` folder until rank 0 renames it and moves the pointer, so the last complete
   checkpoint stays the one ``latest`` names.

What the job is (its store and this rank) is process-wide (:func:`attach`): a failure is
handled where it surfaces (the entry point, a watch thread), and a process belongs to one
job.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from megatron_ext.runtime import oom

PHASE_ATTR = "_megatron_ext_phase"
REPORTED_ATTR = "_megatron_ext_reported"
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
PRINT_WAIT_S = 5.0
"""How long a rank that did not print waits for the line of the one that does."""
TEARDOWN_S = 10.0
"""How long the run's own teardown (writers, optimizer threads) may take after a failure."""
POLL_S = 1.0
"""How often a rank looks for another rank's failure in the store."""
UNREACHABLE_POLLS = 3
"""Failed polls in a row after which an unreachable store counts as a failed job."""
BEFORE_RENDEZVOUS_WAIT_S = 10.0
"""Before the ranks have met, how long a rank other than 0 waits for rank 0 to report the
error they share (all ranks check the same flags) before it reports its own."""


class Job:
    """The place of this process in a job whose ranks have met: the store, the rank, the size.

    Args:
        store: the job's rendezvous store (a torch.distributed Store).
        rank: this process's rank.
        world: the number of ranks.
        generation: what tells a restarted job's keys from its last attempt's (torchrun's
            restart count).
    """

    def __init__(self, store, rank: int, world: int, generation: str = "0"):
        self.store = store
        self.rank = rank
        self.world = world
        prefix = f"megatron_ext/fatal/{generation}/"
        self.claim_key = prefix + "claim"
        self.failed_key = prefix + "printed"
        self.failing = False
        """This rank is failing itself (its watch then leaves the exit to it)."""
        self.watch: Optional[PeerWatch] = None


_job: Optional[Job] = None
_exit_lock = threading.Lock()


def attach(store, rank: int, world: int) -> Job:
    """Registers the job once its ranks have met; starts the watch on the others (world > 1)."""
    global _job
    detach()
    _job = Job(store, rank, world, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if world > 1:
        _job.watch = PeerWatch(_job)
        _job.watch.start()
    return _job


def detach() -> None:
    """The run ends normally: stop watching the other ranks, forget the job."""
    global _job
    job, _job = _job, None
    if job is not None and job.watch is not None:
        job.watch.stop()


def current_job() -> Optional[Job]:
    """The attached job (None before the ranks have met, or after :func:`detach`)."""
    return _job


# ---------------------------------------------------------------------- the line


@contextlib.contextmanager
def during(phase: str):
    """Marks an exception escaping the block with ``phase`` (the innermost mark wins)."""
    try:
        yield
    except BaseException as exc:
        if getattr(exc, PHASE_ATTR, None) is None:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(exc, PHASE_ATTR, phase)
        raise


def phase_of(exc: BaseException, default: str = "running") -> str:
    """The phase :func:`during` marked ``exc`` with."""
    return getattr(exc, PHASE_ATTR, None) or default


def _first_line(exc: BaseException) -> str:
    """The message's first line (and a data-loader worker's own last line).

    An error re-raised from a worker carries the worker's traceback in its message.
    """
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].startswith("Caught ") and "Original Traceback" in str(exc):
        return f"{lines[0]} {lines[-1]}"
    return lines[0]


def describe(exc: BaseException, advice: Callable[[str], str] = lambda kind: "",
             default_device: str = "cuda", interrupted: str = "") -> str:
    """The one line for ``exc`` (without ``error: ``).

    ``advice(kind)`` gives the flags that help for an out-of-memory of ``kind`` (``device``
    or ``host``), ``interrupted`` what a Ctrl-C leaves behind and how to stop otherwise:
    the caller knows the run's config.
    """
    from megatron_ext.errors import UsageError

    if isinstance(exc, UsageError):
        return str(exc)
    phase = phase_of(exc)
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted (Ctrl-C) while {phase}" + (f": {interrupted}" if interrupted
                                                        else "")
    kind = oom.classify(exc)
    if kind is not None:
        return oom.oom_line(oom.shortage_of(exc, kind, default_device), phase, advice(kind))
    message = _first_line(exc)
    name = type(exc).__name__
    return (f"{name} while {phase}: {message} (the traceback is above)" if message
            else f"{name} while {phase} (the traceback is above)")


def exit_code(exc: BaseException) -> int:
    """The process's status for ``exc``: 130 for Ctrl-C, 2 for a usage error, else 1."""
    from megatron_ext.errors import UsageError

    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, UsageError):
        return UsageError.exit_code
    return EXIT_FAILED


def wants_traceback(exc: BaseException) -> bool:
    """A bug keeps its traceback; a usage error, Ctrl-C and out-of-memory are one line."""
    from megatron_ext.errors import UsageError

    return not (isinstance(exc, (UsageError, KeyboardInterrupt))
                or oom.classify(exc) is not None)


def _print_line(line: str, exc: Optional[BaseException] = None) -> None:
    if exc is not None and wants_traceback(exc):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()


def announce(exc: BaseException, advice: Callable[[str], str] = lambda kind: "",
             default_device: str = "cuda", interrupted: str = "") -> None:
    """Reports ``exc`` once for the whole job (see the module's docstring); idempotent.

    ``advice``, ``default_device`` and ``interrupted``: as :func:`describe` takes them.

    Where the ranks have met, the first rank to fail prints the line (after its traceback,
    for a bug) and then flags the store; another failing rank prints nothing and waits up
    to :data:`PRINT_WAIT_S` for that flag. Before the ranks have met (every rank checks the
    same flags) rank 0 prints; the others wait :data:`BEFORE_RENDEZVOUS_WAIT_S` for rank 0
    to end the launch and print their own line only if they are still running then (an
    error of theirs alone).
    """
    if getattr(exc, REPORTED_ATTR, False):
        return
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, REPORTED_ATTR, True)
    job = _job
    if getattr(exc, PHASE_ATTR, None) is None:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(exc, PHASE_ATTR, "starting up" if job is None else "running")
    line = describe(exc, advice, default_device, interrupted)
    if job is None:
        _report_before_rendezvous(line, exc)
        return
    job.failing = True
    if job.world == 1:
        _print_line(line, exc)
        return
    try:
        first = int(job.store.add(job.claim_key, 1)) == 1
    except Exception:  # noqa: BLE001 - no store: better the line twice than never
        first = True
    if first:
        _print_line(line, exc)
        with contextlib.suppress(Exception):
            job.store.set(job.failed_key, str(job.rank))
        return
    _wait_for_key(job, PRINT_WAIT_S)


def _wait_for_key(job: Job, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if job.store.check([job.failed_key]):
                return
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
            return
        time.sleep(0.1)


def _launch_rank() -> tuple:
    """(rank, world) from the launcher's variables, as far as they parse; (0, 1) if not."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")).strip()
    world = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")).strip()
    if not (rank.isdigit() and world.isdigit()):
        return 0, 1
    return int(rank), int(world)


def _report_before_rendezvous(line: str, exc: Optional[BaseException]) -> None:
    rank, world = _launch_rank()
    if rank == 0 or rank >= world:
        _print_line(line, exc)
        return
    # Rank 0 checks the same flags and environment: it prints, exits, and the launcher
    # ends this process meanwhile. Still running afterwards, the error is this rank's own.
    time.sleep(BEFORE_RENDEZVOUS_WAIT_S)
    _print_line(line, exc)


def report_peer_failure(job: Job) -> None:
    """A note (not an error line: the failing rank printed that) on why this rank stops."""
    who = ""
    with contextlib.suppress(Exception):
        if job.store.check([job.failed_key]):
            who = f" (rank {job.store.get(job.failed_key).decode()})"
    print(f"rank {job.rank}: stopping: another rank of the job failed{who}; its error line "
          "says why", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- ending the process


def bounded(fn: Callable[[], object], seconds: float = TEARDOWN_S) -> bool:
    """Runs ``fn`` on a daemon thread for at most ``seconds``; whether it finished.

    Its exceptions are swallowed: after a failure, teardown is best effort.
    """
    done = threading.Event()

    def run():
        with contextlib.suppress(BaseException):
            fn()
        done.set()
    threading.Thread(target=run, name="megatron_ext-teardown", daemon=True).start()
    return done.wait(seconds)


def kill_children(grace: float = 2.0) -> None:
    """Kills every process this one started (and theirs), then reaps them.

    SIGKILL, not SIGTERM: the data-loader workers ignore SIGTERM (see the module's
    docstring), and a half-done checkpoint write is a ``.tmp`` folder nobody trusts.
    """
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        return
    with contextlib.suppress(Exception):
        children = psutil.Process().children(recursive=True)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(children, timeout=grace)


def exit_now(code: int) -> None:
    """Ends this process now with ``code``: children killed, output flushed, no exit hooks.

    ``os._exit`` on purpose: the interpreter's own exit joins non-daemon threads and
    multiprocessing children, which is where a failed run used to hang. Called by two
    threads (the main one and the watch), only the first ends the process.
    """
    if not _exit_lock.acquire(blocking=False):
        while True:  # the other thread is ending the process
            time.sleep(1.0)
    kill_children()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class PeerWatch(threading.Thread):
    """Ends this process when another rank of the job failed (a daemon thread).

    Polls the job's store every :data:`POLL_S` for the flag :func:`announce` sets; the
    store unreachable :data:`UNREACHABLE_POLLS` times in a row (rank 0, its host, is gone)
    counts as a failure too. The watch stops before the normal end of the run
    (:func:`detach`), when ranks may leave at their own pace.
    """

    def __init__(self, job: Job):
        super().__init__(name="megatron_ext-peer-watch", daemon=True)
        self.job = job
        self._halt = threading.Event()

    def stop(self) -> None:
        """Stops watching (the run ends normally)."""
        self._halt.set()

    def run(self) -> None:
        """Polls until stopped, or ends the process when another rank failed."""
        misses = 0
        while not self._halt.wait(POLL_S):
            try:
                failed = self.job.store.check([self.job.failed_key])
                misses = 0
            except Exception:  # noqa: BLE001 - the store's host is gone
                misses += 1
                failed = misses >= UNREACHABLE_POLLS
            if not failed or self._halt.is_set():
                continue
            if self.job.failing:
                return  # this rank reports and exits on its own
            report_peer_failure(self.job)
            exit_now(EXIT_FAILED)


def run_main(body: Callable[[], int]) -> int:
    """Runs the entry point's ``body``; every way it fails becomes one line and a status.

    A failure before the ranks have met returns its status (the in-process callers, tests
    among them, go on); once they have, the report is followed by :func:`exit_now`.
    """
    try:
        return body()
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure is reported the same way
        announce(exc)
        if _job is None:
            # Nothing has started that could keep the process alive (no process group, no
            # workers, no threads): the caller may go on (in-process callers, tests).
            return exit_code(exc)
        exit_now(exit_code(exc))
        raise  # not reached
