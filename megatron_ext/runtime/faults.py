"""Fault injection for the test suite: one typed config, a no-op by default.

Like megatron-core's ``fault_injector.py``, faults are declared in one place and checked
when the config is made, not parsed where they fire. A rule is ``kind:arg:arg``; several are
joined by ``;``. Each site asks :class:`Faults` for the rules of its kind and acts on them;
with no rule given every question answers "none", so a production run pays one empty-list
test per site.

Checkpoint faults (``MEGATRON_EXT_CHECKPOINT_FAULT``):

* ``enospc:ITERATION``: the save of that iteration fails with ENOSPC after the model and
  optimizer files are written (as a file system that fills during the save would).

Offload faults (``MEGATRON_EXT_OFFLOAD_FAULT``):

* ``kill-in-flush:STEP``: SIGKILL in the middle of a state write at STEP, leaving a partial
  temp file and the lock held;
* ``corrupt-after-flush:STEP``: flip one payload byte of a file just written at STEP;
* ``enospc:PATH``: writes to path index PATH fail with ENOSPC;
* ``slow:PATH:FACTOR:STEP``: from STEP on, I/O on PATH takes FACTOR times as long;
* ``vanish:PATH:STEP``: this rank's directory on PATH disappears at the start of STEP.

Crashes (``MEGATRON_EXT_FAULTS``): ``PLACE:ITERATION[:ERROR[:RANK]]`` raises ERROR at PLACE
in iteration ITERATION (on RANK only, when given), to test that every failure ends the job
promptly with one line (:mod:`megatron_ext.runtime.fatal`). ERROR is ``error`` (a
RuntimeError, the default), ``oom`` (torch's CUDA out-of-memory error, with its message) or
``host-oom`` (a MemoryError, as numpy raises it). The places:

* ``forward``, ``backward``: the forward step of the iteration's first micro-batch; the
  backward through its loss (raised inside autograd);
* ``optimizer``: just before the optimizer step;
* ``data``: in a data-loader worker, loading a sample of the iteration (constant batch);
* ``save``: the checkpoint save of the iteration, once this rank's files are written and
  before the checkpoint is published;
* ``offload-io``: the offload engine's fetch or flush thread, at its first read or write
  once the loop has reached the iteration;
* ``zenflow-worker``: ZenFlow's CPU worker threads, at their first task once the loop has
  reached the iteration.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
from typing import Dict, List, Optional, Sequence

from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import knob

CHECKPOINT_ENV = "MEGATRON_EXT_CHECKPOINT_FAULT"
OFFLOAD_ENV = "MEGATRON_EXT_OFFLOAD_FAULT"
CRASH_ENV = "MEGATRON_EXT_FAULTS"

PLACES = ("forward", "backward", "optimizer", "data", "save", "offload-io", "zenflow-worker")
"""Where a crash can be injected (see the module's docstring)."""
THREAD_PLACES = ("offload-io", "zenflow-worker")
"""Places on threads that do not know the iteration: they fire once the loop reached it."""
ERRORS = ("error", "oom", "host-oom")

Rules = Sequence[Sequence[str]]
"""Parsed rules: one ``[kind, arg, ...]`` per rule, in the order given (lists in the config,
which goes through JSON to wandb unchanged)."""


def _split(text: str) -> List[List[str]]:
    return [part.split(":") for part in text.split(";") if part]


def parse_checkpoint_faults(text: str) -> Rules:
    """The rules of ``MEGATRON_EXT_CHECKPOINT_FAULT`` (``enospc:ITERATION`` only)."""
    rules = _split(text)
    for rule in rules:
        if rule[0] != "enospc" or len(rule) != 2 or not rule[1].isdigit():
            raise UsageError(f"{CHECKPOINT_ENV}={text}: give enospc:ITERATION (faults for "
                             "tests), or unset it")
    return rules


def parse_offload_faults(text: str) -> Rules:
    """The rules of ``MEGATRON_EXT_OFFLOAD_FAULT``, split but taken as given (see above)."""
    return _split(text)


def parse_crash_faults(text: str) -> Rules:
    """The rules of ``MEGATRON_EXT_FAULTS``: ``PLACE:ITERATION[:ERROR[:RANK]]`` (see above)."""
    rules = _split(text)
    for rule in rules:
        ok = (2 <= len(rule) <= 4 and rule[0] in PLACES and rule[1].isdigit()
              and (len(rule) < 3 or rule[2] in ERRORS) and (len(rule) < 4 or rule[3].isdigit()))
        if not ok:
            raise UsageError(f"{CRASH_ENV}={text}: give PLACE:ITERATION[:ERROR[:RANK]] joined by "
                             f"';', PLACE one of {', '.join(PLACES)}, ERROR one of "
                             f"{', '.join(ERRORS)} (faults for tests), or unset it")
    return rules


@dataclasses.dataclass
class FaultConfig:
    """Faults injected by the test suite (none by default)."""

    checkpoint_fault: Rules = knob([], env=CHECKPOINT_ENV, parse=parse_checkpoint_faults,
                                   metavar="RULES")
    """Checkpoint faults, ``enospc:ITERATION`` joined by ';' (see runtime/faults.py)."""

    offload_fault: Rules = knob([], env=OFFLOAD_ENV, parse=parse_offload_faults,
                                metavar="RULES")
    """Offload engine faults: kill-in-flush:STEP, corrupt-after-flush:STEP, enospc:PATH,
    slow:PATH:FACTOR:STEP, vanish:PATH:STEP, joined by ';' (see runtime/faults.py)."""

    crash: Rules = knob([], env=CRASH_ENV, parse=parse_crash_faults, flag="--crash-fault",
                        metavar="RULES")
    """Crashes: PLACE:ITERATION[:ERROR[:RANK]] joined by ';', PLACE one of forward, backward,
    optimizer, data, save, offload-io, zenflow-worker; ERROR one of error, oom, host-oom
    (see runtime/faults.py)."""


class Faults:
    """The rules of one site's kind of faults; empty (a no-op) unless a test gave some."""

    def __init__(self, rules: Rules = ()):
        self.rules = rules
        self._by_kind: Dict[str, List[List[str]]] = {}
        for rule in rules:
            self._by_kind.setdefault(rule[0], []).append(list(rule[1:]))

    def get(self, kind: str) -> List[List[str]]:
        """The arguments of every rule of ``kind``, in the order given."""
        return self._by_kind.get(kind, [])

    def check_save(self, iteration: int) -> None:
        """Raises the injected ENOSPC at the save of ``iteration`` (checkpoint faults).

        The armed crash of place ``save`` (:func:`crash_point`) fires here too.
        """
        for (at,) in self.get("enospc"):
            if int(at) == iteration:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "(injected fault)")
        crash_point("save", iteration)


# torch's own messages (c10's CUDA caching allocator; numpy's array allocation), so that the
# one-line report is tested on what a real out-of-memory says.
CUDA_OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
    "of which 1.10 GiB is free. Including non-PyTorch memory, this process has 138.70 GiB "
    "memory in use. Of the allocated memory 135.20 GiB is allocated by PyTorch, and 1.50 GiB "
    "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
    "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
HOST_OOM_MESSAGE = ("Unable to allocate 3.00 GiB for an array with shape (805306368,) and data "
                    "type float32")


def injected_error(kind: str, place: str) -> BaseException:
    """The exception a crash rule raises: ``error``, ``oom`` or ``host-oom``."""
    if kind == "oom":
        import torch

        return torch.OutOfMemoryError(CUDA_OOM_MESSAGE)
    if kind == "host-oom":
        return MemoryError(HOST_OOM_MESSAGE)
    return RuntimeError(f"injected fault at {place}")


class Crashes:
    """The crash rules of one process (``MEGATRON_EXT_FAULTS``); none by default.

    Args:
        rules: the parsed rules (``FaultConfig.crash``).
        rank: this process's rank (a rule with a rank fires on that rank only).
    """

    def __init__(self, rules: Rules = (), rank: int = 0):
        self.rules = [list(rule) for rule in rules]
        self.rank = rank
        self.iteration = 0
        """The loop's iteration (:meth:`reached`), for the places on threads."""
        self._fired: set = set()
        self._lock = threading.Lock()

    def __getstate__(self):  # for a spawned data-loader worker: no lock to pickle
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reached(self, iteration: int) -> None:
        """The loop starts ``iteration`` (the thread places go by it)."""
        self.iteration = iteration

    def check(self, place: str, iteration: Optional[int] = None) -> None:
        """Raises the injected error of a rule for ``place`` at ``iteration``.

        Without ``iteration`` (a thread's place) a rule fires once, at the first check
        after the loop reached its iteration.
        """
        if not self.rules:
            return
        for index, rule in enumerate(self.rules):
            if rule[0] != place or (len(rule) > 3 and int(rule[3]) != self.rank):
                continue
            at = int(rule[1])
            if iteration is not None and iteration != at:
                continue
            if iteration is None:
                with self._lock:
                    if self.iteration < at or index in self._fired:
                        continue
                    self._fired.add(index)
            raise injected_error(rule[2] if len(rule) > 2 else "error", place)


_armed = Crashes()


def arm(crashes: Crashes) -> None:
    """Makes ``crashes`` the rules :func:`crash_point` checks, for the life of the run.

    Why process-wide: the places on the engines' threads are reached through objects built
    without the run's config; the rules are fixed when the run starts and are a no-op
    unless a test gave some.
    """
    global _armed
    _armed = crashes


def armed() -> Crashes:
    """The rules of the run (none unless :func:`arm` was given some)."""
    return _armed


def crash_point(place: str, iteration: Optional[int] = None) -> None:
    """Raises the armed crash of ``place`` (see :meth:`Crashes.check`); a no-op by default."""
    _armed.check(place, iteration)


def crashes_in_backward(tensor, iteration: int):
    """``tensor`` unchanged, but its backward raises the ``backward`` crash of ``iteration``.

    Without a ``backward`` rule ``tensor`` itself (no autograd node is added).
    """
    if not any(rule[0] == "backward" for rule in _armed.rules):
        return tensor
    return _raise_in_backward().apply(tensor, iteration)


def _raise_in_backward():
    import torch

    class RaiseInBackward(torch.autograd.Function):
        """Identity forward; the backward checks the ``backward`` crash (inside autograd)."""

        @staticmethod
        def forward(ctx, tensor, iteration):
            ctx.iteration = iteration
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx, grad):
            crash_point("backward", ctx.iteration)
            return grad, None

    return RaiseInBackward
