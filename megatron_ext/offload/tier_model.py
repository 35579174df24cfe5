"""The model of the state tiers: where does a subgroup live, who updates it.

A rank's optimizer-state subgroups live in a hierarchy: spare memory of the model's device
(the device tier), the host cache (pinned on GPU machines), and files on the tier paths
(:mod:`.paths`, placed by :mod:`.placement`). The engine runs the pipeline; the decisions
it asks about are the records and pure functions here (no I/O, no clock, no torch):

* where a subgroup lives: :class:`TierKind` and :class:`Tier` (``DEVICE_TIER``,
  ``HOST_TIER``, or a path index);
* which subgroups the device tier holds: :func:`spread` and :func:`fixed_device_subgroups`
  for a fixed budget; :func:`device_budget` and :func:`resize_device_tier` for ``auto``
  sizing from the measured peak memory of an iteration;
* who updates a host subgroup: :class:`Updater` (device, CPU, or streamed through the
  device); :func:`stream_rate`, :func:`stream_share`, :func:`split_updates` and
  :class:`UpdateRates` split the host subgroups between CPU Adam and the stream so that
  both sides end together;
* how much the ``auto`` sizes give the host cache and each path:
  :func:`pipeline_host_bytes`, :func:`host_cache_budget` and :func:`path_room`;
* the I/O floor of a step: :func:`steady_path_io` (the bytes that must cross each path per
  step, given where the subgroups live and what the cache keeps) and :func:`io_floor`
  (those bytes over the paths' bandwidths).

Units: bandwidths in GB/s (10**9 bytes per second); sizes in bytes; rates in elements per
second.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = [
    "DEVICE_TIER",
    "HOST_TIER",
    "Tier",
    "TierKind",
    "UpdateRates",
    "Updater",
    "device_budget",
    "fixed_device_subgroups",
    "host_cache_budget",
    "io_floor",
    "path_room",
    "pipeline_host_bytes",
    "resize_device_tier",
    "split_updates",
    "spread",
    "stream_rate",
    "steady_path_io",
    "stream_share",
]

_GB = 1e9


class TierKind(enum.Enum):
    """Where a subgroup's state lives."""

    DEVICE = "device"
    """In the model device's memory, updated there by a fused Adam; no PCIe traffic."""
    HOST = "host"
    """In the host cache (pinned on GPU machines), with or without a file on a path."""
    PATH = "path"
    """In a file on one of the --offload-paths (fetched into the host cache to update)."""


@dataclass(frozen=True)
class Tier:
    """A subgroup's place in the hierarchy: a kind and, for PATH, the path index."""

    kind: TierKind
    path: Optional[int] = None

    def __str__(self) -> str:
        return self.kind.value if self.path is None else f"path{self.path}"


DEVICE_TIER = Tier(TierKind.DEVICE)
HOST_TIER = Tier(TierKind.HOST)


class Updater(enum.Enum):
    """Who runs a subgroup's Adam step."""

    DEVICE = "device"
    """Its states are on the device: the fused device Adam, in place."""
    CPU = "cpu"
    """CPU Adam on the host buffer (the one-pass host AdamW on GPU machines)."""
    STREAM = "stream"
    """States H2D, the fused device Adam, states D2H (copies on their own streams)."""


def spread(count: int, n: int) -> List[int]:
    """``count`` of the indices ``0..n-1``, evenly spread.

    The first one sits at the middle of its stretch, so that device-tier subgroups
    interleave with those that need I/O.
    """
    if not 0 <= count <= n:
        raise ValueError(f"spread: count {count} not in [0, {n}]")
    return [(2 * k + 1) * n // (2 * count) for k in range(count)]


def fixed_device_subgroups(sizes: Sequence[int], budget_bytes: int) -> List[int]:
    """The subgroups a device tier of ``budget_bytes`` holds (placement fills it first).

    As many subgroups as fit, taking the largest count ``k`` whose ``k`` evenly spread
    subgroups (:func:`spread`) fit in the budget.

    Args:
        sizes: bytes of each subgroup's state.
        budget_bytes: bytes of device memory for states.

    Returns:
        The chosen subgroup indices, ascending.
    """
    if budget_bytes <= 0 or not sizes:
        return []
    best: List[int] = []
    lo, hi = 0, len(sizes)
    while lo <= hi:
        mid = (lo + hi) // 2
        chosen = spread(mid, len(sizes))
        if sum(sizes[i] for i in chosen) <= budget_bytes:
            best, lo = chosen, mid + 1
        else:
            hi = mid - 1
    return best


def device_budget(limit_bytes: int, peak_bytes: int, state_bytes: int,
                  reserve_bytes: int) -> int:
    """Bytes of device memory the device tier may hold (``auto`` sizing).

    ``peak_bytes`` is the peak allocated memory of a training iteration as measured, which
    includes the device tier's own ``state_bytes`` (they stay allocated throughout): what
    the rest of the iteration needs is the difference, and the tier gets what is left of
    ``limit_bytes`` after it and a safety ``reserve_bytes`` (fragmentation, evaluation,
    checkpointing, other processes).
    """
    others = max(0, peak_bytes - state_bytes)
    return max(0, limit_bytes - reserve_bytes - others)


def resize_device_tier(members: Sequence[int], sizes: Sequence[int], budget_bytes: int,
                       candidates: Sequence[int]) -> Tuple[List[int], List[int]]:
    """Which subgroups join or leave the device tier to fit ``budget_bytes``.

    Args:
        members: the device tier's subgroups, in the order they joined.
        sizes: bytes of each subgroup's state.
        budget_bytes: what the tier may hold now (:func:`device_budget`).
        candidates: subgroups that may join, most wanted first; empty once the tier is
            sized (it then only gives memory back).

    Returns:
        (joining, leaving): subgroups to move up, in order, while they fit; or subgroups
        to move down (the last to join leave first) until the rest fits.
    """
    used = sum(sizes[i] for i in members)
    if used > budget_bytes:
        leaving = []
        for index in reversed(members):
            if used <= budget_bytes:
                break
            leaving.append(index)
            used -= sizes[index]
        return [], leaving
    joining = []
    for index in candidates:
        if index in members:
            continue
        if used + sizes[index] > budget_bytes:
            continue
        joining.append(index)
        used += sizes[index]
    return joining, []


def stream_rate(bytes_per_element: float, h2d_gbps: float, d2h_gbps: float,
                device_rate: float) -> float:
    """Elements per second of the streamed update when its three stages overlap.

    States go up and come back in full (``bytes_per_element`` each way, on two copy
    streams), so the pipeline runs at its slowest stage: a copy direction or the device's
    Adam (``device_rate`` elements/s).
    """
    return min(h2d_gbps * _GB / bytes_per_element, d2h_gbps * _GB / bytes_per_element,
               device_rate)


def stream_share(cpu_rate: Optional[float], stream_elements_rate: Optional[float],
                 prior: float = 0.5) -> float:
    """The share of the host subgroups' elements to stream, so both sides end together.

    With CPU Adam at ``c`` and the stream at ``s`` elements/s, streaming a share ``f`` of
    ``N`` elements takes ``f N / s`` and the CPU's part ``(1 - f) N / c``: equal at
    ``f = s / (s + c)``. ``prior`` until both rates are measured.
    """
    if not cpu_rate or not stream_elements_rate:
        return prior
    return stream_elements_rate / (stream_elements_rate + cpu_rate)


def split_updates(sizes: Sequence[int], share: float) -> List[bool]:
    """Which of the host subgroups (in the step's order) are streamed: True = streamed.

    Error diffusion over the elements: subgroup ``k`` is streamed when that keeps the
    streamed elements so far closest to ``share`` of all elements so far, so the two kinds
    interleave and both sides start at once. ``share`` 0 streams none, 1 all.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"split_updates: share must be in [0, 1], got {share}")
    out: List[bool] = []
    total = streamed = 0
    for size in sizes:
        total += size
        with_it = abs(streamed + size - share * total)
        without = abs(streamed - share * total)
        take = with_it < without or (with_it == without and share >= 0.5)
        if share == 0.0:
            take = False
        elif share == 1.0:
            take = True
        out.append(take)
        if take:
            streamed += size
    return out


class UpdateRates:
    """Measured update throughputs (elements/s), smoothed: CPU Adam and the stream.

    Fed timings by the engine, reads no clock.
    """

    def __init__(self, alpha: float = 0.5):
        self.alpha = alpha
        self.cpu: Optional[float] = None
        self.stream: Optional[float] = None

    def _mix(self, old: Optional[float], elements: int, seconds: float) -> Optional[float]:
        if elements <= 0 or seconds <= 0:
            return old
        rate = elements / seconds
        return rate if old is None else self.alpha * rate + (1 - self.alpha) * old

    def observe(self, cpu_elements: int, cpu_seconds: float, stream_elements: int,
                stream_seconds: float) -> None:
        """One step's totals of each side."""
        self.cpu = self._mix(self.cpu, cpu_elements, cpu_seconds)
        self.stream = self._mix(self.stream, stream_elements, stream_seconds)

    def share(self, prior: float = 0.5) -> float:
        """The streamed share for the next step (:func:`stream_share`)."""
        return stream_share(self.cpu, self.stream, prior)


# ----------------------------------------------------------------- auto sizes


def pipeline_host_bytes(max_numel: int, buffer_bytes: int) -> int:
    """Host bytes the update pipeline takes besides the cache's buffers (one rank).

    Two gradient staging buffers and an fp32 scratch of the largest subgroup (4 bytes per
    element each, the most a gradient dtype takes), and one state buffer for filling the
    device tier and for checkpoints.
    """
    return 3 * 4 * max_numel + buffer_bytes


def host_cache_budget(mem_available: int, local_ranks: int, reserve: int,
                      pipeline: int) -> int:
    """Bytes of host memory one rank's cache may take (``--offload-host-cache-gb auto``).

    The node's ``mem_available`` less ``reserve`` (bytes left free: page cache, loaders,
    other processes), shared by the ``local_ranks`` of the node, less each rank's
    ``pipeline`` bytes (:func:`pipeline_host_bytes`).
    """
    return max(0, (mem_available - reserve) // max(1, local_ranks) - pipeline)


def path_room(free_bytes: int, local_ranks: int, reserve: int) -> int:
    """Bytes of one path a rank may fill with state files.

    The path's ``free_bytes`` shared by the ``local_ranks`` of the node (each rank writes
    its own directory there), less ``reserve`` (the recycled spare files and one temporary
    file of the rank).
    """
    return max(0, free_bytes // max(1, local_ranks) - reserve)


# ----------------------------------------------------------------- the I/O floor


def steady_path_io(paths: Sequence[int], nbytes: Sequence[int], cached: Optional[int],
                   alternate: bool, n_paths: int) -> List[float]:
    """Bytes read from each path per step once the pipeline is steady (writes: the same).

    The subgroups with a file are walked once per step, ``paths[k]`` the path and
    ``nbytes[k]`` the bytes a miss reads (and, evicted, writes back) of the k-th in
    ascending order. The host cache holds ``cached`` of them (None: every one) at the end
    of a step. With the alternating order the next step starts on those (the last ones of
    one walk are the first of the next), so a step misses all but ``cached``: the top
    ``cached`` after an ascending step, the bottom after a descending one (the average of
    the two here). Without it every step starts on what the cache evicted: all miss,
    unless every one fits. Each miss is read once; each is evicted dirty once, so written
    once.
    """
    total = [0.0] * n_paths
    for path, size in zip(paths, nbytes):
        total[path] += size
    count = len(paths)
    if cached is None or cached >= count:
        return [0.0] * n_paths
    if not alternate:
        return total
    kept = [0.0] * n_paths
    for k in list(range(cached)) + list(range(count - cached, count)):
        kept[paths[k]] += nbytes[k] / 2
    return [t - k for t, k in zip(total, kept)]


def io_floor(read_bytes: Sequence[float], write_bytes: Sequence[float],
             read_gbps: Sequence[Optional[float]],
             write_gbps: Sequence[Optional[float]]) -> List[float]:
    """Seconds each path needs per step to read and write its bytes at its bandwidth.

    Reads and writes of one path take turns (the node-local lock), so its time is the sum;
    different paths work at once, so the step's floor is the largest. A path with bytes to
    move and no known bandwidth counts 0 (nothing to divide by).
    """
    out = []
    for r, w, rr, wr in zip(read_bytes, write_bytes, read_gbps, write_gbps):
        seconds = 0.0
        if r and rr:
            seconds += r / (rr * _GB)
        if w and wr:
            seconds += w / (wr * _GB)
        out.append(seconds)
    return out
