"""How much host memory this process may still take: the one measurement of it.

The kernel's ``MemAvailable`` is the node's; a job often runs under a tighter bound that the
node does not show: a memory cgroup (Slurm's ``task/cgroup`` with ``--mem``, a container's
limit), whose excess the kernel's OOM killer answers with SIGKILL, or an address-space
limit (``ulimit -v``), whose excess fails the allocation. :func:`host_available` is the
smallest of the three rooms, and names the one that bounds it, so the memory plan and the
offload engine's auto sizes (which both read it) stay inside the job's real limit.

Pure where it can be: the readers take their files' paths, so tests give them fake trees.
"""

from __future__ import annotations

import dataclasses
import os
import resource
from typing import List, Optional, Tuple

__all__ = ["HostAvailable", "host_available", "cgroup_room", "address_space_limit",
           "address_space_room", "read_meminfo"]

# A cgroup limit at or above this is "no limit" (v1 writes 2^63 rounded down to a page).
_UNLIMITED = 1 << 60


@dataclasses.dataclass(frozen=True)
class HostAvailable:
    """Bytes the process may still allocate, and what bounds them.

    Attributes:
        bytes: the smallest room of the three.
        source: ``"MemAvailable"``, ``"the memory cgroup <path>"`` or ``"ulimit -v"``.
    """

    bytes: int
    source: str


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def read_meminfo(meminfo: str = "/proc/meminfo") -> str:
    """/proc/meminfo's text ('' where there is none)."""
    return _read(meminfo) or ""


def mem_available(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """The kernel's MemAvailable in bytes (None where it does not say)."""
    text = read_meminfo(meminfo)
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _stat_field(text: str, names: Tuple[str, ...]) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names:
            return int(parts[1])
    return 0


def _cgroup_dirs(proc_cgroup: str, root: str) -> List[Tuple[str, str, str]]:
    """(directory, limit file, usage file) of this process's memory cgroup and its
    ancestors, v2 (the unified hierarchy) and v1 (the memory controller)."""
    dirs = []
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one hierarchy, at the root or at root/unified
            bases = [root, os.path.join(root, "unified")]
            names = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            bases = [os.path.join(root, "memory")]
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for base in bases:
            here = path.strip("/")
            while True:
                directory = os.path.join(base, here) if here else base
                if os.path.isfile(os.path.join(directory, names[0])):
                    dirs.append((directory, *names))
                if not here:
                    break
                here = os.path.dirname(here)
    return dirs


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup",
                root: str = "/sys/fs/cgroup") -> Optional[Tuple[int, str]]:
    """(bytes, directory) of the tightest memory cgroup over this process: its limit less
    what it holds (less the inactive page cache, which the kernel reclaims before it kills);
    None where no cgroup limits memory."""
    best = None
    for directory, limit_name, usage_name in _cgroup_dirs(proc_cgroup, root):
        limit_text = (_read(os.path.join(directory, limit_name)) or "").strip()
        if not limit_text or limit_text == "max" or int(limit_text) >= _UNLIMITED:
            continue
        usage = int((_read(os.path.join(directory, usage_name)) or "0").strip() or 0)
        stat = _read(os.path.join(directory, "memory.stat")) or ""
        usage -= min(usage, _stat_field(stat, ("total_inactive_file", "inactive_file")))
        room = max(0, int(limit_text) - usage)
        if best is None or room < best[0]:
            best = (room, directory)
    return best


def address_space_limit() -> Optional[int]:
    """The address-space limit of this process (``ulimit -v``) in bytes; None: unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def address_space_room(status: str = "/proc/self/status") -> Optional[int]:
    """The soft RLIMIT_AS (``ulimit -v``) less the process's VmSize; None when unlimited."""
    limit = address_space_limit()
    if limit is None:
        return None
    size = _stat_field((_read(status) or "").replace("kB", ""), ("VmSize:",)) * 1024
    return max(0, limit - size)


def host_available(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                   cgroup_root: str = "/sys/fs/cgroup",
                   status: str = "/proc/self/status") -> Optional[HostAvailable]:
    """The smallest of MemAvailable, the memory cgroup's room and ``ulimit -v``'s room
    (None where the kernel says none of them)."""
    rooms = []
    available = mem_available(meminfo)
    if available is not None:
        rooms.append(HostAvailable(available, "MemAvailable"))
    cgroup = cgroup_room(proc_cgroup, cgroup_root)
    if cgroup is not None:
        rooms.append(HostAvailable(cgroup[0], f"the memory cgroup {cgroup[1]}"))
    address = address_space_room(status)
    if address is not None:
        rooms.append(HostAvailable(address, "ulimit -v"))
    return min(rooms, key=lambda room: room.bytes) if rooms else None
