"""The byte layout of one subgroup's optimizer state, in the dtypes the run stores.

A subgroup of ``n`` elements keeps its master weights, ``exp_avg`` and ``exp_avg_sq`` in
one contiguous byte buffer: the three arrays one after the other, each in its own dtype
(Megatron-LM's ``--main-params-dtype``, ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``; fp32
by default: 12 bytes per element, 8 with bf16 moments) and each starting on a 4-byte
boundary so that every dtype can be viewed in place. With all three in fp32 the layout is
the engine's original ``3n`` fp32 floats, byte for byte, so state files keep their format.
The same layout is used in every tier (GPU memory, host cache, files) and on the wire.
"""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

import torch

from megatron_ext.runtime.dtypes import DTYPES

_ALIGN = 4


def _align(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Dtypes of the master weights and the two Adam moments."""

    master: torch.dtype = torch.float32
    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32

    @classmethod
    def from_names(cls, master: str = "fp32", exp_avg: str = "fp32",
                   exp_avg_sq: str = "fp32") -> "StateLayout":
        """The layout of Megatron-LM's dtype names (fp32, fp16, bf16)."""
        return cls(DTYPES[master], DTYPES[exp_avg], DTYPES[exp_avg_sq])

    @property
    def dtypes(self) -> Tuple[torch.dtype, torch.dtype, torch.dtype]:
        """(master, exp_avg, exp_avg_sq)."""
        return (self.master, self.exp_avg, self.exp_avg_sq)

    @property
    def names(self) -> List[str]:
        """The dtypes as Megatron-LM names them (recorded in checkpoint manifests)."""
        back = {v: k for k, v in DTYPES.items()}
        return [back[d] for d in self.dtypes]

    @property
    def exact(self) -> bool:
        """Whether every state is fp32 (the Adam math then runs on the stored arrays)."""
        return all(d == torch.float32 for d in self.dtypes)

    @property
    def bytes_per_element(self) -> int:
        """Bytes of state per element, without alignment padding."""
        return sum(torch.empty((), dtype=d).element_size() for d in self.dtypes)

    def offsets(self, n: int) -> Tuple[int, int, int, int]:
        """Byte offsets of the three arrays of an ``n``-element subgroup, and the total."""
        sizes = [n * torch.empty((), dtype=d).element_size() for d in self.dtypes]
        first = 0
        second = _align(first + sizes[0])
        third = _align(second + sizes[1])
        return first, second, third, _align(third + sizes[2])

    def nbytes(self, n: int) -> int:
        """Bytes of an ``n``-element subgroup's state (the payload of its file)."""
        return self.offsets(n)[3]

    def views(self, buffer: torch.Tensor, n: int) -> List[torch.Tensor]:
        """[master, exp_avg, exp_avg_sq] of an ``n``-element subgroup held in ``buffer``.

        Args:
            buffer: a 1-D uint8 tensor of at least :meth:`nbytes` bytes (any device) whose
                data starts on a 4-byte boundary.
            n: the subgroup's elements.
        """
        starts = self.offsets(n)
        return [buffer[start:start + n * torch.empty((), dtype=d).element_size()].view(d)
                for start, d in zip(starts[:3], self.dtypes)]
