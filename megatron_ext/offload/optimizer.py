"""megatron-core's DistributedOptimizer with its fp32 states in the offload engine.

megatron-core builds the optimizer as usual (param groups, the DDP buffers' shard ranges,
the grad scaler); :class:`~megatron_ext.optim.sharded_optimizer.ShardedStateOptimizer`
keeps megatron-core's grad-norm, clipping, fp16-skip and all-gather semantics and frees
the fp32 masters megatron-core made on the model's device; this subclass hands the shard
to an :class:`OffloadEngine`, which reads the gradients from the DDP grad buffer in their
training dtype.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch

from megatron_ext.errors import UsageError
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.engine import OffloadEngine
from megatron_ext.offload.jobdir import FULL_ERRNOS, default_run_id
from megatron_ext.offload.paths import TierSpec, format_tier_spec, parse_tier_spec
from megatron_ext.offload.probe import PROBE_REPEATS, probe_bandwidth, probe_plan
from megatron_ext.offload.states import StateLayout
from megatron_ext.offload.subgroups import ShardParam
from megatron_ext.optim.sharded_optimizer import (
    ShardedStateOptimizer,
    bound_distributed_optimizer,
)
from megatron_ext.runtime.faults import Faults


class OffloadedDistributedOptimizer(ShardedStateOptimizer):
    """A DistributedOptimizer whose masters and Adam moments live in host memory and files."""

    state_prefix = "offload"

    def __init__(self, *args, offload_config: OffloadConfig, rank: int, run_id: str,
                 tiers: List[TierSpec], layout: Optional[StateLayout] = None,
                 faults: Faults = Faults(), device_budget_bytes: Optional[int] = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        params = [self._shard_param(shard) for shard in self.shards]
        self.engine = OffloadEngine(offload_config, params, rank=rank, device=self.device,
                                    tiers=tiers, run_id=run_id, model_dtype=self.model_dtype,
                                    grad_dtype=self.grad_dtype, layout=layout, faults=faults,
                                    device_budget_bytes=device_budget_bytes)

    def _shard_param(self, shard) -> ShardParam:
        model_param = shard.model_param
        world_range = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
        gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
        param_buffer = self.buffers[gbuf_index].buckets[bucket_id].param_data
        out = param_buffer.view(-1)[world_range.start:world_range.end]
        return ShardParam(numel=shard.numel, group=shard.group, grad=shard.grad, out=out,
                          init=shard.weights)

    def _update(self) -> None:
        self.engine.step(self.optimizer.param_groups, self._inv_scale, self._clip_coeff)

    def _copy_main_params_to_model_params(self):
        self.engine.write_all_params()

    def reload_masters(self) -> None:
        """The engine's masters from the model weights (after a model-only load)."""
        self.engine.reset_masters_from_model()

    # ------------------------------------------------------------ checkpoints

    def common_state(self) -> dict:
        """The engine's step (checked against its files on load)."""
        return {"offload_step": self.engine.step_count}

    def load_common_state(self, state: dict) -> None:
        """Keeps the saved step for the check in :meth:`load_external_state`."""
        self._loaded_step = state["offload_step"]

    def save_external_state(self, checkpoint_dir: str) -> None:
        """Puts the engine's state files and a manifest under ``checkpoint_dir``/offload."""
        self.engine.save(os.path.join(checkpoint_dir, "offload"), self.layout())

    def load_external_state(self, checkpoint_dir: str) -> None:
        """Restores the engine's state from a checkpoint written by save_external_state."""
        self.engine.load(os.path.join(checkpoint_dir, "offload"), self.layout())
        loaded = getattr(self, "_loaded_step", None)
        if loaded is not None and loaded != self.engine.step_count:
            from megatron_ext.errors import UsageError

            raise UsageError(f"{checkpoint_dir}: offloaded state is of step "
                             f"{self.engine.step_count} but the checkpoint's optimizer of "
                             f"step {loaded}: the checkpoint is inconsistent")

    def metrics(self) -> Dict[str, float]:
        """The engine's ``offload/*`` metrics since the last call."""
        record = self.engine.metrics()
        record["offload/device_state_gib"] = self.device_state_bytes() / 2**30
        return record

    def close(self) -> None:
        """Stops the engine's threads and removes its tier files."""
        self.engine.close()


# ---------------------------------------------------------------- construction


def _broadcast(value):
    objects = [value]
    torch.distributed.broadcast_object_list(objects, src=0)
    return objects[0]


def _run_id(cfg: OffloadConfig) -> str:
    return cfg.offload_run_id or default_run_id(os.environ)


def resolve_tiers(cfg: OffloadConfig, rank: int) -> List[TierSpec]:
    """Tier specs with bandwidths: given ones, or probed once by rank 0 and shared."""
    specs = [parse_tier_spec(text) for text in cfg.offload_paths]
    missing = [i for i, s in enumerate(specs) if s.read_gbps is None or s.write_gbps is None]
    if missing:
        probed = None
        if rank == 0:
            probed = {}
            # As the engine moves data: one subgroup's file per pass, its chunk size, its
            # threads, O_DIRECT as configured; the median of several passes.
            size_mb, block_mb = probe_plan(cfg.offload_subgroup_size)
            for i in missing:
                try:
                    result = probe_bandwidth(specs[i].path, size_mb=size_mb, block_mb=block_mb,
                                             threads=cfg.offload_io_threads,
                                             direct_io=cfg.offload_direct_io,
                                             repeats=PROBE_REPEATS)
                except OSError as err:
                    if err.errno not in FULL_ERRNOS:
                        raise
                    # Full: skipped (the probe leaves no file), as the job directories skip
                    # a path too full for their lock file.
                    probed[i] = None
                    print(f" offload: --offload-paths {specs[i].path} skipped: {err.strerror} "
                          "while probing its bandwidth", flush=True)
                    continue
                probed[i] = (result.read_gbps, result.write_gbps)
                print(f" offload: probed {specs[i].path}: read {probed[i][0]:.2f} GB/s, "
                      f"write {probed[i][1]:.2f} GB/s (median of {result.repeats} passes of "
                      f"{result.size_mb} MiB, {cfg.offload_io_threads} threads, O_DIRECT "
                      f"{'on' if result.direct_io_used else 'off'}; give DIR@READ,WRITE to "
                      "skip the probe)", flush=True)
        probed = _broadcast(probed)
        for i, speeds in probed.items():
            if speeds is not None:
                specs[i].read_gbps, specs[i].write_gbps = speeds
        full = [specs[i].path for i, speeds in probed.items() if speeds is None]
        if full and len(full) == len(specs):
            raise UsageError(f"--offload-paths: no path has room ({', '.join(full)}: full "
                             "while probing the bandwidth): free space there, or give a path "
                             "with room")
        specs = [spec for i, spec in enumerate(specs) if probed.get(i, ()) is not None]
    return specs


def settle_path_speeds(cfg: OffloadConfig, rank: int) -> Optional[List[str]]:
    """Probes the ``--offload-paths`` given without bandwidths, once, before the plan.

    The probed speeds are written into ``cfg.offload_paths`` (``DIR@READ,WRITE``, the
    form :func:`resolve_tiers` reads back without probing; a path too full to probe is
    dropped, as the engine drops it), so that the memory plan and the engine place the
    subgroups with the same numbers: one measurement of the paths per run. Collective
    (rank 0 probes, every rank takes its numbers). Returns the previous items, or None when
    every path had its bandwidths already.
    """
    if all(parse_tier_spec(text).effective_gbps is not None for text in cfg.offload_paths):
        return None
    before = list(cfg.offload_paths)
    cfg.offload_paths = [format_tier_spec(spec) for spec in resolve_tiers(cfg, rank)]
    return before


def offload_setup(cfg: OffloadConfig, rank: int) -> tuple:
    """(run id, tier specs with bandwidths): the same on every rank (collective call)."""
    own = _run_id(cfg)  # every rank checks the environment's id: all refuse alike
    run_id = _broadcast(own if rank == 0 else None)
    return run_id, resolve_tiers(cfg, rank)


def offloaded_distributed_optimizer(cfg: OffloadConfig, rank: int,
                                    layout: Optional[StateLayout] = None,
                                    faults: Faults = Faults(),
                                    device_budget_bytes: Optional[int] = None):
    """Within the block, megatron-core's optimizer factory builds the offloaded optimizer.

    ``layout``: the dtypes the states are stored in (Megatron-LM's precision-aware
    optimizer flags); fp32 by default. ``faults``: the test suite's offload faults
    (``RunConfig.faults.offload_fault``); none by default. ``device_budget_bytes``: with
    ``--offload-device-cache-gb auto``, the device bytes the memory plan leaves for the
    device tier before the first step (None: the first step sizes it).
    """
    run_id, tiers = offload_setup(cfg, rank)
    return bound_distributed_optimizer(OffloadedDistributedOptimizer, offload_config=cfg,
                                       rank=rank, run_id=run_id, tiers=tiers, layout=layout,
                                       faults=faults, device_budget_bytes=device_budget_bytes)
