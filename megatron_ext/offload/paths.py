"""Tier paths: the ``--offload-paths`` items and the free space on them.

``--offload-paths`` names several directories (node-local NVMe, parallel-file-system
scratch, ...) that together hold the optimizer-state subgroups the host cache cannot. Each
step every non-cached subgroup is read once and written once, so a path's useful speed is
its *effective* bandwidth for one read plus one write of the same bytes
(:attr:`TierSpec.effective_gbps`), which is what placement weighs.

This module holds what a path *is*, apart from how it is measured (:mod:`.probe`) and what
is put on it (:mod:`.placement`):

* :class:`TierSpec`: a directory and its read/write bandwidths, when known;
* :func:`parse_tier_spec` / :func:`format_tier_spec`: ``DIR[@READ_GBPS[,WRITE_GBPS]]``,
  the command line's form of a spec (tools/probe_tiers.py prints it);
* :func:`check_free_space` and :class:`TierFullError`: the "clear error before any state
  is lost" check, shared by the engine, placement and the probe tool;
* :func:`human_bytes`: sizes in those errors' messages.

Units: bandwidths in GB/s (10**9 bytes per second); sizes in bytes.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_ext.errors import UsageError

__all__ = [
    "TierSpec",
    "TierFullError",
    "parse_tier_spec",
    "format_tier_spec",
    "check_free_space",
    "human_bytes",
]

_BANDWIDTH_FORMAT = "bandwidths must be positive numbers in GB/s, as DIR@READ_GBPS,WRITE_GBPS"


class TierFullError(UsageError):
    """The tier paths lack the free space that the subgroups need.

    Attributes:
        needed_bytes: the bytes that had to fit (all subgroups, or the one that did not).
        free_bytes: the free bytes of each path considered (``None``: unlimited).
    """

    def __init__(self, message: str, needed_bytes: int,
                 free_bytes: Sequence[Optional[int]]):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = list(free_bytes)


@dataclass
class TierSpec:
    """One directory of the virtual tier and its bandwidths, when known.

    Attributes:
        path: the directory that holds this tier's subgroup files.
        read_gbps: sequential read bandwidth in GB/s; ``None`` until given or probed.
        write_gbps: sequential write bandwidth in GB/s; ``None`` until given or probed.
    """

    path: str
    read_gbps: Optional[float] = None
    write_gbps: Optional[float] = None

    def __post_init__(self):
        for name in ("read_gbps", "write_gbps"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"TierSpec.{name} must be a positive number, got {value!r}")

    @property
    def effective_gbps(self) -> Optional[float]:
        """GB/s for one read plus one write of the same bytes: 1 / (1/R + 1/W).

        This is what a step costs per subgroup byte on this path (read, update, write
        back); ``None`` unless both bandwidths are known.
        """
        if self.read_gbps is None or self.write_gbps is None:
            return None
        return 1.0 / (1.0 / self.read_gbps + 1.0 / self.write_gbps)


def parse_tier_spec(text: str, flag: str = "--offload-paths") -> TierSpec:
    """Parses one ``--offload-paths`` item: ``DIR``, ``DIR@GBPS`` or ``DIR@READ,WRITE``.

    The text is split at its last ``@``. What follows is a bandwidth spec unless it
    contains a ``/``: then the ``@`` belongs to the directory (``/scratch/u@site/run``).
    A directory whose *last* component contains ``@`` is written with a trailing ``/``
    (``/scratch/u@site/``, or ``/scratch/u@site/@2,1`` with bandwidths);
    :func:`format_tier_spec` does so. One number means read = write.

    Args:
        text: the item as given on the command line.
        flag: the flag named in error messages.

    Returns:
        The spec; bandwidths are ``None`` when not given.

    Raises:
        UsageError: empty directory, or bandwidths that are not positive finite numbers.
    """
    if not text.strip():
        raise UsageError(f"{flag}: empty directory name")
    head, sep, tail = text.rpartition("@")
    if not sep or "/" in tail:
        return TierSpec(path=text)
    if not head:
        raise UsageError(f"{flag} {text}: missing directory before '@' "
                         "(expected DIR@READ_GBPS,WRITE_GBPS)")
    parts = tail.split(",")
    values = [_positive_float(part) for part in parts]
    if len(parts) > 2 or any(value is None for value in values):
        hint = ""
        if not any(ch.isdigit() for ch in tail):
            hint = " (a directory whose name contains '@' is written with a trailing '/')"
        raise UsageError(f"{flag} {text}: {_BANDWIDTH_FORMAT}{hint}")
    read_gbps = values[0]
    write_gbps = values[1] if len(values) == 2 else read_gbps
    return TierSpec(path=head, read_gbps=read_gbps, write_gbps=write_gbps)


def format_tier_spec(spec: TierSpec) -> str:
    """The ``--offload-paths`` item that :func:`parse_tier_spec` reads back as ``spec``.

    Bandwidths are written with 2 decimals (3 significant digits below 0.01 GB/s, so that a
    slow path is not written as the invalid 0.00), and only when both are known.
    """
    path = spec.path
    if "@" in path and "/" not in path.rpartition("@")[2]:
        path += "/"
    if spec.read_gbps is None or spec.write_gbps is None:
        return path
    return f"{path}@{_format_gbps(spec.read_gbps)},{_format_gbps(spec.write_gbps)}"


def _format_gbps(value: float) -> str:
    return f"{value:.2f}" if value >= 0.01 else f"{value:.3g}"


def _positive_float(text: str) -> Optional[float]:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def check_free_space(path: str, needed_bytes: int) -> int:
    """Free bytes of ``path``'s file system, or a clear error when short of ``needed_bytes``.

    "Free" is what an unprivileged process may use (``f_bavail``, as ``shutil.disk_usage``
    reports), not the blocks reserved for root.

    Args:
        path: a directory of the tier.
        needed_bytes: the bytes about to be written there.

    Returns:
        The free bytes.

    Raises:
        UsageError: ``path`` does not exist.
        TierFullError: fewer than ``needed_bytes`` are free.
    """
    try:
        free = shutil.disk_usage(path).free
    except FileNotFoundError:
        raise UsageError(f"--offload-paths {path}: directory not found") from None
    if needed_bytes > free:
        raise TierFullError(
            f"--offload-paths {path}: needs {human_bytes(needed_bytes)} but only "
            f"{human_bytes(free)} is free; free space, or add a path or host cache",
            needed_bytes, [free])
    return free


def human_bytes(num: float) -> str:
    """``num`` bytes in decimal units, as the free-space errors print them: ``1.20 GB``."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(num) < 1000:
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1000
    return f"{num:.2f} TB"
