"""``--tensorboard-dir``: TensorBoard scalars with Megatron-LM's tag names.

A Megatron-LM user's dashboards read these tags, so they are Megatron-LM's (its
training.py ``training_log`` and ``evaluate_and_print_results``), each training scalar
also against consumed samples (``'<tag> vs samples'``):

* every ``--tensorboard-log-interval`` iterations: ``learning-rate``, ``batch-size``,
  ``lm loss`` (that iteration's loss), ``loss-scale`` (unless
  ``--no-log-loss-scale-to-tensorboard``), ``world-size`` (``--log-world-size-to-tensorboard``),
  ``grad-norm``, and with
  ``--log-memory-to-tensorboard`` the CUDA allocator's ``mem-reserved-bytes``,
  ``mem-allocated-bytes``, ``mem-max-allocated-bytes``, ``mem-allocated-count``;
* every ``--log-interval`` iterations with ``--log-timers-to-tensorboard``:
  ``iteration-time`` and ``<timer>-time`` (seconds per iteration) of the timers that
  ``--timing-log-level`` selects in Megatron-LM;
* at each evaluation: ``lm loss validation`` and, with
  ``--log-validation-ppl-to-tensorboard``, ``lm loss validation ppl``.

Only the last rank writes, as in Megatron-LM.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional

from megatron_ext.errors import UsageError

log = logging.getLogger(__name__)

# The loop's record keys of the timers Megatron-LM writes at each --timing-log-level
# (level 1: once per iteration; level 2: per micro-batch), and their Megatron-LM names.
TIMERS_BY_LEVEL = {
    1: {"time/forward_backward_s": "forward-backward", "time/grad_sync_s": "all-grads-sync",
        "time/optimizer_s": "optimizer"},
    2: {"time/forward_s": "forward-compute", "time/backward_s": "backward-compute"},
}


def timer_tags(timing_log_level: int) -> Dict[str, str]:
    """Record key -> TensorBoard tag of the timers written at ``timing_log_level``."""
    tags: Dict[str, str] = {}
    for level in range(1, timing_log_level + 1):
        tags.update({key: name + "-time" for key, name in TIMERS_BY_LEVEL.get(level, {}).items()})
    return tags


class TensorBoardWriter:
    """A SummaryWriter over ``--tensorboard-dir``; a no-op where it is not enabled."""

    def __init__(self, cfg, rank: int, world_size: int, is_cpu: bool):
        lg = cfg.logging
        self.lg = lg
        self.world_size = world_size
        self.enabled = bool(lg.tensorboard_dir)
        self._writer = None
        if lg.log_memory_to_tensorboard and is_cpu:
            raise UsageError("--log-memory-to-tensorboard writes CUDA memory statistics, and "
                             "this run has no GPU; leave it out on the CPU")
        if not self.enabled or rank != world_size - 1:
            return
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=lg.tensorboard_dir,
                                     max_queue=lg.tensorboard_queue_size)
        log.info("TensorBoard: writing to %s", lg.tensorboard_dir)

    def wants(self, iteration: int) -> bool:
        """Whether iteration's training scalars are written (the same answer on every rank)."""
        return self.enabled and iteration % self.lg.tensorboard_log_interval == 0

    def _scalar(self, tag: str, value, iteration: int, samples: Optional[int]) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        self._writer.add_scalar(tag, value, iteration)
        if samples is not None:
            self._writer.add_scalar(tag + " vs samples", value, samples)

    def train(self, iteration: int, samples: int, values: dict) -> None:
        """Writes one iteration's scalars.

        Args:
            iteration: the iteration just trained (1-based).
            samples: consumed training samples after it.
            values: ``lm_loss``, ``lr``, ``global_batch_size``, ``loss_scale``,
                and ``grad_norm`` of that iteration.
        """
        if self._writer is None:
            return
        lg = self.lg
        self._scalar("learning-rate", values["lr"], iteration, samples)
        self._scalar("batch-size", values["global_batch_size"], iteration, samples)
        self._scalar("lm loss", values["lm_loss"], iteration, samples)
        if lg.log_loss_scale_to_tensorboard:
            self._scalar("loss-scale", values["loss_scale"], iteration, samples)
        if lg.log_world_size_to_tensorboard:
            self._scalar("world-size", self.world_size, iteration, samples)
        self._scalar("grad-norm", values["grad_norm"], iteration, samples)
        if lg.log_memory_to_tensorboard:
            import torch

            stats = torch.cuda.memory_stats()
            for tag, key in (("mem-reserved-bytes", "reserved_bytes.all.current"),
                             ("mem-allocated-bytes", "allocated_bytes.all.current"),
                             ("mem-max-allocated-bytes", "allocated_bytes.all.peak"),
                             ("mem-allocated-count", "allocation.all.current")):
                self._writer.add_scalar(tag, stats.get(key, 0), iteration)

    def timers(self, record: dict) -> None:
        """Writes a log record's timers (``--log-timers-to-tensorboard``)."""
        if self._writer is None or not self.lg.log_timers_to_tensorboard:
            return
        iteration = record["iteration"]
        self._writer.add_scalar("iteration-time", record["time/iteration_s"], iteration)
        for key, tag in timer_tags(self.lg.timing_log_level).items():
            if key in record:
                self._writer.add_scalar(tag, record[key], iteration)

    def validation(self, iteration: int, samples: int, loss: float, ppl: float) -> None:
        """Writes an evaluation's loss (and perplexity)."""
        if self._writer is None:
            return
        self._scalar("lm loss validation", loss, iteration, samples)
        if self.lg.log_validation_ppl_to_tensorboard:
            self._scalar("lm loss validation ppl", ppl, iteration, samples)

    def close(self) -> None:
        """Flushes and closes the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
