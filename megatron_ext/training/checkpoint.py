"""Checkpoints: megatron-core dist_checkpointing (torch_dist), atomic, resumable.

Layout under --save::

    iter_0000010/                       one checkpoint (dist_checkpointing + rng/)
    latest_checkpointed_iteration.txt   the 'latest' pointer (Megatron-LM's name)

A checkpoint is written to ``iter_N.tmp``, then renamed, then the pointer is replaced
(write, fsync, rename), so a crash at any moment leaves the previous checkpoint and a
pointer to it intact. Model and optimizer are saved sharded by megatron-core; the
iteration, data position, scheduler and optimizer step count as common state; each
rank's random-number-generator states as ``rng/rank_NNNNN.pt``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch

from megatron_ext.errors import UsageError
from megatron_ext.training.optimizer import (
    inner_torch_optimizers,
    load_external_state,
    save_external_state,
)

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1
_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


@dataclasses.dataclass
class TrainState:
    """Progress that a resumed run continues from."""

    iteration: int = 0
    consumed_train_samples: int = 0
    optimizer_steps: int = 0
    skipped_iterations: int = 0


def checkpoint_name(root: str, iteration: int) -> str:
    """The folder of the checkpoint of ``iteration`` under ``root``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """The iteration named by the 'latest' pointer of ``root``, or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise UsageError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number")
    return int(text)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _rng_state(runtime) -> dict:
    from megatron.core import tensor_parallel

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if not runtime.is_cpu:
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict, runtime) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if not runtime.is_cpu and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _unwrap(module):
    """The GPTModel inside DDP and Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _model_keys(model_chunks) -> list:
    """Megatron-LM's keys of the model chunks: ``model``, or ``model0``, ``model1``, ... ."""
    if len(model_chunks) == 1:
        return ["model"]
    return [f"model{i}" for i in range(len(model_chunks))]


def _sharded_state(model_chunks, optimizer, is_loading: bool, with_optimizer: bool) -> dict:
    state = {key: _unwrap(chunk).sharded_state_dict()
             for key, chunk in zip(_model_keys(model_chunks), model_chunks)}
    # The optimizer finds each parameter's sharded tensor among all the chunks'.
    model_sd = state["model"] if len(model_chunks) == 1 else dict(state)
    if with_optimizer:
        if is_loading:
            _materialize_optimizer_states(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata=dict(_SHARDING))
    return state


def _materialize_optimizer_states(optimizer) -> None:
    """Creates the optimizer states (zeros) that a load fills in place.

    megatron-core's sharded_state_dict needs them and torch creates them lazily at the
    first step. A zero-gradient step of the inner torch optimizer creates them without
    touching the fp32 masters (lr is irrelevant for zero gradients with AdamW only if
    weight decay is zero, so the masters are restored afterwards).
    """
    for torch_opt in inner_torch_optimizers(optimizer):
        if torch_opt.state:
            continue
        params = [p for g in torch_opt.param_groups for p in g["params"]]
        saved = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def _fix_step_counts(optimizer, steps: int) -> None:
    """Gives every parameter its own step tensor equal to the steps taken.

    dist_checkpointing restores one shared ``step`` tensor object (or a stale value) for
    all parameters; torch AdamW then increments it once per parameter and the resumed
    run diverges. The true count is kept in the common state.
    """
    for torch_opt in inner_torch_optimizers(optimizer):
        for state in torch_opt.state.values():
            if "step" in state:
                old = state["step"]
                state["step"] = torch.tensor(float(steps), dtype=old.dtype, device=old.device) \
                    if torch.is_tensor(old) else steps


def save_checkpoint(root: str, train_state: TrainState, model_chunks, optimizer, scheduler,
                    cfg, runtime) -> str:
    """Saves a checkpoint of every rank atomically; returns its directory."""
    from megatron.core import dist_checkpointing

    rank0 = runtime.rank == 0
    final = checkpoint_name(root, train_state.iteration)
    tmp = final + ".tmp"
    if rank0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    torch.distributed.barrier()
    state = _sharded_state(model_chunks, optimizer, is_loading=False, with_optimizer=True)
    state.update({
        "checkpoint_version": FORMAT_VERSION,
        "train_state": dataclasses.asdict(train_state),
        "opt_param_scheduler": scheduler.state_dict(),
        "config": cfg.to_dict(),
        "world_size": runtime.world_size,
    })
    dist_checkpointing.save(state, tmp, content_metadata=dict(_SHARDING))
    save_external_state(optimizer, tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(_rng_state(runtime), os.path.join(tmp, "rng", f"rank_{runtime.rank:05d}.pt"))
    torch.distributed.barrier()
    if rank0:
        for dirpath, _, files in os.walk(tmp):
            for name in files:
                with open(os.path.join(dirpath, name), "rb") as f:
                    os.fsync(f.fileno())
        old = None
        if os.path.exists(final):
            old = final + ".old"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_atomic(os.path.join(root, TRACKER), str(train_state.iteration))
        if old:
            shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier()
    return final


def resolve_load_dir(cfg) -> Optional[str]:
    """The checkpoint directory --load points at; None to start from scratch.

    ``--load`` equal to ``--save`` with no checkpoint yet starts from scratch (the
    resume-or-start pattern of requeued Slurm jobs); any other --load without a checkpoint
    is an error.
    """
    root = cfg.checkpoint.load
    if not root:
        return None
    iteration = read_tracker(root) if os.path.isdir(root) else None
    if iteration is None:
        same = cfg.checkpoint.save and os.path.abspath(cfg.checkpoint.save) == os.path.abspath(root)
        if same and not cfg.checkpoint.finetune:
            return None
        raise UsageError(f"--load {root}: no checkpoint there (no {TRACKER}); check the path, "
                         "or drop --load to start from scratch")
    path = checkpoint_name(root, iteration)
    if not os.path.isdir(path):
        raise UsageError(f"--load {root}: {TRACKER} names iteration {iteration} but "
                         f"{path} does not exist")
    return path


def _optimizer_kind(config: dict) -> str:
    """Which optimizer a run config uses, in words (their checkpoint states differ)."""
    if config.get("zenflow", {}).get("zenflow"):
        return "--zenflow"
    if config.get("offload", {}).get("offload_optimizer"):
        return "--offload-optimizer"
    return "the plain optimizer"


def load_checkpoint(path: str, model_chunks, optimizer, scheduler, cfg, runtime) -> TrainState:
    """Loads the checkpoint at ``path`` into model, optimizer and scheduler.

    Returns:
        the restored TrainState (zeroed with --finetune).
    """
    from megatron.core import dist_checkpointing

    ck = cfg.checkpoint
    common = dist_checkpointing.load_common_state_dict(path)
    if common.get("checkpoint_version") != FORMAT_VERSION:
        raise UsageError(f"--load {path}: not a megatron_ext checkpoint of format {FORMAT_VERSION}")
    with_optimizer = ck.load_optim and not ck.finetune
    if with_optimizer:
        saved, now = _optimizer_kind(common.get("config", {})), _optimizer_kind(cfg.to_dict())
        if saved != now:
            raise UsageError(f"--load {path}: its optimizer state was saved by {saved} and this "
                             f"run uses {now}; add --finetune (model weights only) or "
                             "--no-load-optim (weights and iteration) to start a fresh optimizer")
    state = _sharded_state(model_chunks, optimizer, is_loading=True, with_optimizer=with_optimizer)
    loaded = dist_checkpointing.load(state, path)
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        _unwrap(chunk).load_state_dict(loaded[key])
    train_state = TrainState(**loaded["train_state"])
    if with_optimizer:
        # fp32 masters can be views of the model's leaf parameters: copy without autograd.
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        load_external_state(optimizer, path)
        _fix_step_counts(optimizer, train_state.optimizer_steps)
    else:
        # The fp32 masters were built from the initial weights: rebuild them from the
        # loaded ones.
        optimizer.reload_model_params()
    if ck.finetune:
        return TrainState()
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    rng_file = os.path.join(path, "rng", f"rank_{runtime.rank:05d}.pt")
    if ck.load_rng:
        if os.path.isfile(rng_file) and loaded.get("world_size") == runtime.world_size:
            _set_rng_state(torch.load(rng_file, weights_only=False), runtime)
        elif runtime.rank == 0:
            log.warning("checkpoint was saved at world size %s: random states not restored",
                        loaded.get("world_size"))
    return train_state
