"""The ZenFlow mode (``--zenflow``): the optimizer mode of ZenFlow's selective updates.

Registers itself in :mod:`megatron_ext.optim.modes` when imported (the registry imports it
by name at its first lookup). Light at import: the engine, torch and megatron-core are
imported inside :meth:`ZenFlowMode.build`. With ``--offload-optimizer`` too, ZenFlow builds
the optimizer (it outranks the offload mode) and keeps its CPU side's states in the offload
engine's host cache and tiers.
"""

from __future__ import annotations

import math
from typing import List, Optional

from megatron_ext.optim.modes import (
    MemoryNeeds,
    Mode,
    Requirement,
    TieredStates,
    metric_section,
    needs,
    only,
    refuses,
    register,
)

# Its part of the stdout line: (metric, label, format) of its ``zenflow/*`` metrics.
LINE_FIELDS = (("rho", "rho", ".3f"), ("update_interval", "S", ".0f"),
               ("stall_s", "stall (ms)", "ms"), ("selected_ratio", "selected", ".1%"))


def _gpu_state_flags(cfg) -> bool:
    """Whether flags that size or shape the offload engine's GPU states are given.

    ``--offload-device-cache-gb auto`` is the default and means no device tier under
    ZenFlow (its engine's states live on the CPU); a size in GB is refused.
    """
    return bool(cfg.optimizer.use_precision_aware_optimizer
                or cfg.offload.device_cache_bytes() > 0)


class ZenFlowMode(Mode):
    """Important columns updated on the GPU every step, the others by the CPU per window."""

    name = "zenflow"
    flag = "--zenflow"
    switch = "zenflow.zenflow"
    words = "--zenflow"
    precedence = 2
    requirements = (
        Requirement("--zenflow keeps its own GPU states: --use-precision-aware-optimizer and "
                    "--offload-device-cache-gb apply to --offload-optimizer alone",
                    _gpu_state_flags),
        needs("parallel.use_distributed_optimizer",
              "--zenflow splits the distributed optimizer's shard between the GPU and the CPU: "
              "add --use-distributed-optimizer"),
        refuses("optimizer.optimizer_cpu_offload",
                "--zenflow and --optimizer-cpu-offload both move optimizer states to the host; "
                "choose one"),
        only("optimizer.optimizer", "adam", "--zenflow supports --optimizer adam only"),
    )

    def build(self, cfg, model_chunks, runtime, plan=None):
        """megatron-core's factory with the ZenFlow DistributedOptimizer bound into it."""
        from megatron_ext.offload.capacity import host_knob_after_the_model
        from megatron_ext.optim.factory import build_megatron_optimizer
        from megatron_ext.zenflow.optimizer import zenflow_optimizer

        with zenflow_optimizer(cfg.zenflow, runtime.rank,
                               host_knob_after_the_model(cfg.offload, plan)) as bound:
            return build_megatron_optimizer(cfg, model_chunks, bound)

    def measure_tiers(self, cfg, runtime) -> None:
        """With ``--offload-paths`` (its CPU side's states may go to the tiers, or be moved
        there by :meth:`refit`), their bandwidths probed once, before the plan."""
        if cfg.offload.offload_paths:
            from megatron_ext.offload.optimizer import settle_path_speeds

            settle_path_speeds(cfg.offload, runtime.rank)

    def checkpoint_state_bytes(self, cfg, shape) -> float:
        """fp32 master and moments of every element, and the delayed ones' two fp32 windows.

        The engine's state_dict saves the open window's partial sums too (measured: 21.2 B
        per parameter with --bf16 and --zenflow-topk-ratio 0.1, weights included); CPU-side
        states in the offload tiers are counted at fp32 (an upper bound).
        """
        return 12.0 + 8.0 * (1.0 - cfg.zenflow.zenflow_topk_ratio)

    def memory_needs(self, cfg, shape, gpu_room: Optional[int] = None) -> MemoryNeeds:
        """The selected columns' states on the GPU; the delayed ones' on the CPU side.

        GPU: fp32 master and moments of the selected columns and of every 1-D parameter,
        the buffer the new weights wait in, and the fp32 accumulator with
        ``--zenflow-accumulate device`` (auto: when the GPU has room for it and 1 GiB).
        Host: the accumulators (two fp32 windows and the staging slots; one fp32 mean
        with the device accumulator), the new weights, and the CPU side's fp32 master and
        moments, unless they live in the offload tiers (``--zenflow-cpu-states``); and
        what a re-selection holds besides them while the states move.
        """
        from megatron_ext.memory.shape import state_array_bytes, state_nbytes
        from megatron_ext.offload.mode import path_placement, path_reserve_bytes

        zen, off = cfg.zenflow, cfg.offload
        n = shape.shard_elements
        vectors = min(n, -(-shape.rank_vector_params // shape.dp))
        selected = math.ceil((n - vectors) * zen.zenflow_topk_ratio)
        delayed = n - vectors - selected
        gpu = {"ZenFlow GPU states": (selected + vectors) * 12,
               "ZenFlow new weights": delayed * shape.param_bytes}
        place = zen.zenflow_accumulate
        if place == "auto":
            room = None if gpu_room is None else gpu_room - sum(gpu.values())
            place = "device" if room is not None and room > 4 * delayed + 2**30 else "host"
        host = {"ZenFlow new weights": delayed * shape.param_bytes}
        if place == "device":
            gpu["ZenFlow accumulator"] = 4 * delayed
            host["ZenFlow window mean"] = 4 * delayed
        else:
            host["ZenFlow accumulators"] = (8 + zen.zenflow_staging_slots
                                            * shape.grad_bytes) * delayed
        tiered = None
        if zen.zenflow_cpu_states == "tiers":
            from megatron_ext.offload.tier_model import pipeline_host_bytes

            arrays = state_array_bytes(cfg)
            # The engine's own rule for what its pipeline takes on the host (tier_model).
            biggest = min(off.offload_subgroup_size, max(1, delayed))
            host["offload pipeline"] = pipeline_host_bytes(biggest,
                                                           state_nbytes(arrays, biggest))
            # A re-selection fills a new engine from the old one: its pipeline, and two
            # subgroups beside the old states (the one being filled, and an old one whose
            # rows it still reads; the others are freed after their last read).
            host["ZenFlow re-selection"] = (host["offload pipeline"]
                                            + 2 * state_nbytes(arrays, biggest))
            if arrays[0] == 2:
                # Masters as remainders: the old weights under those two subgroups' writes
                # are kept aside while old reads still need them (zenflow/kept_weights.py).
                host["ZenFlow re-selection"] += 2 * biggest * shape.param_bytes
            interval = zen.zenflow_update_interval
            tiered = TieredStates(
                elements=delayed, arrays=arrays, subgroup_size=off.offload_subgroup_size,
                host_bytes=off.host_cache_bytes(),
                updates_per_iteration=1.0 / (int(interval) if interval.isdigit() else 4),
                overlaps_compute=True,
                path_reserve_bytes=path_reserve_bytes(
                    state_nbytes(arrays, min(off.offload_subgroup_size, delayed))),
                place=path_placement(off.offload_placement))
            host_fix = ("use --zenflow-accumulate device (the accumulator on the GPU) or a "
                        "larger --zenflow-topk-ratio")
        else:
            host["ZenFlow CPU states"] = 12 * delayed
            # A re-selection moves one kind of state at a time through whole fp32 copies
            # of each param group's shards (Move.whole_groups): the kind's new CPU states,
            # the group's whole shard and the GPU side's old kind, 8 B per shard element.
            host["ZenFlow re-selection"] = 8 * n
            host_fix = ("use --zenflow-cpu-states tiers with --offload-paths DIR"
                        if off.offload_optimizer else
                        "add --offload-optimizer --offload-paths DIR (ZenFlow then keeps its "
                        "CPU-side states in the offload tiers)")
        return MemoryNeeds(gpu=gpu, host=host, tiered=tiered, host_fix=host_fix,
                           gpu_fix="lower --zenflow-topk-ratio, or "
                                   "--zenflow-accumulate host", host_reserve=True)

    def host_memory_fixes(self, cfg, on_cpu: bool) -> List[str]:
        """The CPU side's states on a disk, its accumulators on the GPU, fewer columns."""
        zen, off = cfg.zenflow, cfg.offload
        if zen.zenflow_cpu_states == "tiers" and off.offload_optimizer:
            from megatron_ext.offload.mode import host_cache_fixes

            fixes = host_cache_fixes(off)
        else:  # in host memory, or the engine's host cache without files (refit)
            fixes = ["--offload-optimizer --offload-paths DIR (ZenFlow's CPU-side states in "
                     "the offload tiers, on a disk)"]
        if not on_cpu and zen.zenflow_accumulate != "device":
            fixes.append("--zenflow-accumulate device (the delayed gradients summed on the GPU)")
        if zen.zenflow_topk_ratio < 1:
            fixes.append("a larger --zenflow-topk-ratio (fewer columns on the CPU side)")
        return fixes

    def refit(self, cfg, plan):
        """Host states that do not fit move to the offload engine's host cache (auto only).

        With ``--zenflow-cpu-states auto`` and no ``--offload-optimizer``, the CPU side's
        states start in host memory (12 bytes per element); where the plan refuses that, the
        offload engine's host cache holds them without files, at its layout's bytes (10 with
        bf16 weights: the masters as remainders beside the weights waiting for the model).
        """
        from megatron_ext.memory.plan import gb

        zen = cfg.zenflow
        states = plan.host.items.get("ZenFlow CPU states")
        if not (zen.cpu_states_auto and zen.zenflow_cpu_states == "host" and states):
            return None
        off = cfg.offload
        size = off.offload_subgroup_size
        zen.zenflow_cpu_states = "tiers"
        # Without --offload-optimizer the engine's flags keep their defaults: only the test
        # hook sizes its subgroups (the plan and the engine both read the offload section).
        off.offload_subgroup_size = zen.zenflow_cache_subgroup_size or size

        def undo():
            zen.zenflow_cpu_states = "host"
            off.offload_subgroup_size = size

        return (f"zenflow: the CPU side's states ({gb(states)} GB in host memory) leave too "
                "little host memory for the rest of the run: they live in the offload "
                "engine's host cache instead (--zenflow-cpu-states auto; give --offload-"
                "optimizer --offload-paths DIR to put them on disk too)", undo)

    def log_summary(self, record: dict) -> Optional[str]:
        """``zenflow: rho .. S .. stall (ms) .. selected ..`` from its metrics in the record."""
        return metric_section(record, self.name, LINE_FIELDS)


register(ZenFlowMode())
