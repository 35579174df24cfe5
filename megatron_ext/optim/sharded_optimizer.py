"""A megatron-core DistributedOptimizer whose per-element states live outside megatron-core.

Both the offload engine and ZenFlow keep the fp32 masters and Adam moments of the rank's
shard themselves (in host memory and files, or split between the GPU and the CPU). What
they share, and what this base class keeps megatron-core's: the param groups and shard
ranges megatron-core computed, the grad-norm and clipping semantics (per-parameter norms
of the unscaled grads, all-reduced over the same group), the fp16 inf/nan skip and loss
scaler, the param all-gather after the step, and the common (not per-element) part of
the optimizer checkpoint. Gradients are read from DDP's grad buffer in their training
dtype: no fp32 copy of the shard's gradients is made on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.module import param_is_not_shared
from torch.profiler import record_function


@dataclasses.dataclass
class Shard:
    """One parameter's part of the rank's optimizer shard."""

    model_param: torch.nn.Parameter
    group: int
    """Index of its optimizer param group (lr, weight decay, betas, eps)."""
    start: int
    """First element of the parameter (flattened) that this rank owns."""
    end: int
    counts_in_norm: bool = True
    """False for shared and tensor-parallel duplicate parameters (megatron-core's rule)."""

    @property
    def numel(self) -> int:
        """Elements of the parameter in this rank's shard."""
        return self.end - self.start

    def grad(self) -> torch.Tensor:
        """The reduce-scattered gradient of the shard (training dtype, model device)."""
        return self.model_param.main_grad.view(-1)[self.start:self.end]

    def weights(self) -> torch.Tensor:
        """The shard's current model weights (a view: writes go into the model)."""
        return self.model_param.detach().view(-1)[self.start:self.end]


class ShardedStateOptimizer(DistributedOptimizer):
    """A DistributedOptimizer whose subclass keeps the per-element states itself.

    Subclasses implement :meth:`_update` (the step, given ``self._inv_scale`` and
    ``self._clip_coeff``), :meth:`reload_masters` and the external-state hooks.
    """

    # The checkpoint code must not create or fix torch optimizer states for this one.
    owns_optimizer_states = True
    state_prefix = "external"
    """Name of the common state in the checkpoint (``optimizer.<prefix>.*``)."""

    @classmethod
    def _build_model_and_main_param_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges,
                                           config):
        """megatron-core's groups, built one parameter at a time, each fp32 master freed at once.

        megatron-core clones every bf16/fp16 shard into an fp32 master on the model's device
        and keeps all of them until it returns: 4 bytes per parameter of the shard at once
        (47.5 GiB for a 12.76B GPT on one GPU, the peak of its run: 95.4 GiB). This optimizer
        keeps no masters there (``__init__`` empties them), so each one is emptied as soon as
        it exists and the transient is one parameter's shard. The groups, their order and the
        optimizer's param lists are megatron-core's.
        """
        parent = super()._build_model_and_main_param_groups
        # Per group: model fp16, model fp32, shard fp16, shard fp32, fp32-from-fp16 masters.
        groups = [[] for _ in range(5)]
        for group_range in opt_group_ranges:
            lists = [[] for _ in range(5)]
            for model_param in group_range["params"]:
                single = {"params": [model_param], "orig_group": {}}
                built = parent(gbuf_ranges, param_gbuf_map, [single], config)
                for into, one in zip(lists, built):
                    into.extend(one[0])
                for master in built[4][0]:
                    if master is not None:
                        master.data = torch.empty(0, dtype=master.dtype, device=master.device)
            for into, one in zip(groups, lists):
                into.append(one)
            # The inner optimizer's params: megatron-core's own rule.
            from_float16 = (lists[2] if config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                            else lists[4])
            group_range["orig_group"]["params"] = [*lists[3], *from_float16]
        return tuple(groups)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._inv_scale: Optional[torch.Tensor] = None
        self._clip_coeff: Optional[float] = None
        self._grad_norm: Optional[float] = None
        main_to_model = {}
        for model_groups, main_groups in ((self.model_float16_groups,
                                           self.shard_fp32_from_float16_groups),
                                          (self.model_fp32_groups, self.shard_fp32_groups)):
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main_param in zip(model_group, main_group):
                    main_to_model[id(main_param)] = model_param
        tp_group = getattr(self, "tp_group", None)
        self.shards: List[Shard] = []
        self.model_dtype = self.grad_dtype = torch.float32
        self.device = torch.device("cpu")
        for group_index, group in enumerate(self.optimizer.param_groups):
            for main_param in group["params"]:
                model_param = main_to_model[id(main_param)]
                param_range = self._get_model_param_range_map(model_param)["param"]
                self.device = model_param.device
                self.model_dtype = model_param.dtype
                self.grad_dtype = model_param.main_grad.dtype
                self.shards.append(Shard(
                    model_param=model_param, group=group_index, start=param_range.start,
                    end=param_range.end,
                    counts_in_norm=bool(param_is_not_shared(main_param) and tensor_parallel.
                                        param_is_not_tensor_parallel_duplicate(main_param,
                                                                               tp_group))))
        # The fp32 masters megatron-core made on the device (bf16/fp16 models) are not
        # needed: the subclass builds its own from the model weights.
        for group in self.shard_fp32_from_float16_groups:
            for main_param in group:
                main_param.data = torch.empty(0, dtype=main_param.dtype, device=main_param.device)

    # ------------------------------------------------------------ gradients

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """fp16: finds inf/nan in the training-dtype grads and updates the loss scale."""
        if not self.grad_scaler:
            self._inv_scale = None
            return False
        # The inv scale of this step is the one before the scaler's update; a 0-dim
        # tensor multiplies host and device tensors alike.
        self._inv_scale = self.grad_scaler.inv_scale.detach().reshape(()).cpu()
        grads = [s.grad() for s in self.shards]
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
    @record_function("optimizer/grad_norm")
    def get_grad_norm(self):
        """megatron-core's global grad norm, from per-parameter norms of the unscaled grads.

        megatron-core takes the norm of each fp32 main grad, then the norm of those norms;
        here each parameter's norm comes from its training-dtype grad (converted one
        parameter at a time), so no fp32 copy of the shard is made.
        """
        norms = []
        for shard in self.shards:
            if not shard.counts_in_norm:
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
        self._grad_norm = norm
        return norm

    def clip_grad_norm(self, clip_grad: float) -> float:
        """The clipping itself happens in the subclass's update, where grads become fp32."""
        return self.get_grad_norm()

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """The subclass's update, then megatron-core's param all-gather."""
        if self.config.clip_grad <= 0.0:
            self._clip_coeff, self._grad_norm = None, None
        timers = self.config.timers
        if timers is not None:
            timers("optimizer-inner-step", log_level=1).start()
        with record_function("optimizer/update"):
            self._update()
        if timers is not None:
            timers("optimizer-inner-step").stop()
        if not self.ddp_config.overlap_param_gather:
            for model_chunk in self.model_chunks:
                model_chunk.start_param_sync()
        return True

    def _update(self) -> None:
        raise NotImplementedError

    def reload_masters(self) -> None:
        """Rebuilds the fp32 masters from the model weights (after a model-only load)."""
        raise NotImplementedError

    def _copy_model_grads_to_main_grads(self):
        """Never: the update reads the grad buffer itself."""

    def _copy_model_params_to_main_params(self, state_dict=None):
        self.reload_masters()

    # ------------------------------------------------------------ checkpoints

    def common_state(self) -> dict:
        """Subclass state that is not per element (goes into the common checkpoint)."""
        return {}

    def load_common_state(self, state: dict) -> None:
        """Restores what :meth:`common_state` returned."""

    def state_dict(self):
        """The state that is not per element: param-group settings, loss scaler, subclass's."""
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        state = {"param_groups": groups, **self.common_state()}
        if self.grad_scaler:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict):
        """Restores what :meth:`state_dict` returned (per-element state loads separately)."""
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k in group})
        if self.grad_scaler and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        self.load_common_state(state_dict)

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           **kwargs):
        """The common state as dist_checkpointing objects.

        The per-element state goes into the checkpoint through
        :meth:`save_external_state` instead.
        """
        state = self.state_dict()
        prefix = f"optimizer.{self.state_prefix}.dp_group_idx_{self.data_parallel_group_idx}"
        return {k: ShardedObject(f"{prefix}.{k}", v, (1,), (0,),
                                 replica_id=(self.distributed_optimizer_instance_id, 0,
                                             self.data_parallel_group.rank()))
                for k, v in state.items()}

    def layout(self) -> Dict[str, int]:
        """Where this rank's shard sits: a checkpoint of another layout cannot be loaded."""
        from megatron.core import parallel_state

        return {"dp_size": self.data_parallel_group.size(),
                "dp_rank": self.data_parallel_group.rank(),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank()}

    def save_external_state(self, checkpoint_dir: str) -> None:
        """Writes the per-element state under ``checkpoint_dir``."""
        raise NotImplementedError

    def load_external_state(self, checkpoint_dir: str) -> None:
        """Restores what :meth:`save_external_state` wrote."""
        raise NotImplementedError

    def device_state_bytes(self) -> int:
        """Bytes of fp32 state megatron-core itself still holds (should be 0).

        Counts megatron-core's fp32 masters of bf16/fp16 parameters and the torch
        optimizer's states: the tensors that would sit on the model's device.
        """
        total = sum(p.numel() * p.element_size()
                    for group in self.shard_fp32_from_float16_groups for p in group)
        for state in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values()
                         if torch.is_tensor(t) and t.dim() > 0)
        return total


@contextlib.contextmanager
def bound_distributed_optimizer(cls, **kwargs):
    """Within the block, megatron-core's optimizer factory builds ``cls(..., **kwargs)``.

    ``get_megatron_optimizer`` looks ``DistributedOptimizer`` up by name when it builds
    one, so a subclass bound there is used for every model chunk.

    Yields:
        the bound subclass: what the factory built is checked against it with
        :func:`check_bound`.
    """
    import megatron.core.optimizer as mcore_optimizer

    class Bound(cls):
        def __init__(self, *args, **more):
            super().__init__(*args, **kwargs, **more)

    Bound.__name__ = Bound.__qualname__ = cls.__name__
    original = mcore_optimizer.DistributedOptimizer
    mcore_optimizer.DistributedOptimizer = Bound
    try:
        yield Bound
    finally:
        mcore_optimizer.DistributedOptimizer = original


def check_bound(optimizer, bound: type):
    """Returns ``optimizer`` when each optimizer of its chain is an instance of ``bound``.

    The binding relies on megatron-core's factory looking ``DistributedOptimizer`` up by
    name in ``megatron.core.optimizer``; a megatron-core whose factory does not would
    silently train with its own optimizer instead of the mode's.

    Raises:
        RuntimeError: the factory built another class (named, with the likely cause).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, bound):
            raise RuntimeError(
                f"megatron-core's optimizer factory built {type(opt).__module__}."
                f"{type(opt).__qualname__}, not the bound {bound.__name__}: this megatron-core "
                "no longer builds its DistributedOptimizer through the name in "
                "megatron.core.optimizer, where megatron_ext binds its optimizers (this "
                "project runs on megatron-core 0.16.1 up to 0.20)")
    return optimizer

