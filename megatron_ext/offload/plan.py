"""The tier plan of one rank's subgroups: where each lives and who updates it.

A subgroup's state lives in the device tier (the model device's memory, updated there),
in the host cache (with or without a file) or in a file on one of the ``--offload-paths``.
:class:`TierPlan` holds those decisions and the numbers behind them: the host cache's
capacity, the placement over the paths (by bandwidth, with the free space measured at
start), the device tier's members (a fixed size, or ``auto`` from the measured peak), the
path rebalancing and the CPU/stream split of the host subgroups' updates. It answers "where
does subgroup i live" (:meth:`TierPlan.tier_of`), "how many bytes per tier"
(:meth:`TierPlan.device_bytes`, :meth:`TierPlan.tier_bytes`) and "who updates it this
step" (:meth:`TierPlan.assign`). It moves no bytes: the store does, when the engine asks.
"""

from __future__ import annotations

import logging
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from megatron_ext.errors import UsageError
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.io import SPARES_PER_SIZE
from megatron_ext.offload.paths import TierFullError, TierSpec, check_free_space
from megatron_ext.offload.placement import Rebalancer, place_subgroups
from megatron_ext.offload.tier_model import (
    DEVICE_TIER,
    HOST_TIER,
    Tier,
    TierKind,
    Updater,
    UpdateRates,
    device_budget,
    fixed_device_subgroups,
    resize_device_tier,
    split_updates,
)

log = logging.getLogger(__name__)


def gb(nbytes: float) -> str:
    """Bytes as GB for messages: two decimals, or three significant digits below 0.01."""
    value = nbytes / 1e9
    return f"{value:.2f}" if value >= 0.01 else f"{value:.3g}"


class TierPlan:
    """Capacities, placement and the device tier of one rank's subgroups.

    Attributes:
        capacity: host buffers the cache may hold (None: unlimited).
        home: each subgroup's path index; -1 for one the host cache keeps without a file
            (and for a fixed device tier's); None for all when there are no paths.
        resident: subgroups that live in the host cache only (no file), never evicted.
        device_members: the device tier's subgroups, in the order they joined.
        rates: the measured update throughputs behind the CPU/stream split.
    """

    def __init__(self, cfg: OffloadConfig, numels: Sequence[int], sizes: Sequence[int],
                 buffer_bytes: int, *, tiers: Sequence[TierSpec], rank: int,
                 device: torch.device):
        """Sizes the tiers and places the subgroups (measures each path's free space).

        Args:
            cfg: the engine's config.
            numels: elements of each subgroup.
            sizes: bytes of each subgroup's state.
            buffer_bytes: bytes of one host buffer (the largest subgroup's state).
            tiers: the paths, with their bandwidths.
            rank: this rank (for messages).
            device: the model's device.

        Raises:
            UsageError: a size that cannot work (``auto`` on the CPU without the memory
                hook, a host cache too small for the pipeline or for all subgroups).
            TierFullError: the paths and the host cache cannot hold every subgroup.
        """
        self.cfg = cfg
        self.numels, self.sizes = list(numels), list(sizes)
        self.buffer_bytes = buffer_bytes
        self.rank, self.device = rank, device
        self.is_cuda = device.type == "cuda"
        # The device tier: subgroups whose state lives on the model's device, in the order
        # they joined; a fixed size is placed now, ``auto`` at the first step.
        self.device_auto = cfg.device_cache_auto
        self.device_members: List[int] = (
            [] if self.device_auto else fixed_device_subgroups(self.sizes,
                                                               cfg.device_cache_bytes()))
        self._device_set = set(self.device_members)
        self.device_sized = not self.device_auto
        if (self.device_auto and not self.is_cuda
                and cfg.offload_device_memory_limit_gb is None):
            raise UsageError("--offload-device-cache-gb auto measures GPU memory and this run "
                             "is on the CPU: give a size in GB (the CPU's 'device' tier is "
                             "host memory)")
        self.capacity = self._cache_capacity(bool(tiers))
        self.resident: FrozenSet[int] = frozenset()
        self.rates = UpdateRates()
        self.rebalancer: Optional[Rebalancer] = None
        if not tiers:
            self.home: List[Optional[int]] = [None] * len(self.sizes)
            return
        weights = [t.effective_gbps for t in tiers]
        # Room for the recycled spares and one temporary file per path besides the states.
        reserve = (SPARES_PER_SIZE + 1) * max(self.sizes, default=0)
        free = [max(0, check_free_space(t.path, 0) - reserve) for t in tiers]
        try:
            self.home = self._place(weights, free)
        except TierFullError as err:
            if not self.device_auto:
                raise
            raise TierFullError(
                f"{err}; with --offload-device-cache-gb auto the host cache and the paths "
                "must hold every subgroup until the first step sizes the device tier: "
                "give the device tier a size in GB instead", err.needed_bytes,
                err.free_bytes) from None
        if cfg.offload_rebalance and len(tiers) > 1:
            self.rebalancer = Rebalancer(weights)

    # ----------------------------------------------------------------- capacities

    def _cache_capacity(self, has_paths: bool) -> Optional[int]:
        cfg = self.cfg
        # Subgroups of the device tier need no host buffer.
        n = len(self.sizes) - len(self.device_members)
        per_buffer = self.buffer_bytes
        if cfg.offload_host_cache_gb is None:
            return None if not has_paths else min(n, 3)
        fits = int(round(cfg.offload_host_cache_gb * 1e9) // max(per_buffer, 1))
        if not has_paths:
            if fits < n:
                raise UsageError(
                    f"--offload-host-cache-gb {cfg.offload_host_cache_gb:g} holds {fits} of the "
                    f"{n} subgroups of this rank and there is no --offload-paths for the rest: "
                    f"give at least {gb(n * per_buffer)} GB, or add --offload-paths DIR")
            return None
        if fits < min(n, 3):
            raise UsageError(
                f"--offload-host-cache-gb {cfg.offload_host_cache_gb:g} holds {fits} subgroups of "
                f"{gb(per_buffer)} GB; the pipeline needs 3: give at least "
                f"{gb(3 * per_buffer)} GB or a smaller --offload-subgroup-size")
        return min(n, fits)

    def _place(self, weights: List[float], free: List[int]) -> List[int]:
        """Each subgroup's path, -1 for those the host cache keeps without a file.

        Normally every subgroup has a file and the cache is a cache. When the paths cannot
        hold them all, the cache keeps the fewest subgroups that let the rest fit, as long
        as three buffers are left for the pipeline; they are taken from the middle of the
        order (with the alternating order, the cache reuses the subgroups at both ends).
        """
        n = len(self.sizes)
        # A fixed device tier's subgroups have no file (home -1, not resident either).
        hosted = [i for i in range(n) if i not in self._device_set]
        spare = 0 if self.capacity is None else max(0, self.capacity - min(len(hosted), 3))
        lack = sum(self.sizes[i] for i in hosted) - sum(free)
        first = max(0, lack // max(self.sizes, default=1)) if lack > 0 else 0
        error = None
        for kept in range(min(first, spare), spare + 1):
            lo = (len(hosted) - kept) // 2
            resident = set(hosted[lo:lo + kept])
            others = [i for i in hosted if i not in resident]
            try:
                homes = place_subgroups([self.sizes[i] for i in others], weights,
                                        self.cfg.offload_placement, capacity=free)
            except TierFullError as err:
                error = err
                continue
            self.resident = frozenset(resident)
            home = [-1] * n
            for index, path in zip(others, homes):
                home[index] = path
            if resident:
                log.info("offload: rank %d keeps %d of %d subgroups (%.2f GB) in the host cache "
                         "only: the paths hold the other %.2f GB", self.rank, kept, n,
                         sum(self.sizes[i] for i in resident) / 1e9,
                         sum(self.sizes[i] for i in others) / 1e9)
            return home
        raise TierFullError(f"{error} (the host cache can keep at most {spare} of the {n} "
                            "subgroups besides the pipeline's 3: a larger "
                            "--offload-host-cache-gb helps too)", error.needed_bytes,
                            error.free_bytes)

    # ----------------------------------------------------------------- where things live

    def on_device(self, index: int) -> bool:
        """Whether subgroup ``index`` is in the device tier."""
        return index in self._device_set

    def tier_of(self, index: int, cached: bool, location: Optional[int]) -> Tier:
        """Where subgroup ``index``'s state lives now.

        Args:
            index: the subgroup.
            cached: whether the host cache holds it.
            location: the path of its current file (None: never written).
        """
        if index in self._device_set:
            return DEVICE_TIER
        if cached or location is None:
            return HOST_TIER
        return Tier(TierKind.PATH, location)

    def device_bytes(self) -> int:
        """Bytes of state in the device tier."""
        return sum(self.sizes[i] for i in self.device_members)

    def path_subgroups(self, path: int) -> int:
        """Subgroups placed on path ``path``."""
        return sum(1 for h in self.home if h == path)

    def tier_bytes(self) -> Dict[str, int]:
        """Bytes of state the plan puts in each tier: device, host only, each path."""
        placed = {"device": self.device_bytes(),
                  "host": sum(self.sizes[i] for i in self.resident)}
        for index, home in enumerate(self.home):
            if home is None and index not in self._device_set:
                placed["host"] += self.sizes[index]
            elif home is not None and home >= 0 and index not in self._device_set:
                placed[f"path{home}"] = placed.get(f"path{home}", 0) + self.sizes[index]
        return placed

    def evacuate(self, path: int, other: int) -> None:
        """Every subgroup placed on ``path`` goes to ``other`` (a path that failed)."""
        for index, home in enumerate(self.home):
            if home == path:
                self.home[index] = other

    # ----------------------------------------------------------------- the device tier

    def memory(self, step_count: int) -> Tuple[int, int]:
        """(usable device bytes, peak allocated bytes of the iterations so far)."""
        limit_gb = self.cfg.offload_device_memory_limit_gb
        if limit_gb is not None:
            peak_gb = 0.0
            for step, value in self.cfg.offload_device_peak_gb:
                if step <= step_count + 1:
                    peak_gb = value
            return int(limit_gb * 1e9), int(peak_gb * 1e9) + self.device_bytes()
        return (torch.cuda.mem_get_info(self.device)[1],
                torch.cuda.max_memory_allocated(self.device))

    def resize_device(self, limit: int, peak: int) -> Tuple[List[int], List[int]]:
        """``auto``: (joining, leaving) the device tier for the measured memory.

        The first call fills the tier from the measured peak; later ones only give back.
        """
        reserve = int(self.cfg.offload_device_reserve_gb * 1e9)
        budget = device_budget(limit, peak, self.device_bytes(), reserve)
        candidates = [] if self.device_sized else self.promotion_order()
        return resize_device_tier(self.device_members, self.sizes, budget, candidates)

    def promotion_order(self) -> List[int]:
        """Subgroups to move up, most wanted first.

        Those on paths (their I/O goes away), then the host's, each kind evenly spread.
        """
        hosted = [i for i in range(len(self.sizes)) if i not in self._device_set]
        on_paths = [i for i in hosted if self.home[i] is not None and self.home[i] >= 0
                    and i not in self.resident]
        in_host = [i for i in hosted if i not in on_paths]

        def interleaved(ids: List[int]) -> List[int]:
            # Bit-reversed positions (0, n/2, n/4, 3n/4, ...): every prefix is spread out.
            bits = max(1, (len(ids) - 1).bit_length())
            return [ids[k] for k in sorted(range(len(ids)),
                                           key=lambda k: int(f"{k:0{bits}b}"[::-1], 2))]
        return interleaved(on_paths) + interleaved(in_host)

    def join(self, index: int) -> None:
        """Subgroup ``index`` is in the device tier now (its host buffer and file gone)."""
        self.resident = self.resident - {index}
        self.device_members.append(index)
        self._device_set.add(index)

    def leave(self, index: int, to_host: bool) -> None:
        """Subgroup ``index`` left the device tier; ``to_host``: its state is in the cache."""
        self.device_members.remove(index)
        self._device_set.discard(index)
        if to_host and (self.home[index] is None or self.home[index] < 0):
            # No path to flush it to: the host keeps it.
            self.resident = self.resident | {index}

    # ----------------------------------------------------------------- updates and paths

    def stream_share(self) -> float:
        """The share of the host subgroups' elements the device updates this step."""
        if not self.cfg.offload_gpu_update:
            return 0.0
        forced = self.cfg.offload_stream_share
        if forced is not None:
            return forced
        if not self.is_cuda:
            # The "device" is the CPU itself: streaming would only add copies.
            return 0.0
        return self.rates.share()

    def assign(self, order: Sequence[int]) -> Dict[int, Updater]:
        """Who updates each subgroup this step (the tier model's decision)."""
        hosted = [i for i in order if i not in self._device_set]
        streamed = split_updates([self.numels[i] for i in hosted], self.stream_share())
        plan = {i: Updater.DEVICE for i in self._device_set}
        plan.update({i: Updater.STREAM if s else Updater.CPU for i, s in zip(hosted, streamed)})
        return plan

    def observe_io(self, path: int, nbytes: int, seconds: float) -> None:
        """One read or write on ``path``, for the rebalancer."""
        if self.rebalancer is not None:
            self.rebalancer.observe(path, nbytes, seconds)

    def rebalance(self, bad_paths: Sequence[int]) -> List[Tuple[int, int, int]]:
        """Ends a step: the (subgroup, from, to) moves made toward the observed throughputs.

        A move to a path in ``bad_paths`` (one that failed a write) is not made.
        """
        if self.rebalancer is None:
            return []
        moves = []
        for index, source, target in self.rebalancer.end_step(self.home, self.sizes):
            if target in bad_paths:
                continue
            self.home[index] = target
            moves.append((index, source, target))
        return moves
