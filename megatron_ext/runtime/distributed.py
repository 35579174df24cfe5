"""Process-group and parallel-state setup from torchrun's or Slurm's environment."""

from __future__ import annotations

import dataclasses
import datetime
import os
import random

import numpy as np
import torch

from megatron_ext.errors import UsageError
from megatron_ext.runtime import slurm


@dataclasses.dataclass
class Runtime:
    """Where this process runs and its place in the parallel layout."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp: int
    pp: int
    dp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    host_group: object = None
    """All ranks over gloo, for host-side agreement (exit signals); None for one process."""

    @property
    def is_cpu(self) -> bool:
        """Whether the run trains on the CPU."""
        return self.device.type == "cpu"


def resolve_device(choice: str) -> torch.device:
    """Maps --device to a torch device (auto: cuda when a GPU is visible)."""
    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        raise UsageError("--device cuda: no GPU is visible to this process; use --device cpu")
    if choice == "cuda" or (choice == "auto" and has_cuda):
        return torch.device("cuda")
    return torch.device("cpu")


def read_process_env() -> tuple:
    """(rank, world size, local rank) from torchrun, srun, or a single process."""
    from_slurm = slurm.torch_env_from_slurm(os.environ)
    if from_slurm:
        os.environ.update(from_slurm)
    rank, world, local = (_env_int(name, default) for name, default in
                          (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"RANK={rank} WORLD_SIZE={world}: the rank must be in [0, WORLD_SIZE); "
                         "launch with torchrun or srun, or unset them for a single process")
    return rank, world, local


def _env_int(name: str, default: int) -> int:
    """A launcher's integer variable (torchrun sets them; a script may set them wrong)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name}={value}: not an integer; launch with torchrun or srun, or "
                         "unset it for a single process") from None


def initialize(cfg) -> Runtime:
    """Initializes torch.distributed and megatron-core's parallel state.

    nccl on GPU, gloo on CPU. On the CPU the compatibility layer
    (:mod:`megatron_ext.runtime.cpu_compat`) is installed first.
    """
    rank, world, local = read_process_env()
    dp = cfg.check_world(world)
    device = resolve_device(cfg.runtime.device)
    if device.type == "cpu":
        from megatron_ext.runtime import cpu_compat

        cpu_compat.install()
        backend = "gloo"
        # One intra-op thread per rank when ranks share the machine's cores.
        if world > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        if torch.cuda.device_count() <= local:
            raise UsageError(f"local rank {local} has no GPU ({torch.cuda.device_count()} visible)")
        if cfg.parallel.distributed_backend != "nccl":
            raise UsageError(f"--distributed-backend {cfg.parallel.distributed_backend}: on "
                             "GPUs this project runs megatron-core's collectives on nccl; use "
                             "nccl (gloo is what --device cpu uses)")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    if not torch.distributed.is_initialized():
        # A single process without a rendezvous address of its own needs no TCP store: an
        # in-process one takes no port (a free port picked and then bound could be taken by
        # another process in between: EADDRINUSE when several runs start at once).
        store = (torch.distributed.HashStore() if world == 1
                 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"))
                 else None)
        torch.distributed.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world,
            store=store,
            timeout=datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes),
        )
    host_group = None
    if world > 1:  # on the CPU the default group is gloo already
        host_group = (torch.distributed.new_group(backend="gloo") if backend == "nccl"
                      else torch.distributed.group.WORLD)
    from megatron.core import parallel_state

    from megatron_ext.runtime import grad_norm

    grad_norm.install()
    par = cfg.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_size(),
    )
    runtime = Runtime(
        rank=rank,
        world_size=world,
        local_rank=local,
        device=device,
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        dp=dp,
        dp_rank=parallel_state.get_data_parallel_rank(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        host_group=host_group,
    )
    set_seed(cfg.training.seed, runtime)
    return runtime


def set_seed(seed: int, runtime: Runtime) -> None:
    """Seeds every generator as Megatron-LM does (offset per pipeline stage)."""
    from megatron.core import tensor_parallel

    seed = seed + 100 * runtime.pp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # On the CPU the tracker's fork is a no-op (there is no separate CUDA generator):
    # dropout inside tensor-parallel regions then draws from the CPU generator.
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=runtime.is_cpu,
                                                    force_reset_rng=True)


def shutdown() -> None:
    """Destroys the process groups (end of run)."""
    from megatron.core import parallel_state

    if torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
