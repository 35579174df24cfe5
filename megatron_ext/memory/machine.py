"""The machine the memory plan sizes a run for: GPU, host memory, paths, speed.

:func:`measure` reads this machine at start-up (free GPU memory, the host memory the process may take, each
``--offload-paths`` directory's free space, the ``--save`` disk's; the knobs of
:mod:`megatron_ext.memory.config` stand in for each); ``tools/plan_memory.py`` states a
target machine instead (:class:`Machine` built from its flags). The only I/O of the
package is here (the host's room through :mod:`megatron_ext.runtime.host_memory`, which the
offload engine's auto sizes read too).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import List, Optional, Sequence, Tuple

from megatron_ext.runtime.host_memory import host_available

GB = 1e9

# Achieved TFLOP/s per GPU of forward+backward (model FLOPs with recomputation, the
# formula of memory/shape.py) measured on this project's runs; the plan's default on
# such a device. H200: the 16.5B and 20.1B rows of bench/results/2026-12-02b-h200
# (bf16, full recompute, iterations 2-3): 1.773e16 FLOPs in 29.5-30.3 s and 2.164e16
# FLOPs in 35.9-37.0 s, 584-603 TFLOP/s.
MEASURED_TFLOPS = {"H200": 590.0}


@dataclasses.dataclass(frozen=True)
class PathCapacity:
    """One ``--offload-paths`` directory as the plan sees it.

    Attributes:
        name: the directory (or "path N" on a stated target machine).
        free_bytes: its free space, for the whole node.
        read_gbps: its read bandwidth in GB/s (None: not known before the probe).
        write_gbps: its write bandwidth in GB/s (None: not known).
    """

    name: str
    free_bytes: int
    read_gbps: Optional[float] = None
    write_gbps: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Machine:
    """Capacities of one node and the speed of its GPUs.

    Attributes:
        name: the device in words ("NVIDIA H200", "cpu", "target").
        gpu_total_bytes: memory of one GPU (None: no GPU, a CPU run).
        gpu_free_bytes: free memory of this rank's GPU now (None: no GPU).
        host_available_bytes: what the process may still allocate on the host: the node's
            MemAvailable, or less where a memory cgroup or ``ulimit -v`` bounds the job
            (:func:`megatron_ext.runtime.host_memory.host_available`).
        host_source: what bounds ``host_available_bytes`` ("MemAvailable", "the memory
            cgroup DIR", "ulimit -v").
        ranks_per_node: training processes sharing the host and the paths.
        paths: the ``--offload-paths`` directories, in order.
        tflops: achieved TFLOP/s per GPU of forward+backward (None: not known).
        save_dir: the ``--save`` directory, or its nearest existing parent where it is not
            made yet (None: no --save, or a stated target machine).
        save_free_bytes: the free space of ``save_dir``'s file system (None: not known).
        expandable_segments: whether the CUDA caching allocator grows segments in place
            (the project's default, :func:`expandable_segments`); its slack is then small.
    """

    name: str
    gpu_total_bytes: Optional[int]
    gpu_free_bytes: Optional[int]
    host_available_bytes: int
    host_source: str = "MemAvailable"
    ranks_per_node: int = 1
    paths: Tuple[PathCapacity, ...] = ()
    tflops: Optional[float] = None
    save_dir: Optional[str] = None
    save_free_bytes: Optional[int] = None
    expandable_segments: bool = True

    def host_share(self) -> int:
        """The host memory one rank may plan with."""
        return self.host_available_bytes // max(1, self.ranks_per_node)

    def path_share(self, index: int) -> int:
        """The free space of path ``index`` that one rank may plan with."""
        return self.paths[index].free_bytes // max(1, self.ranks_per_node)


def split_path_spec(text: str) -> Tuple[str, Optional[float], Optional[float]]:
    """(directory, read GB/s, write GB/s) of an ``--offload-paths`` item.

    The config has checked the item already (``offload.paths.parse_tier_spec``, whose rule
    this follows: split at the last ``@`` unless what follows has a ``/``; one number is
    read = write).
    """
    head, sep, tail = text.rpartition("@")
    if not sep or "/" in tail or not head:
        return text, None, None
    values = [float(part) for part in tail.split(",")]
    return head, values[0], values[-1]


def default_tflops(device_name: str) -> Optional[float]:
    """The measured figure of :data:`MEASURED_TFLOPS` for a device of this name, if any."""
    for key, value in MEASURED_TFLOPS.items():
        if key in device_name:
            return value
    return None


def expandable_segments(environ) -> bool:
    """Whether the job's CUDA allocator settings grow segments in place.

    Unset, the run sets them so (``runtime.distributed.ALLOCATOR_DEFAULT``); set, as they
    say (torch's default is off).
    """
    conf = environ.get("PYTORCH_CUDA_ALLOC_CONF", environ.get("PYTORCH_ALLOC_CONF"))
    if conf is None:
        return True
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _ranks_per_node(environ) -> int:
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        text = environ.get(name, "").split("(")[0]
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def measure(cfg, runtime, environ=None) -> Machine:
    """The machine now, as the rank ``runtime`` sees it (the knobs override each value).

    Args:
        cfg: the run's config (its ``plan`` section's knobs, its ``--offload-paths``).
        runtime: the run's runtime (its device).
        environ: the environment (default ``os.environ``), for the ranks per node.
    """
    plan = cfg.plan
    environ = os.environ if environ is None else environ
    name, total, free = "cpu", None, None
    if not runtime.is_cpu:
        import torch

        free, total = torch.cuda.mem_get_info(runtime.device)
        name = torch.cuda.get_device_name(runtime.device)
    if plan.plan_gpu_free_gb is not None:
        free = int(plan.plan_gpu_free_gb * GB)
        total = free if total is None else total
    host, host_source = None, "MemAvailable"
    if plan.plan_memavailable_gb is not None:
        host = int(plan.plan_memavailable_gb * GB)
    else:
        room = host_available()
        if room is None:
            raise OSError("/proc/meminfo has no MemAvailable line and no memory cgroup or "
                          "ulimit -v bounds the process: give MEGATRON_EXT_MEMAVAILABLE_GB")
        host, host_source = room.bytes, room.source
    tflops = plan.plan_tflops or (default_tflops(name) if not runtime.is_cpu else None)
    save_dir = save_free = None
    if cfg.checkpoint.save:
        save_dir = existing_parent(cfg.checkpoint.save)
        save_free = (int(plan.plan_save_free_gb * GB) if plan.plan_save_free_gb is not None
                     else shutil.disk_usage(save_dir).free)
    return Machine(name=name, gpu_total_bytes=total, gpu_free_bytes=free,
                   host_available_bytes=host, host_source=host_source,
                   ranks_per_node=_ranks_per_node(environ),
                   paths=tuple(measure_paths(cfg.offload.offload_paths,
                                             plan.plan_path_free_gb)),
                   tflops=tflops, save_dir=save_dir, save_free_bytes=save_free,
                   expandable_segments=expandable_segments(environ))


def existing_parent(path: str) -> str:
    """``path`` if it exists, else its nearest existing parent (where it will be made)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def measure_paths(specs: Sequence[str], free_gb: Sequence[float] = ()) -> List[PathCapacity]:
    """Each ``--offload-paths`` item's free space (statvfs, or ``free_gb``) and stated speed.

    A path given without bandwidths is probed by the engine when it starts, after the plan:
    the plan then has no time for it.
    """
    paths = []
    for i, text in enumerate(specs):
        directory, read, write = split_path_spec(text)
        free = (int(free_gb[i] * GB) if i < len(free_gb)
                else shutil.disk_usage(directory).free)
        paths.append(PathCapacity(directory, free, read, write))
    return paths


def parse_target_path(text: str, index: int) -> PathCapacity:
    """``GB[@READ_GBPS[,WRITE_GBPS]]`` of ``tools/plan_memory.py --target-path``.

    Raises:
        ValueError: not of that form, or not positive numbers.
    """
    size, _, speed = text.partition("@")
    values = [float(size)] + [float(part) for part in speed.split(",") if speed]
    if len(values) > 3 or any(not value > 0 or value == float("inf") for value in values):
        raise ValueError(f"--target-path {text}: give GB[@READ_GBPS,WRITE_GBPS], positive "
                         "numbers")
    read = values[1] if len(values) > 1 else None
    write = values[2] if len(values) > 2 else read
    return PathCapacity(f"path{index}", int(values[0] * GB), read, write)


def target_machine(gpu_gb: float, host_gb: float, paths: Sequence[str], tflops: Optional[float],
                   gpus_per_node: int = 1, name: str = "target") -> Machine:
    """A stated machine (``tools/plan_memory.py``).

    One GPU of ``gpu_gb`` free, the node's ``host_gb`` of MemAvailable and its ``paths``
    (``GB[@READ,WRITE]`` each), the CUDA allocator as this shell's environment sets it.
    """
    gpu = int(gpu_gb * GB)
    return Machine(name=name, gpu_total_bytes=gpu, gpu_free_bytes=gpu,
                   host_available_bytes=int(host_gb * GB), ranks_per_node=gpus_per_node,
                   paths=tuple(parse_target_path(text, i) for i, text in enumerate(paths)),
                   tflops=tflops, expandable_segments=expandable_segments(os.environ))
