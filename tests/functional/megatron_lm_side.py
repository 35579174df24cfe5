"""Megatron-LM's side of a checkpoint, done with megatron-core as Megatron-LM does it.

Run as a script (under torchrun for several ranks) by test_megatron_lm_checkpoint.py:

- ``load CKPT_ROOT -- FLAGS``: what Megatron-LM's ``load_checkpoint`` does with
  ``--ckpt-format torch_dist``: read the common state, take the content metadata, build
  the sharded state dict with Megatron-LM's keys (``model``: the model's
  ``sharded_state_dict``; ``optimizer``: ``optimizer.sharded_state_dict(model_sd,
  is_loading=True, metadata=...)``; ``rng_state``: a ShardedObject per (PP, TP) rank), load
  it, put it into a fresh model / optimizer / OptimizerParamScheduler / rng, take the data
  position from ``args.consumed_train_samples``, then train on to the end with this
  project's loop. Writes a JSON report of what it read (``--report``).
- ``save CKPT_ROOT STOP -- FLAGS``: train STOP iterations, then write a checkpoint the way
  Megatron-LM's ``save_checkpoint`` writes one (``generate_state_dict``: ``args``,
  ``checkpoint_version`` 3.0, ``iteration``, model, optimizer, ``opt_param_scheduler``,
  ``rng_state``, ``num_floating_point_operations_so_far``, content metadata; no integrity
  manifest, none of this project's keys) and the tracker file.
- ``save-legacy CKPT_ROOT STOP -- FLAGS``: the same run, written in this project's
  format 1 (``rng/rank_NNNNN.pt`` files, the scheduler counted in iterations).

The Namespace and the state dicts are written here, from megatron-core calls, not by this
project's checkpoint module.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def _trainer(flags):
    from megatron_ext.config import parse_config
    from megatron_ext.runtime.quiet import quiet_optional_dependencies
    from megatron_ext.training.loop import Trainer

    quiet_optional_dependencies()
    return Trainer(parse_config(flags))


def _metadata(common=None):
    from megatron.core import dist_checkpointing, parallel_state

    if common is None:  # Megatron-LM's _build_sharded_state_dict_metadata (distributed optim)
        metadata = {"distrib_optim_sharding_type": "dp_reshardable",
                    "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    else:
        metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
                        or {})
    saved = dict(metadata)
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return metadata, saved


def _bare(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _megatron_state(trainer, metadata, is_loading):
    """Megatron-LM's generate_state_dict for torch_dist: model, optimizer, rng_state."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model = trainer.model
    state = {}
    for i, chunk in enumerate(model):
        state["model" if len(model) == 1 else f"model{i}"] = \
            _bare(chunk).sharded_state_dict(metadata=metadata)
    model_sd = state["model"] if len(model) == 1 else dict(state)
    if is_loading:
        from megatron_ext.checkpoint.checkpointing import _materialize_optimizer_states

        # torch creates Adam's states at the first step, and megatron-core's
        # DistributedOptimizer cannot build the sharded state dict of a load without them
        # (without Apex/Transformer Engine; bench/peers/megatron_lm_launch.py does the same for
        # Megatron-LM's own pretrain_gpt.py).
        _materialize_optimizer_states(trainer.optimizer)
    state["optimizer"] = trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                              metadata=metadata)
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state()}
    pp, tp = (parallel_state.get_pipeline_model_parallel_world_size(),
              parallel_state.get_tensor_model_parallel_world_size())
    state["rng_state"] = ShardedObject(
        "rng_state", [rng], (pp, tp), (parallel_state.get_pipeline_model_parallel_rank(),
                                       parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return state


def load(root, flags, report):
    from megatron.core import dist_checkpointing

    from megatron_ext.checkpoint.checkpointing import TrainState

    trainer = _trainer(flags)
    iteration = int(open(os.path.join(root, "latest_checkpointed_iteration.txt")).read())
    path = os.path.join(root, f"iter_{iteration:07d}")
    common = dist_checkpointing.load_common_state_dict(path)
    metadata, saved = _metadata(common)
    state = _megatron_state(trainer, metadata, is_loading=True)
    loaded = dist_checkpointing.load(state, path)
    for i, chunk in enumerate(trainer.model):
        _bare(chunk).load_state_dict(loaded["model" if len(trainer.model) == 1 else f"model{i}"])
    with torch.no_grad():
        trainer.optimizer.load_state_dict(loaded["optimizer"])
    trainer.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    rng = loaded["rng_state"][0]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    args = common["args"]
    trainer.state = TrainState(iteration=loaded["iteration"],
                               consumed_train_samples=args.consumed_train_samples,
                               optimizer_steps=loaded["iteration"])
    from megatron_ext.checkpoint.checkpointing import _fix_step_counts

    _fix_step_counts(trainer.optimizer, loaded["iteration"])
    if torch.distributed.get_rank() == 0 and report:
        with open(report, "w") as f:
            json.dump({
                "checkpoint_version": common["checkpoint_version"],
                "iteration": loaded["iteration"],
                "content_metadata": saved,
                "args": {k: v for k, v in vars(args).items()
                         if isinstance(v, (int, float, str, bool, type(None), list))},
                "params_dtype": str(args.params_dtype),
                "opt_param_scheduler": loaded["opt_param_scheduler"],
                "rng_keys": sorted(rng),
                "num_floating_point_operations_so_far":
                    common["num_floating_point_operations_so_far"],
            }, f)
    try:
        return trainer.train()
    finally:
        trainer.close()


def _megatron_namespace(trainer, iteration):
    """The attributes Megatron-LM's load_checkpoint and check_checkpoint_args read."""
    cfg, rt = trainer.cfg, trainer.runtime
    return argparse.Namespace(
        num_layers=cfg.model.num_layers, hidden_size=cfg.model.hidden_size,
        num_attention_heads=cfg.model.num_attention_heads,
        ffn_hidden_size=cfg.model.ffn_hidden_size, seq_length=cfg.model.seq_length,
        max_position_embeddings=cfg.model.max_position_embeddings,
        padded_vocab_size=trainer.vocab_size, add_position_embedding=True,
        tensor_model_parallel_size=rt.tp, pipeline_model_parallel_size=rt.pp,
        world_size=rt.world_size, data_parallel_size=rt.dp,
        consumed_train_samples=trainer.state.consumed_train_samples,
        skipped_train_samples=0, consumed_valid_samples=0, train_iters=cfg.training.train_iters,
        global_batch_size=cfg.training.global_batch_size,
        micro_batch_size=cfg.training.micro_batch_size, use_dist_ckpt=True,
        ckpt_format="torch_dist", params_dtype=torch.float32, bf16=False, fp16=False,
        iteration=iteration, no_save_optim=None, no_save_rng=None,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)


def save(root, stop, flags, legacy=False):
    from megatron.core import dist_checkpointing

    trainer = _trainer([*flags, "--exit-interval", str(stop)])
    try:
        trainer.train()  # no --save: it stops at --exit-interval without saving
        assert trainer.state.iteration == stop, trainer.state
        path = os.path.join(root, f"iter_{stop:07d}")
        metadata, saved = _metadata()
        state = _megatron_state(trainer, metadata, is_loading=False)
        if legacy:
            # Format 1: content metadata, rng files of its own, scheduler in iterations.
            saved = {"distrib_optim_sharding_type": "dp_reshardable"}
            rng = state.pop("rng_state").data[0]
            sched = trainer.scheduler.state_dict()
            gbs = trainer.cfg.training.global_batch_size
            for key in ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps"):
                sched[key] = sched[key] // gbs
            state.update({
                "checkpoint_version": 1,
                "train_state": dataclasses.asdict(trainer.state),
                "opt_param_scheduler": sched, "config": trainer.cfg.to_dict(),
                "world_size": trainer.runtime.world_size,
                "padded_vocab_size": trainer.vocab_size})
        else:
            state.update({
                "args": _megatron_namespace(trainer, stop), "checkpoint_version": 3.0,
                "iteration": stop, "opt_param_scheduler": trainer.scheduler.state_dict(),
                "num_floating_point_operations_so_far": 123.0})
        if torch.distributed.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(state, path, content_metadata=saved)
        if legacy:
            os.makedirs(os.path.join(path, "rng"), exist_ok=True)
            torch.save({"random": rng["random_rng_state"], "numpy": rng["np_rng_state"],
                        "torch": rng["torch_rng_state"]},
                       os.path.join(path, "rng", f"rank_{trainer.runtime.rank:05d}.pt"))
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(stop))
        return 0
    finally:
        trainer.close()


def main(argv):
    from megatron_ext.runtime.distributed import shutdown

    split = argv.index("--")
    mine, flags = argv[:split], argv[split + 1:]
    try:
        if mine[0] == "load":
            report = mine[2] if len(mine) > 2 else None
            return load(mine[1], flags, report)
        return save(mine[1], int(mine[2]), flags, legacy=mine[0] == "save-legacy")
    finally:
        # As pretrain_gpt.py ends (training/loop.py): the process groups destroyed before
        # the interpreter exits. Left to the exit, gloo's threads were sometimes destroyed
        # while joinable ("terminate called without an active exception", SIGABRT, seen at
        # PP=2 on a loaded machine).
        shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
