"""The tier plan of one rank's subgroups: where each lives and who updates it.

A subgroup's state lives in the device tier (the model device's memory, updated there),
in the host cache (with or without a file) or in a file on one of the ``--offload-paths``.
:class:`TierPlan` holds those decisions and the numbers behind them: the host cache's
capacity (a size, or ``auto`` from the node's MemAvailable), the placement over the paths
(by bandwidth, within the room each path has: its free space, measured at start or
injected), the device tier's members (a fixed size, or ``auto``: the memory plan's budget
before the first step, then the measured peak), the path rebalancing and the CPU/stream
split of the host subgroups' updates. It answers "where does subgroup i live"
(:meth:`TierPlan.tier_of`), "how many bytes per tier" (:meth:`TierPlan.device_bytes`,
:meth:`TierPlan.tier_bytes`), "who updates it this step" (:meth:`TierPlan.assign`) and
"what must cross each path per step" (:meth:`TierPlan.path_io_per_step`). It moves no
bytes: the store does, when the engine asks.
"""

from __future__ import annotations

import logging
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from megatron_ext.errors import UsageError
from megatron_ext.offload.capacity import HostMemory, host_memory, local_ranks, path_rooms
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.io import SPARES_PER_SIZE  # noqa: F401 (the spares' count, for tests)
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
    steady_path_io,
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
        host_fits: host buffers the measured host memory allows (None: not measured).
        home: each subgroup's path index; -1 for one the host cache keeps without a file
            (and for a device-tier subgroup with no path); None for all when there are no
            paths.
        room: the bytes each path may hold (its free space, shared by the node's ranks,
            less the spare files).
        resident: subgroups that live in the host cache only (no file), never evicted.
        device_members: the device tier's subgroups, in the order they joined.
        rates: the measured update throughputs behind the CPU/stream split.
    """

    def __init__(self, cfg: OffloadConfig, numels: Sequence[int], sizes: Sequence[int],
                 buffer_bytes: int, *, tiers: Sequence[TierSpec], rank: int,
                 device: torch.device, device_budget_bytes: Optional[int] = None):
        """Sizes the tiers and places the subgroups (measures host memory and free space).

        Args:
            cfg: the engine's config.
            numels: elements of each subgroup.
            sizes: bytes of each subgroup's state.
            buffer_bytes: bytes of one host buffer (the largest subgroup's state).
            tiers: the paths, with their bandwidths.
            rank: this rank (for messages).
            device: the model's device.
            device_budget_bytes: with ``--offload-device-cache-gb auto``, the device
                bytes the tier may take before the first step (the memory plan's GPU
                budget); None: the first step sizes it, and until then the host cache and
                the paths hold every subgroup.

        Raises:
            UsageError: a size that cannot work (a host cache too small for the pipeline,
                or, with no paths, for all subgroups).
            TierFullError: the paths and the host cache cannot hold every subgroup.
        """
        self.cfg = cfg
        self.numels, self.sizes = list(numels), list(sizes)
        self.buffer_bytes = buffer_bytes
        self.rank, self.device = rank, device
        self.is_cuda = device.type == "cuda"
        self.local_ranks = local_ranks()
        # The device tier: subgroups whose state lives on the model's device, in the order
        # they joined. A fixed size is placed now; ``auto`` takes the plan's budget now (if
        # given) and is sized again at the first step. A CPU run has no device memory to
        # measure: ``auto`` there is no tier, unless the test hook stands in for it.
        self.device_auto = cfg.device_cache_auto and (
            self.is_cuda or cfg.offload_device_memory_limit_gb is not None)
        self.device_budget = device_budget_bytes if self.device_auto else None
        budget = (cfg.device_cache_bytes() if not cfg.device_cache_auto
                  else self.device_budget or 0)
        self.device_members: List[int] = fixed_device_subgroups(self.sizes, budget)
        self._device_set = set(self.device_members)
        self.device_sized = not self.device_auto
        self.host_fits: Optional[int] = None
        self.host: Optional[HostMemory] = None
        self.capacity = self._cache_capacity(bool(tiers))
        self.resident: FrozenSet[int] = frozenset()
        self.rates = UpdateRates()
        self.rebalancer: Optional[Rebalancer] = None
        self.tiers = list(tiers)
        self.room: List[int] = []
        if not tiers:
            self.home: List[Optional[int]] = [None] * len(self.sizes)
            log.info("%s", self.describe())
            return
        weights = [t.effective_gbps for t in tiers]
        # check_free_space looked up here, so that tests can stand in for the file system.
        self.room = path_rooms(cfg, self.tiers, max(self.sizes, default=0), self.local_ranks,
                               check_free_space)
        try:
            self.home = self._place(weights, list(self.room))
        except TierFullError as err:
            if not (self.device_auto and self.device_budget is None):
                raise
            raise TierFullError(
                f"{err}; with --offload-device-cache-gb auto and no GPU budget from the "
                "memory plan, the host cache and the paths must hold every subgroup until "
                "the first step sizes the device tier: give the device tier a size in GB "
                "instead", err.needed_bytes, err.free_bytes) from None
        if cfg.offload_rebalance and len(tiers) > 1:
            self.rebalancer = Rebalancer(weights)
        log.info("%s", self.describe())

    # ----------------------------------------------------------------- capacities

    def _per_buffer(self) -> int:
        """Host bytes one cached subgroup takes.

        Its state; with ``auto`` also its fp32 gradients when they are converted up front
        (--no-offload-delayed-grad-conversion; a size in GB counts the states only, as it
        always has).
        """
        extra = (4 * max(self.numels, default=0) if self.cfg.host_cache_auto
                 and not self.cfg.offload_delayed_grad_conversion else 0)
        return self.buffer_bytes + extra

    def _host_memory(self) -> Optional[HostMemory]:
        """``auto``: the host memory this rank's cache may take; None: not measured.

        Measured on a GPU run, or where the MemAvailable knob is set; a CPU run without it
        keeps the rule from before auto (its host is also its "device").
        """
        if not (self.is_cuda or self.cfg.offload_mem_available_gb is not None):
            return None
        memory = host_memory(self.cfg, max(self.numels, default=0), self.buffer_bytes,
                             self.local_ranks)
        if memory is None:
            log.warning("offload: MemAvailable is unknown on this host: the host cache keeps "
                        "three subgroups (give --offload-host-cache-gb to size it)")
        return memory

    def _cache_capacity(self, has_paths: bool) -> Optional[int]:
        cfg = self.cfg
        # Subgroups of the device tier need no host buffer.
        n = len(self.sizes) - len(self.device_members)
        per_buffer = self._per_buffer()
        if cfg.host_cache_auto:
            self.host = self._host_memory()
            if self.host is None:
                return None if not has_paths else min(n, 3)
            fits = self.host_fits = self.host.budget // max(per_buffer, 1)
            if not has_paths:
                if fits < n:
                    raise UsageError(
                        f"host memory holds {fits} of the {n} subgroups of rank {self.rank} "
                        f"({gb(n * per_buffer)} GB; {self.host}) and there is no "
                        "--offload-paths for the rest: add --offload-paths DIR (node-local "
                        "NVMe, scratch)")
                return None
            if fits < min(n, 3):
                raise UsageError(
                    f"host memory holds {fits} subgroups of {gb(per_buffer)} GB for rank "
                    f"{self.rank} ({self.host}); the pipeline needs 3: free "
                    f"{gb(3 * per_buffer - self.host.budget)} GB more host memory, lower "
                    "--offload-host-reserve-gb, or give a smaller --offload-subgroup-size")
            return min(n, fits)
        if cfg.no_host_cache and n:
            # No cache: the pipeline's buffers alone, every state in a file on the paths.
            if not has_paths:
                raise UsageError(
                    f"--offload-host-cache-gb 0 keeps none of the {n} subgroups of rank "
                    f"{self.rank} in host memory and there is no --offload-paths for them: "
                    "give --offload-paths DIR, or a positive --offload-host-cache-gb (or auto)")
            return min(n, 3)
        fits = int(round(cfg.offload_host_cache_gb * 1e9) // max(per_buffer, 1))
        size = f"{cfg.offload_host_cache_gb:g}"
        if not has_paths:
            if fits < n:
                raise UsageError(
                    f"--offload-host-cache-gb {size} holds {fits} of the "
                    f"{n} subgroups of this rank and there is no --offload-paths for the rest: "
                    f"give at least {gb(n * per_buffer)} GB, or add --offload-paths DIR")
            return None
        if fits < min(n, 3):
            raise UsageError(
                f"--offload-host-cache-gb {size} holds {fits} subgroups of "
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
        # A device tier's subgroups have no file (home -1, not resident either).
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
            return home
        if self.cfg.host_cache_auto and self.host_fits is not None:
            hint = (f"host memory ({self.host}) keeps at most {spare} of the {n} "
                    "subgroups besides the pipeline's 3: free disk space, add a path or "
                    "host memory, or run on more nodes")
        else:
            hint = (f"the host cache can keep at most {spare} of the {n} subgroups besides "
                    "the pipeline's 3: a larger --offload-host-cache-gb helps too")
        raise TierFullError(f"{error} ({hint})", error.needed_bytes, error.free_bytes)

    def describe(self) -> str:
        """One line: what each tier holds, and where ``auto`` got its numbers."""
        cfg = self.cfg
        n = len(self.sizes)
        device = f"device {gb(self.device_bytes())} GB in {len(self.device_members)} subgroups"
        if cfg.device_cache_auto and not self.device_auto:
            device += " (auto: no GPU on this run)"
        elif self.device_auto:
            device += (f" (auto: the plan's budget {gb(self.device_budget)} GB, refined at "
                       "the first step)" if self.device_budget is not None
                       else " (auto: sized at the first step)")
        hosted = n - len(self.device_members)
        held = hosted if self.capacity is None else self.capacity
        host = (f"host cache {gb(held * self._per_buffer())} GB, {held} subgroups, "
                f"{self.host_only()} of them without a file")
        if cfg.host_cache_auto:
            host += (f" (auto: {self.host})" if self.host is not None
                     else " (auto: everything in host memory)" if not self.tiers
                     else " (auto: the pipeline's 3 on a CPU run)")
        elif cfg.no_host_cache:
            host += " (0: no cache, the pipeline's buffers only)"
        parts = [f"offload: rank {self.rank} tiers: {device}; {host}"]
        placed = self.tier_bytes()
        for i, tier in enumerate(self.tiers):
            parts.append(f"path{i} {tier.path} {gb(placed.get(f'path{i}', 0))} GB, "
                         f"{self.path_subgroups(i)} subgroups (room {gb(self.room[i])} GB)")
        return "; ".join(parts)

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

    def host_only(self) -> int:
        """Subgroups the host keeps without a file (all hosted ones when there are no paths)."""
        return sum(1 for i, h in enumerate(self.home)
                   if i not in self._device_set and (h is None or i in self.resident))

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

    def memory(self, step_count: int, held_bytes: int = 0) -> Tuple[int, int]:
        """(usable device bytes, peak bytes of the iterations so far).

        The peak counts the device tier's states as held, also when they are not allocated
        yet (``held_bytes``: the bytes of them that are; before the first step's fill,
        none), so that :meth:`resize_device` can take them out again.

        On a GPU both are the caching allocator's view, not the device's: usable is what
        this process's allocator can hold (its reserved bytes and the driver's free ones:
        not the CUDA context, the libraries' or other processes' memory), the peak is its
        reserved peak (the segments' slack beside the tensors included: the next iteration
        needs it again). Llama-3-8B without recomputation (bench/results/2026-12-03c-h200,
        call4): forward and backward allocated 85.75 GB at most while the process held
        ~91 GB of the device; sized from the allocated peak and the device's 150.11 GB,
        the tier left iteration 2 short of memory.
        """
        limit_gb = self.cfg.offload_device_memory_limit_gb
        if limit_gb is not None:
            peak_gb = 0.0
            for step, value in self.cfg.offload_device_peak_gb:
                if step <= step_count + 1:
                    peak_gb = value
            return int(limit_gb * 1e9), int(peak_gb * 1e9) + self.device_bytes()
        peak = torch.cuda.max_memory_reserved(self.device)
        free = torch.cuda.mem_get_info(self.device)[0]
        return (free + torch.cuda.memory_reserved(self.device),
                peak - held_bytes + self.device_bytes())

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
        """Subgroup ``index`` left the device tier; ``to_host``: its state is in the cache.

        One with a path goes back to it. One without (placed on the device from the start)
        gets a path with room if there is one, else the host keeps it without a file: the
        cache grows by a buffer where the measured host memory allows it.

        Raises:
            UsageError: neither a path nor the host has room for it.
        """
        self.device_members.remove(index)
        self._device_set.discard(index)
        home = self.home[index]
        if home is not None and home >= 0:
            return
        if home is None:
            # No paths: the host keeps every state (the cache is unlimited).
            hosted = len(self.sizes) - len(self.device_members)
            if self.host_fits is not None and hosted > self.host_fits:
                raise UsageError(
                    f"the device tier of rank {self.rank} gives back subgroup {index} and host "
                    f"memory holds {self.host_fits} of the {hosted} subgroups now on the host "
                    f"({self.host}): add --offload-paths DIR, or give "
                    "--offload-device-cache-gb a size that stays on the GPU")
            if to_host:
                self.resident = self.resident | {index}
            return
        path = self._path_with_room(index)
        if path is not None:
            self.home[index] = path
            return
        hosted = len(self.sizes) - len(self.device_members)
        buffers = self.capacity
        if (buffers is not None and self.host_fits is not None and buffers < self.host_fits
                and self.cfg.host_cache_auto):
            buffers += 1
        if buffers is not None and buffers - len(self.resident) - 1 < min(3, hosted):
            raise UsageError(
                f"the device tier of rank {self.rank} gives back subgroup {index} "
                f"({gb(self.sizes[index])} GB) and neither the paths (room "
                f"{', '.join(gb(r) for r in self._room_left())} GB) nor the host cache "
                f"({self.capacity} buffers, {len(self.resident)} of them without a file) "
                "have room for it: free disk space, add a path, or give "
                "--offload-device-cache-gb a size that stays on the GPU")
        self.capacity = buffers
        self.resident = self.resident | {index}

    def _room_left(self) -> List[int]:
        """The bytes each path has left beyond the subgroups homed on it."""
        used = [0] * len(self.room)
        for index, home in enumerate(self.home):
            if home is not None and home >= 0:
                used[home] += self.sizes[index]
        return [r - u for r, u in zip(self.room, used)]

    def _path_with_room(self, index: int) -> Optional[int]:
        """The path with the most room left that can take subgroup ``index``, if any."""
        left = self._room_left()
        fits = [i for i, r in enumerate(left) if r >= self.sizes[index]]
        return max(fits, key=lambda i: (left[i], -i)) if fits else None

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

    def path_io_per_step(self) -> List[float]:
        """Bytes each path must read per step once the pipeline is steady.

        As many are written. Given where the subgroups live and what the host cache keeps.
        """
        walk = [i for i, h in enumerate(self.home) if h is not None and h >= 0
                and i not in self.resident and i not in self._device_set]
        # Without the delayed conversion, a miss also writes and reads its fp32 gradients.
        grad = 0 if self.cfg.offload_delayed_grad_conversion else 4
        cached = None if self.capacity is None else max(0, self.capacity - len(self.resident))
        return steady_path_io([self.home[i] for i in walk],
                              [self.sizes[i] + grad * self.numels[i] for i in walk], cached,
                              self.cfg.offload_alternate_order, len(self.tiers))

    def observe_io(self, path: int, nbytes: int, seconds: float) -> None:
        """One read or write on ``path``, for the rebalancer."""
        if self.rebalancer is not None:
            self.rebalancer.observe(path, nbytes, seconds)

    def rebalance(self, bad_paths: Sequence[int]) -> List[Tuple[int, int, int]]:
        """Ends a step: the (subgroup, from, to) moves made toward the observed throughputs.

        A move to a path in ``bad_paths`` (one that failed a write), or beyond a path's
        room, is not made.
        """
        if self.rebalancer is None:
            return []
        moves = []
        # Within each path's room: the auto sizes placed up to it.
        for index, source, target in self.rebalancer.end_step(self.home, self.sizes,
                                                              free_bytes=self._room_left()):
            if target in bad_paths:
                continue
            self.home[index] = target
            moves.append((index, source, target))
        return moves
