"""ZenFlow's engine over a rank's optimizer shard: its step, as named phases.

Each step (see ``schedule`` for when steps are synchronous, windows close and columns are
re-selected):

1. GPU side (:meth:`ZenFlowEngine._gpu_update`): the gradients of every parameter that is
   not a matrix and of the selected columns of each matrix are gathered (compacted per
   param group), unscaled and clipped like megatron-core's, and Adam updates their fp32
   masters and moments, which live on the model's device; the new weights are scattered
   into the model.
2. CPU side (``transfers.DelayedGrads``): the delayed columns' gradients are gathered in
   the training dtype and summed in fp32 over the window (``accumulation``): on the
   model's device, whose window mean goes to the host once at the window's end
   (``--zenflow-accumulate device``), or on the host, each step's grads copied to pinned
   host memory on a side stream and added into the open window's accumulator by the CPU
   worker's accumulate thread (``host``); auto picks at the first step from the device's
   free memory.
3. At the last step of a window (:meth:`ZenFlowEngine._close_window`): wait for the
   previous window's CPU update, copy its new weights into the model (``transfers.Uploads``),
   and start the CPU update of this window (Adam with the mean of the window's gradients)
   on the worker's update thread; the GPU trains on. Synchronous (warm-up) steps run the
   CPU update inside the step instead.
4. Re-selection (at a synchronous step or a window end): the pending CPU update is
   finished and applied first, then the states of the columns that change sides move
   between the GPU and the CPU side (``moves``); no moment is lost or duplicated.

Adam's bias correction counts each side's own steps (the GPU side steps every
iteration, the CPU side once per window); a column that changes sides continues with
its moments under the other side's count. The CPU side's states are kept by a
:class:`~.cpu_states.CpuStates` (host memory by default, or the offload tiers).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.profiler import record_function

from megatron_ext.optim.adamw import adam_update, unscale_and_clip
from megatron_ext.zenflow.accumulation import (
    DeviceAccumulator,
    choose_place,
    measured_free_memory,
)
from megatron_ext.zenflow.config import CPUS_ENV, ZenFlowConfig
from megatron_ext.zenflow.cpu_affinity import cpu_ranges
from megatron_ext.zenflow.cpu_states import CpuStates, HostCpuStates
from megatron_ext.zenflow.cpu_worker import CpuWorker
from megatron_ext.zenflow.metrics import EngineStats
from megatron_ext.zenflow.moves import KINDS, move_states
from megatron_ext.zenflow.schedule import StepPlan, WindowSchedule, adam_floor
from megatron_ext.zenflow.selection import (
    Plan,
    build_plans,
    column_energy,
    global_importance,
    local_mask,
    matrices_of,
    top_columns,
)
from megatron_ext.zenflow.transfers import DelayedGrads, Uploads

FORMAT = 1

log = logging.getLogger(__name__)


class ZenFlowEngine:
    """ZenFlow's state and step over a rank's optimizer shard (megatron-independent)."""

    def __init__(self, cfg: ZenFlowConfig, shards: Sequence, *, device: torch.device,
                 model_dtype: torch.dtype, grad_dtype: torch.dtype, dp_group=None,
                 tp_group=None, stats_group=None, tp_rank: int = 0, tp_size: int = 1,
                 all_params: Optional[Sequence[torch.Tensor]] = None,
                 cpu_states: Optional[CpuStates] = None,
                 free_memory: Optional[Callable[[], tuple]] = None):
        """The engine over ``shards``.

        ``cpu_states``: where the CPU side keeps its fp32 masters and moments (default: in
        host memory, :class:`~.cpu_states.HostCpuStates`). ``free_memory()``: (free, total)
        bytes of the model's device for the auto accumulation place, measured at the first
        step (default :func:`~megatron_ext.zenflow.accumulation.measured_free_memory`,
        which takes the config's test hook; a test injects a limit).
        """
        self.cfg = cfg
        self.shards = list(shards)
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.model_dtype, self.grad_dtype = model_dtype, grad_dtype
        self.dp_group, self.tp_group, self.stats_group = dp_group, tp_group, stats_group
        self.all_matrices, self.matrices = matrices_of(self.shards, tp_rank, tp_size, all_params)
        self.schedule = WindowSchedule(cfg)
        self.gpu_plan: Optional[Plan] = None
        self.cpu_plan: Optional[Plan] = None
        self.gpu: Dict[str, Dict[int, torch.Tensor]] = {k: {} for k in KINDS}
        self.gpu_steps = 0
        self.states = cpu_states if cpu_states is not None else HostCpuStates(fused=self.is_cuda)
        """The CPU side's fp32 masters and moments (the worker's, through the interface)."""
        self.cpu = CpuWorker({}, model_dtype, pin=self.is_cuda, states=self.states, knobs=cfg)
        self.selected: Dict[int, torch.Tensor] = {}
        """Matrix shard index -> whole-matrix selected columns (CPU, ascending)."""
        self.selected_all: List[torch.Tensor] = []
        """The same for every 2-D weight of the model (identical on all ranks)."""
        self.upload_pending = False
        """A finished or running CPU update whose weights have not entered the model yet."""
        self.selected_ratio = 0.0
        self.retention = float("nan")
        self.stats = EngineStats()
        slots = cfg.zenflow_staging_slots
        # The accumulate thread adds up to slots - 1 steps in one pass (each pass reads and
        # writes the fp32 accumulator once), keeping a slot free for the loop's next step.
        self.cpu.batch_steps = max(1, slots - 1)
        d2h = torch.cuda.Stream(device) if self.is_cuda else None
        self.place: Optional[str] = None
        """Where the delayed grads are summed, "device" or "host" (decided at the first
        step of the process: :meth:`_decide_place`)."""
        self.place_reason = ""
        self._free_memory = free_memory or (lambda: measured_free_memory(
            self.device, cfg.zenflow_device_free_bytes))
        self.dev = DeviceAccumulator(device, stream=d2h)
        # Matrices whose delayed energy counts in rho (not TP duplicates): fixed for the run.
        counted = {m.shard for m in self.matrices if m.counts}
        self.delayed = DelayedGrads(self.shards, counted, device=device, grad_dtype=grad_dtype,
                                    stats_group=stats_group, worker=self.cpu, dev=self.dev,
                                    stats=self.stats, slots=slots, stream=d2h)
        self.uploads = Uploads(device, model_dtype, self.cpu, lambda: self.cpu_plan.sizes,
                               self.stats)
        # The auto interval's lower bound: the time per step (its stalls left out) over the
        # window that is open, measured between the starts of consecutive steps.
        self._last_start: Optional[float] = None
        self._window_time = [0.0, 0]
        self._reset_stats()

    # ------------------------------------------------------------ helpers

    def _grad(self, index: int) -> torch.Tensor:
        return self.shards[index].grad().reshape(-1)

    def _weights(self, index: int) -> torch.Tensor:
        return self.shards[index].weights().reshape(-1)

    def _reset_stats(self) -> None:
        self.stats.reset()
        with self.cpu.lock:
            self.cpu.busy = {k: 0.0 for k in self.cpu.busy}

    @property
    def initialized(self) -> bool:
        """States exist (after the first step or a load)."""
        return self.gpu_plan is not None

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, hparams: List[dict], inv_scale, clip_coeff) -> None:
        """One optimizer step with the gradients in the shards' grad buffers."""
        self._time_step()
        plan = self.schedule.next_step()
        if not self.initialized:
            self._select(first=True)
        if self.place is None:
            self._decide_place()
        self._gpu_update(hparams, inv_scale, clip_coeff)
        with record_function("zenflow/send_delayed_grads"):
            rho = self.delayed.send(self.cpu_plan, self.place, self.schedule.buffer,
                                    inv_scale, clip_coeff,
                                    last=plan.sync or plan.closes_window,
                                    need_rho=self.cfg.fixed_interval is None)
        self._close_window(plan, hparams)
        # With a fixed interval rho is only a metric: it stays on the device (no sync here).
        floor = self._window_floor() if plan.closes_window and \
            self.cfg.fixed_interval is None else 1
        self.schedule.end_step(plan, rho if isinstance(rho, float) else 0.0, floor=floor)
        if plan.select and plan.step > 1:
            self._select(first=False)
            if self.place == "device":
                self.dev.resize(self.cpu_plan.sizes)
        self.stats.counts["steps"] += 1

    def _time_step(self) -> None:
        """The previous step's interval, its waits left out, into the open window's time."""
        start = time.perf_counter()
        if self._last_start is not None:
            self._window_time[0] += start - self._last_start - self.stats.step_stall
            self._window_time[1] += 1
        self._last_start, self.stats.step_stall = start, 0.0

    def _gpu_update(self, hparams: List[dict], inv_scale, clip_coeff) -> None:
        """Adam on the GPU side's columns; their new weights into the model."""
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
        self.stats.counts["gpu_update_s"] += time.perf_counter() - start

    def _close_window(self, plan: StepPlan, hparams: List[dict]) -> None:
        """At a synchronous step or a window's end: the CPU update of the window."""
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

    def _flush_pending(self) -> None:
        """Waits for the CPU update in flight and copies its weights into the model."""
        if not self.upload_pending:
            return
        with record_function("zenflow/flush_pending"):
            self.stats.wait(self.cpu.wait_update)
            self.uploads.apply(self.cpu_plan, self._weights)
            self.upload_pending = False

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
        cpus = self.cpu.cpus
        allowed = os.sched_getaffinity(0)
        log.info("ZenFlow's CPU-side threads run on %s (%s)",
                 f"CPUs {cpu_ranges(cpus)}, the training loop keeps {cpu_ranges(allowed - cpus)}"
                 if cpus else f"all {len(allowed)} CPUs of this process", CPUS_ENV)
        if self.place == "device":
            self.cpu.share_accumulators()
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
            self.gpu = move_states(self.gpu, *old_plans, self.gpu_plan, self.cpu_plan,
                                   self.shards, self.cpu, self.device)

    def _set_selection(self, selected: Dict[int, torch.Tensor]) -> None:
        self.selected = selected
        masks = {m.shard: local_mask(selected[m.shard], m) for m in self.matrices}
        self.gpu_plan, self.cpu_plan = build_plans(self.shards, self.matrices, masks, self.device)
        if self.is_cuda:
            self._ensure_staging()

    def _ensure_staging(self) -> None:
        """Buffers for the plan in force: the new weights' on the device, the staging.

        The pinned staging of the delayed grads only with host accumulation (undecided:
        later, at :meth:`_decide_place`).
        """
        self.uploads.ensure(self.cpu_plan.sizes)
        if self.place != "host":  # device accumulation needs no staging (undecided: later)
            return
        self.delayed.ensure_staging(self.cpu_plan.sizes)

    def _build_states(self) -> None:
        """fp32 masters from the model weights, zero moments (megatron-core's start)."""
        for group, n in self.gpu_plan.sizes.items():
            master = self.gpu_plan.gather(group, self._weights, torch.empty(
                n, dtype=torch.float32, device=self.device))
            self.gpu["master"][group] = master
            self.gpu["exp_avg"][group] = torch.zeros_like(master)
            self.gpu["exp_avg_sq"][group] = torch.zeros_like(master)
        # The place first: the host accumulators are then allocated once, the way the
        # place keeps them (one shared page-locked buffer on the device's way), not as two
        # zero buffers that pinning then copies (Llama-3-8B: 87 GB of accumulators at once,
        # bench/results/2026-12-03c-h200 call2).
        if self.place is None:
            self._decide_place()
        self.cpu.resize(self.cpu_plan.sizes)
        self._masters_to_cpu()

    def _masters_to_cpu(self) -> None:
        # The weights stay on the model's device: the CPU side's states copy them a piece
        # at a time (the offload engine's fill), so no host copy of every delayed column's
        # weight exists beside the states being filled.
        self.cpu.set_masters({
            group: self.cpu_plan.gather(group, self._weights, torch.empty(
                n, dtype=self.model_dtype, device=self.device))
            for group, n in self.cpu_plan.sizes.items()})

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
            "cpu_steps": self.states.steps,
            "gpu": {k: {g: t.cpu() for g, t in v.items()} for k, v in self.gpu.items()},
            "cpu": self.states.state_dict(),
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
        engine's files: :meth:`CpuStates.load`), after the side has been rebuilt for the
        saved selection.
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
        self.states.steps = state["cpu_steps"]
        self.states.load_state_dict(state["cpu"])
        if load_cpu_states is not None:
            load_cpu_states()
        # The accumulator of a partial window last: with one shared buffer (device
        # accumulation) its sum is the one kept.
        for index in sorted(range(len(self.cpu.acc)), key=lambda i: bool(state["acc_steps"][i])):
            for group, tensor in state["acc"][index].items():
                self.cpu.acc[index][group].copy_(tensor)
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
        counts = self.stats.counts
        steps = max(1, counts["steps"])
        wall = time.perf_counter() - counts["since"]
        with self.cpu.lock:
            busy = dict(self.cpu.busy)
        record = {
            "zenflow/selected_ratio": self.selected_ratio,
            "zenflow/rho": self.stats.rho_sum() / steps,
            "zenflow/retention": self.retention,
            "zenflow/update_interval": float(self.schedule.window_length),
            "zenflow/stall_s": counts["stall_s"] / steps,
            "zenflow/gpu_update_s": counts["gpu_update_s"] / steps,
            "zenflow/cpu_update_bg_s": busy["update"] / steps,
            "zenflow/cpu_accumulate_bg_s": busy["accumulate"] / steps,
            "zenflow/d2h_bytes": counts["d2h_bytes"] / steps,
            "zenflow/h2d_bytes": counts["h2d_bytes"] / steps,
            "zenflow/uploads_ready": float(counts["uploads_ready"]),
            "zenflow/device_state_gib": self.device_state_bytes() / 2**30,
            "zenflow/host_state_gib": self.host_state_bytes() / 2**30,
            "zenflow/stall_share": counts["stall_s"] / wall if wall > 0 else 0.0,
            "zenflow/host_thread_s": (busy["accumulate"] + busy["update"]) / steps,
            "zenflow/pcie_bytes": (counts["d2h_bytes"] + counts["h2d_bytes"]) / steps,
            "zenflow/d2h_copies": counts["d2h_copies"] / steps,
            "zenflow/accumulate_on_device": float(self.place == "device"),
            "zenflow/device_acc_gib": self.dev.nbytes() / 2**30,
            "zenflow/grad_bytes": float(torch.empty((), dtype=self.grad_dtype).element_size()),
        }
        record.update(self.cpu.metrics())
        self._reset_stats()
        return record

    def close(self) -> None:
        """Stops the CPU worker's threads and closes the CPU side's states."""
        self.cpu.close()
