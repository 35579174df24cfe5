"""Out of memory in one line: which memory, what was asked, what was free, what to try.

torch's CUDA out-of-memory error is a paragraph, and the traceback above it sixty lines; a
host that runs out raises ``MemoryError`` (numpy), a ``RuntimeError`` (torch's CPU
allocator) or, under ``ulimit -v``, an ``ImportError`` while a library maps its segments
or a ``RuntimeError`` (EAGAIN) where a thread cannot map its stack.
:func:`classify` tells them apart from any other error and :func:`oom_line` writes the
line: ``out of memory on cuda:0 while <phase> (asked 2.00 GiB, 1.10 GiB free of 139.81
GiB): <advice>``. Pure functions of the messages (and of /proc/meminfo's text), so they are
tested on the messages themselves.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from megatron_ext.runtime.host_memory import address_space_limit, read_meminfo

GIB = 1 << 30
_UNITS = {"b": 1, "bytes": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*(bytes|[KMGT]i?B|B)"

_DEVICE_MARKERS = ("CUDA out of memory", "CUDA error: out of memory", "HIP out of memory")
_HOST_MARKERS = ("DefaultCPUAllocator: can't allocate memory", "failed to map segment",
                 "Cannot allocate memory", "std::bad_alloc")
# EAGAIN: what starting a thread says when its stack cannot be mapped (see classify).
_THREAD_MARKER = "Resource temporarily unavailable"


@dataclasses.dataclass
class Shortage:
    """What ran out, as far as the message and the machine tell.

    Attributes:
        device: ``cuda:N`` for GPU memory, ``host`` for the host's.
        asked: bytes of the allocation that failed (None: not in the message).
        free: bytes free on that memory when it failed (None: unknown).
        total: the memory's size (None: unknown).
        limit: the process's address-space limit (``ulimit -v``; None: unlimited).
    """

    device: str
    asked: Optional[int] = None
    free: Optional[int] = None
    total: Optional[int] = None
    limit: Optional[int] = None


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.lower()])


def _find(pattern: str, text: str) -> Optional[int]:
    match = re.search(pattern, text)
    return _bytes(match.group(1), match.group(2)) if match else None


def size_text(nbytes: Optional[int]) -> str:
    """``2.00 GiB``, ``512.00 MiB``; ``?`` when unknown."""
    if nbytes is None:
        return "?"
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / (1 << 20):.2f} MiB"


def classify(exc: BaseException, limited: Optional[bool] = None) -> Optional[str]:
    """``device`` for GPU out-of-memory, ``host`` for the host's, None for other errors.

    Args:
        exc: the error.
        limited: whether the process runs under an address-space limit (``ulimit -v``;
            read from the process by default). Under one, a thread that cannot be started
            (``Resource temporarily unavailable``: no room to map its stack, e.g. gloo's
            process-group threads) is the host's memory too; without one that message
            means something else (a busy resource) and stays an ordinary error.
    """
    name = type(exc).__name__
    first = str(exc)
    if name == "OutOfMemoryError" or any(m in first for m in _DEVICE_MARKERS):
        return "device"
    if isinstance(exc, MemoryError):
        return "host"
    if isinstance(exc, (RuntimeError, ImportError, OSError)) and any(
            m in first for m in _HOST_MARKERS):
        return "host"
    if isinstance(exc, (RuntimeError, OSError)) and _THREAD_MARKER in first:
        if limited is None:
            limited = address_space_limit() is not None
        if limited:
            return "host"
    return None


def device_shortage(message: str, default_device: str = "cuda") -> Shortage:
    """Parses torch's CUDA out-of-memory message (the current and the pre-2.1 wording).

    ``CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81
    GiB of which 1.10 GiB is free. ...``; before torch 2.1: ``Tried to allocate 2.00 GiB
    (GPU 0; 79.15 GiB total capacity; ...; 1.10 GiB free; ...)``.
    """
    gpu = re.search(r"GPU\s+(\d+)", message)
    shortage = Shortage(device=f"cuda:{gpu.group(1)}" if gpu else default_device)
    shortage.asked = _find(r"[Tt]ried to allocate\s+" + _SIZE, message)
    now = re.search(r"total capacity of\s+" + _SIZE + r"\s+of which\s+" + _SIZE + r"\s+is free",
                    message)
    if now:
        shortage.total = _bytes(now.group(1), now.group(2))
        shortage.free = _bytes(now.group(3), now.group(4))
    else:
        shortage.total = _find(_SIZE + r"\s+total capacity", message)
        shortage.free = _find(_SIZE + r"\s+free", message)
    return shortage


def host_shortage(message: str, meminfo: str = "") -> Shortage:
    """The host's shortage: the asked size from the message, free and total from meminfo.

    ``meminfo``: the text of /proc/meminfo (MemAvailable and MemTotal, in kB); empty when
    unreadable.
    """
    asked = _find(r"you tried to allocate\s+(\d+)\s+(bytes)", message)
    if asked is None:
        asked = _find(r"Unable to allocate\s+" + _SIZE, message)
    fields = {}
    for line in meminfo.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return Shortage(device="host", asked=asked, free=fields.get("MemAvailable"),
                    total=fields.get("MemTotal"))


def shortage_of(exc: BaseException, kind: str, default_device: str = "cuda") -> Shortage:
    """The :class:`Shortage` of an out-of-memory error of ``kind`` (see :func:`classify`)."""
    message = str(exc)
    if kind == "device":
        return device_shortage(message, default_device)
    shortage = host_shortage(message, read_meminfo())
    shortage.limit = address_space_limit()
    return shortage


def oom_line(shortage: Shortage, phase: str, advice: str) -> str:
    """The one line (without ``error: ``) that says what ran out and what to try."""
    where = "the host" if shortage.device == "host" else shortage.device
    free = "available" if shortage.device == "host" else "free"
    facts = [f"asked {size_text(shortage.asked)}"] if shortage.asked is not None else []
    if shortage.free is not None:
        total = f" of {size_text(shortage.total)}" if shortage.total is not None else ""
        facts.append(f"{size_text(shortage.free)} {free}{total}")
    if shortage.limit is not None:
        facts.append(f"ulimit -v {size_text(shortage.limit)}")
    detail = f" ({', '.join(facts)})" if facts else ""
    tail = f": {advice}" if advice else ""
    return f"out of memory on {where} while {phase}{detail}{tail}"
