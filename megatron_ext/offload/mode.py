"""The offload mode (``--offload-optimizer``): the optimizer mode of the offload engine.

Registers itself in :mod:`megatron_ext.optim.modes` when imported (the registry imports it
by name at its first lookup). Light at import: the engine, torch and megatron-core are
imported inside :meth:`OffloadMode.build`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megatron_ext.optim.modes import Mode, needs, only, refuses, register


class OffloadMode(Mode):
    """The distributed optimizer's fp32 states in the offload engine's host cache and tiers."""

    name = "offload"
    flag = "--offload-optimizer"
    switch = "offload.offload_optimizer"
    words = "--offload-optimizer"
    precedence = 1
    requirements = (
        needs("parallel.use_distributed_optimizer",
              "--offload-optimizer offloads the distributed optimizer's shard: add "
              "--use-distributed-optimizer"),
        refuses("optimizer.optimizer_cpu_offload",
                "--offload-optimizer and --optimizer-cpu-offload are two offloads of the same "
                "states; choose one"),
        only("optimizer.optimizer", "adam", "--offload-optimizer supports --optimizer adam only"),
    )

    def build(self, cfg, model_chunks, runtime):
        """megatron-core's factory with the offloaded DistributedOptimizer bound into it."""
        from megatron_ext.offload.optimizer import offloaded_distributed_optimizer
        from megatron_ext.optim.factory import build_megatron_optimizer
        from megatron_ext.runtime.faults import Faults

        with offloaded_distributed_optimizer(cfg.offload, runtime.rank,
                                             cfg.optimizer.state_layout(),
                                             Faults(cfg.faults.offload_fault)) as bound:
            return build_megatron_optimizer(cfg, model_chunks, bound)

    def log_summary(self, record: dict) -> Optional[str]:
        """The engine's part of the stdout line (when the record has its metrics).

        Main-thread phases, the I/O threads' busy time (which overlaps them), cache hits and
        bytes moved per iteration.
        """
        if "offload/cache_hit_rate" not in record:
            return None
        ms = lambda key: record.get(f"offload/{key}", 0.0) * 1000  # noqa: E731
        return (f"offload (ms): stall {ms('stall_s'):.1f} convert {ms('convert_s'):.1f} "
                f"update {ms('update_s'):.1f} writeback {ms('writeback_s'):.1f}, io threads "
                f"fetch {ms('fetch_bg_s'):.1f} flush {ms('flush_bg_s'):.1f} lock wait "
                f"{ms('lock_wait_bg_s'):.1f}, cache hits {record['offload/cache_hit_rate']:.0%}, "
                f"io {record.get('offload/io_bytes', 0.0) / 1e9:.2f} GB")

    def derived_metrics(self, record: dict) -> Dict[str, float]:
        """``offload/roofline_ratio``: the iteration's time over its lower bound.

        The bound is the larger of forward+backward and the engine's I/O floor; 1.0 means
        nothing else costs time.
        """
        floor = record.get("offload/io_floor_s")
        step, compute = record.get("time/iteration_s"), record.get("time/forward_backward_s")
        if floor is None or step is None or compute is None:
            return {}
        bound = max(compute, floor)
        return {"offload/roofline_ratio": step / bound} if bound > 0 else {}

    def checkpoint_problems(self, directory: str) -> List[Tuple[str, str]]:
        """The engine's manifests under the checkpoint and the state files they name."""
        from megatron_ext.offload.checkpoint import manifest_problems

        return manifest_problems(directory)


register(OffloadMode())
