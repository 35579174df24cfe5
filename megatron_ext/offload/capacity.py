"""The machine's capacities as the ``auto`` sizes see them: host memory, room on each path.

Read once, at start, for the tier plan (:mod:`.plan`): the node's available host memory
(MemAvailable, or less under a memory cgroup or ``ulimit -v``, or the knob
``MEGATRON_EXT_MEMAVAILABLE_GB``), the
training processes of the node (they share both), and each path's free space (statvfs, or
the knob ``MEGATRON_EXT_PATH_FREE_GB``). The rules that turn them into budgets are pure
functions of :mod:`.tier_model` (:func:`~.tier_model.host_cache_budget`,
:func:`~.tier_model.path_room`); this module only reads the numbers and keeps them for the
messages.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.io import SPARES_PER_SIZE
from megatron_ext.offload.paths import TierSpec
from megatron_ext.offload.tier_model import host_cache_budget, path_room, pipeline_host_bytes
from megatron_ext.runtime.host_memory import host_available

__all__ = ["HostMemory", "host_knob_after_the_model", "host_memory", "local_ranks",
           "mem_available", "path_rooms"]


def _gb(nbytes: float) -> str:
    value = nbytes / 1e9
    return f"{value:.2f}" if value >= 0.01 else f"{value:.3g}"


def _available(cfg: OffloadConfig):
    """(bytes, what bounds them) or None: the knob, else the one measurement."""
    if cfg.offload_mem_available_gb is not None:
        return int(round(cfg.offload_mem_available_gb * 1e9)), "MemAvailable"
    room = host_available()
    return None if room is None else (room.bytes, room.source)


def mem_available(cfg: OffloadConfig) -> Optional[int]:
    """The host memory this process may still allocate, in bytes: the knob, else the one
    measurement of it (MemAvailable, or less under a memory cgroup or ``ulimit -v``:
    :func:`megatron_ext.runtime.host_memory.host_available`, which the memory plan reads too).

    None where the kernel says nothing of it.
    """
    found = _available(cfg)
    return None if found is None else found[0]


def host_knob_after_the_model(cfg: OffloadConfig, plan) -> OffloadConfig:
    """The engine's config with the MemAvailable knob as the engine sees it.

    The knob stands for the host the memory plan saw, before the model was built. On a
    CPU run (the plan knows no GPU) the weights, gradients and activations live in host
    memory too (``MemoryPlan.host_view``), so the cache's auto size takes what they leave;
    a measured MemAvailable, read after the model is built, already leaves them out.
    """
    if (plan is None or plan.machine.gpu_total_bytes is not None
            or cfg.offload_mem_available_gb is None):
        return cfg
    seen = copy.copy(cfg)  # not dataclasses.replace: a settled config is not parsed again
    seen.offload_mem_available_gb = max(0.0, cfg.offload_mem_available_gb - plan.gpu.used / 1e9)
    return seen


def local_ranks() -> int:
    """Training processes on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


@dataclass(frozen=True)
class HostMemory:
    """One rank's share of the node's host memory for its cache (all in bytes).

    Attributes:
        available: the host memory the process may take at start (MemAvailable, or less).
        reserve: left free for the node (--offload-host-reserve-gb; default a tenth).
        pipeline: what the rank's update pipeline takes besides the cache.
        ranks: the training processes of the node.
        budget: what the rank's cache may take.
        source: what bounds ``available`` (see :class:`~megatron_ext.runtime.host_memory.HostAvailable`).
    """

    available: int
    reserve: int
    pipeline: int
    ranks: int
    budget: int
    source: str = "MemAvailable"

    def __str__(self) -> str:
        ranks = f"{self.ranks} rank{'s' if self.ranks > 1 else ''}"
        what = ("MemAvailable" if self.source == "MemAvailable"
                else f"host memory available under {self.source}")
        return (f"{what} {_gb(self.available)} GB less a reserve of {_gb(self.reserve)} "
                f"GB (--offload-host-reserve-gb), over {ranks} of the node, less the "
                f"pipeline's {_gb(self.pipeline)} GB: {_gb(self.budget)} GB")


def host_memory(cfg: OffloadConfig, max_numel: int, buffer_bytes: int,
                ranks: int) -> Optional[HostMemory]:
    """The host memory one rank's cache may take; None where MemAvailable is unknown."""
    found = _available(cfg)
    if found is None:
        return None
    available, source = found
    reserve = cfg.host_reserve_bytes(available)
    pipeline = pipeline_host_bytes(max_numel, buffer_bytes)
    return HostMemory(available, reserve, pipeline, ranks,
                      host_cache_budget(available, ranks, reserve, pipeline), source)


def path_rooms(cfg: OffloadConfig, tiers: Sequence[TierSpec], max_size: int, ranks: int,
               free_space: Callable[[str, int], int]) -> List[int]:
    """The bytes each path may hold for one rank.

    Its free space (the knob's, else ``free_space(path, 0)``: statvfs) shared by the node's
    ``ranks``, less room for the recycled spare files and one temporary file of the rank
    (files of ``max_size`` bytes).
    """
    reserve = (SPARES_PER_SIZE + 1) * max_size
    rooms = []
    for i, tier in enumerate(tiers):
        free = (int(round(cfg.offload_path_free_gb[i] * 1e9)) if cfg.offload_path_free_gb
                else free_space(tier.path, 0))
        rooms.append(path_room(free, ranks, reserve))
    return rooms
