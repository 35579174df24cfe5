"""What crosses between the model and the CPU updater: gradients in, new weights out.

The gradient sources (:func:`gradient_source`, chosen once at construction) hand the CPU
updater a subgroup's fp32 gradients: delayed in-place conversion on a host model
(:class:`HostGrads`) or a CUDA one (:class:`PinnedGrads`: training-dtype D2H into pinned
stages on their own stream), or fp32 first (:class:`Fp32FirstGrads`, the ablation). With
remainders they hand over the subgroup's bf16 weights too. The write-backs
(:class:`HostWriteBack`, :class:`StagedWriteBack`) put the update's new weights into the
model. The gather/scatter helpers are shared with the device's updates.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Dict, Optional, Sequence

import torch

from megatron_ext.offload.states import StateLayout
from megatron_ext.offload.store import SubgroupStore
from megatron_ext.offload.subgroups import Subgroup
from megatron_ext.optim.adamw import unscale_and_clip

if TYPE_CHECKING:
    from megatron_ext.offload.subgroups import ShardParam


def scatter(params: Sequence["ShardParam"], sg: Subgroup, master: torch.Tensor) -> None:
    """Subgroup ``sg``'s new weights into the model's param buffers (synchronous copies)."""
    for piece in sg.pieces:
        params[piece.param].out[piece.start:piece.start + piece.length].copy_(
            master[piece.offset:piece.offset + piece.length])


def gather_grads(params: Sequence["ShardParam"], sg: Subgroup, grads: torch.Tensor) -> None:
    """Subgroup ``sg``'s gradients from the model's grad buffers into ``grads``."""
    for piece in sg.pieces:
        src = params[piece.param].grad().reshape(-1)
        grads[piece.offset:piece.offset + piece.length].copy_(
            src[piece.start:piece.start + piece.length])


def gather_params(params: Sequence["ShardParam"], sg: Subgroup, into: torch.Tensor,
                  non_blocking: bool = False) -> torch.Tensor:
    """Subgroup ``sg``'s current model weights (from ``out``) into ``into``; returns it."""
    for piece in sg.pieces:
        into[piece.offset:piece.offset + piece.length].copy_(
            params[piece.param].out[piece.start:piece.start + piece.length],
            non_blocking=non_blocking)
    return into


# ---------------------------------------------------------------- write-back


class HostWriteBack:
    """New weights into the model's param buffer, in the model's dtype (host model)."""

    def __init__(self, params: Sequence["ShardParam"], subgroups: Sequence[Subgroup]):
        self.params, self.subgroups = params, subgroups

    def __call__(self, index: int, master: torch.Tensor, slot: int) -> None:
        """Copies subgroup ``index``'s ``master`` into the model (``slot``: unused here).

        ``master``: the fp32 masters, or with remainders the new bf16 weights.
        """
        scatter(self.params, self.subgroups[index], master)

    def target(self, index: int, slot: int) -> Optional[torch.Tensor]:
        """Where an update puts subgroup ``index``'s new bf16 weights (remainders).

        None: in place of the current weights the updater was given (a host model's
        write-back copies them synchronously, nothing else reads them meanwhile).
        """
        return None

    def wait_readers(self) -> None:
        """Nothing in flight reads a host buffer."""

    def finish(self) -> None:
        """Nothing in flight at the end of a step."""

    def sync(self) -> None:
        """Nothing in flight."""


class StagedWriteBack(HostWriteBack):
    """New weights to a CUDA model: on a copy stream, through two device stages.

    New fp32 masters cross to the device straight from their pinned state buffer and are
    cast there: a CPU cast pass over the shard costs more than the extra PCIe bytes
    (measured on the H200 machine, 2026-11-30). With remainders the update has made the
    bf16 weights anyway (they are half of the master): they cross instead, from two pinned
    stages (:meth:`target`), half the bytes.
    """

    def __init__(self, params: Sequence["ShardParam"], subgroups: Sequence[Subgroup],
                 layout: StateLayout, max_numel: int, device: torch.device,
                 model_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, subgroups)
        self.device = device
        self._h2d = torch.cuda.Stream(device)
        wire = model_dtype if layout.remainders else layout.master
        self._out_stage = [torch.empty(max_numel, dtype=wire, device=device)
                           for _ in range(2)]
        self._host_stage = ([torch.empty(max_numel, dtype=model_dtype, pin_memory=True)
                             for _ in range(2)] if layout.remainders else None)
        self._out_events = [None, None]

    def target(self, index: int, slot: int) -> Optional[torch.Tensor]:
        """Pinned stage ``slot`` for the new bf16 weights, once its last copy has left it."""
        if self._host_stage is None:
            return None
        if self._out_events[slot] is not None:
            self._out_events[slot].synchronize()
        return self._host_stage[slot][:self.subgroups[index].numel]

    def __call__(self, index: int, master: torch.Tensor, slot: int) -> None:
        """Starts the copy of subgroup ``index``'s ``master`` through stage ``slot``.

        ``master``: pinned host memory (the state buffer's masters, or with remainders the
        stage of :meth:`target`), left alone until the copy ends.
        """
        sg = self.subgroups[index]
        if self._out_events[slot] is not None:
            self._out_events[slot].synchronize()
        stage = self._out_stage[slot][:sg.numel]
        with torch.cuda.stream(self._h2d):
            stage.copy_(master, non_blocking=True)
            for piece in sg.pieces:
                self.params[piece.param].out[piece.start:piece.start + piece.length].copy_(
                    stage[piece.offset:piece.offset + piece.length], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._h2d)
        self._out_events[slot] = event

    def wait_readers(self) -> None:
        """Waits until no master is still crossing to the device from a host buffer."""
        for event in self._out_events:
            if event is not None:
                event.synchronize()

    def finish(self) -> None:
        """The training stream waits for the step's weights."""
        torch.cuda.current_stream(self.device).wait_stream(self._h2d)

    def sync(self) -> None:
        """The training stream waits for the weights, and stage 0's copy has ended."""
        torch.cuda.current_stream(self.device).wait_stream(self._h2d)
        self._out_events[0].synchronize()


# ---------------------------------------------------------------- gradient sources


class GradSource:
    """The CPU updater's fp32 gradients of a subgroup, unscaled and clipped.

    With remainders (``param_dtype`` given) also the subgroup's current weights
    (:meth:`params`), which the masters are rebuilt from.
    """

    def __init__(self, params: Sequence["ShardParam"], subgroups: Sequence[Subgroup],
                 max_numel: int, param_dtype: Optional[torch.dtype] = None):
        self.params, self.subgroups = params, subgroups
        self._scratch = torch.empty(max_numel, dtype=torch.float32)
        self._param_scratch = (torch.empty(max_numel, dtype=param_dtype)
                               if param_dtype is not None else None)

    def params_of(self, index: int, slot: int) -> Optional[torch.Tensor]:
        """Subgroup ``index``'s current weights on the host (remainders; else None).

        Read from the model synchronously: its last write-back has landed (the step's
        write-backs end before the next step's updates start, and no two subgroups share
        an element).
        """
        if self._param_scratch is None:
            return None
        sg = self.subgroups[index]
        return gather_params(self.params, sg, self._param_scratch[:sg.numel])

    def begin(self, order: Sequence[int], inv_scale, clip_coeff) -> None:
        """A step starts; ``order``: the subgroups the CPU updates, in order."""

    def issue(self, index: int, slot: int) -> None:
        """Subgroup ``index`` is next after the one being updated (a chance to copy ahead)."""

    def end(self) -> None:
        """The step ended."""


class HostGrads(GradSource):
    """Delayed conversion, host model: the training-dtype gradients converted in place."""

    def fp32(self, index: int, slot: int, inv_scale, clip_coeff) -> torch.Tensor:
        """Subgroup ``index``'s fp32 gradients, unscaled and clipped like megatron-core's."""
        grads = self._scratch[:self.subgroups[index].numel]
        gather_grads(self.params, self.subgroups[index], grads)
        unscale_and_clip(grads, inv_scale, clip_coeff)
        return grads


class PinnedGrads(GradSource):
    """Delayed conversion, CUDA model: training-dtype gradients D2H into pinned stages.

    The next subgroup's copy runs on its own stream while this one's Adam runs; with
    remainders the subgroup's bf16 weights cross beside its gradients, on the same stream.
    """

    def __init__(self, params: Sequence["ShardParam"], subgroups: Sequence[Subgroup],
                 max_numel: int, device: torch.device, grad_dtype: torch.dtype,
                 param_dtype: Optional[torch.dtype] = None):
        super().__init__(params, subgroups, max_numel)
        self.device = device
        self._d2h = torch.cuda.Stream(device)
        self._grad_stage = [torch.empty(max_numel, dtype=grad_dtype, pin_memory=True)
                            for _ in range(2)]
        # A stage is rewritten two subgroups later, once the CPU has read it (fp32(),
        # params_of() of that subgroup ran before the issue of the next but one).
        self._param_stage = ([torch.empty(max_numel, dtype=param_dtype, pin_memory=True)
                              for _ in range(2)] if param_dtype is not None else None)
        self._grad_events = [None, None]

    def begin(self, order: Sequence[int], inv_scale, clip_coeff) -> None:
        """The copies wait for the backward; the first subgroup's starts."""
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        if order:
            self.issue(order[0], 0)

    def issue(self, index: int, slot: int) -> None:
        """Starts the D2H copy of a subgroup's gradients (training dtype) into pinned memory."""
        stage = self._grad_stage[slot]
        sg = self.subgroups[index]
        with torch.cuda.stream(self._d2h):
            for piece in sg.pieces:
                src = self.params[piece.param].grad().reshape(-1)
                stage[piece.offset:piece.offset + piece.length].copy_(
                    src[piece.start:piece.start + piece.length], non_blocking=True)
            if self._param_stage is not None:
                gather_params(self.params, sg, self._param_stage[slot][:sg.numel],
                              non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._d2h)
        self._grad_events[slot] = event

    def fp32(self, index: int, slot: int, inv_scale, clip_coeff) -> torch.Tensor:
        """Subgroup ``index``'s fp32 gradients, unscaled and clipped like megatron-core's."""
        grads = self._scratch[:self.subgroups[index].numel]
        self._grad_events[slot].synchronize()
        grads.copy_(self._grad_stage[slot][:grads.numel()])
        unscale_and_clip(grads, inv_scale, clip_coeff)
        return grads

    def params_of(self, index: int, slot: int) -> Optional[torch.Tensor]:
        """Subgroup ``index``'s bf16 weights, copied beside its gradients (remainders)."""
        if self._param_stage is None:
            return None
        self._grad_events[slot].synchronize()
        return self._param_stage[slot][:self.subgroups[index].numel]


class Fp32FirstGrads(GradSource):
    """Without delayed conversion: the shard's fp32 gradients first, as ZeRO-Infinity does.

    Each subgroup's gradients become fp32 on the model's device, cross to the host in fp32
    and, for subgroups outside the cache, go to the tier and come back in the update.
    """

    def __init__(self, params: Sequence["ShardParam"], subgroups: Sequence[Subgroup],
                 max_numel: int, store: SubgroupStore,
                 param_dtype: Optional[torch.dtype] = None):
        super().__init__(params, subgroups, max_numel, param_dtype)
        self.store = store
        # Each subgroup's fp32 gradients of this step, in host memory (a tensor) or in a
        # file on the path of that index (an int).
        self._staged: Dict[int, object] = {}

    def begin(self, order: Sequence[int], inv_scale, clip_coeff) -> None:
        """Stages the fp32 gradients of every subgroup in ``order``."""
        start = time.perf_counter()
        for index in order:
            sg = self.subgroups[index]
            host = torch.empty(sg.numel, dtype=torch.float32)
            for piece in sg.pieces:
                src = self.params[piece.param].grad().reshape(-1)
                part = src[piece.start:piece.start + piece.length].float()
                unscale_and_clip(part, inv_scale, clip_coeff)
                host[piece.offset:piece.offset + piece.length].copy_(part)
            if self.store.tiers and index not in self.store.cache:
                self._staged[index] = self.store.write(index, host, kind="grad")
            else:
                self._staged[index] = host
        self.store.stats.add("convert", time.perf_counter() - start)

    def fp32(self, index: int, slot: int, inv_scale, clip_coeff) -> torch.Tensor:
        """Subgroup ``index``'s staged fp32 gradients (already unscaled and clipped)."""
        grads = self._scratch[:self.subgroups[index].numel]
        staged = self._staged[index]
        if isinstance(staged, int):
            self.store.read(index, grads, kind="grad", path=staged)
        else:
            grads.copy_(staged)
        return grads

    def end(self) -> None:
        """Forgets the step's gradients."""
        self._staged.clear()


def gradient_source(delayed: bool, params: Sequence["ShardParam"],
                    subgroups: Sequence[Subgroup], max_numel: int, *, device: torch.device,
                    grad_dtype: torch.dtype, store: SubgroupStore,
                    param_dtype: Optional[torch.dtype] = None) -> GradSource:
    """The CPU updater's gradients: delayed conversion (host or CUDA model) or fp32 first.

    ``param_dtype``: with remainders, the model's dtype (the source hands the subgroup's
    weights to the update as well); None without.
    """
    if not delayed:
        return Fp32FirstGrads(params, subgroups, max_numel, store, param_dtype)
    if device.type == "cuda":
        return PinnedGrads(params, subgroups, max_numel, device, grad_dtype, param_dtype)
    return HostGrads(params, subgroups, max_numel, param_dtype)
