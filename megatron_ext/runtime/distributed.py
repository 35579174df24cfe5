"""Process-group and parallel-state setup from torchrun's or Slurm's environment."""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import sys
import time

import numpy as np
import torch

from megatron_ext.errors import UsageError
from megatron_ext.runtime import fatal, mcore_compat, slurm

BARE_RENDEZVOUS_S = 30.0
"""How long the ranks of a launch without torchrun or Slurm wait for each other at the
start. Started by hand or by a script, they start together; a WORLD_SIZE given to a single
process by mistake then fails in seconds, not after --distributed-timeout-minutes."""
RENDEZVOUS_NOTE_S = 30.0
"""How often rank 0 says which ranks it still waits for."""

ALLOCATOR_DEFAULT = "expandable_segments:True"
"""The CUDA caching allocator's settings when the job gives none (PYTORCH_CUDA_ALLOC_CONF
or PYTORCH_ALLOC_CONF unset): segments that grow in place instead of new blocks beside
freed ones. With torch's default, a 1.3B run reserved up to 5 GB (14 %) more than it
allocated (bench/results/2026-12-07-h100-plan-vs-peak), memory the plan cannot foresee."""


def cuda_allocator_default(environ=os.environ) -> str:
    """Sets :data:`ALLOCATOR_DEFAULT` when the job sets no allocator settings; returns the
    settings in force ('' when the job's own)."""
    if environ.get("PYTORCH_CUDA_ALLOC_CONF") is not None or \
            environ.get("PYTORCH_ALLOC_CONF") is not None:
        return ""
    environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT
    if environ is os.environ and torch.cuda.is_initialized():
        # The variable is read when the allocator starts: tell a started one.
        torch.cuda.memory._set_allocator_settings(ALLOCATOR_DEFAULT)
    return ALLOCATOR_DEFAULT


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


LAUNCH_VARIABLES = ("RANK", "MASTER_ADDR", "MASTER_PORT")
"""What every process of a job of several needs besides WORLD_SIZE (torchrun and srun, the
latter through :func:`read_process_env`, set them)."""


def check_launch_env(world: int) -> None:
    """Refuses a job of several processes without its rank and rank 0's address.

    Before any rendezvous: a WORLD_SIZE left in the environment of one process would
    otherwise make it the store's host and wait for peers that never come, or try to
    reach a store at no address.
    """
    missing = [name for name in LAUNCH_VARIABLES if not os.environ.get(name, "").strip()]
    if world == 1 or not missing:
        return
    names = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else missing[0]
    raise UsageError(f"WORLD_SIZE={world} without {names}: each of the {world} processes "
                     "needs its RANK and the address of rank 0 (MASTER_ADDR, MASTER_PORT); "
                     f"launch with torchrun (torchrun --nproc-per-node {world} ...) or srun, "
                     "which set them, or unset WORLD_SIZE for a single process")


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
    mcore_compat.check_version()
    rank, world, local = read_process_env()
    check_launch_env(world)
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
        cuda_allocator_default()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
        store = rendezvous(rank, world, timeout)
        # The job's failure handling shares the store (runtime/fatal.py): its keys and
        # the process group's (under torch's own prefix) do not meet.
        fatal.attach(store, rank, world)
        torch.distributed.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world,
            store=torch.distributed.PrefixStore("default_pg", store),
            timeout=timeout,
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


def launcher() -> str:
    """What started this process: ``torchrun``, ``slurm``, ``mpi`` or ``bare``."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
        return "slurm"
    if env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE"):
        return "mpi"
    return "bare"


def rendezvous(rank: int, world: int, timeout: datetime.timedelta):
    """The job's store, once every rank has reached it; a UsageError in one line if not.

    One process without an address of its own gets an in-process store (no port: a free
    port picked and then bound could be taken by another process in between). Otherwise
    rank 0 hosts a TCP store at MASTER_ADDR:MASTER_PORT (under torchrun its agent does) and
    every rank checks in; rank 0 says which ranks it waits for every
    :data:`RENDEZVOUS_NOTE_S`. The wait is bounded by ``timeout`` under a launcher, by
    :data:`BARE_RENDEZVOUS_S` for a launch by hand.
    """
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if world == 1 and not (addr and port):
        return torch.distributed.HashStore()
    check_launch_env(world)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"MASTER_PORT={port}: not a port number; give a free TCP port")
    by = launcher()
    wait_s = timeout.total_seconds() if by != "bare" else min(BARE_RENDEZVOUS_S,
                                                              timeout.total_seconds())
    started = time.monotonic()
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = torch.distributed.TCPStore(
            addr, int(port), world, is_master=rank == 0 and not agent,
            timeout=datetime.timedelta(seconds=wait_s), wait_for_workers=False,
            multi_tenant=not agent)
    except (RuntimeError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"rank {rank} of {world}: cannot reach the job's store at "
                         f"{addr}:{port} ({first}); check MASTER_ADDR/MASTER_PORT and that rank "
                         "0 runs") from None
    key = "megatron_ext/rendezvous/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if int(store.add(key, 1)) == world:
        store.set(key + "/all", "1")
    # Waits in the store (no polling); rank 0 wakes up to say what it waits for.
    deadline = started + wait_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            joined = int(store.add(key, 0))
            raise UsageError(
                f"WORLD_SIZE={world}: only {joined} of {world} ranks started within "
                f"{wait_s:.0f} s ({by} launch, store at {addr}:{port}); start one process per "
                "rank (torchrun --nproc-per-node, srun), or unset WORLD_SIZE for a single "
                "process")
        try:
            store.wait([key + "/all"], datetime.timedelta(
                seconds=min(left, RENDEZVOUS_NOTE_S) if rank == 0 else left))
            break
        except RuntimeError:  # torch's DistStoreError: this wait timed out
            if rank == 0 and time.monotonic() < deadline:
                joined = int(store.add(key, 0))
                print(f"rank 0: waiting for {world - joined} of {world} ranks to start "
                      f"({addr}:{port})", file=sys.stderr, flush=True)
    store.set_timeout(timeout)
    return store


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
    """Destroys the process groups (end of run); the failure watch stops first."""
    from megatron.core import parallel_state

    fatal.detach()
    if torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
