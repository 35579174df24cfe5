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
"""

from __future__ import annotations

import dataclasses
import errno
import os
from typing import Dict, List, Sequence

from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import knob

CHECKPOINT_ENV = "MEGATRON_EXT_CHECKPOINT_FAULT"
OFFLOAD_ENV = "MEGATRON_EXT_OFFLOAD_FAULT"

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
        """Raises the injected ENOSPC at the save of ``iteration`` (checkpoint faults)."""
        for (at,) in self.get("enospc"):
            if int(at) == iteration:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "(injected fault)")
