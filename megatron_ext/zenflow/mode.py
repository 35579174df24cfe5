"""The ZenFlow mode (``--zenflow``): the optimizer mode of ZenFlow's selective updates.

Registers itself in :mod:`megatron_ext.optim.modes` when imported (the registry imports it
by name at its first lookup). Light at import: the engine, torch and megatron-core are
imported inside :meth:`ZenFlowMode.build`. With ``--offload-optimizer`` too, ZenFlow builds
the optimizer (it outranks the offload mode) and keeps its CPU side's states in the offload
engine's host cache and tiers.
"""

from __future__ import annotations

from typing import Optional

from megatron_ext.optim.modes import (
    Mode,
    Requirement,
    metric_section,
    needs,
    only,
    refuses,
    register,
)

# Its part of the stdout line: (metric, label, format) of its ``zenflow/*`` metrics.
LINE_FIELDS = (("rho", "rho", ".3f"), ("update_interval", "S", ".0f"),
               ("stall_s", "stall (ms)", "ms"), ("selected_ratio", "selected", ".1%"))


def _gpu_state_flags(cfg) -> bool:
    """Whether flags that size or shape the offload engine's GPU states are given.

    ``--offload-device-cache-gb auto`` is the default and means no device tier under
    ZenFlow (its engine's states live on the CPU); a size in GB is refused.
    """
    return bool(cfg.optimizer.use_precision_aware_optimizer
                or cfg.offload.device_cache_bytes() > 0)


class ZenFlowMode(Mode):
    """Important columns updated on the GPU every step, the others by the CPU per window."""

    name = "zenflow"
    flag = "--zenflow"
    switch = "zenflow.zenflow"
    words = "--zenflow"
    precedence = 2
    requirements = (
        Requirement("--zenflow keeps its own GPU states: --use-precision-aware-optimizer and "
                    "--offload-device-cache-gb apply to --offload-optimizer alone",
                    _gpu_state_flags),
        needs("parallel.use_distributed_optimizer",
              "--zenflow splits the distributed optimizer's shard between the GPU and the CPU: "
              "add --use-distributed-optimizer"),
        refuses("optimizer.optimizer_cpu_offload",
                "--zenflow and --optimizer-cpu-offload both move optimizer states to the host; "
                "choose one"),
        only("optimizer.optimizer", "adam", "--zenflow supports --optimizer adam only"),
    )

    def build(self, cfg, model_chunks, runtime):
        """megatron-core's factory with the ZenFlow DistributedOptimizer bound into it."""
        from megatron_ext.optim.factory import build_megatron_optimizer
        from megatron_ext.zenflow.optimizer import zenflow_optimizer

        with zenflow_optimizer(cfg.zenflow, runtime.rank, cfg.offload) as bound:
            return build_megatron_optimizer(cfg, model_chunks, bound)

    def log_summary(self, record: dict) -> Optional[str]:
        """``zenflow: rho .. S .. stall (ms) .. selected ..`` from its metrics in the record."""
        return metric_section(record, self.name, LINE_FIELDS)


register(ZenFlowMode())
