"""Where the delayed columns' gradients are summed over a window, and the device-side sum.

``--zenflow-accumulate host`` (the original way): every step's delayed gradients go to
pinned host memory and the CPU worker's accumulate thread adds them into an fp32
accumulator. ``device``: the model's device keeps one fp32 accumulator for the open
window, adds each step's delayed gradients into it (on a GPU, at the device's memory
bandwidth), and at the window's end divides by the step count and copies the window's
mean to the host once, on a side stream, into the CPU worker's accumulator of that
window; the device accumulator is zeroed behind the copy, on the same stream, and the
next step's add waits for that (on the device, not on the host). The CPU's Adam of
window ``w`` still runs while window ``w + 1`` accumulates.

Both places do the same fp32 operations in the same order: per step, the gradient
converted to fp32, multiplied by the inverse loss scale, then by the clip coefficient
(each when present), added to the sum (``0 + x`` for the window's first step), and the
sum divided by the step count at the window's end (when more than one). So they give
the same results bit for bit.

:func:`choose_place` is the auto rule (pure); :class:`DeviceAccumulator` is the sum.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from megatron_ext.errors import UsageError
from megatron_ext.optim.adamw import unscale_and_clip

MARGIN_BYTES = 1 << 30
"""The least device memory auto leaves free beyond the accumulator (1 GiB)."""
MARGIN_SHARE = 0.05
"""... or this share of the device's memory when that is more (fragmentation, the peaks
of later iterations, re-selections that grow the delayed set a little)."""
CHUNK = 1 << 26
"""Elements converted to fp32 at a time when a step's grads are unscaled or clipped on
the device before the add (256 MB of fp32 scratch)."""


def margin_bytes(total_bytes: Optional[int]) -> int:
    """The memory auto keeps free beyond the accumulator on a device of ``total_bytes``."""
    if not total_bytes:
        return MARGIN_BYTES
    return max(MARGIN_BYTES, int(MARGIN_SHARE * total_bytes))


def choose_place(mode: str, need_bytes: int, free_bytes: Optional[int],
                 total_bytes: Optional[int]) -> Tuple[str, str]:
    """``("device" | "host", why)`` for ``--zenflow-accumulate mode``.

    Args:
        mode: auto, device or host.
        need_bytes: the device accumulator's size (4 bytes per delayed element).
        free_bytes: the device's free memory after the first forward-backward; None when
            there is no device memory to measure (a CPU-only run).
        total_bytes: the device's memory (for the margin), or None.
    """
    if mode in ("device", "host"):
        return mode, f"--zenflow-accumulate {mode}"
    if mode != "auto":
        raise UsageError(f"--zenflow-accumulate {mode}: give auto, device or host")
    if free_bytes is None:
        return "host", "auto: no device memory to measure (CPU run)"
    margin = margin_bytes(total_bytes)
    gib = 2 ** 30
    if need_bytes + margin <= free_bytes:
        return "device", (f"auto: {free_bytes / gib:.2f} GiB free on the device >= "
                          f"{need_bytes / gib:.2f} GiB accumulator + {margin / gib:.2f} "
                          "GiB margin")
    return "host", (f"auto: {free_bytes / gib:.2f} GiB free on the device < "
                    f"{need_bytes / gib:.2f} GiB accumulator + {margin / gib:.2f} GiB margin")


def measured_free_memory(device: torch.device, free_bytes: Optional[int] = None
                         ) -> Tuple[Optional[int], Optional[int]]:
    """(free, total) bytes of ``device``; ``(free_bytes, None)`` when the test hook gives it.

    ``free_bytes``: the ``zenflow_device_free_bytes`` knob of
    :class:`~megatron_ext.zenflow.config.ZenFlowConfig`
    ($MEGATRON_EXT_ZENFLOW_DEVICE_FREE_BYTES). On a GPU, the driver's free memory: what
    the caching allocator already holds stays for the activations of the next iterations.
    (None, None) on a CPU without the hook.
    """
    if free_bytes is not None:
        return int(free_bytes), None
    if device.type != "cuda":
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


class DeviceAccumulator:
    """The open window's fp32 sum of the delayed grads on the model's device.

    One buffer per param group (the compact delayed columns of the plan in force). On a
    CUDA device the window's copy to the host and the zeroing behind it run on ``stream``
    (the engine's D2H stream); elsewhere they run at once.
    """

    def __init__(self, device: torch.device, stream=None):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.stream = stream
        self.acc: Dict[int, torch.Tensor] = {}
        self.steps = 0
        """Steps added into the open window."""
        self._reset: Optional[object] = None
        """The event after which the buffers are zero again (the last drain's)."""
        self.transfers = 0
        """Window sums copied to the host (one per window, all groups in one go)."""
        self._scratch: Optional[torch.Tensor] = None

    def nbytes(self) -> int:
        """Device memory of the accumulator."""
        return sum(t.numel() * t.element_size() for t in self.acc.values())

    def _wait_reset(self, host: bool = False) -> None:
        """Orders what follows after the last drain's zeroing (on the device or the host)."""
        if self._reset is None:
            return
        if host:
            self._reset.synchronize()
        else:
            torch.cuda.current_stream(self.device).wait_event(self._reset)
        self._reset = None

    def resize(self, sizes: Dict[int, int]) -> None:
        """Zero buffers for the per-group ``sizes`` (only between windows: empty window)."""
        if self.steps:
            raise RuntimeError("device accumulator resized mid-window")
        self._wait_reset(host=True)
        self.acc = {}  # the old buffers go first: never both sizes at once on the device
        self.acc = {g: torch.zeros(n, dtype=torch.float32, device=self.device)
                    for g, n in sizes.items()}

    def add(self, grads: Dict[int, torch.Tensor], inv_scale, clip_coeff) -> None:
        """Adds one step's compact grads (training dtype, on the device) into the sum.

        With neither an inverse loss scale nor a clip coefficient the conversion to fp32
        is fused into the add (``acc += grad`` reads the grad in its dtype and adds in
        fp32: the same rounding as converting first); else a chunk at a time through an
        fp32 scratch: convert, unscale, clip, add.
        """
        self._wait_reset()
        if torch.is_tensor(inv_scale):  # once per step, not per chunk
            inv_scale = inv_scale.to(self.device)
        for group, grad in grads.items():
            acc = self.acc[group]
            if inv_scale is None and clip_coeff is None:
                acc.add_(grad)
                continue
            want = min(CHUNK, max(t.numel() for t in self.acc.values()))
            if self._scratch is None or self._scratch.numel() < want:
                self._scratch = torch.empty(want, dtype=torch.float32, device=self.device)
            step = self._scratch.numel()
            for start in range(0, grad.numel(), step):
                part = grad[start:start + step]
                fp32 = self._scratch[:part.numel()]
                fp32.copy_(part)
                unscale_and_clip(fp32, inv_scale, clip_coeff)
                acc[start:start + part.numel()].add_(fp32)
        self.steps += 1

    def load(self, partial: Dict[int, torch.Tensor], steps: int) -> None:
        """Sets the open window's sum (from a checkpoint or the host's accumulator)."""
        self._wait_reset(host=True)
        for group, acc in self.acc.items():
            acc.copy_(partial[group])
        self.steps = steps

    def partial(self) -> Dict[int, torch.Tensor]:
        """The open window's sum so far, on the host (for a checkpoint)."""
        self._wait_reset()
        return {g: t.to("cpu", copy=True) for g, t in self.acc.items()}

    def drain(self, out: Dict[int, torch.Tensor]) -> Tuple[int, Optional[Callable[[], None]]]:
        """Closes the window: its mean into the host tensors ``out``; zero for the next.

        Returns (the window's step count, a callable that waits until ``out`` holds the
        mean, or None when it does already). The mean is the sum divided by the step
        count (a 0-dim device tensor: true division on every device, as the host's
        kernels do) when there was more than one step.
        """
        steps = self.steps
        if steps > 1:
            divisor = torch.full((), float(steps), dtype=torch.float32, device=self.device)
            for acc in self.acc.values():
                acc.div_(divisor)
        self.steps = 0
        self.transfers += 1
        if not self.is_cuda:
            for group, acc in self.acc.items():
                out[group][:acc.numel()].copy_(acc)
                acc.zero_()
            return steps, None
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for group, acc in self.acc.items():
                out[group][:acc.numel()].copy_(acc, non_blocking=True)
            copied = torch.cuda.Event(blocking=True)
            copied.record(stream)
            for acc in self.acc.values():
                acc.zero_()
            self._reset = stream.record_event()
        return steps, copied.synchronize
