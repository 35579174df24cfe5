"""Who runs a subgroup's Adam step: the CPU, the device, or the device streaming host states.

Each updater has one ``update(index, buffer, args)``: subgroup ``index``'s state buffer
(a host buffer of the cache, or its device state) takes one AdamW step, and the new weights
go into the model's param buffer in the model's dtype.

* :class:`CpuUpdater`: gradients to the host, CPU Adam on the host buffer, weights back
  through a write-back (:mod:`.staging`). Its gradients come from a source chosen once, at
  construction (:func:`.staging.gradient_source`): delayed in-place conversion (the training dtype
  crosses to the host and becomes fp32 inside the subgroup's update) or fp32 first
  (``--no-offload-delayed-grad-conversion``: the whole shard's fp32 gradients before the
  update, through the tier files, as ZeRO-Infinity does).
* :class:`DeviceUpdater`: the device tier's states, updated where they are by the fused
  device Adam; the gradients never leave the device.
* :func:`stream_updater`: a host subgroup updated by the device: states up, fused Adam,
  states down (on CUDA, copies on their own streams, nothing waits for them).

One Adam (:class:`SubgroupAdam`) for every tier and updater, so that on a CPU run all of
them do the same arithmetic: bit for bit equal to megatron-core's optimizer.

With remainders (:mod:`.remainders`: the layout stores each fp32 master as 16 bits beside
the bf16 parameter) every updater hands the Adam the subgroup's current bf16 parameters
as well: it rebuilds the fp32 masters in a scratch, steps, and splits them again; the new
bf16 parameters are what the write-back sends (half the bytes of fp32 masters). The CPU
updater's parameters come with its gradients (on a CUDA model, D2H beside them, on the
same stream); the device's are gathered from the model where they are.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.offload.remainders import decode, encode, sign_bits
from megatron_ext.offload.staging import (
    GradSource,
    HostWriteBack,
    gather_grads,
    gather_params,
    scatter,
)
from megatron_ext.offload.states import StateLayout
from megatron_ext.offload.store import StepStats, SubgroupStore
from megatron_ext.offload.subgroups import Subgroup
from megatron_ext.optim import device_adam
from megatron_ext.optim.adamw import adam_update, unscale_and_clip

if TYPE_CHECKING:
    from megatron_ext.offload.subgroups import ShardParam


@dataclasses.dataclass
class StepArgs:
    """One optimizer step's inputs, the same for every subgroup."""

    step: int
    """The Adam step the states take (bias correction)."""
    hparams: Sequence[dict]
    """The optimizer's param groups (lr, betas, eps, weight_decay), by index."""
    inv_scale: Optional[torch.Tensor]
    """fp16 loss-scale inverse to unscale the gradients with, or None."""
    clip_coeff: Optional[float]
    """The gradient-clipping factor (< 1) or None."""
    device_inv_scale: Optional[torch.Tensor] = None
    """``inv_scale`` on the model's device (for the device's updates)."""


class SubgroupAdam:
    """A subgroup's AdamW step on its state buffer, host or device."""

    def __init__(self, subgroups: Sequence[Subgroup], layout: StateLayout, fused: bool):
        self.subgroups, self.layout = subgroups, layout
        self.fused = fused
        """Torch's fused kernel for host states (set on GPU machines, see adam_update)."""
        self.max_numel = max((sg.numel for sg in subgroups), default=0)
        self._masters: Dict[torch.device, torch.Tensor] = {}

    def master_scratch(self, device: torch.device) -> torch.Tensor:
        """The fp32 scratch where remainders become masters for the math (one per device)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        scratch = self._masters.get(device)
        if scratch is None:
            scratch = torch.empty(self.max_numel, dtype=torch.float32, device=device)
            self._masters[device] = scratch
        return scratch

    def __call__(self, index: int, buffer: torch.Tensor, grads: torch.Tensor, step: int,
                 hparams: Sequence[dict], params: Optional[torch.Tensor] = None,
                 params_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Subgroup ``index``'s Adam step on its state buffer (host or device).

        One function for every tier and updater, so that on a CPU run all of them do the
        same arithmetic (torch's reference AdamW, megatron-core's): bit for bit equal.
        States stored in fp16/bf16 are widened to fp32 for the math and rounded back.

        Args:
            index: the subgroup.
            buffer: its state buffer.
            grads: its fp32 gradients (unscaled and clipped), on the buffer's device.
            step: the Adam step the states take.
            hparams: the param groups' settings, by index.
            params: with remainders: the subgroup's current bf16 weights (contiguous, on
                the buffer's device); the masters are rebuilt from them.
            params_out: with remainders: where the new bf16 weights go (default: into
                ``params``).

        Returns:
            What the model's weights become: the fp32 masters (a view of the buffer), or
            with remainders the new bf16 weights.
        """
        sg = self.subgroups[index]
        states = self.layout.views(buffer, sg.numel)
        on_device = buffer.is_cuda
        if self.layout.remainders:
            rem, v_bits = states[0], sign_bits(states[2])
            master = decode(params, rem, v_bits,
                            self.master_scratch(buffer.device)[:sg.numel])
            states = [master, states[1], states[2]]
        for group, offset, length in sg.runs:
            span = slice(offset, offset + length)
            parts = [t[span] if t.dtype == torch.float32 else t[span].float() for t in states]
            if on_device:
                _device_adam(parts[0], grads[span], parts[1], parts[2], step, hparams[group])
            else:
                adam_update(parts[0], grads[span], parts[1], parts[2], step,
                            hparams[group], fused=self.fused)
            for state, part in zip(states, parts):
                if state.dtype != torch.float32:
                    state[span].copy_(part)
        if self.layout.remainders:
            return encode(states[0], rem, v_bits, params if params_out is None else params_out)
        return states[0]


def _device_adam(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, step: int, hp: dict) -> None:
    """Torch's fused CUDA AdamW in place, queued on the current stream without a host sync.

    Like :func:`megatron_ext.optim.adamw.adam_update` for CUDA tensors, but the step
    tensor is made on the device by a fill kernel: a host-to-device copy of it would wait
    for the stream and serialize the GPU's work with the CPU Adam running meanwhile.
    """
    if master.numel() == 0:
        return
    from torch.optim.adam import adam

    beta1, beta2 = hp["betas"]
    step_tensor = torch.full((), float(step - 1), dtype=torch.float32, device=master.device)
    adam([master], [grad], [exp_avg], [exp_avg_sq], [], [step_tensor], foreach=False,
         fused=True, capturable=False, differentiable=False, has_complex=False,
         amsgrad=False, beta1=beta1, beta2=beta2, lr=hp["lr"],
         weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False,
         decoupled_weight_decay=True)


# ---------------------------------------------------------------- updaters


class CpuUpdater:
    """CPU Adam on host buffers; the CPU-updated subgroups alternate two staging slots."""

    def __init__(self, subgroups: Sequence[Subgroup], grads: GradSource, adam: SubgroupAdam,
                 write_back: HostWriteBack, stats: StepStats):
        self.subgroups, self.grads, self.adam = subgroups, grads, adam
        self.write_back, self.stats = write_back, stats
        self._slot: Dict[int, int] = {}
        self._next: Dict[int, int] = {}
        self._elements, self._seconds = 0, 0.0

    def begin(self, order: Sequence[int], args: StepArgs) -> None:
        """A step starts; ``order``: the subgroups this updater updates, in order."""
        self._slot = {index: k % 2 for k, index in enumerate(order)}
        self._next = dict(zip(order, order[1:]))
        self.grads.begin(order, args.inv_scale, args.clip_coeff)

    def update(self, index: int, buffer: torch.Tensor, args: StepArgs) -> None:
        """Subgroup ``index``'s step on its host buffer; the weights go back to the model."""
        if index in self._next:
            self.grads.issue(self._next[index], self._slot[self._next[index]])
        slot = self._slot[index]
        t0 = time.perf_counter()
        grads = self.grads.fp32(index, slot, args.inv_scale, args.clip_coeff)
        params = self.grads.params_of(index, slot)
        t1 = time.perf_counter()
        target = self.write_back.target(index, slot) if params is not None else None
        master = self.adam(index, buffer, grads, args.step, args.hparams, params, target)
        t2 = time.perf_counter()
        self.write_back(index, master, slot)
        t3 = time.perf_counter()
        with self.stats.lock:
            self.stats.time["convert"] += t1 - t0
            self.stats.time["update"] += t2 - t1
            self.stats.time["writeback"] += t3 - t2
        self._elements += self.subgroups[index].numel
        self._seconds += t2 - t0

    def end(self) -> None:
        """The training stream waits for the weights; the step's gradients are let go."""
        self.write_back.finish()
        self.grads.end()

    def take_counts(self) -> Tuple[int, float]:
        """(elements, seconds) of CPU Adam since the last call."""
        counts = (self._elements, self._seconds)
        self._elements, self._seconds = 0, 0.0
        return counts


class DeviceUpdater:
    """The fused device Adam on a state buffer on the device (current stream).

    The gradients never leave the device; the new weights go straight into the model's
    buffer. With remainders the subgroup's weights are gathered from the model into a
    device scratch, the update rebuilds the masters from them and leaves the new weights
    there, and they are scattered back.
    """

    def __init__(self, params: Sequence["ShardParam"], subgroups: Sequence[Subgroup],
                 adam: SubgroupAdam, stats: StepStats, *, device: torch.device,
                 max_numel: int, allocate: bool, param_dtype: Optional[torch.dtype] = None):
        self.params, self.subgroups, self.adam, self.stats = params, subgroups, adam, stats
        self.device, self.max_numel = device, max_numel
        self.is_cuda = device.type == "cuda"
        self.param_dtype = param_dtype
        """With remainders, the model's dtype; None without."""
        layout = adam.layout
        self.one_pass = (layout.remainders and param_dtype == torch.bfloat16
                         and layout.exp_avg == torch.float32
                         and layout.exp_avg_sq == torch.float32 and device_adam.enabled(device))
        """The one-pass kernel (:mod:`megatron_ext.optim.device_adam`) instead of torch's
        passes: remainders of bf16 weights, fp32 moments, asked for and available."""
        # Allocated now (``allocate``) so that ``auto`` sizing measures it in the first peak.
        self._grad: Optional[torch.Tensor] = None
        self._param: Optional[torch.Tensor] = None
        if allocate:
            self._scratch()

    def _scratch(self) -> None:
        """The device scratches: fp32 gradients; with remainders, weights and masters."""
        if self._grad is None:
            self._grad = torch.empty(self.max_numel, dtype=torch.float32, device=self.device)
        if self.param_dtype is not None and self._param is None:
            self._param = torch.empty(self.max_numel, dtype=self.param_dtype,
                                      device=self.device)
            self.adam.master_scratch(self.device)

    def master_scratches(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """With remainders: the device's fp32 master and model-dtype weight scratches.

        The state build of the device tier uses them (it runs before the first update, on
        the same stream): no other device memory for it.
        """
        self._scratch()
        return self.adam.master_scratch(self.device), self._param

    def scale(self, inv_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``inv_scale`` on the device (a non-blocking copy on CUDA)."""
        if self.is_cuda and torch.is_tensor(inv_scale):
            return inv_scale.to(self.device, non_blocking=True)
        return inv_scale

    def _grads(self, index: int, inv_scale, clip_coeff) -> torch.Tensor:
        """The subgroup's fp32 gradients on the model's device, unscaled and clipped."""
        sg = self.subgroups[index]
        self._scratch()
        grads = self._grad[:sg.numel]
        gather_grads(self.params, sg, grads)
        return unscale_and_clip(grads, inv_scale, clip_coeff)

    def apply(self, index: int, state: torch.Tensor, args: StepArgs) -> None:
        """The step of the state buffer ``state`` on the device; the weights to the model."""
        if self.one_pass:
            self._apply_one_pass(index, state, args)
            return
        grads = self._grads(index, args.device_inv_scale, args.clip_coeff)
        sg = self.subgroups[index]
        params = (gather_params(self.params, sg, self._param[:sg.numel])
                  if self.param_dtype is not None else None)
        master = self.adam(index, state, grads, args.step, args.hparams, params)
        scatter(self.params, sg, master)

    def _apply_one_pass(self, index: int, state: torch.Tensor, args: StepArgs) -> None:
        """The step in one pass per piece, straight from and into the model's buffers."""
        sg = self.subgroups[index]
        rem, exp_avg, exp_avg_sq = self.adam.layout.views(state, sg.numel)
        for piece in sg.pieces:
            param = self.params[piece.param]
            at = slice(piece.offset, piece.offset + piece.length)
            src = slice(piece.start, piece.start + piece.length)
            device_adam.adamw_remainders(
                param.out[src], param.grad().reshape(-1)[src], rem[at], exp_avg[at],
                exp_avg_sq[at], step=args.step, hp=args.hparams[param.group],
                inv_scale=args.device_inv_scale, clip_coeff=args.clip_coeff)

    def update(self, index: int, state: torch.Tensor, args: StepArgs) -> None:
        """A device-tier subgroup's step (timed for the metrics)."""
        start = time.perf_counter()
        self.apply(index, state, args)
        self.stats.add("device_update", time.perf_counter() - start)
        self.stats.device_subgroups += 1


class SyncStreamUpdater:
    """A host subgroup updated by the device, the steps in order: states up, Adam, down.

    What a CPU run does (its "device" is the CPU, so CI runs the same updates).
    """

    def __init__(self, device_updater: DeviceUpdater, store: SubgroupStore):
        self.on_device, self.store = device_updater, store
        self._slot: Optional[torch.Tensor] = None
        self._elements, self._seconds = 0, 0.0

    def update(self, index: int, buffer: torch.Tensor, args: StepArgs) -> None:
        """Subgroup ``index``'s step through a device slot."""
        start = time.perf_counter()
        self._stream(index, buffer[:self.store.sizes[index]], args)
        self.store.stats.add("stream_issue", time.perf_counter() - start)
        self.store.stats.streamed_subgroups += 1

    def _stream(self, index: int, host: torch.Tensor, args: StepArgs) -> None:
        start = time.perf_counter()
        if self._slot is None:
            self._slot = torch.empty(self.store.buffer_bytes, dtype=torch.uint8,
                                     device=self.store.device)
        slot = self._slot[:host.numel()]
        slot.copy_(host)
        self.on_device.apply(index, slot, args)
        host.copy_(slot)
        self._elements += self.store.subgroups[index].numel
        self._seconds += time.perf_counter() - start

    def fill_slot(self) -> Optional[torch.Tensor]:
        """A device buffer of a subgroup for the state build to reuse (None: none here;
        the host builds the host subgroups' states)."""
        return None

    def take_counts(self) -> Tuple[int, float]:
        """(elements, seconds) of streamed updates since the last call."""
        counts = (self._elements, self._seconds)
        self._elements, self._seconds = 0, 0.0
        return counts


class CudaStreamUpdater(SyncStreamUpdater):
    """A host subgroup updated by the GPU: states H2D, fused Adam, states D2H.

    The copies run on their own streams (both directions in flight at once, two device
    slots alternating) and nothing here waits for them: the host buffer is marked busy
    until its D2H ends.
    """

    def __init__(self, device_updater: DeviceUpdater, store: SubgroupStore):
        super().__init__(device_updater, store)
        device = store.device
        self._stream_slots = [torch.empty(store.buffer_bytes, dtype=torch.uint8,
                                          device=device) for _ in range(2)]
        self._sh2d = torch.cuda.Stream(device)
        self._sd2h = torch.cuda.Stream(device)
        self._stream_next = 0
        self._slot_free: List[object] = [None, None]
        self._stream_marks: List[tuple] = []

    def fill_slot(self) -> Optional[torch.Tensor]:
        """The first stream slot, once its last D2H is done (the current stream waits)."""
        if self._slot_free[0] is not None:
            torch.cuda.current_stream(self.store.device).wait_event(self._slot_free[0])
        return self._stream_slots[0]

    def _stream(self, index: int, host: torch.Tensor, args: StepArgs) -> None:
        nbytes = host.numel()
        k = self._stream_next
        self._stream_next ^= 1
        slot = self._stream_slots[k][:nbytes]
        current = torch.cuda.current_stream(self.store.device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
        with torch.cuda.stream(self._sh2d):
            if self._slot_free[k] is not None:
                self._sh2d.wait_event(self._slot_free[k])
            marks[0].record(self._sh2d)
            slot.copy_(host, non_blocking=True)
            marks[1].record(self._sh2d)
        current.wait_event(marks[1])
        marks[2].record(current)
        self.on_device.apply(index, slot, args)
        marks[3].record(current)
        with torch.cuda.stream(self._sd2h):
            self._sd2h.wait_event(marks[3])
            marks[4].record(self._sd2h)
            host.copy_(slot, non_blocking=True)
            marks[5].record(self._sd2h)
        self._slot_free[k] = marks[5]
        self.store.mark_busy(index, marks[5])
        self._stream_marks.append((self.store.subgroups[index].numel, marks))

    def take_counts(self) -> Tuple[int, float]:
        """(elements, seconds) of the last step's streamed updates, from the GPU's events."""
        stream_elements, stream_s = super().take_counts()
        if self._stream_marks:
            # The pipeline runs at its slowest stage: H2D, the device's Adam, or D2H.
            stages = [0.0, 0.0, 0.0]
            for elements, marks in self._stream_marks:
                marks[5].synchronize()
                stream_elements += elements
                for k in range(3):
                    stages[k] += marks[2 * k].elapsed_time(marks[2 * k + 1]) / 1000
            stream_s = max(stages)
            self._stream_marks = []
        return stream_elements, stream_s


def stream_updater(device_updater: DeviceUpdater, store: SubgroupStore,
                   gpu_update: bool) -> SyncStreamUpdater:
    """The streamed updater of the run: on CUDA with ``--offload-gpu-update``, on streams."""
    if store.is_cuda and gpu_update:
        return CudaStreamUpdater(device_updater, store)
    return SyncStreamUpdater(device_updater, store)
