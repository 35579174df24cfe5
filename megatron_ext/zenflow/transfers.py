"""ZenFlow's traffic between the model's device and the CPU side.

:class:`DelayedGrads`: each step's delayed columns' grads, their share of the gradient
energy (rho), and their way to the window's sum: added into the device accumulator (whose
window mean goes to the host once at the window's end), or copied into pinned staging on
the D2H stream and queued for the CPU worker's accumulate thread.
:class:`Uploads`: the CPU update's new weights on their way into the model: from the
host upload buffers to a device buffer on the H2D stream (started by the update thread
as soon as the update has finished), scattered into the model at the window's boundary.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_ext.zenflow.accumulation import DeviceAccumulator
from megatron_ext.zenflow.cpu_worker import CpuWorker
from megatron_ext.zenflow.metrics import EngineStats
from megatron_ext.zenflow.selection import Plan


def energy(tensors: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all elements (fp64, 0-dim, on ``device``).

    One multi-tensor norm (fp32 accumulation per tensor, one pass over the training-dtype
    grads, no fp32 copy), squared and summed in fp64: rho is a ratio of two of these.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum()


class DelayedGrads:
    """Sends each step's delayed grads to the window's sum; measures rho on the way.

    With host accumulation on a GPU, the grads wait in pinned staging: ``slots`` steps'
    worth, so that the training loop waits only when the accumulate thread is that many
    steps behind (it falls behind while the CPU Adam of a window shares memory bandwidth
    with it).
    """

    def __init__(self, shards: Sequence, counted: set, *, device: torch.device,
                 grad_dtype: torch.dtype, stats_group, worker: CpuWorker,
                 dev: DeviceAccumulator, stats: EngineStats, slots: int, stream=None):
        self.shards = shards
        self._counted = counted
        """Shards whose delayed energy counts in rho (not TP duplicates)."""
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.grad_dtype = grad_dtype
        self.stats_group = stats_group
        self.cpu = worker
        self.dev = dev
        self.stats = stats
        self._slots = slots
        self._stage: List[Dict[int, torch.Tensor]] = [{} for _ in range(slots)]
        self._stage_free: List[Optional[object]] = [None] * slots
        self._slot = 0
        self._d2h = stream
        """The D2H stream (on a CUDA device)."""

    def _grad(self, index: int) -> torch.Tensor:
        return self.shards[index].grad().reshape(-1)

    def send(self, plan: Plan, place: str, buffer: int, inv_scale, clip_coeff, last: bool,
             need_rho: bool = True):
        """Gathers the delayed columns' grads, queues their accumulation; returns rho.

        ``plan``: the CPU plan in force; ``place``: the accumulation's ("device" or
        "host"); ``buffer``: the open window's accumulator. ``last``: the step closes its
        window (the accumulation leaves the mean). rho is a float with ``need_rho`` (the
        auto interval decides on it), else a 0-dim fp64 tensor on the model's device, read
        when the metrics are (no host-device sync per step).
        """
        total_energy = energy([s.grad() for s in self.shards if s.counts_in_norm and s.numel],
                              self.device)
        on_device = place == "device"
        if not on_device:
            slot = self._slot
            self._slot = (slot + 1) % self._slots
            if self._stage_free[slot] is not None:  # the accumulation that used this slot
                self.stats.wait(self._stage_free[slot].result)
        grads, counted = {}, []
        for group, n in plan.sizes.items():
            compact = plan.gather(group, self._grad, torch.empty(
                n, dtype=self.grad_dtype, device=self.device))
            pieces = plan.pieces[group]
            if all(piece.shard in self._counted for piece in pieces):
                counted.append(compact)
            else:
                counted += [compact[p.offset:p.offset + p.length] for p in pieces
                            if p.shard in self._counted]
            grads[group] = compact
        delayed_energy = energy(counted, self.device)
        energies = torch.stack([delayed_energy, total_energy])
        if self.stats_group is not None and torch.distributed.get_world_size(self.stats_group) > 1:
            torch.distributed.all_reduce(energies, group=self.stats_group)
        if need_rho:
            delayed, total = energies.tolist()
            rho = delayed / total if total > 0 else 0.0
        else:
            delayed, total = energies.unbind()
            rho = torch.where(total > 0, delayed / total, torch.zeros_like(total))
        self.stats.add_rho(rho)
        counts = self.stats.counts
        if on_device:
            self.dev.add(grads, inv_scale, clip_coeff)
            if last:
                if self.cpu.shared_acc:  # the previous window's update reads the buffer
                    self.stats.wait(self.cpu.wait_update)
                steps, ready = self.dev.drain(self.cpu.acc[buffer])
                counts["d2h_bytes"] += self.dev.nbytes()
                counts["d2h_copies"] += 1
                self.cpu.deposit(buffer, steps, ready)
            return rho
        # Every read from the GPU of this step is above: the D2H queued below is served
        # before any later copy to the host (bench/gpu/copy_probe.py), so a read after it waits.
        ready = None
        if self.is_cuda and grads:
            grads, ready = self._to_host(slot, grads)
        counts["d2h_bytes"] += sum(g.numel() * g.element_size() for g in grads.values())
        counts["d2h_copies"] += 1 if grads else 0
        self._stage_free[slot] = self.cpu.accumulate(buffer, grads, inv_scale, clip_coeff,
                                                     ready=ready, last=last)
        return rho

    def _to_host(self, slot: int, grads: Dict[int, torch.Tensor]):
        """Copies the compact grads into pinned staging on the D2H stream.

        The staging is allocated by :meth:`ensure_staging` at each selection, for the sizes
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

    def ensure_staging(self, sizes: Dict[int, int]) -> None:
        """Pinned staging for the delayed grads: every slot, for the per-group ``sizes``.

        All at once, when a selection is made: pinning gigabytes takes a second or more,
        which a slot's first use would otherwise add to a training step. A buffer is
        replaced (with 1% headroom: re-selection changes the sizes a little) only when a
        group outgrows it.
        """
        from megatron_ext.offload.blockio import aligned_empty

        size = torch.empty((), dtype=self.grad_dtype).element_size()
        for stage in self._stage:
            for group, n in sizes.items():
                buf = stage.get(group)
                if buf is None or buf.numel() < n:
                    stage[group] = aligned_empty((int(n * 1.01) + 1) * size, self.grad_dtype,
                                                 pin=True)


class Uploads:
    """The CPU update's new weights into the model.

    On a CUDA device they go to the device on their own stream as soon as the update has
    finished (the update thread starts the copy: the worker's ``after_update``), into a
    device buffer from which the window's boundary scatters them: the boundary step waits
    for no copy unless the update finished just before it. Elsewhere the boundary
    scatters the host upload buffers themselves.
    """

    def __init__(self, device: torch.device, model_dtype: torch.dtype, worker: CpuWorker,
                 sizes: Callable[[], Dict[int, int]], stats: EngineStats):
        """``sizes()``: the per-group sizes of the CPU plan in force (read at each copy)."""
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.model_dtype = model_dtype
        self.cpu = worker
        self._sizes = sizes
        self.stats = stats
        self._upload_dev: Dict[int, torch.Tensor] = {}
        self._upload_copy: Optional[object] = None
        """The event of the pending update's copy to ``_upload_dev``, once started."""
        self._last_copy: Optional[object] = None
        """The event of the last copy from the host upload buffers (they are rewritten only
        after it: the worker's ``upload_guard``)."""
        self._scattered: Optional[object] = None
        """The event of the last boundary's scatter from ``_upload_dev`` (the next copy into
        it waits for it)."""
        if self.is_cuda:
            self._h2d = torch.cuda.Stream(device)
            worker.upload_guard = self._wait_last_copy
            worker.after_update = self._start_upload_copy

    def apply(self, plan: Plan, weights: Callable[[int], torch.Tensor]) -> None:
        """Scatters the finished update's weights into the model.

        Into the CPU ``plan``'s columns of ``weights(shard)``.
        """
        counts = self.stats.counts
        if not self.is_cuda:
            for group in plan.sizes:
                values = self.cpu.upload[group]
                plan.scatter(group, values, weights)
                counts["h2d_bytes"] += values.numel() * values.element_size()
        else:
            if self._upload_copy is None:  # no update ran (weights set by a load)
                self._start_upload_copy()
            elif self._upload_copy.query():
                counts["uploads_ready"] += 1
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self._upload_copy)
            for group, n in plan.sizes.items():
                values = self._upload_dev[group][:n]
                plan.scatter(group, values, weights)
                counts["h2d_bytes"] += values.numel() * values.element_size()
            self._upload_copy = None
            self._scattered = stream.record_event()

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
            for group, n in self._sizes().items():
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

    def ensure(self, sizes: Dict[int, int]) -> None:
        """The device buffer for the new weights, for the per-group ``sizes``.

        It receives the CPU update's weights (2 bytes per delayed element in bf16: 2.3 GB
        on the 1.28B reference GPT at k=0.1); made when a selection is made, and replaced
        (with 1% headroom) only when a group outgrows it.
        """
        for group, n in sizes.items():
            buf = self._upload_dev.get(group)
            if buf is None or buf.numel() < n:
                self._upload_dev[group] = torch.empty(int(n * 1.01) + 1, dtype=self.model_dtype,
                                                      device=self.device)
