"""The offload mode (``--offload-optimizer``): the optimizer mode of the offload engine.

Registers itself in :mod:`megatron_ext.optim.modes` when imported (the registry imports it
by name at its first lookup). Light at import: the engine, torch and megatron-core are
imported inside :meth:`OffloadMode.build`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megatron_ext.optim.modes import (
    MemoryNeeds,
    Mode,
    TieredStates,
    needs,
    only,
    refuses,
    register,
)


def path_placement(policy: str):
    """The engine's placement over the paths, for the memory plan (``TieredStates.place``)."""
    def place(sizes: List[int], weights: List[float], free: List[int]) -> List[int]:
        from megatron_ext.offload.placement import place_subgroups

        return place_subgroups(sizes, weights, policy, capacity=free)
    return place


PATH_SPARE_FILES = 3
"""Subgroup files a path keeps room for beside the states: ``io.SPARES_PER_SIZE`` recycled
spares and one temporary file (``TierPlan``'s reserve; io.py imports torch, which the plan
does without: a unit test keeps the two equal)."""


def path_reserve_bytes(subgroup_bytes: int) -> int:
    """Free space a path keeps beside the states (``TierPlan``'s reserve)."""
    return PATH_SPARE_FILES * subgroup_bytes


def host_cache_fixes(off) -> List[str]:
    """What moves the offload engine's states out of host memory (its config ``off``).

    The offload mode's own host fixes, and ZenFlow's when its CPU-side states live in the
    engine's tiers.
    """
    if not off.offload_paths:
        return ["--offload-paths DIR (a disk for the optimizer states) with a smaller "
                "--offload-host-cache-gb"]
    if off.host_cache_auto:
        return ["a larger --offload-host-reserve-gb (host memory the cache leaves free), or "
                "--offload-host-cache-gb 0 (every state in a file)"]
    if not off.no_host_cache:
        return ["a smaller --offload-host-cache-gb (0: every state in a file)"]
    return ["a smaller --offload-subgroup-size (the pipeline's three host buffers are "
            "subgroups)"]


class OffloadMode(Mode):
    """The distributed optimizer's fp32 states in the offload engine's host cache and tiers."""

    name = "offload"
    flag = "--offload-optimizer"
    switch = "offload.offload_optimizer"
    words = "--offload-optimizer"
    precedence = 1
    requirements = (
        needs("parallel.use_distributed_optimizer",
              "--offload-optimizer offloads the distributed optimizer's shard: add "
              "--use-distributed-optimizer"),
        refuses("optimizer.optimizer_cpu_offload",
                "--offload-optimizer and --optimizer-cpu-offload are two offloads of the same "
                "states; choose one"),
        only("optimizer.optimizer", "adam", "--offload-optimizer supports --optimizer adam only"),
    )

    def build(self, cfg, model_chunks, runtime, plan=None):
        """megatron-core's factory with the offloaded DistributedOptimizer bound into it.

        With ``--offload-device-cache-gb auto`` and a memory plan that knows the GPU, the
        device tier starts at the plan's budget (so the host cache and the paths hold only
        the rest before the first step); the first step's measured peak then refines it.
        """
        from megatron_ext.memory.plan import device_budget_bytes
        from megatron_ext.offload.capacity import host_knob_after_the_model
        from megatron_ext.offload.optimizer import offloaded_distributed_optimizer
        from megatron_ext.optim.factory import build_megatron_optimizer
        from megatron_ext.runtime.faults import Faults

        budget = None
        if (plan is not None and cfg.offload.device_cache_auto
                and plan.machine.gpu_free_bytes is not None):
            budget = device_budget_bytes(plan)
        offload = host_knob_after_the_model(cfg.offload, plan)
        with offloaded_distributed_optimizer(offload, runtime.rank,
                                             cfg.optimizer.state_layout(),
                                             Faults(cfg.faults.offload_fault),
                                             device_budget_bytes=budget) as bound:
            return build_megatron_optimizer(cfg, model_chunks, bound)

    def log_summary(self, record: dict) -> Optional[str]:
        """The engine's part of the stdout line (when the record has its metrics).

        Main-thread phases, the I/O threads' busy time (which overlaps them), cache hits and
        bytes moved per iteration.
        """
        if "offload/cache_hit_rate" not in record:
            return None
        ms = lambda key: record.get(f"offload/{key}", 0.0) * 1000  # noqa: E731
        return (f"offload (ms): stall {ms('stall_s'):.1f} convert {ms('convert_s'):.1f} "
                f"update {ms('update_s'):.1f} writeback {ms('writeback_s'):.1f}, io threads "
                f"fetch {ms('fetch_bg_s'):.1f} flush {ms('flush_bg_s'):.1f} lock wait "
                f"{ms('lock_wait_bg_s'):.1f}, cache hits {record['offload/cache_hit_rate']:.0%}, "
                f"io {record.get('offload/io_bytes', 0.0) / 1e9:.2f} GB")

    def host_memory_fixes(self, cfg, on_cpu: bool) -> List[str]:
        """The states out of the host cache and into files on the paths."""
        return host_cache_fixes(cfg.offload)

    def measure_tiers(self, cfg, runtime) -> None:
        """The paths' bandwidths probed once, before the plan (``settle_path_speeds``)."""
        from megatron_ext.offload.optimizer import settle_path_speeds

        settle_path_speeds(cfg.offload, runtime.rank)

    def checkpoint_state_bytes(self, cfg, shape) -> float:
        """The state files' bytes per element (the plan's arrays; 10 with remainders).

        Files linked from a path on the save directory's file system take no new space at
        the save, but the tier writes new ones at the next step while the checkpoint keeps
        the old: counted all the same.
        """
        from megatron_ext.memory.shape import state_array_bytes

        return float(sum(state_array_bytes(cfg)))

    def memory_needs(self, cfg, shape, gpu_room: Optional[int] = None) -> MemoryNeeds:
        """The shard's states in the tiers; the engine's staging on the GPU and the host.

        The device tier is ``--offload-device-cache-gb`` (auto: the plan's device budget),
        the host cache ``--offload-host-cache-gb`` (default: what the host has left), the
        paths the rest. On the GPU: the write-back's two stages and the device updater's
        fp32 gradients of one subgroup, and with the streamed update two state slots; on
        the host: the gradients' two pinned stages and an fp32 scratch.
        """
        from megatron_ext.memory.shape import state_array_bytes, state_nbytes
        from megatron_ext.offload.tier_model import pipeline_host_bytes

        off = cfg.offload
        arrays = state_array_bytes(cfg)
        biggest = min(off.offload_subgroup_size, shape.shard_elements)
        buffer = state_nbytes(arrays, biggest)
        gpu = {"offload staging": biggest * (2 * arrays[0] + 4)
               + (2 * buffer if off.offload_gpu_update else 0)}
        # The engine's own rule for what its pipeline takes on the host (tier_model).
        host = {"offload pipeline": pipeline_host_bytes(biggest, buffer)}
        states = TieredStates(
            elements=shape.shard_elements, arrays=arrays, subgroup_size=off.offload_subgroup_size,
            device_bytes=None if off.device_cache_auto else off.device_cache_bytes(),
            host_bytes=off.host_cache_bytes(),
            path_reserve_bytes=path_reserve_bytes(buffer),
            place=path_placement(off.offload_placement))
        return MemoryNeeds(gpu=gpu, host=host, tiered=states,
                           gpu_fix="lower --offload-device-cache-gb or "
                                   "--offload-subgroup-size")

    def derived_metrics(self, record: dict) -> Dict[str, float]:
        """``offload/roofline_ratio``: the iteration's time over its lower bound.

        The bound is the larger of forward+backward and the engine's I/O floor; 1.0 means
        nothing else costs time.
        """
        floor = record.get("offload/io_floor_s")
        step, compute = record.get("time/iteration_s"), record.get("time/forward_backward_s")
        if floor is None or step is None or compute is None:
            return {}
        bound = max(compute, floor)
        return {"offload/roofline_ratio": step / bound} if bound > 0 else {}

    def checkpoint_problems(self, directory: str) -> List[Tuple[str, str]]:
        """The engine's manifests under the checkpoint and the state files they name."""
        from megatron_ext.offload.checkpoint import manifest_problems

        return manifest_problems(directory)


register(OffloadMode())
