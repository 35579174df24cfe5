"""The memory plan: what goes where, per rank, before the first allocation. Pure.

From the model's shape (:mod:`.shape`), the mode's needs (``Mode.memory_needs`` of
:mod:`megatron_ext.optim.modes`) and the machine (:mod:`.machine`), :func:`make_plan` says
per tier (the GPU, the host, each ``--offload-paths`` directory) how many bytes and
subgroups go there, the expected activation peak and the predicted step time
(forward+backward from FLOPs at the machine's TFLOP/s; the update from the bytes that
cross each path at its bandwidth), and what cannot fit: :attr:`MemoryPlan.refusals`, one
line each with the numbers and the flag that fixes it.

Tiered states (the offload engine's, ZenFlow's CPU side in the tiers) are placed as the
engine places them: subgroups of ``--offload-subgroup-size`` elements, the device tier
first (a fixed size, or ``auto``: :func:`device_budget_bytes`), the host cache next, the
paths the rest by the mode's placement rule (the engine's own function: in proportion to
the bandwidths); when the paths are short, the host cache keeps the fewest subgroups that
let the rest fit.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from megatron_ext.memory.machine import GB, Machine
from megatron_ext.memory.shape import ModelShape, state_nbytes
from megatron_ext.optim.modes import TieredStates, mode_of

PIPELINE_BUFFERS = 3
"""Host buffers the offload pipeline needs at least (fetch, update, flush)."""

SLACK_EXPANDABLE = 0.01
"""The CUDA caching allocator's reserved memory beyond what it hands out, as a share of
the GPU items besides the device tier (whole-subgroup allocations, placed after it), with
expandable segments (the default). Measured on an H100 on 2026-12-07
(bench/results/2026-12-07b-h100-plan-vs-peak): 0.05-0.24 GB, at most 0.35 % of the peak,
over 1.3B plain, offload, ZenFlow, 2.7B micro-batch 2 and Llama-3-8B offload."""
SLACK_DEFAULT = 0.15
"""The same with torch's default allocator (the job set PYTORCH_CUDA_ALLOC_CONF without
expandable segments): 0.27-4.96 GB, up to 14.1 % of the allocated peak (1.3B plain,
bench/results/2026-12-07-h100-plan-vs-peak)."""
GPU_LIBRARIES = int(2.6 * GB)
"""GPU memory a run takes after the plan outside the caching allocator: the kernels of the
CUDA libraries (cuBLAS, cuDNN, NCCL) and the compiled Triton kernels, loaded at first use.
Measured as the driver's used memory at its peak less at the plan, less the allocator's
reserved peak, on an H200 on 2026-12-07 (bench/results/2026-12-07d-h200-plan-vs-peak): 2.06
GB (2.7B plain), 2.07 (1.3B offload), 2.49 (Llama-3-8B offload); on an H100 2.60 (Llama-3-8B
offload, bench/results/2026-12-07e-h100-llama-and-gpu-tests): the largest measured."""
GPU_PROCESS_HOST = int(2.1 * GB)
"""Host memory a GPU run's process takes after the plan besides what the plan places
there: megatron-core's start-up, NCCL, the CUDA libraries' kernels loaded at the first
iteration. Measured on an H100 on 2026-12-07: the resident set of a plain run grew 1.84-1.91
GB after the plan's print, for 1.3B and 2.7B alike."""


def gb(nbytes: float) -> str:
    """Bytes as GB for the table and the refusals.

    3 significant digits below 10 GB, 1 decimal up to 100 GB, none above.
    """
    value = nbytes / GB
    if value >= 10:
        return f"{value:.0f}" if value >= 100 else f"{value:.1f}"
    return f"{value:.3g}"


@dataclasses.dataclass
class Tier:
    """One place the plan puts bytes in.

    Attributes:
        name: "GPU", "host" or the path's directory.
        items: bytes by item ("weights", "optimizer states", ...).
        capacity: what this rank may use there (None: not known, e.g. no GPU on a CPU run).
        subgroups: subgroups of tiered states placed there (the host: its cache's buffers;
            the paths: the subgroups with a file there).
        read_bytes: bytes read from it per iteration (paths).
        write_bytes: bytes written to it per iteration (paths).
        read_gbps: read bandwidth (paths; None: not known before the probe).
        write_gbps: write bandwidth (paths).
    """

    name: str
    items: Dict[str, int] = dataclasses.field(default_factory=dict)
    capacity: Optional[int] = None
    subgroups: int = 0
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    read_gbps: Optional[float] = None
    write_gbps: Optional[float] = None

    @property
    def used(self) -> int:
        """The bytes the plan puts there."""
        return sum(self.items.values())

    def io_seconds(self) -> Optional[float]:
        """Seconds of this path's reads and writes per iteration (None: speed not known)."""
        if not (self.read_bytes or self.write_bytes):
            return 0.0
        if not (self.read_gbps and self.write_gbps):
            return None
        return self.read_bytes / (self.read_gbps * GB) + self.write_bytes / (self.write_gbps * GB)


@dataclasses.dataclass
class MemoryPlan:
    """Where a run's bytes go on its most loaded rank, and how long a step should take.

    Attributes:
        mode: the optimizer mode's name.
        shape: the model's numbers.
        machine: the capacities planned with.
        gpu, host: the GPU and host tiers.
        paths: one tier per ``--offload-paths`` directory.
        device_budget: the GPU bytes left for a device tier before the first step.
        subgroup_bytes: bytes of one (full) subgroup of tiered states (0: none).
        state_bytes_per_element: of the tiered states (0: none).
        device_subgroups, host_subgroups: subgroups of tiered states in the device tier
            and in the host cache without a file.
        host_cache_bytes: the host cache's buffers (capacity x subgroup bytes).
        fwd_bwd_s: predicted forward+backward seconds (None: no TFLOP/s known).
        io_floor_s: seconds of the paths' reads and writes per iteration (slowest path).
        step_s: predicted iteration seconds.
        checkpoint_weights_bytes, checkpoint_state_bytes: one checkpoint of the whole job
            (every rank's part), its weights and its optimizer states (0: no --save).
        refusals: why the run cannot fit, one line each (empty: it fits).
    """

    mode: str
    shape: ModelShape
    machine: Machine
    gpu: Tier
    host: Tier
    paths: List[Tier]
    device_budget: int = 0
    subgroup_bytes: int = 0
    state_bytes_per_element: int = 0
    device_subgroups: int = 0
    host_subgroups: int = 0
    host_cache_bytes: int = 0
    fwd_bwd_s: Optional[float] = None
    io_floor_s: Optional[float] = None
    step_s: Optional[float] = None
    checkpoint_weights_bytes: int = 0
    checkpoint_state_bytes: int = 0
    refusals: List[str] = dataclasses.field(default_factory=list)

    def host_view(self) -> Tier:
        """The host as the job fills it: on a CPU run (no GPU) what the plan counts for the
        device (weights, gradients, activations, ...) lives in host memory beside the
        host's own items; on a GPU run the host tier itself."""
        if self.machine.gpu_total_bytes is not None:
            return self.host
        items = dict(self.gpu.items)
        for name, value in self.host.items.items():
            items[name] = items.get(name, 0) + value
        return Tier("host", items, self.host.capacity, subgroups=self.host.subgroups)

    @property
    def checkpoint_bytes(self) -> int:
        """One checkpoint's bytes (0: no --save)."""
        return self.checkpoint_weights_bytes + self.checkpoint_state_bytes

    @property
    def tiers(self) -> List[Tier]:
        """The GPU, the host and each path, in that order."""
        return [self.gpu, self.host, *self.paths]


def device_budget_bytes(plan: MemoryPlan) -> int:
    """The GPU bytes the offload device tier may take before the first step.

    Free GPU memory minus the weights, the gradients, the activation estimate, the mode's
    other GPU items and a reserve (``--offload-device-reserve-gb``); 0 with no GPU known.
    """
    return plan.device_budget


def _gpu_reserve(cfg) -> int:
    return int(cfg.offload.offload_device_reserve_gb * GB)


def _host_reserve(cfg, available: int, ranks: int) -> int:
    """A rank's part of the host memory left free.

    The offload engine's rule for the node (``OffloadConfig.host_reserve_bytes``), shared
    by its ``ranks``.
    """
    return cfg.offload.host_reserve_bytes(available) // max(1, ranks)


def _subgroup_sizes(states: TieredStates) -> List[int]:
    size, n = states.subgroup_size, states.elements
    numels = [size] * (n // size) + ([n % size] if n % size else [])
    return [state_nbytes(states.arrays, numel) for numel in numels]


def _place_on_paths(states: TieredStates, sizes: List[int], hosted: List[int],
                    capacity: int, paths: List[Tier], free: List[int]
                    ) -> Tuple[Optional[List[int]], frozenset]:
    """(home path of each hosted subgroup, those the host keeps without a file).

    As the engine: the fewest kept in the host cache (from the middle of the order) that
    let the rest fit, while the pipeline keeps its buffers; (None, {}) when nothing fits.
    """
    weights = [1.0 / (1.0 / p.read_gbps + 1.0 / p.write_gbps)
               if p.read_gbps and p.write_gbps else 1.0 for p in paths]
    spare = max(0, capacity - min(len(hosted), PIPELINE_BUFFERS))
    lack = sum(sizes[i] for i in hosted) - sum(free)
    first = max(0, lack // max(sizes)) if lack > 0 else 0
    for kept in range(min(first, spare), spare + 1):
        lo = (len(hosted) - kept) // 2
        resident = frozenset(hosted[lo:lo + kept])
        others = [i for i in hosted if i not in resident]
        try:
            homes = states.place([sizes[i] for i in others], weights, free)
        except Exception as err:  # the mode's rule says it does not fit: one more kept
            if not isinstance(err, ValueError) and type(err).__name__ != "TierFullError":
                raise
            continue
        home = {i: path for i, path in zip(others, homes)}
        return [home.get(i, -1) for i in hosted], resident
    return None, frozenset()


def _place_tiered(plan: MemoryPlan, states: TieredStates, host_room: int) -> Optional[str]:
    """Places the tiered states over the device tier, the host cache and the paths.

    Returns:
        The refusal when they do not fit, else None.
    """
    sizes = _subgroup_sizes(states)
    if not sizes:
        return None
    buffer = max(sizes)
    plan.subgroup_bytes = buffer
    plan.state_bytes_per_element = sum(states.arrays)
    device = plan.device_budget if states.device_bytes is None else states.device_bytes
    n = len(sizes)
    on_device = min(n, device // buffer) if device > 0 else 0
    # Evenly spread over the order (the engine's rule); sizes are equal but the last.
    device_ids = [(2 * k + 1) * n // (2 * on_device) for k in range(on_device)]
    plan.device_subgroups = on_device
    if on_device:
        plan.gpu.items["device tier"] = sum(sizes[i] for i in device_ids)
        plan.gpu.subgroups = on_device
    hosted = [i for i in range(n) if i not in set(device_ids)]
    fits = (states.host_bytes if states.host_bytes is not None else max(0, host_room)) // buffer
    all_bytes = sum(sizes)
    if states.host_bytes == 0 and hosted:
        # No host cache: the pipeline's buffers alone, every state in a file on the paths.
        if not plan.paths:
            return (f"--offload-host-cache-gb 0 keeps none of the optimizer states "
                    f"({gb(sum(sizes[i] for i in hosted))} GB) in host memory and there is no "
                    "--offload-paths for them: give --offload-paths DIR, or a positive "
                    "--offload-host-cache-gb (or auto)")
        fits = PIPELINE_BUFFERS
    if not plan.paths:
        if fits < len(hosted):
            short = (len(hosted) - fits) * buffer
            return (f"the optimizer states need {gb(all_bytes)} GB: the GPU's device tier "
                    f"holds {gb(plan.gpu.items.get('device tier', 0))} and the host "
                    f"{gb(fits * buffer)} ({_host_words(states)}); {gb(short)} GB more: add "
                    f"--offload-paths DIR with {gb(short)} GB free{_fix(states)}")
        plan.host_subgroups = len(hosted)
        plan.host_cache_bytes = len(hosted) * buffer
        plan.host.items["optimizer states"] = plan.host_cache_bytes
        plan.host.subgroups = len(hosted)
        return None
    capacity = min(len(hosted), fits)
    if capacity < min(len(hosted), PIPELINE_BUFFERS):
        # The engine's words (offload/plan.py) for a given size; the same rule for auto.
        where = (f"--offload-host-cache-gb {states.host_bytes / GB:g} holds"
                 if states.host_bytes is not None else
                 f"the host ({_host_words(states)}) has room for")
        return (f"{where} {fits} subgroups of {gb(buffer)} GB; the pipeline needs "
                f"{PIPELINE_BUFFERS}: give at least {gb(PIPELINE_BUFFERS * buffer)} GB or a "
                "smaller --offload-subgroup-size")
    free = [max(0, plan.machine.path_share(i) - states.path_reserve_bytes)
            for i in range(len(plan.paths))]
    homes, resident = _place_on_paths(states, sizes, hosted, capacity, plan.paths, free)
    if homes is None:
        room = sum(free) + capacity * buffer + plan.gpu.items.get("device tier", 0)
        short = all_bytes - room
        return (f"the optimizer states need {gb(all_bytes)} GB: the GPU's device tier holds "
                f"{gb(plan.gpu.items.get('device tier', 0))}, the host {gb(capacity * buffer)} "
                f"and the paths {gb(sum(free))} ({len(plan.paths)} path(s) free per rank); "
                f"{gb(max(short, buffer))} GB more: add --offload-paths DIR with that much "
                f"free, or more host memory{_fix(states)}")
    plan.host_subgroups = len(resident)
    plan.host_cache_bytes = capacity * buffer
    only = f", {len(resident)} without a file" if resident else ""
    plan.host.items[f"optimizer states (host cache{only})"] = plan.host_cache_bytes
    plan.host.subgroups = capacity
    # The cache's buffers beyond the host-only subgroups keep the tail of the last pass
    # (alternating order): that many of the path subgroups are hits, the rest cross the disk.
    reused = max(0, capacity - len(resident))
    on_paths = [i for i, home in zip(hosted, homes) if home >= 0]
    moved = max(0, len(on_paths) - reused) / max(1, len(on_paths))
    for index, path in enumerate(plan.paths):
        mine = [i for i, home in zip(hosted, homes) if home == index]
        path.subgroups = len(mine)
        path.items["optimizer states"] = sum(sizes[i] for i in mine)
        path.read_bytes = path.write_bytes = (path.items["optimizer states"] * moved
                                              * states.updates_per_iteration)
    return None


def _host_words(states: TieredStates) -> str:
    return ("--offload-host-cache-gb" if states.host_bytes is not None
            else "its MemAvailable less the run's other host needs and a reserve")


def _fix(states: TieredStates) -> str:
    return f"; {states.fix}" if states.fix else ""


def _gpu_refusal(plan: MemoryPlan, gpu_fix: str, base: int) -> Optional[str]:
    free = plan.gpu.capacity
    if free is None or plan.gpu.used <= free:
        return None
    parts = ", ".join(f"{name} {gb(value)}" for name, value in plan.gpu.items.items() if value)
    if base > free:
        fix = ("more GPUs for the model (--tensor-model-parallel-size, "
               "--pipeline-model-parallel-size), --recompute-granularity full, or a smaller "
               "--micro-batch-size")
    else:
        fix = gpu_fix or "free GPU memory"
    return f"the run needs {gb(plan.gpu.used)} GB on the GPU ({parts}), {gb(free)} GB free: {fix}"


def _bound(machine: Machine) -> str:
    """What bounds the host's room where it is not the node's MemAvailable."""
    return "" if machine.host_source == "MemAvailable" else f" (under {machine.host_source})"


def _host_fix(machine: Machine) -> str:
    """The remedy of a mode that has none of its own for a host too small."""
    if machine.host_source == "MemAvailable":
        return "free host memory"
    if machine.host_source == "ulimit -v":
        return "raise the job's address-space limit (ulimit -v) or free host memory"
    return (f"raise the limit of {machine.host_source} (Slurm: --mem) or free host memory")


def make_plan(cfg, shape: ModelShape, machine: Machine) -> MemoryPlan:
    """The memory plan of ``cfg`` on ``machine`` (see the module's description)."""
    mode = mode_of(cfg)
    gpu = Tier("GPU", {"weights": shape.weights_bytes, "gradients": shape.grads_bytes,
                       "activations": shape.activation_bytes}, machine.gpu_free_bytes)
    base = gpu.used
    plan = MemoryPlan(mode=mode.name, shape=shape, machine=machine, gpu=gpu,
                      host=Tier("host", capacity=machine.host_share()),
                      paths=[Tier(p.name, capacity=machine.path_share(i),
                                  read_gbps=p.read_gbps, write_gbps=p.write_gbps)
                             for i, p in enumerate(machine.paths)])
    room = None
    if machine.gpu_free_bytes is not None:
        room = max(0, machine.gpu_free_bytes - base - _gpu_reserve(cfg))
    needs = mode.memory_needs(cfg, shape, room)
    gpu.items.update(needs.gpu)
    plan.host.items.update(needs.host)
    beside = 0  # the GPU bytes besides the tensors: the allocator's and the libraries'
    if machine.gpu_total_bytes is not None:
        share = SLACK_EXPANDABLE if machine.expandable_segments else SLACK_DEFAULT
        gpu.items["allocator slack"] = int(share * gpu.used)
        gpu.items["CUDA libraries"] = GPU_LIBRARIES
        beside = gpu.items["allocator slack"] + GPU_LIBRARIES
        plan.host.items["CUDA libraries and start-up"] = GPU_PROCESS_HOST
    if room is not None:
        plan.device_budget = max(0, room - sum(needs.gpu.values()) - beside)
    refusal = _gpu_refusal(plan, needs.gpu_fix, base)
    if refusal:
        plan.refusals.append(refusal)
    reserve = (_host_reserve(cfg, plan.host.capacity, machine.ranks_per_node)
               if needs.host_reserve else 0)
    host = plan.host_view()
    if host.used > plan.host.capacity - reserve:
        parts = ", ".join(f"{k} {gb(v)}" for k, v in host.items.items())
        kept = f" less a reserve of {gb(reserve)}" if reserve else ""
        plan.refusals.append(
            f"the run needs {gb(host.used)} GB of host memory per rank ({parts}), "
            f"{gb(plan.host.capacity)} GB available{_bound(machine)}{kept}: "
            f"{needs.host_fix or _host_fix(machine)}")
    if needs.tiered is not None:
        host_room = (plan.host.capacity - host.used
                     - _host_reserve(cfg, machine.host_available_bytes,
                                     machine.ranks_per_node))
        refusal = _place_tiered(plan, needs.tiered, host_room)
        if refusal:
            plan.refusals.append(refusal)
    _predict_times(plan, needs.tiered)
    if cfg.checkpoint.save:
        refusal = _plan_checkpoint(plan, cfg, mode)
        if refusal:
            plan.refusals.append(refusal)
    return plan


def _plan_checkpoint(plan: MemoryPlan, cfg, mode) -> Optional[str]:
    """Sizes one checkpoint of the job; the refusal when the --save disk cannot hold it.

    The weights in the training dtype and the optimizer states as the mode saves them
    (``Mode.checkpoint_state_bytes``), each parameter's once; the file system's free space
    is the whole job's (ranks on a shared file system write to the same disk).
    """
    shape, machine = plan.shape, plan.machine
    plan.checkpoint_weights_bytes = shape.total_params * shape.param_bytes
    plan.checkpoint_state_bytes = int(shape.total_params
                                      * mode.checkpoint_state_bytes(cfg, shape))
    free = machine.save_free_bytes
    if free is None or plan.checkpoint_bytes <= free:
        return None
    return (f"--save {cfg.checkpoint.save}: one checkpoint takes {gb(plan.checkpoint_bytes)} "
            f"GB (weights {gb(plan.checkpoint_weights_bytes)}, optimizer states "
            f"{gb(plan.checkpoint_state_bytes)}) and {machine.save_dir} has {gb(free)} GB "
            "free: free space there, or give --save a directory on a larger disk")


def _predict_times(plan: MemoryPlan, states: Optional[TieredStates]) -> None:
    tflops = plan.machine.tflops
    if tflops:
        plan.fwd_bwd_s = plan.shape.flops_per_iteration / plan.shape.world_size / (tflops * 1e12)
    seconds = [path.io_seconds() for path in plan.paths]
    plan.io_floor_s = None if any(s is None for s in seconds) else max(seconds, default=0.0)
    if plan.fwd_bwd_s is None or plan.io_floor_s is None:
        return
    if states is not None and states.overlaps_compute:
        plan.step_s = max(plan.fwd_bwd_s, plan.io_floor_s)
    else:  # the update follows the backward: its I/O adds to the step
        plan.step_s = plan.fwd_bwd_s + plan.io_floor_s


def plan_run(cfg, vocab_size: int, world_size: int, machine: Machine) -> MemoryPlan:
    """The plan of ``cfg`` on ``world_size`` ranks of ``machine``'s kind."""
    from megatron_ext.memory.shape import model_shape

    return make_plan(cfg, model_shape(cfg, vocab_size, world_size), machine)

