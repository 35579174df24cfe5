"""ZenFlow selective updates: the engine, and the megatron-core optimizer that drives it.

Each step (see ``schedule`` for when steps are synchronous, windows close and columns are
re-selected):

1. GPU side: the gradients of every parameter that is not a matrix and of the selected
   columns of each matrix are gathered (compacted per param group), unscaled and clipped
   like megatron-core's, and Adam updates their fp32 masters and moments, which live on
   the model's device; the new weights are scattered into the model.
2. CPU side: the delayed columns' gradients are gathered in the training dtype and
   summed in fp32 over the window (``accumulation``): on the model's device, whose
   window mean goes to the host once at the window's end (``--zenflow-accumulate
   device``), or on the host, each step's grads copied to pinned host memory on a side
   stream and added into the open window's accumulator by the CPU worker's accumulate
   thread (``host``); auto picks at the first step from the device's free memory.
3. At the last step of a window: wait for the previous window's CPU update, copy its new
   weights into the model, and start the CPU update of this window (Adam with the mean of
   the window's gradients) on the worker's update thread; the GPU trains on.
   Synchronous (warm-up) steps run the CPU update inside the step instead.
4. Re-selection (at a synchronous step or a window end): the pending CPU update is
   finished and applied first, then the states of the columns that change sides move
   between the GPU and host memory; no moment is lost or duplicated.

Adam's bias correction counts each side's own steps (the GPU side steps every
iteration, the CPU side once per window); a column that changes sides continues with
its moments under the other side's count.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.profiler import record_function

from megatron_ext.errors import UsageError
from megatron_ext.optim.adamw import adam_update, unscale_and_clip
from megatron_ext.optim.sharded_optimizer import (
    ShardedStateOptimizer,
    bound_distributed_optimizer,
)
from megatron_ext.runtime.to_host import ToHost
from megatron_ext.zenflow.accumulation import (
    DeviceAccumulator,
    choose_place,
    measured_free_memory,
)
from megatron_ext.zenflow.config import ZenFlowConfig
from megatron_ext.zenflow.cpu_worker import CPUS_ENV, CpuSide, TieredCpuSide, cpu_ranges
from megatron_ext.zenflow.schedule import WindowSchedule, adam_floor
from megatron_ext.zenflow.selection import (
    Plan,
    build_plans,
    column_energy,
    global_importance,
    local_mask,
    matrices_of,
    top_columns,
)

KINDS = ("master", "exp_avg", "exp_avg_sq")
FORMAT = 1
STAGING_SLOTS = 3
"""Steps of delayed grads that may wait in pinned memory for the accumulate thread (each
slot holds one step's delayed grads in the training dtype: 2 bytes x (1-k) x parameters)."""
STAGING_ENV = "MEGATRON_EXT_ZENFLOW_STAGING_SLOTS"

log = logging.getLogger(__name__)


def staging_slots() -> int:
    """Staging slots: $MEGATRON_EXT_ZENFLOW_STAGING_SLOTS, else STAGING_SLOTS.

    At least 1; fewer save host memory on large models, at the price of more waiting.
    """
    value = os.environ.get(STAGING_ENV, "").strip()
    if not value:
        return STAGING_SLOTS
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{STAGING_ENV}={value}: give a whole number of slots, at least 1")
    return int(value)


def _energy(tensors: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all elements (fp64, 0-dim, on ``device``).

    One multi-tensor norm (fp32 accumulation per tensor, one pass over the training-dtype
    grads, no fp32 copy), squared and summed in fp64: rho is a ratio of two of these.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum()


class ZenFlowEngine:
    """ZenFlow's state and step over a rank's optimizer shard (megatron-independent)."""

    def __init__(self, cfg: ZenFlowConfig, shards: Sequence, *, device: torch.device,
                 model_dtype: torch.dtype, grad_dtype: torch.dtype, dp_group=None,
                 tp_group=None, stats_group=None, tp_rank: int = 0, tp_size: int = 1,
                 all_params: Optional[Sequence[torch.Tensor]] = None,
                 make_cpu_engine: Optional[Callable] = None,
                 free_memory: Optional[Callable[[], tuple]] = None):
        """The engine over ``shards``.

        ``free_memory()``: (free, total) bytes of the model's device for the auto
        accumulation place, measured at the first step (default
        :func:`~megatron_ext.zenflow.accumulation.measured_free_memory`; a test injects a
        limit).
        """
        self.cfg = cfg
        self.shards = list(shards)
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.model_dtype, self.grad_dtype = model_dtype, grad_dtype
        self.dp_group, self.tp_group, self.stats_group = dp_group, tp_group, stats_group
        self.all_matrices, self.matrices = matrices_of(self.shards, tp_rank, tp_size, all_params)
        # Matrices whose delayed energy counts in rho (not TP duplicates): fixed for the run.
        self._counted = {m.shard for m in self.matrices if m.counts}
        self.schedule = WindowSchedule(cfg)
        self.gpu_plan: Optional[Plan] = None
        self.cpu_plan: Optional[Plan] = None
        self.gpu: Dict[str, Dict[int, torch.Tensor]] = {k: {} for k in KINDS}
        self.gpu_steps = 0
        # With make_cpu_engine (--offload-optimizer), the CPU side's master and moments
        # live in an offload engine (host cache and --offload-paths files).
        self.cpu = (CpuSide({}, model_dtype, pin=self.is_cuda) if make_cpu_engine is None else
                    TieredCpuSide({}, model_dtype, pin=self.is_cuda,
                                  make_engine=make_cpu_engine))
        self.selected: Dict[int, torch.Tensor] = {}
        """Matrix shard index -> whole-matrix selected columns (CPU, ascending)."""
        self.selected_all: List[torch.Tensor] = []
        """The same for every 2-D weight of the model (identical on all ranks)."""
        self.upload_pending = False
        """A finished or running CPU update whose weights have not entered the model yet."""
        self.selected_ratio = 0.0
        self.retention = float("nan")
        # Pinned staging for the delayed grads: staging_slots() steps' worth, so that the
        # training loop waits only when the accumulate thread is that many steps behind
        # (it falls behind while the CPU Adam of a window shares memory bandwidth with it).
        self._slots = staging_slots()
        # The accumulate thread adds up to slots - 1 steps in one pass (each pass reads and
        # writes the fp32 accumulator once), keeping a slot free for the loop's next step.
        self.cpu.batch_steps = max(1, self._slots - 1)
        self._stage: List[Dict[int, torch.Tensor]] = [{} for _ in range(self._slots)]
        self._stage_free: List[Optional[object]] = [None] * self._slots
        self._slot = 0
        self._rho_copy: Optional[ToHost] = None
        """The GPU's running rho sum on its way to the host (read by :meth:`metrics`)."""
        # The CPU update's new weights go to the device on their own stream as soon as the
        # update has finished (the update thread starts the copy), into a device buffer
        # from which the window's boundary scatters them: the boundary step waits for no
        # copy unless the update finished just before it.
        self._upload_dev: Dict[int, torch.Tensor] = {}
        self._upload_copy: Optional[object] = None
        """The event of the pending update's copy to ``_upload_dev``, once started."""
        self._last_copy: Optional[object] = None
        """The event of the last copy from the host upload buffers (they are rewritten only
        after it: ``cpu.upload_guard``)."""
        self._scattered: Optional[object] = None
        """The event of the last boundary's scatter from ``_upload_dev`` (the next copy into
        it waits for it)."""
        self._d2h = None
        if self.is_cuda:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)
            self.cpu.upload_guard = self._wait_last_copy
            self.cpu.after_update = self._start_upload_copy
        self.place: Optional[str] = None
        """Where the delayed grads are summed, "device" or "host" (decided at the first
        step of the process: :meth:`_decide_place`)."""
        self.place_reason = ""
        self._free_memory = free_memory or (lambda: measured_free_memory(self.device))
        self.dev = DeviceAccumulator(device, stream=self._d2h)
        # The auto interval's lower bound: the time per step (its stalls left out) over the
        # window that is open, measured between the starts of consecutive steps.
        self._last_start: Optional[float] = None
        self._step_stall = 0.0
        self._window_time = [0.0, 0]
        self._reset_stats()

    # ------------------------------------------------------------ helpers

    def _grad(self, index: int) -> torch.Tensor:
        return self.shards[index].grad().reshape(-1)

    def _weights(self, index: int) -> torch.Tensor:
        return self.shards[index].weights().reshape(-1)

    def _reset_stats(self) -> None:
        self._stats = {"steps": 0, "rho": 0.0, "stall_s": 0.0, "gpu_update_s": 0.0,
                       "d2h_bytes": 0.0, "h2d_bytes": 0.0, "uploads_ready": 0,
                       "d2h_copies": 0, "since": time.perf_counter()}
        if hasattr(self, "cpu"):
            with self.cpu.lock:
                self.cpu.busy = {k: 0.0 for k in self.cpu.busy}

    def _wait(self, fn) -> None:
        start = time.perf_counter()
        fn()
        waited = time.perf_counter() - start
        self._stats["stall_s"] += waited
        self._step_stall += waited

    @property
    def initialized(self) -> bool:
        """States exist (after the first step or a load)."""
        return self.gpu_plan is not None

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, hparams: List[dict], inv_scale, clip_coeff) -> None:
        """One optimizer step with the gradients in the shards' grad buffers."""
        start = time.perf_counter()
        if self._last_start is not None:  # the previous step's interval, its waits left out
            self._window_time[0] += start - self._last_start - self._step_stall
            self._window_time[1] += 1
        self._last_start, self._step_stall = start, 0.0
        plan = self.schedule.next_step()
        if not self.initialized:
            self._select(first=True)
        if self.place is None:
            self._decide_place()
        start = time.perf_counter()
        self.gpu_steps += 1
        with record_function("zenflow/gpu_update"):
            for group, n in self.gpu_plan.sizes.items():
                grad = self.gpu_plan.gather(group, self._grad, torch.empty(
                    n, dtype=self.grad_dtype, device=self.device))
                grad = unscale_and_clip(grad.float(), inv_scale, clip_coeff)
                adam_update(self.gpu["master"][group], grad, self.gpu["exp_avg"][group],
                            self.gpu["exp_avg_sq"][group], self.gpu_steps, hparams[group])
                self.gpu_plan.scatter(group, self.gpu["master"][group], self._weights)
        self._stats["gpu_update_s"] += time.perf_counter() - start
        with record_function("zenflow/send_delayed_grads"):
            rho = self._send_delayed_grads(inv_scale, clip_coeff,
                                           last=plan.sync or plan.closes_window,
                                           need_rho=self.cfg.fixed_interval is None)
        buffer = self.schedule.buffer
        if plan.sync:
            self._flush_pending()
            self.cpu.submit_update(buffer, -plan.step, hparams)
            self.upload_pending = True
            self._flush_pending()
        elif plan.closes_window:
            self._flush_pending()
            self.cpu.submit_update(buffer, self.schedule.windows_closed, hparams)
            self.upload_pending = True
            if plan.select:
                self._flush_pending()
        # With a fixed interval rho is only a metric: it stays on the device (no sync here).
        floor = self._window_floor() if plan.closes_window and \
            self.cfg.fixed_interval is None else 1
        self.schedule.end_step(plan, rho if isinstance(rho, float) else 0.0, floor=floor)
        if plan.select and plan.step > 1:
            self._select(first=False)
            if self.place == "device":
                self.dev.resize(self.cpu_plan.sizes)
        self._stats["steps"] += 1

    def _window_floor(self) -> int:
        """The next window's least length: its steps outlast the CPU's Adam pass.

        From the last finished CPU update's time (the one this boundary waited for) and
        the time per step of the window that closes; the largest over the ranks that
        share rho, so that all of them agree on every boundary.
        """
        total, count = self._window_time
        self._window_time = [0.0, 0]
        step_s = total / count if count else 0.0
        floor = adam_floor(self.cpu.last_update_s, step_s)
        if self.stats_group is not None and \
                torch.distributed.get_world_size(self.stats_group) > 1:
            value = torch.tensor([floor], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX,
                                         group=self.stats_group)
            floor = int(value.item())
        return floor

    # ------------------------------------------------------------ accumulation place

    def _decide_place(self) -> None:
        """Device or host accumulation, once per process, before the first accumulation.

        At the first step, so after the first forward-backward: the free memory then
        leaves room for the activations' peak (held by the caching allocator).
        """
        need = 4 * sum(self.cpu_plan.sizes.values())
        free, total = (None, None) if self.cfg.zenflow_accumulate != "auto" else \
            self._free_memory()
        self.place, self.place_reason = choose_place(self.cfg.zenflow_accumulate, need,
                                                     free, total)
        log.info("ZenFlow accumulates the delayed gradients on the %s (%s)", self.place,
                 self.place_reason)
        cpus = getattr(self.cpu, "cpus", None)
        allowed = os.sched_getaffinity(0)
        log.info("ZenFlow's CPU-side threads run on %s (%s)",
                 f"CPUs {cpu_ranges(cpus)}, the training loop keeps {cpu_ranges(allowed - cpus)}"
                 if cpus else f"all {len(allowed)} CPUs of this process", CPUS_ENV)
        if self.place == "device":
            if self.is_cuda:
                self.cpu.pin_accumulators()
            self.dev.resize(self.cpu_plan.sizes)
            self._adopt_host_partial()
        elif self.is_cuda:
            self._ensure_staging()

    def _adopt_host_partial(self) -> None:
        """The open window's partial sum from the host accumulator into the device's.

        A checkpoint's sum is in the host's layout, the same numbers either place.
        """
        buffer = self.schedule.buffer
        steps = self.cpu.acc_steps[buffer]
        if steps and not self.cpu.acc_is_mean[buffer]:
            self.dev.load(self.cpu.acc[buffer], steps)
            self.cpu.acc_steps[buffer] = 0

    def _send_delayed_grads(self, inv_scale, clip_coeff, last: bool, need_rho: bool = True):
        """Gathers the delayed columns' grads, queues their accumulation; returns rho.

        ``last``: the step closes its window (the accumulation leaves the mean). rho is a
        float with ``need_rho`` (the auto interval decides on it), else a 0-dim fp64 tensor
        on the model's device, read when the metrics are (no host-device sync per step).
        """
        total_energy = _energy([s.grad() for s in self.shards if s.counts_in_norm and s.numel],
                               self.device)
        on_device = self.place == "device"
        if not on_device:
            slot = self._slot
            self._slot = (slot + 1) % self._slots
            if self._stage_free[slot] is not None:  # the accumulation that used this slot
                self._wait(self._stage_free[slot].result)
        grads, counted = {}, []
        for group, n in self.cpu_plan.sizes.items():
            compact = self.cpu_plan.gather(group, self._grad, torch.empty(
                n, dtype=self.grad_dtype, device=self.device))
            pieces = self.cpu_plan.pieces[group]
            if all(piece.shard in self._counted for piece in pieces):
                counted.append(compact)
            else:
                counted += [compact[p.offset:p.offset + p.length] for p in pieces
                            if p.shard in self._counted]
            grads[group] = compact
        delayed_energy = _energy(counted, self.device)
        energies = torch.stack([delayed_energy, total_energy])
        if self.stats_group is not None and torch.distributed.get_world_size(self.stats_group) > 1:
            torch.distributed.all_reduce(energies, group=self.stats_group)
        if need_rho:
            delayed, total = energies.tolist()
            rho = delayed / total if total > 0 else 0.0
        else:
            delayed, total = energies.unbind()
            rho = torch.where(total > 0, delayed / total, torch.zeros_like(total))
        self._add_rho(rho)
        if on_device:
            self.dev.add(grads, inv_scale, clip_coeff)
            if last:
                buffer = self.schedule.buffer
                steps, ready = self.dev.drain(self.cpu.acc[buffer])
                self._stats["d2h_bytes"] += self.dev.nbytes()
                self._stats["d2h_copies"] += 1
                self.cpu.deposit(buffer, steps, ready)
            return rho
        # Every read from the GPU of this step is above: the D2H queued below is served
        # before any later copy to the host (bench/copy_probe.py), so a read after it waits.
        ready = None
        if self.is_cuda and grads:
            grads, ready = self._to_host(slot, grads)
        self._stats["d2h_bytes"] += sum(g.numel() * g.element_size() for g in grads.values())
        self._stats["d2h_copies"] += 1 if grads else 0
        self._stage_free[slot] = self.cpu.accumulate(self.schedule.buffer, grads, inv_scale,
                                                     clip_coeff, ready=ready, last=last)
        return rho

    def _add_rho(self, rho) -> None:
        """Adds a step's rho to the metrics' sum.

        A sum on the GPU starts its copy to the host now, before the step's D2H is
        queued: :meth:`metrics` reads that copy, not the GPU (a read after the D2H would
        wait for all of it).
        """
        total = self._stats["rho"] + rho
        self._stats["rho"] = total
        if isinstance(total, torch.Tensor):
            self._rho_copy = ToHost(total)

    def _rho_sum(self) -> float:
        total = self._stats["rho"]
        return float(self._rho_copy.get()) if isinstance(total, torch.Tensor) else float(total)

    def _to_host(self, slot: int, grads: Dict[int, torch.Tensor]):
        """Copies the compact grads into pinned staging on the D2H stream.

        The staging is allocated by :meth:`_ensure_staging` at each selection, for the sizes
        of the plan in force.
        """
        stage = self._stage[slot]
        out = {}
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            for group, grad in grads.items():
                dst = stage[group][:grad.numel()]
                dst.copy_(grad, non_blocking=True)
                grad.record_stream(self._d2h)
                out[group] = dst
            event = torch.cuda.Event()
            event.record(self._d2h)
        return out, event.synchronize

    def _flush_pending(self) -> None:
        """Waits for the CPU update in flight and copies its weights into the model."""
        if not self.upload_pending:
            return
        with record_function("zenflow/flush_pending"):
            self._flush_pending_now()

    def _flush_pending_now(self) -> None:
        self._wait(self.cpu.wait_update)
        if not self.is_cuda:
            for group in self.cpu_plan.sizes:
                values = self.cpu.upload[group]
                self.cpu_plan.scatter(group, values, self._weights)
                self._stats["h2d_bytes"] += values.numel() * values.element_size()
        else:
            if self._upload_copy is None:  # no update ran (weights set by a load)
                self._start_upload_copy()
            elif self._upload_copy.query():
                self._stats["uploads_ready"] += 1
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self._upload_copy)
            for group, n in self.cpu_plan.sizes.items():
                values = self._upload_dev[group][:n]
                self.cpu_plan.scatter(group, values, self._weights)
                self._stats["h2d_bytes"] += values.numel() * values.element_size()
            self._upload_copy = None
            self._scattered = stream.record_event()
        self.upload_pending = False

    def _start_upload_copy(self) -> None:
        """Host upload buffers -> ``_upload_dev`` on the H2D stream.

        Called on the CPU worker's update thread when an update has finished (or on the
        loop's thread at a boundary with no update): after the last boundary's scatter,
        which read those device buffers, and before the next boundary's, which waits for
        this copy's event. Nothing else touches the buffers in between.
        """
        with torch.cuda.device(self.device), torch.cuda.stream(self._h2d):
            if self._scattered is not None:
                self._h2d.wait_event(self._scattered)
            for group, n in self.cpu_plan.sizes.items():
                dst = self._upload_dev[group][:n]
                dst.copy_(self.cpu.upload[group], non_blocking=True)
                dst.record_stream(self._h2d)
            event = self._h2d.record_event()
        self._upload_copy = self._last_copy = event

    def _wait_last_copy(self) -> None:
        """Until the last copy from the host upload buffers has finished."""
        event = self._last_copy
        if event is not None:
            event.synchronize()

    # ------------------------------------------------------------ selection

    def _select(self, first: bool) -> None:
        """Selects the columns from the current grads; builds or moves the states."""
        local = [torch.zeros(m.cols, dtype=torch.float64, device=self.device)
                 for m in self.all_matrices]
        for m in self.matrices:
            local[m.key] = column_energy(self._grad(m.shard), m)
        full = global_importance(local, self.all_matrices, self.dp_group, self.tp_group)
        chosen = [top_columns(v, self.cfg.zenflow_topk_ratio).cpu() for v in full]
        if self.selected_all:
            kept = sum(int(torch.isin(new, old).sum())
                       for new, old in zip(chosen, self.selected_all))
            self.retention = kept / max(1, sum(v.numel() for v in chosen))
        self.selected_ratio = (sum(v.numel() for v in chosen)
                               / max(1, sum(m.full_cols for m in self.all_matrices)))
        self.selected_all = chosen
        old_plans = (self.gpu_plan, self.cpu_plan)
        self._set_selection({m.shard: chosen[m.key] for m in self.matrices})
        if first:
            self._build_states()
        else:
            self._move_states(*old_plans)

    def _set_selection(self, selected: Dict[int, torch.Tensor]) -> None:
        self.selected = selected
        masks = {m.shard: local_mask(selected[m.shard], m) for m in self.matrices}
        self.gpu_plan, self.cpu_plan = build_plans(self.shards, self.matrices, masks, self.device)
        if self.is_cuda:
            self._ensure_staging()

    def _ensure_staging(self) -> None:
        """Pinned staging for the delayed grads and the device buffer for the new weights.

        Staging: every slot, for the plan in force. The device buffer receives the CPU
        update's weights (2 bytes per delayed element in bf16: 2.3 GB on the 1.28B
        reference GPT at k=0.1). All at once, when a selection is made: pinning gigabytes
        takes a second or more, which a slot's first use would otherwise add to a training
        step. A buffer is replaced (with 1% headroom: re-selection changes the sizes a
        little) only when a group outgrows it.
        """
        from megatron_ext.offload.io import aligned_empty

        for group, n in self.cpu_plan.sizes.items():
            buf = self._upload_dev.get(group)
            if buf is None or buf.numel() < n:
                self._upload_dev[group] = torch.empty(int(n * 1.01) + 1, dtype=self.model_dtype,
                                                      device=self.device)
        if self.place != "host":  # device accumulation needs no staging (undecided: later)
            return
        size = torch.empty((), dtype=self.grad_dtype).element_size()
        for stage in self._stage:
            for group, n in self.cpu_plan.sizes.items():
                buf = stage.get(group)
                if buf is None or buf.numel() < n:
                    stage[group] = aligned_empty((int(n * 1.01) + 1) * size, self.grad_dtype,
                                                 pin=True)

    def _build_states(self) -> None:
        """fp32 masters from the model weights, zero moments (megatron-core's start)."""
        for group, n in self.gpu_plan.sizes.items():
            master = self.gpu_plan.gather(group, self._weights, torch.empty(
                n, dtype=torch.float32, device=self.device))
            self.gpu["master"][group] = master
            self.gpu["exp_avg"][group] = torch.zeros_like(master)
            self.gpu["exp_avg_sq"][group] = torch.zeros_like(master)
        self.cpu.resize(self.cpu_plan.sizes)
        self._masters_to_cpu()

    def _masters_to_cpu(self) -> None:
        self.cpu.set_masters({
            group: self.cpu_plan.gather(group, self._weights, torch.empty(
                n, dtype=self.model_dtype, device=self.device)).cpu()
            for group, n in self.cpu_plan.sizes.items()})

    def _move_states(self, old_gpu: Plan, old_cpu: Plan) -> None:
        """Moves every state element to its side under the new plans, one kind at a time."""
        if isinstance(self.cpu, TieredCpuSide):
            self._move_states_tiered(old_gpu, old_cpu)
            return
        groups = sorted({s.group for s in self.shards})
        new_cpu_sizes = dict(self.cpu_plan.sizes)
        cpu_new: Dict[str, Dict[int, torch.Tensor]] = {}
        for kind in KINDS:
            cpu_old = getattr(self.cpu, kind)
            gpu_new, cpu_new[kind] = {}, {}
            for group in groups:
                full = {i: torch.empty(s.numel, dtype=torch.float32)
                        for i, s in enumerate(self.shards) if s.group == group}
                if group in self.gpu[kind]:
                    old_gpu.scatter(group, self.gpu[kind][group].cpu(), full.__getitem__)
                if group in cpu_old:
                    old_cpu.scatter(group, cpu_old[group], full.__getitem__)
                if group in self.gpu_plan.sizes:
                    gpu_new[group] = self.gpu_plan.gather(group, full.__getitem__, torch.empty(
                        self.gpu_plan.sizes[group], dtype=torch.float32)).to(self.device)
                if group in new_cpu_sizes:
                    cpu_new[kind][group] = self.cpu_plan.gather(group, full.__getitem__,
                                                                torch.empty(new_cpu_sizes[group]))
                del full
            self.gpu[kind] = gpu_new
            cpu_old.clear()
        self.cpu.replace_states(new_cpu_sizes, cpu_new)

    def _move_states_tiered(self, old_gpu: Plan, old_cpu: Plan) -> None:
        """The move with the CPU side's states in the offload engine.

        One matrix segment (or 1-D parameter) at a time, its three states are assembled
        from the old GPU buffers and the old engine, then cut by the new plans into the new
        GPU buffers and a new engine. Nothing of the size of the CPU side's states is held
        in host memory.
        """
        def units(plan: Plan) -> Dict[tuple, tuple]:
            return {(p.shard, None if p.segment is None else p.segment.offset): (g, p)
                    for g, pieces in plan.pieces.items() for p in pieces}

        old_g, old_c = units(old_gpu), units(old_cpu)
        last: Dict[str, object] = {"key": None, "states": None}

        def assemble(key: tuple) -> List[torch.Tensor]:
            """The unit's master, exp_avg and exp_avg_sq, fp32, on the host.

            ``[rows, width]`` for a matrix segment, flat for a 1-D parameter.
            """
            if last["key"] == key:
                return last["states"]
            sources = [(side, unit) for side, unit in (("gpu", old_g.get(key)),
                                                        ("cpu", old_c.get(key)))
                       if unit is not None]
            first = sources[0][1][1]
            seg = first.segment
            shape = (first.length,) if seg is None else (seg.rows, seg.width)
            states = [torch.empty(shape, dtype=torch.float32) for _ in KINDS]
            for side, (group, piece) in sources:
                if side == "gpu":
                    parts = [self.gpu[kind][group][piece.offset:piece.offset + piece.length]
                             .cpu() for kind in KINDS]
                else:
                    parts = [torch.empty(piece.length) for _ in KINDS]
                    self.cpu.read_states(group, piece.offset, piece.length, parts)
                for state, part in zip(states, parts):
                    if seg is None:
                        state.copy_(part)
                    else:
                        state.index_copy_(1, piece.index_on(torch.device("cpu")),
                                          part.view(seg.rows, -1))
            last["key"], last["states"] = key, states
            return states

        def cut(piece, state: torch.Tensor) -> torch.Tensor:
            if piece.segment is None:
                return state
            return state.index_select(1, piece.index_on(torch.device("cpu"))).reshape(-1)

        gpu_new = {kind: {g: torch.empty(n, dtype=torch.float32, device=self.device)
                          for g, n in self.gpu_plan.sizes.items()} for kind in KINDS}
        for key, (group, piece) in units(self.gpu_plan).items():
            for kind, state in zip(KINDS, assemble(key)):
                gpu_new[kind][group][piece.offset:piece.offset + piece.length].copy_(
                    cut(piece, state))
        new_cpu = {g: [(p.offset, p) for p in pieces] for g, pieces in self.cpu_plan.pieces.items()}

        def fill(group: int, start: int, length: int, views: List[torch.Tensor]) -> None:
            for offset, piece in new_cpu.get(group, ()):
                lo, hi = max(start, offset), min(start + length, offset + piece.length)
                if lo >= hi:
                    continue
                key = (piece.shard, piece.segment.offset)
                for view, state in zip(views, assemble(key)):
                    view[lo - start:hi - start].copy_(cut(piece, state)[lo - offset:hi - offset])

        self.cpu.reselect(dict(self.cpu_plan.sizes), fill)
        self.gpu = gpu_new

    # ------------------------------------------------------------ model and checkpoints

    def reload_masters(self) -> None:
        """fp32 masters from the model weights (moments kept); before the first step: none."""
        if not self.initialized:
            return
        for group, n in self.gpu_plan.sizes.items():
            self.gpu_plan.gather(group, self._weights, self.gpu["master"][group])
        self._masters_to_cpu()

    def write_all_params(self) -> None:
        """Every fp32 master into the model."""
        if not self.initialized:
            return
        for group in self.gpu_plan.sizes:
            self.gpu_plan.scatter(group, self.gpu["master"][group], self._weights)
        self.cpu.masters_to_upload()
        for group in self.cpu_plan.sizes:
            values = self.cpu.upload[group].to(self.device)
            self.cpu_plan.scatter(group, values, self._weights)

    def state_dict(self) -> dict:
        """Everything per element, on the host (waits for the CPU worker, applies nothing)."""
        self.cpu.wait_accumulate()
        self.cpu.wait_update()
        state = {"format": FORMAT, "schedule": self.schedule.state_dict(),
                 "initialized": self.initialized}
        if not self.initialized:
            return state
        # The open window's partial sum in the host's layout (whichever place holds it):
        # a run may resume with the other place and continue the same sum.
        acc = [dict(a) for a in self.cpu.acc]
        acc_steps = list(self.cpu.acc_steps)
        if self.place == "device" and self.dev.steps:
            buffer = self.schedule.buffer
            acc[buffer], acc_steps[buffer] = self.dev.partial(), self.dev.steps
        state.update({
            "selected": self.selected,
            "selected_all": self.selected_all,
            "gpu_steps": self.gpu_steps,
            "cpu_steps": self.cpu.steps,
            "gpu": {k: {g: t.cpu() for g, t in v.items()} for k, v in self.gpu.items()},
            "cpu": {k: dict(v) for k, v in self.cpu.states().items()},
            "acc": acc,
            "acc_steps": acc_steps,
            "upload_pending": self.upload_pending,
            "selected_ratio": self.selected_ratio,
            "retention": self.retention,
        })
        return state

    def load_state_dict(self, state: dict, load_cpu_states: Optional[Callable] = None) -> None:
        """Restores :meth:`state_dict` (same layout).

        ``load_cpu_states`` restores the CPU side's states kept elsewhere (the offload
        engine's files), after the side has been rebuilt for the saved selection.
        """
        self.schedule.load_state_dict(state["schedule"])
        if not state["initialized"]:
            return
        self._set_selection(state["selected"])
        self.selected_all = state["selected_all"]
        self.gpu_steps = state["gpu_steps"]
        self.gpu = {k: {g: t.to(self.device, copy=True) for g, t in v.items()}
                    for k, v in state["gpu"].items()}
        self.cpu.resize(self.cpu_plan.sizes)
        self.cpu.steps = state["cpu_steps"]
        for kind, saved in state["cpu"].items():
            for group, tensor in saved.items():
                getattr(self.cpu, kind)[group].copy_(tensor)
        if load_cpu_states is not None:
            load_cpu_states()
        for mine, saved in zip(self.cpu.acc, state["acc"]):
            for group, tensor in saved.items():
                mine[group].copy_(tensor)
        self.cpu.acc_steps = list(state["acc_steps"])
        if self.place == "device":  # decided already (a load after steps of this process)
            self.dev.steps = 0
            self.dev.resize(self.cpu_plan.sizes)
            self._adopt_host_partial()
        self.upload_pending = state["upload_pending"]
        if self.upload_pending:
            self.cpu.masters_to_upload()
        self.selected_ratio = state["selected_ratio"]
        self.retention = state["retention"]

    # ------------------------------------------------------------ metrics

    def device_state_bytes(self) -> int:
        """fp32 states held on the model's device (selected columns, 1-D parameters)."""
        return sum(t.numel() * t.element_size() for v in self.gpu.values() for t in v.values())

    def host_state_bytes(self) -> int:
        """fp32 states and accumulators in host memory."""
        return self.cpu.host_bytes()

    def metrics(self) -> Dict[str, float]:
        """``zenflow/*`` per-step means since the last call.

        Besides the earlier names: ``stall_share`` (the loop's waits for the CPU side over
        the wall time since the last call), ``host_thread_s`` (the CPU side's threads'
        time per step: accumulation and Adam), ``pcie_bytes`` (D2H + H2D per step),
        ``d2h_copies`` (copies of delayed grads to the host per step: 1 with host
        accumulation, 1 per window with device accumulation), ``accumulate_on_device``
        (1: device accumulation, 0: host), ``device_acc_gib`` (its device memory) and
        ``grad_bytes`` (bytes per gradient element: 2 for bf16 grads, 4 for fp32).
        """
        steps = max(1, self._stats["steps"])
        wall = time.perf_counter() - self._stats["since"]
        with self.cpu.lock:
            busy = dict(self.cpu.busy)
        record = {
            "zenflow/selected_ratio": self.selected_ratio,
            "zenflow/rho": self._rho_sum() / steps,
            "zenflow/retention": self.retention,
            "zenflow/update_interval": float(self.schedule.window_length),
            "zenflow/stall_s": self._stats["stall_s"] / steps,
            "zenflow/gpu_update_s": self._stats["gpu_update_s"] / steps,
            "zenflow/cpu_update_bg_s": busy["update"] / steps,
            "zenflow/cpu_accumulate_bg_s": busy["accumulate"] / steps,
            "zenflow/d2h_bytes": self._stats["d2h_bytes"] / steps,
            "zenflow/h2d_bytes": self._stats["h2d_bytes"] / steps,
            "zenflow/uploads_ready": float(self._stats["uploads_ready"]),
            "zenflow/device_state_gib": self.device_state_bytes() / 2**30,
            "zenflow/host_state_gib": self.host_state_bytes() / 2**30,
            "zenflow/stall_share": self._stats["stall_s"] / wall if wall > 0 else 0.0,
            "zenflow/host_thread_s": (busy["accumulate"] + busy["update"]) / steps,
            "zenflow/pcie_bytes": (self._stats["d2h_bytes"] + self._stats["h2d_bytes"]) / steps,
            "zenflow/d2h_copies": self._stats["d2h_copies"] / steps,
            "zenflow/accumulate_on_device": float(self.place == "device"),
            "zenflow/device_acc_gib": self.dev.nbytes() / 2**30,
            "zenflow/grad_bytes": float(torch.empty((), dtype=self.grad_dtype).element_size()),
        }
        record.update(self.cpu.metrics())
        self._reset_stats()
        return record

    def close(self) -> None:
        """Stops the CPU worker's threads."""
        self.cpu.close()


class ZenFlowOptimizer(ShardedStateOptimizer):
    """megatron-core's DistributedOptimizer running ZenFlow's selective updates."""

    state_prefix = "zenflow"

    def __init__(self, *args, zenflow_config: ZenFlowConfig, rank: int, offload=None, **kwargs):
        super().__init__(*args, **kwargs)
        from megatron.core import parallel_state

        self.rank = rank
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        make_cpu_engine = None
        if offload is not None:
            offload_config, run_id, tiers = offload

            def make_cpu_engine(params, generation=0):
                from megatron_ext.offload.engine import OffloadEngine

                # Each re-selection's engine in its own directory: the next one is filled
                # from the previous one's files.
                engine = OffloadEngine(offload_config, params, rank=rank,
                                       device=torch.device("cpu"), tiers=tiers,
                                       run_id=run_id if not generation else
                                       f"{run_id}.selection{generation}",
                                       model_dtype=self.model_dtype, grad_dtype=torch.float32)
                # On GPU machines the CPU side takes torch's fused CPU Adam (see
                # cpu_worker.adam_update); on a CPU-only run, the reference implementation.
                engine.fused_adam = self.device.type == "cuda"
                return engine
        self.engine = ZenFlowEngine(
            zenflow_config, self.shards, device=self.device, model_dtype=self.model_dtype,
            grad_dtype=self.grad_dtype, dp_group=self.data_parallel_group,
            tp_group=parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None,
            stats_group=self.get_grad_stats_parallel_group(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(), tp_size=tp_size,
            all_params=[p for chunk in self.model_chunks for p in chunk.parameters()
                        if p.requires_grad],
            make_cpu_engine=make_cpu_engine)

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
        cpu_engine = getattr(self.engine.cpu, "engine", None)
        if cpu_engine is not None:
            cpu_engine.save(self._offload_dir(checkpoint_dir), self.layout())

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
            cpu_engine = getattr(self.engine.cpu, "engine", None)
            if cpu_engine is not None:
                cpu_engine.load(self._offload_dir(checkpoint_dir), self.layout())
        self.engine.load_state_dict(state, load_cpu_states)

    def metrics(self) -> Dict[str, float]:
        """The engine's ``zenflow/*`` metrics since the last call."""
        return self.engine.metrics()

    def close(self) -> None:
        """Stops the CPU worker."""
        self.engine.close()


def zenflow_optimizer(cfg: ZenFlowConfig, rank: int, offload_config=None):
    """Within the block, megatron-core's optimizer factory builds the ZenFlow optimizer.

    With ``offload_config`` (``--offload-optimizer``), the CPU side keeps its states in
    the offload engine's host cache and tier paths.
    """
    offload = None
    if offload_config is not None and offload_config.offload_optimizer:
        from megatron_ext.offload.optimizer import offload_setup

        offload = (offload_config, *offload_setup(offload_config, rank))
    return bound_distributed_optimizer(ZenFlowOptimizer, zenflow_config=cfg, rank=rank,
                                       offload=offload)
