"""SIGTERM / SIGUSR1 -> save and exit at the next iteration boundary.

Slurm sends SIGTERM at preemption and, with ``--signal=USR1@T``, SIGUSR1 T seconds before
the time limit. The handler only records the signal; the loop asks every rank at each
boundary (one tiny all-reduce) so that all ranks stop at the same iteration.
"""

from __future__ import annotations

import signal

import torch

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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

    def should_exit(self, device) -> bool:
        """True on every rank when any rank received an exit signal (a collective)."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32,
                            device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
