"""``--profile``: iterations --profile-step-start+1 to --profile-step-end, on the chosen ranks.

As Megatron-LM's ``--profile``:

* alone, an nsys capture range: ``torch.cuda.profiler.start()`` (cudaProfilerStart) and
  :func:`torch.autograd.profiler.emit_nvtx` (an NVTX range per operator, with shapes)
  before the first profiled step, ``stop()`` after the last. Run under ``nsys profile
  --capture-range=cudaProfilerApi --capture-range-end=stop``. Without CUDA there is no
  capture range to open: that is refused, in one line, rather than run unprofiled.
* with ``--use-pytorch-profiler``, torch.profiler (CPU and CUDA activities; unlike
  Megatron-LM, without shapes and Python stacks). Writes ``<--profile-dir>/rank<R>-iter<A>-<B>.txt``
  (operators and labelled ranges such as ``zenflow/send_delayed_grads`` by total CPU time,
  then by device time) and a Chrome trace ``.json`` of the same iterations (chrome://tracing
  or Perfetto; ``bench/gpu/profile_summary.py``), and, when ``--tensorboard-dir`` is given, the
  trace there too in the layout of TensorBoard's profiler plugin (where Megatron-LM writes
  it).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Optional

import torch

from megatron_ext.errors import UsageError
from megatron_ext.runtime.quiet import native_lines_dropped

log = logging.getLogger(__name__)

ROWS = 60


def profiled_steps(cfg) -> range:
    """The 1-based iterations that ``--profile`` covers (Megatron-LM's range)."""
    return range(cfg.profile_step_start + 1, cfg.profile_step_end + 1)


class Profiler:
    """Starts before the first profiled iteration, stops after the last one."""

    def __init__(self, cfg, rank: int, is_cpu: bool, tensorboard_dir: Optional[str] = None):
        self.cfg = cfg
        self.active = bool(cfg.profile) and rank in cfg.profile_ranks
        self.rank = rank
        self.is_cpu = is_cpu
        self.tensorboard_dir = tensorboard_dir
        if cfg.profile and not cfg.use_pytorch_profiler and is_cpu:
            raise UsageError("--profile without --use-pytorch-profiler opens an nsys (CUDA) "
                             "capture range, and this run has no GPU; add "
                             "--use-pytorch-profiler for torch.profiler on the CPU")
        self._prof: Optional[torch.profiler.profile] = None
        self._nvtx = None
        self._first = 0
        self._last = 0

    def before(self, iteration: int) -> None:
        """Called before the ``iteration``-th step (1-based)."""
        if not self.active or iteration != self.cfg.profile_step_start + 1:
            return
        self._first = iteration
        if self.cfg.use_pytorch_profiler:
            if self._prof is None:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if not self.is_cpu:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                # Without Megatron-LM's record_shapes/with_stack: on the CPU they multiply
                # the profiled steps' time and push the labelled ranges out of the table.
                self._prof = torch.profiler.profile(activities=activities)
                # torch's profiler prints a "USDT:" mark line when it starts and stops.
                with native_lines_dropped():
                    self._prof.__enter__()
        elif self._nvtx is None:
            torch.cuda.profiler.start()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()
            log.info("profile: cudaProfilerStart before iteration %d (nsys capture range)",
                     iteration)

    def after(self, iteration: int) -> None:
        """Called after the ``iteration``-th step."""
        self._last = iteration
        if iteration >= self.cfg.profile_step_end:
            self._finish(iteration)

    def _finish(self, last: int) -> None:
        if self._nvtx is not None:
            torch.cuda.synchronize()
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
            torch.cuda.profiler.stop()
            log.info("profile: cudaProfilerStop after iteration %d", last)
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        if not self.is_cpu:
            torch.cuda.synchronize()
        with native_lines_dropped():
            prof.__exit__(None, None, None)
        os.makedirs(self.cfg.profile_dir, exist_ok=True)
        stem = os.path.join(self.cfg.profile_dir, f"rank{self.rank}-iter{self._first}-{last}")
        averages = prof.key_averages()
        tables = [averages.table(sort_by="cpu_time_total", row_limit=ROWS)]
        if not self.is_cpu:
            tables.append(averages.table(sort_by="device_time_total", row_limit=ROWS))
        with open(stem + ".txt", "w") as f:
            f.write(f"iterations {self._first}-{last}, rank {self.rank}\n\n")
            f.write("\n\n".join(tables))
        prof.export_chrome_trace(stem + ".json")
        where = f"{stem}.txt and .json"
        if self.tensorboard_dir:
            # A trace is saved once: the plugin's copy is the same file under the name
            # torch.profiler.tensorboard_trace_handler would give it.
            os.makedirs(self.tensorboard_dir, exist_ok=True)
            shutil.copyfile(stem + ".json", os.path.join(
                self.tensorboard_dir, f"rank{self.rank}.{int(time.time() * 1000)}.pt.trace.json"))
            where += f", and the trace to {self.tensorboard_dir}"
        log.info("profile of iterations %d-%d written to %s", self._first, last, where)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None or self._nvtx is not None:  # training ended in the range
            self._finish(self._last)
