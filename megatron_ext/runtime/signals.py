"""SIGTERM / SIGUSR1 -> save and exit at the next iteration boundary.

Slurm sends SIGTERM at preemption and, with ``--signal=USR1@T``, SIGUSR1 T seconds before
the time limit. The handler only records the signal; the loop asks every rank at each
boundary (one tiny all-reduce) so that all ranks stop at the same iteration. The
all-reduce runs on the host (gloo): a flag on the GPU would be one H2D and one D2H copy
per iteration, and a small copy waits behind the large ones an optimizer may have in
flight on its side streams (ZenFlow's delayed gradients), stalling every iteration.
"""

from __future__ import annotations

import contextlib
import signal

import torch

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# What a save's helper processes must survive: the exit signals, and SIGINT (Ctrl-C reaches
# the whole foreground process group).
SHIELDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@contextlib.contextmanager
def shielded_helpers():
    """Blocks the exit signals in this thread while a save forks its helper processes.

    megatron-core's checkpoint writer forks worker processes. ``kill -TERM -- -PGID``,
    ``scancel`` and Ctrl-C signal every process of the job, these workers too: killed,
    they take the save at the signal with them. A forked child inherits the blocked mask,
    so the workers finish their writes (and exit, discarding the pending signal); this
    process receives a signal that arrived meanwhile when the mask is restored (recorded
    by :class:`ExitSignalHandler`, or acted on as usual outside the loop).
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class ExitSignalHandler:
    """Records exit signals; :meth:`should_exit` agrees on them across ranks."""

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        self.received = signum

    def should_exit(self, group) -> bool:
        """True on every rank when any rank received an exit signal.

        ``group``: a host (gloo) group of all ranks, where they agree with a collective;
        None for a single process (nothing to agree on).
        """
        received = self.received is not None
        if group is None:
            return received
        flag = torch.tensor([int(received)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(flag.item())
