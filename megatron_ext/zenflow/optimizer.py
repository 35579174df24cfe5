"""ZenFlow's megatron-core optimizer: the DistributedOptimizer subclass and its builder.

The optimizer hands its shard to :class:`~.engine.ZenFlowEngine` (the step, the states of
both sides), picks where the CPU side keeps its states (``--zenflow-cpu-states``:
:mod:`.cpu_states`), and writes the rank's ZenFlow state beside megatron-core's checkpoint.
"""

from __future__ import annotations

import os
from typing import Dict

import torch

from megatron_ext.errors import UsageError
from megatron_ext.optim.sharded_optimizer import (
    ShardedStateOptimizer,
    bound_distributed_optimizer,
)
from megatron_ext.zenflow.config import ZenFlowConfig
from megatron_ext.zenflow.cpu_states import HostCpuStates, TieredCpuStates, offload_engines
from megatron_ext.zenflow.engine import FORMAT, ZenFlowEngine


class ZenFlowOptimizer(ShardedStateOptimizer):
    """megatron-core's DistributedOptimizer running ZenFlow's selective updates."""

    state_prefix = "zenflow"

    def __init__(self, *args, zenflow_config: ZenFlowConfig, rank: int, offload=None, **kwargs):
        super().__init__(*args, **kwargs)
        from megatron.core import parallel_state

        self.rank = rank
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        # On GPU machines the CPU side takes the one-pass host AdamW (the same bits in host
        # memory and in the tiers, before and after a re-selection); on a CPU-only run, the
        # reference implementation (megatron-core's there, bit for bit).
        fused = self.device.type == "cuda"
        if offload is not None:
            offload_config, run_id, tiers = offload
            self.cpu_states = TieredCpuStates(offload_engines(
                offload_config, run_id, tiers, rank=rank, model_dtype=self.model_dtype,
                fused_adam=fused))
        else:
            self.cpu_states = HostCpuStates(fused=fused)
        self.engine = ZenFlowEngine(
            zenflow_config, self.shards, device=self.device, model_dtype=self.model_dtype,
            grad_dtype=self.grad_dtype, dp_group=self.data_parallel_group,
            tp_group=parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None,
            stats_group=self.get_grad_stats_parallel_group(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(), tp_size=tp_size,
            all_params=[p for chunk in self.model_chunks for p in chunk.parameters()
                        if p.requires_grad],
            cpu_states=self.cpu_states)

    def _update(self) -> None:
        self.engine.step(self.optimizer.param_groups, self._inv_scale, self._clip_coeff)

    def reload_masters(self) -> None:
        """The engine's masters from the model weights (after a model-only load)."""
        self.engine.reload_masters()

    def _copy_main_params_to_model_params(self):
        self.engine.write_all_params()

    def common_state(self) -> dict:
        """The step count (checked against the per-rank file on load)."""
        return {"zenflow_step": self.engine.schedule.step}

    def load_common_state(self, state: dict) -> None:
        """Keeps the saved step for the check in :meth:`load_external_state`."""
        self._loaded_step = state.get("zenflow_step")

    def _file(self, checkpoint_dir: str) -> str:
        return os.path.join(checkpoint_dir, "zenflow", f"rank{self.rank:05d}.pt")

    def save_external_state(self, checkpoint_dir: str) -> None:
        """Writes the rank's ZenFlow state (both sides, accumulators, schedule) to one file."""
        path = self._file(checkpoint_dir)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = self.engine.state_dict()
        state["layout"] = self.layout()
        tmp = path + ".tmp"
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.cpu_states.save(self._offload_dir(checkpoint_dir), self.layout())

    def _offload_dir(self, checkpoint_dir: str) -> str:
        return os.path.join(checkpoint_dir, "zenflow", "offload")

    def load_external_state(self, checkpoint_dir: str) -> None:
        """Restores :meth:`save_external_state`'s file; refuses another layout."""
        path = self._file(checkpoint_dir)
        if not os.path.isfile(path):
            raise UsageError(f"{checkpoint_dir}: no ZenFlow state for rank {self.rank} ({path}); "
                             "it was not saved with --zenflow: load it with --finetune or "
                             "--no-load-optim")
        try:
            state = torch.load(path, weights_only=False, map_location="cpu")
        except Exception as err:  # noqa: BLE001 (a damaged file: say which)
            raise UsageError(f"{path}: unreadable ZenFlow state ({type(err).__name__}: {err})") \
                from None
        if state.get("format") != FORMAT or state.get("layout") != self.layout():
            raise UsageError(f"{path}: saved with another parallel layout "
                             f"({state.get('layout')}, this run {self.layout()}); resume with "
                             "the same DP/TP/PP sizes, or use --finetune")
        loaded = getattr(self, "_loaded_step", None)
        if loaded is not None and loaded != state["schedule"]["step"]:
            raise UsageError(f"{path}: ZenFlow state of step {state['schedule']['step']} but "
                             f"the checkpoint's optimizer of step {loaded}: inconsistent")

        def load_cpu_states():
            self.cpu_states.load(self._offload_dir(checkpoint_dir), self.layout())
        self.engine.load_state_dict(state, load_cpu_states)

    def metrics(self) -> Dict[str, float]:
        """The engine's ``zenflow/*`` metrics since the last call."""
        return self.engine.metrics()

    def close(self) -> None:
        """Stops the CPU worker."""
        self.engine.close()


def zenflow_optimizer(cfg: ZenFlowConfig, rank: int, offload_config=None):
    """Within the block, megatron-core's optimizer factory builds the ZenFlow optimizer.

    With ``cfg.zenflow_cpu_states`` "tiers" (settled by the run's config), the CPU side
    keeps its states in the offload engine's host cache and tier paths, as
    ``offload_config`` gives them; with "host", in host memory.
    """
    if cfg.zenflow_cpu_states not in ("host", "tiers"):
        raise ValueError(f"zenflow_cpu_states {cfg.zenflow_cpu_states!r}: the run's config "
                         "settles auto to host or tiers before the optimizer is built")
    offload = None
    if cfg.zenflow_cpu_states == "tiers":
        from megatron_ext.offload.optimizer import offload_setup

        offload = (offload_config, *offload_setup(offload_config, rank))
    return bound_distributed_optimizer(ZenFlowOptimizer, zenflow_config=cfg, rank=rank,
                                       offload=offload)
