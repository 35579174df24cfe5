"""Checkpoints: megatron-core dist_checkpointing (torch_dist), atomic, resumable.

Layout under --save::

    iter_0000010/                       one checkpoint (dist_checkpointing, torch_dist)
    latest_checkpointed_iteration.txt   the 'latest' pointer (Megatron-LM's name)

A checkpoint is written to ``iter_N.tmp``, then renamed, then the pointer is replaced
(write, fsync, rename), so a crash at any moment leaves the previous checkpoint and a
pointer to it intact.

The state is Megatron-LM's (format 3.0, as its ``generate_state_dict`` writes it with
``--ckpt-format torch_dist``), so each side loads the other's at the same parallel layout:
the model (``model`` or ``model0``, ``model1``, ... per chunk) and ``optimizer`` sharded,
with the content metadata Megatron-LM writes (``distrib_optim_sharding_type``,
``singleton_local_shards``, ``chained_optim_avoid_prefix``); the common keys ``args``
(Megatron-LM's Namespace, :mod:`.megatron_args`), ``checkpoint_version`` 3.0,
``iteration``, ``opt_param_scheduler`` (counted in samples),
``num_floating_point_operations_so_far``; ``rng_state`` a ShardedObject per (PP, TP) rank.
This project's extras ride along as common keys (``config``, ``train_state``,
``world_size``, ``padded_vocab_size``), an optimizer mode's own files beside (the offload
engine's). Format 1 (this project's earlier one: rng states in ``rng/rank_NNNNN.pt``, the
scheduler in iterations) still loads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
from typing import Optional

import torch

from megatron_ext.checkpoint import integrity, megatron_args, rng
from megatron_ext.checkpoint import scheduler as scheduler_state
from megatron_ext.checkpoint.load_checks import (
    FORMAT_VERSION,
    LEGACY_FORMAT,
    TRACKER,
    checkpoint_name,
    format_of,
    loads_optimizer,
    read_common,
    read_tracker,
)
from megatron_ext.errors import UsageError
from megatron_ext.optim.chain import (
    inner_torch_optimizers,
    load_external_state,
    save_external_state,
)
from megatron_ext.runtime.faults import Faults
from megatron_ext.runtime.signals import shielded_helpers

log = logging.getLogger(__name__)

@dataclasses.dataclass
class TrainState:
    """Progress that a resumed run continues from."""

    iteration: int = 0
    consumed_train_samples: int = 0
    optimizer_steps: int = 0
    skipped_iterations: int = 0
    num_floating_point_operations_so_far: float = 0.0


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


def sharded_metadata(cfg) -> dict:
    """The sharded_state_dict metadata Megatron-LM builds for a save, without the group.

    (Megatron-LM's ``_build_sharded_state_dict_metadata`` at core_v0.16.1, for
    --ckpt-format torch_dist without --dist-ckpt-optim-fully-reshardable.)
    """
    metadata = {}
    if cfg.parallel.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    return metadata


def _with_group(metadata: Optional[dict]) -> dict:
    """The metadata as the model and optimizer take it: with the DP group (not saved)."""
    from megatron.core import parallel_state

    out = dict(metadata or {})
    out["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return out


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


def _sharded_state(model_chunks, optimizer, is_loading: bool, with_optimizer: bool,
                   metadata: dict) -> dict:
    metadata = _with_group(metadata)
    state = {key: _unwrap(chunk).sharded_state_dict(metadata=metadata)
             for key, chunk in zip(_model_keys(model_chunks), model_chunks)}
    # The optimizer finds each parameter's sharded tensor among all the chunks'.
    model_sd = state["model"] if len(model_chunks) == 1 else dict(state)
    if with_optimizer:
        if is_loading:
            _materialize_optimizer_states(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata=metadata)
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
    """Saves a checkpoint of every rank atomically; returns its directory.

    Raises:
        UsageError: the storage failed (full, read-only, ...): the previous checkpoint and
            the pointer are left as they were.
    """
    rank0 = runtime.rank == 0
    final = checkpoint_name(root, train_state.iteration)
    tmp = final + ".tmp"
    if rank0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    torch.distributed.barrier()
    metadata = sharded_metadata(cfg)
    state = _sharded_state(model_chunks, optimizer, is_loading=False, with_optimizer=True,
                           metadata=metadata)
    padded_vocab = _unwrap(model_chunks[0]).vocab_size
    state.update({
        # Megatron-LM's common state (generate_state_dict, save_checkpoint).
        "args": megatron_args.megatron_args(
            cfg, {"world_size": runtime.world_size, "tp": runtime.tp, "pp": runtime.pp,
                  "dp": runtime.dp},
            {"iteration": train_state.iteration,
             "consumed_train_samples": train_state.consumed_train_samples,
             "skipped_train_samples": 0},
            padded_vocab, cfg.virtual_pipeline_size()),
        "checkpoint_version": FORMAT_VERSION,
        "iteration": train_state.iteration,
        "opt_param_scheduler": scheduler.state_dict(),
        "num_floating_point_operations_so_far": train_state.num_floating_point_operations_so_far,
        "rng_state": rng.rng_sharded_object(runtime),
        # This project's extras.
        "train_state": dataclasses.asdict(train_state),
        "config": cfg.to_dict(),
        "world_size": runtime.world_size,
        # What --use-checkpoint-args and the settings check read (the tokenizer's vocabulary
        # padded as the model has it).
        "padded_vocab_size": padded_vocab,
        # A promise that integrity.json is written (a load without it refuses the rest).
        integrity.COMMON_KEY: integrity.MANIFEST,
    })
    try:
        with shielded_helpers():
            _save_files(state, tmp, optimizer, metadata, train_state.iteration,
                        Faults(cfg.faults.checkpoint_fault))
        # Last, once every rank's files are complete: the checksum of each.
        integrity.write_manifest(tmp, runtime.host_group)
        torch.distributed.barrier()
        if rank0:
            publish(root, tmp, final, train_state.iteration)
    # BaseException: torch.distributed.checkpoint's CheckpointException derives from it.
    except BaseException as err:  # noqa: BLE001 - a full or failing disk is one line
        why = None if isinstance(err, (KeyboardInterrupt, SystemExit)) \
            else integrity.storage_error(err, root)
        if why is None:
            raise
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = read_tracker(root) if os.path.isfile(os.path.join(root, TRACKER)) else None
        kept = (f"the previous checkpoint {checkpoint_name(root, previous)} and the pointer are "
                "intact" if previous is not None else "no earlier checkpoint exists")
        raise UsageError(f"--save {root}: saving iteration {train_state.iteration} failed: "
                         f"{why}; {kept}; free space there (or give another --save) and resume "
                         "with --load") from None
    torch.distributed.barrier()
    return final


def _save_files(state: dict, tmp: str, optimizer, metadata: dict, iteration: int,
                faults: Faults) -> None:
    """Writes this rank's files of a checkpoint into ``tmp``."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_ext.runtime import mcore_compat

    # megatron-core collects its writer processes' results through a multiprocessing
    # Manager (a server process of its own, started at the first save). A synchronous save
    # collects them in this process, so a plain queue does: no server that a SIGTERM to the
    # process group can kill before the save at the signal (BrokenPipeError), and ~2 s
    # less for the first save.
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    mcore_compat.save_checkpoint(state, tmp, content_metadata=dict(metadata))
    save_external_state(optimizer, tmp)
    faults.check_save(iteration)
    torch.distributed.barrier()


def publish(root: str, tmp: str, final: str, iteration: int) -> None:
    """Renames the complete ``tmp`` to ``final``, then moves the pointer (rank 0).

    The files are synced first, so the pointer never names a folder a crash could leave
    half written.
    """
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
    _write_atomic(os.path.join(root, TRACKER), str(iteration))
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _same_layout(common: dict, legacy: bool, runtime) -> bool:
    """Whether the checkpoint's rng states belong to this layout (else they are not loaded).

    Format 1 kept one file per rank (the same world size); Megatron-LM's keeps one per
    (PP, TP) rank and ignores them at another TP/PP, as here.
    """
    if legacy:
        return common.get("world_size") == runtime.world_size
    return megatron_args.layout_of(common) in (None, (runtime.tp, runtime.pp))


def _load_sharded(state: dict, path: str, strict: str) -> dict:
    """dist_checkpointing.load with every pickled object read weights_only.

    Raises:
        UsageError: a pickled object outside the allowed types or a damaged one, or a
            checkpoint that does not fit the model.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        with integrity.weights_only_sharded_objects(path):
            return dist_checkpointing.load(state, path, strict=strict)
    except CheckpointingException as err:
        # The settings check names what differs when the checkpoint records its settings;
        # this is for those that do not.
        text = str(err).strip().splitlines()[0][:240] if str(err).strip() else ""
        raise UsageError(f"--load {path}: the checkpoint does not fit this model ({text}); "
                         "give the checkpoint's model settings, or --use-checkpoint-args"
                         ) from None
    except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is one
        usage = integrity.usage_error_behind(err)
        if usage is None:
            raise
        raise usage from None


def _loaded_step(optimizer) -> Optional[int]:
    """The Adam step count a loaded Megatron-LM optimizer state holds, if any.

    megatron-core keeps it in each param group's ``step`` (as Megatron-LM's fused Adam
    counts); torch's AdamW counts per parameter, which the load does not restore.
    """
    for torch_opt in inner_torch_optimizers(optimizer):
        for group in torch_opt.param_groups:
            if "step" in group:
                return int(group["step"])
    return None


def load_checkpoint(path: str, model_chunks, optimizer, scheduler, cfg, runtime,
                    verified: bool = False) -> TrainState:
    """Loads the checkpoint at ``path`` into model, optimizer and scheduler.

    Reads this project's checkpoints (format 3.0, and format 1) and Megatron-LM's (3.0,
    torch_dist): a Megatron-LM checkpoint's progress comes from its ``iteration`` and
    ``args``, as Megatron-LM's load_checkpoint takes it.

    Args:
        path: the checkpoint directory.
        model_chunks: the model (DDP-wrapped chunks).
        optimizer: the megatron-core optimizer.
        scheduler: the OptimizerParamScheduler.
        cfg: the run config.
        runtime: this process's Runtime.
        verified: the checkpoint's files were already checked (:func:`.load_checks.prepare_load`).

    Returns:
        the restored TrainState (zeroed with --finetune).
    """
    from megatron.core import dist_checkpointing

    ck = cfg.checkpoint
    if not verified:
        integrity.verify(path, runtime.host_group)
    common = read_common(path)
    legacy = format_of(common, path) == LEGACY_FORMAT
    weights_only = bool(common.get("weights_only"))
    args = common.get("args")
    with_optimizer = loads_optimizer(common, cfg, runtime, path)
    # The metadata the checkpoint was written with decides the optimizer's keys (as
    # Megatron-LM's load_checkpoint reads it back).
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    state = _sharded_state(model_chunks, optimizer, is_loading=True, with_optimizer=with_optimizer,
                           metadata=metadata)
    rng_here = (ck.load_rng and not ck.finetune and not weights_only
                and _same_layout(common, legacy, runtime))
    sharded_rng = rng_here and not legacy and not getattr(args, "no_save_rng", False)
    if sharded_rng:
        state["rng_state"] = rng.rng_sharded_object(runtime)
    loaded = _load_sharded(state, path, cfg.checkpoint.dist_ckpt_strictness)
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        _unwrap(chunk).load_state_dict(loaded[key])
    train_state = TrainState(**(loaded["train_state"] if "train_state" in loaded
                                else megatron_args.train_state_of(loaded)))
    if with_optimizer:
        # fp32 masters can be views of the model's leaf parameters: copy without autograd.
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        load_external_state(optimizer, path)
        if "train_state" not in loaded:
            # Megatron-LM's checkpoint keeps the step count in the optimizer's param
            # groups; without it, one step per iteration (steps are skipped only on fp16
            # overflow).
            train_state.optimizer_steps = _loaded_step(optimizer) or train_state.iteration
        _fix_step_counts(optimizer, train_state.optimizer_steps)
    else:
        # The fp32 masters were built from the initial weights: rebuild them from the
        # loaded ones.
        optimizer.reload_model_params()
    if ck.finetune or weights_only:
        return TrainState()
    if with_optimizer:
        # As Megatron-LM: the schedule is loaded with the optimizer (not with
        # --no-load-optim, which starts both fresh).
        saved = loaded["opt_param_scheduler"]
        if legacy:
            saved = scheduler_state.scheduler_in_samples(
                saved, common["config"]["training"]["global_batch_size"])
        scheduler_state.load_scheduler(scheduler, saved, ck, path)
    if sharded_rng:
        rng.set_rng_state(loaded["rng_state"][0], runtime)
    elif rng_here and legacy and os.path.isfile(
            rng_file := os.path.join(path, "rng", f"rank_{runtime.rank:05d}.pt")):
        rng.set_rng_state(integrity.safe_load(rng_file, "random-number-generator state"), runtime)
    elif ck.load_rng and runtime.rank == 0 and not ck.finetune:
        log.warning("checkpoint was saved at another parallel layout (or without rng states): "
                    "random states not restored")
    return train_state
