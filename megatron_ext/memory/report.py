"""The memory plan as a small table (the start-up log, tools/plan_memory.py) and as metrics.

:func:`plan_table` is what both print; :func:`plan_metrics` is the ``memory/plan_*`` record
the metrics get once at start-up, so a test (or a reader of the JSONL) can put the plan
beside the engine's own ``offload/*`` numbers. Pure.
"""

from __future__ import annotations

from typing import Dict, List

from megatron_ext.memory.plan import MemoryPlan, Tier, gb


def _seconds(value) -> str:
    return "?" if value is None else (f"{value:.3g} s" if value < 100 else f"{value:.0f} s")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _tier_row(tier: Tier) -> List[str]:
    what = ", ".join(f"{name} {gb(value)}" for name, value in tier.items.items() if value)
    if tier.read_bytes or tier.write_bytes:
        speed = (f" at {tier.read_gbps:.2f}/{tier.write_gbps:.2f} GB/s"
                 if tier.read_gbps and tier.write_gbps else " (speed probed at start)")
        what += (f"; per iteration read {gb(tier.read_bytes)} + write "
                 f"{gb(tier.write_bytes)} GB{speed}")
    capacity = "?" if tier.capacity is None else gb(tier.capacity)
    return [tier.name, gb(tier.used), capacity, str(tier.subgroups) if tier.subgroups else "-",
            what or "-"]


def _shown(plan: MemoryPlan) -> List[Tier]:
    """The tiers as the table shows them: on a CPU run there is no GPU row, its items are
    in the host's (:meth:`MemoryPlan.host_view`)."""
    if plan.machine.gpu_total_bytes is not None:
        return plan.tiers
    return [plan.host_view(), *plan.paths]


def plan_table(plan: MemoryPlan, tflops_flag: str = "--plan-tflops") -> str:
    """The plan in a few lines: a header, one row per tier, the step time, the verdict.

    Args:
        plan: the plan.
        tflops_flag: the flag of the program printing the table that gives the achieved
            TFLOP/s (pretrain_gpt.py's ``--plan-tflops``, tools/plan_memory.py's
            ``--target-tflops``): the hint names it where no TFLOP/s is known.

    The verdict does not repeat the first refusal: the program prints that one as its
    ``error:`` line (or its ``--no-plan-check`` warning) right after the table.
    """
    shape, machine = plan.shape, plan.machine
    head = (f"memory plan ({plan.mode} mode, per rank of {shape.world_size} on {machine.name}"
            f"{f', {machine.ranks_per_node} per node' if machine.ranks_per_node > 1 else ''}; "
            f"{_count(shape.total_params)} parameters, {_count(shape.rank_params)} on the "
            f"rank, TP={shape.tp} PP={shape.pp} DP={shape.dp}")
    if plan.subgroup_bytes:
        head += (f"; {plan.state_bytes_per_element} B/element states in subgroups of "
                 f"{gb(plan.subgroup_bytes)} GB")
    rows = [["tier", "GB", "of GB", "subgroups", "what"]] + [_tier_row(t) for t in _shown(plan)]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [head + ")"]
    for row in rows:
        lines.append("  " + " | ".join(cell.ljust(width) for cell, width in
                                        zip(row[:4], widths)) + " | " + row[4])
    if machine.gpu_total_bytes is not None:  # a CPU run's step time is not predicted
        flops = f"{shape.flops_per_iteration:.3g} FLOPs"
        tflops = f" at {machine.tflops:g} TFLOP/s per GPU" if machine.tflops else \
            f" (no TFLOP/s known: give {tflops_flag})"
        lines.append(f"  step: forward+backward {_seconds(plan.fwd_bwd_s)} ({flops}{tflops}), "
                     f"update I/O floor {_seconds(plan.io_floor_s)}, predicted "
                     f"{_seconds(plan.step_s)}")
    if plan.checkpoint_bytes:
        free = machine.save_free_bytes
        lines.append(f"  checkpoint: {gb(plan.checkpoint_bytes)} GB per save (weights "
                     f"{gb(plan.checkpoint_weights_bytes)}, optimizer states "
                     f"{gb(plan.checkpoint_state_bytes)})"
                     + (f" into {machine.save_dir}" if machine.save_dir else "")
                     + (f", {gb(free)} GB free there" if free is not None else ""))
    if machine.gpu_total_bytes is not None and (plan.mode == "offload" or plan.device_budget):
        lines.append(f"  device budget before the first step: {gb(plan.device_budget)} GB")
    lines.append(_verdict(plan.refusals))
    return "\n".join(lines)


def _verdict(refusals: List[str]) -> str:
    if not refusals:
        return "  fits"
    also = f"; also: {'; '.join(refusals[1:])}" if len(refusals) > 1 else ""
    return f"  does not fit (why: the line below{also})"


def plan_metrics(plan: MemoryPlan) -> Dict[str, float]:
    """``memory/plan_*``: bytes and subgroups per tier, the estimates, the verdict."""
    record: Dict[str, float] = {
        "memory/plan_gpu_bytes": float(plan.gpu.used),
        "memory/plan_host_bytes": float(plan.host.used),
        "memory/plan_weights_bytes": float(plan.gpu.items["weights"]),
        "memory/plan_gradients_bytes": float(plan.gpu.items["gradients"]),
        "memory/plan_activation_bytes": float(plan.gpu.items["activations"]),
        "memory/plan_device_tier_bytes": float(plan.gpu.items.get("device tier", 0)),
        "memory/plan_allocator_slack_bytes": float(plan.gpu.items.get("allocator slack", 0)),
        "memory/plan_cuda_libraries_bytes": float(plan.gpu.items.get("CUDA libraries", 0)),
        "memory/plan_device_subgroups": float(plan.device_subgroups),
        "memory/plan_host_cache_bytes": float(plan.host_cache_bytes),
        "memory/plan_host_only_subgroups": float(plan.host_subgroups),
        "memory/plan_device_budget_bytes": float(plan.device_budget),
        "memory/plan_state_bytes_per_element": float(plan.state_bytes_per_element),
        "memory/plan_checkpoint_bytes": float(plan.checkpoint_bytes),
        "memory/plan_fits": float(not plan.refusals),
    }
    for index, path in enumerate(plan.paths):
        record[f"memory/plan_path{index}_bytes"] = float(path.used)
        record[f"memory/plan_path{index}_subgroups"] = float(path.subgroups)
        record[f"memory/plan_path{index}_io_bytes"] = path.read_bytes + path.write_bytes
    for key, value in (("fwd_bwd_s", plan.fwd_bwd_s), ("io_floor_s", plan.io_floor_s),
                       ("step_s", plan.step_s)):
        if value is not None:
            record[f"memory/plan_{key}"] = float(value)
    return record
