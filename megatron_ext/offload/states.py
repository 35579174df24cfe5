"""The byte layout of one subgroup's optimizer state, in the dtypes the run stores.

A subgroup of ``n`` elements keeps its master weights, ``exp_avg`` and ``exp_avg_sq`` in
one contiguous byte buffer: the three arrays one after the other, each in its own dtype
(Megatron-LM's ``--main-params-dtype``, ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``; fp32
by default: 12 bytes per element, 8 with bf16 moments) and each starting on a 4-byte
boundary so that every dtype can be viewed in place. With all three in fp32 the layout is
the engine's original ``3n`` fp32 floats, byte for byte, so state files keep their format.
With ``remainders`` (bf16 parameters, fp32 masters: ``--no-store-param-remainders`` turns
it off) the master is stored as its low 16 bits (int16) beside the bf16 parameter, and
exp_avg_sq's sign bit holds the bit that completes it (:mod:`.remainders`): 10 bytes per
element, 6 with bf16 moments. The same layout is used in every tier (GPU memory, host
cache, files) and on the wire.
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
    remainders: bool = False
    """The fp32 master stored as its 16-bit remainder beside the bf16 parameter."""

    def __post_init__(self):
        if self.remainders and self.master != torch.float32:
            raise ValueError("remainders hold fp32 masters only")

    def with_remainders(self, on: bool = True) -> "StateLayout":
        """A copy of the layout with the masters stored as remainders (``on``) or whole."""
        return dataclasses.replace(self, remainders=on)

    def remainders_apply(self, model_dtype: torch.dtype) -> bool:
        """Whether remainders are exact here: fp32 masters of bf16 parameters."""
        return self.master == torch.float32 and model_dtype == torch.bfloat16

    @classmethod
    def from_names(cls, master: str = "fp32", exp_avg: str = "fp32",
                   exp_avg_sq: str = "fp32") -> "StateLayout":
        """The layout of Megatron-LM's dtype names (fp32, fp16, bf16)."""
        return cls(DTYPES[master], DTYPES[exp_avg], DTYPES[exp_avg_sq])

    @property
    def dtypes(self) -> Tuple[torch.dtype, torch.dtype, torch.dtype]:
        """The stored arrays' dtypes: (master or int16 remainder, exp_avg, exp_avg_sq)."""
        return (torch.int16 if self.remainders else self.master, self.exp_avg,
                self.exp_avg_sq)

    @property
    def names(self) -> List[str]:
        """The states' dtypes as Megatron-LM names them (master, exp_avg, exp_avg_sq).

        The master's is its own (fp32) with remainders too: :attr:`remainders` says how
        it is stored. Both are recorded in checkpoint manifests.
        """
        back = {v: k for k, v in DTYPES.items()}
        return [back[d] for d in (self.master, self.exp_avg, self.exp_avg_sq)]

    @property
    def exact(self) -> bool:
        """Whether every state is fp32 or exact (the Adam math sees them unrounded)."""
        return all(d == torch.float32 for d in (self.master, self.exp_avg, self.exp_avg_sq))

    def describe(self) -> str:
        """The bytes per element and what they hold, for the start-up log line."""
        if self.remainders:
            masters = "fp32 masters as 16-bit remainders beside the bf16 parameters"
        else:
            masters = f"{self.names[0]} masters"
        moments = "/".join(self.names[1:])
        return f"{self.bytes_per_element} B/element: {masters}, {moments} moments"

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
