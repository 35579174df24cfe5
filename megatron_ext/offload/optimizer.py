"""megatron-core's DistributedOptimizer with its fp32 states in the offload engine.

megatron-core builds the optimizer as usual (param groups, the DDP buffers' shard ranges,
the grad scaler); this subclass then hands the shard to an :class:`OffloadEngine` and
frees the fp32 masters megatron-core made on the model's device. What stays megatron-core's:
the grad-norm and clipping semantics (the same per-parameter norms, all-reduced over the
same group), the fp16 inf/nan skip, the loss scaler, the param all-gather after the step.
What changes: gradients are never copied to fp32 main grads on the device; the engine
reads them from the DDP grad buffer in their training dtype.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Dict, List, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.module import param_is_not_shared

from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.engine import OffloadEngine, ShardParam
from megatron_ext.offload.tiers import TierSpec, parse_tier_spec, probe_bandwidth

PROBE_MB = 64


class OffloadedDistributedOptimizer(DistributedOptimizer):
    """A DistributedOptimizer whose masters and Adam moments live in host memory and files."""

    # The checkpoint code must not create or fix torch optimizer states for this one.
    owns_optimizer_states = True

    def __init__(self, *args, offload_config: OffloadConfig, rank: int, run_id: str,
                 tiers: List[TierSpec], **kwargs):
        super().__init__(*args, **kwargs)
        self._inv_scale: Optional[torch.Tensor] = None
        self._clip_coeff: Optional[float] = None
        main_to_model = {}
        model_dtype = grad_dtype = torch.float32
        for model_groups, main_groups in ((self.model_float16_groups,
                                           self.shard_fp32_from_float16_groups),
                                          (self.model_fp32_groups, self.shard_fp32_groups)):
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main_param in zip(model_group, main_group):
                    main_to_model[id(main_param)] = model_param
        self._main_params: List[torch.Tensor] = []
        params: List[ShardParam] = []
        device = None
        for group_index, group in enumerate(self.optimizer.param_groups):
            for main_param in group["params"]:
                model_param = main_to_model[id(main_param)]
                device = model_param.device
                model_dtype = model_param.dtype
                grad_dtype = model_param.main_grad.dtype
                params.append(self._shard_param(model_param, group_index))
                self._main_params.append(main_param)
        # The fp32 masters megatron-core made on the device (bf16/fp16 models) are not
        # needed: the engine builds its own from the model weights in host memory.
        for group in self.shard_fp32_from_float16_groups:
            for main_param in group:
                main_param.data = torch.empty(0, dtype=main_param.dtype, device=main_param.device)
        self.engine = OffloadEngine(offload_config, params, rank=rank,
                                    device=device or torch.device("cpu"), tiers=tiers,
                                    run_id=run_id, model_dtype=model_dtype, grad_dtype=grad_dtype)

    def _shard_param(self, model_param, group_index: int) -> ShardParam:
        ranges = self._get_model_param_range_map(model_param)
        param_range, world_range = ranges["param"], ranges["gbuf_world_in_bucket"]
        gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
        param_buffer = self.buffers[gbuf_index].buckets[bucket_id].param_data
        out = param_buffer.view(-1)[world_range.start:world_range.end]
        start, end = param_range.start, param_range.end
        return ShardParam(
            numel=end - start,
            group=group_index,
            grad=lambda: model_param.main_grad.view(-1)[start:end],
            out=out,
            init=lambda: model_param.detach().view(-1)[start:end],
        )

    # ------------------------------------------------------------ gradients

    def _shard_grads(self) -> List[torch.Tensor]:
        return [p.grad() for p in self.engine.params]

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """fp16: finds inf/nan in the training-dtype grads and updates the loss scale."""
        if not self.grad_scaler:
            self._inv_scale = None
            return False
        # Unscaling waits for the engine (in fp32, per subgroup); the inv scale of this
        # step is the one before the scaler's update.
        # A 0-dim tensor: it multiplies host and device tensors alike.
        self._inv_scale = self.grad_scaler.inv_scale.detach().reshape(()).cpu()
        grads = self._shard_grads()
        if grads:
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            self.found_inf.fill_(0.0 if bool(finite) else 1.0)
        else:
            self.found_inf.fill_(0.0)
        torch.distributed.all_reduce(self.found_inf, op=torch.distributed.ReduceOp.MAX,
                                     group=self.get_grad_stats_parallel_group())
        found_inf = self.found_inf.item() > 0
        self.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def get_grad_norm(self):
        """megatron-core's global grad norm, from per-parameter norms of the unscaled grads.

        megatron-core takes the norm of each fp32 main grad, then the norm of those norms;
        here each parameter's norm comes from its training-dtype grad (converted one
        parameter at a time), so no fp32 copy of the shard is made.
        """
        tp_group = getattr(self, "tp_group", None)
        norms = []
        for main_param, shard in zip(self._main_params, self.engine.params):
            if not (param_is_not_shared(main_param) and
                    tensor_parallel.param_is_not_tensor_parallel_duplicate(main_param, tp_group)):
                continue
            grad = shard.grad()
            if self._inv_scale is not None:
                grad = grad.float().mul_(self._inv_scale.to(grad.device))
                norms.append(torch.norm(grad))
            else:
                norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))
        norm = get_grad_norm_fp32(norms,
                                  grad_stats_parallel_group=self.get_grad_stats_parallel_group())
        clip = self.config.clip_grad
        coeff = clip / (norm + 1.0e-6) if clip > 0.0 else 1.0
        self._clip_coeff = coeff if coeff < 1.0 else None
        return norm

    def clip_grad_norm(self, clip_grad: float) -> float:
        """The clipping itself happens in the engine, per subgroup."""
        return self.get_grad_norm()

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """The engine's update, then megatron-core's param all-gather."""
        timers = self.config.timers
        if timers is not None:
            timers("optimizer-inner-step", log_level=1).start()
        self.engine.step(self.optimizer.param_groups, self._inv_scale, self._clip_coeff)
        if timers is not None:
            timers("optimizer-inner-step").stop()
        if not self.ddp_config.overlap_param_gather:
            for model_chunk in self.model_chunks:
                model_chunk.start_param_sync()
        return True

    def _copy_model_grads_to_main_grads(self):
        """Never: the engine reads the grad buffer itself."""

    def _copy_main_params_to_model_params(self):
        self.engine.write_all_params()

    def _copy_model_params_to_main_params(self, state_dict=None):
        self.engine.reset_masters_from_model()

    # ------------------------------------------------------------ checkpoints

    def state_dict(self):
        """The state that is not per element: param-group settings, loss scaler, step."""
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        state = {"param_groups": groups, "offload_step": self.engine.step_count}
        if self.grad_scaler:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict):
        """Restores what :meth:`state_dict` returned (the engine's files load separately)."""
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k in group})
        if self.grad_scaler and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        self._loaded_step = state_dict["offload_step"]

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           **kwargs):
        """The common state as dist_checkpointing objects.

        The per-element state goes into the checkpoint as the engine's files instead
        (see :meth:`save_offloaded_state`).
        """
        state = self.state_dict()
        prefix = f"optimizer.offload.dp_group_idx_{self.data_parallel_group_idx}"
        return {k: ShardedObject(f"{prefix}.{k}", v, (1,), (0,),
                                 replica_id=(self.distributed_optimizer_instance_id, 0,
                                             self.data_parallel_group.rank()))
                for k, v in state.items()}

    def _layout(self) -> Dict[str, int]:
        from megatron.core import parallel_state

        return {"dp_size": self.data_parallel_group.size(),
                "dp_rank": self.data_parallel_group.rank(),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank()}

    def save_offloaded_state(self, checkpoint_dir: str) -> None:
        """Puts the engine's state files and a manifest under ``checkpoint_dir``/offload."""
        self.engine.save(os.path.join(checkpoint_dir, "offload"), self._layout())

    def load_offloaded_state(self, checkpoint_dir: str) -> None:
        """Restores the engine's state from a checkpoint written by save_offloaded_state."""
        self.engine.load(os.path.join(checkpoint_dir, "offload"), self._layout())
        loaded = getattr(self, "_loaded_step", None)
        if loaded is not None and loaded != self.engine.step_count:
            from megatron_ext.errors import UsageError

            raise UsageError(f"{checkpoint_dir}: offloaded state is of step "
                             f"{self.engine.step_count} but the checkpoint's optimizer of "
                             f"step {loaded}: the checkpoint is inconsistent")

    def device_state_bytes(self) -> int:
        """Bytes of fp32 optimizer state held outside the engine (should be 0).

        Counts megatron-core's fp32 masters of bf16/fp16 parameters and the torch
        optimizer's states: the tensors that would sit on the model's device.
        """
        total = sum(p.numel() * p.element_size()
                    for group in self.shard_fp32_from_float16_groups for p in group)
        for state in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values()
                         if torch.is_tensor(t) and t.dim() > 0)
        return total

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
    if cfg.offload_run_id:
        return cfg.offload_run_id
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(name)
        if value and value != "none":
            return f"{name.split('_')[0].lower()}-{value}"
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def resolve_tiers(cfg: OffloadConfig, rank: int) -> List[TierSpec]:
    """Tier specs with bandwidths: given ones, or probed once by rank 0 and shared."""
    specs = [parse_tier_spec(text) for text in cfg.offload_paths]
    missing = [i for i, s in enumerate(specs) if s.read_gbps is None or s.write_gbps is None]
    if missing:
        probed = None
        if rank == 0:
            probed = {}
            for i in missing:
                result = probe_bandwidth(specs[i].path, size_mb=PROBE_MB,
                                         threads=cfg.offload_io_threads,
                                         direct_io=cfg.offload_direct_io)
                probed[i] = (result.read_gbps, result.write_gbps)
                print(f" offload: probed {specs[i].path}: read {probed[i][0]:.2f} GB/s, "
                      f"write {probed[i][1]:.2f} GB/s", flush=True)
        probed = _broadcast(probed)
        for i, (read, write) in probed.items():
            specs[i].read_gbps, specs[i].write_gbps = read, write
    return specs


@contextlib.contextmanager
def offloaded_distributed_optimizer(cfg: OffloadConfig, rank: int):
    """Within the block, megatron-core's optimizer factory builds the offloaded optimizer."""
    import megatron.core.optimizer as mcore_optimizer

    run_id = _broadcast(_run_id(cfg) if rank == 0 else None)
    tiers = resolve_tiers(cfg, rank)

    class Bound(OffloadedDistributedOptimizer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, offload_config=cfg, rank=rank, run_id=run_id, tiers=tiers,
                             **kwargs)

    Bound.__name__ = Bound.__qualname__ = OffloadedDistributedOptimizer.__name__
    original = mcore_optimizer.DistributedOptimizer
    mcore_optimizer.DistributedOptimizer = Bound
    try:
        yield
    finally:
        mcore_optimizer.DistributedOptimizer = original
