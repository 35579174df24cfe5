"""Small device values copied to pinned host memory without waiting behind large copies."""

from __future__ import annotations

import torch


class ToHost:
    """A small device tensor's values on their way to pinned host memory.

    The copy is queued on the current stream when made and read by :meth:`get`. Made
    before an optimizer launches large copies to the host on its side streams, it is not
    queued behind them: a GPU serves copies to the host in order, so a plain ``.item()``
    after ZenFlow's step would wait for its 2.3 GB of delayed gradients
    (bench/gpu/copy_probe.py: 40 ms on the H200). The loop's log values and ZenFlow's rho take
    this way. A host tensor is kept as a copy.
    """

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor.clone()

    def get(self) -> torch.Tensor:
        """The values (waits for the copy)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host
