"""The old engine's bf16 weights that a re-selection's new engine writes over, kept aside.

With bf16 weights an offload engine keeps each fp32 master as a 16-bit remainder beside
its weight: the weight half lives in the engine's ``out`` tensors (for ZenFlow's CPU side,
the CPU worker's upload buffers), and the engine reads it back to rebuild a master. On a
GPU machine the upload buffers are page-locked and reused across re-selections
(``CpuWorker._pinned_views``: pinning is slow and registered for the process's life), so a
re-selection's new engine gets views of the same memory as the old engine's ``out``. Its
fill writes each new subgroup's weights there as soon as that subgroup is filled, while
the fill of later subgroups still reads old masters whose weight half lay there (the new
layout moves columns: the same bytes hold other elements' weights).

:class:`KeptWeights` keeps, before a new subgroup is filled, the old weights its write
will cover that an old subgroup not yet released may still need; a read of the old
engine sees them (:meth:`KeptWeights.reading`), and an old subgroup's kept weights go
when it is released. With the move's release of old subgroups after their last read,
only the weights of the few old subgroups whose reads straddle the fill's front are kept
at a time; without it (``CpuStates.replace``), at most the old weights whole.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch


def _span(tensor: torch.Tensor) -> Tuple[int, int]:
    """[first byte, end byte) of a contiguous tensor's data."""
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


class KeptWeights:
    """Old weights saved from the memory a new engine's fill writes (see the module).

    Args:
        old: the replaced engine (its ``params[i].out`` hold its weights, ``subgroups``
            its pieces).
        new_out: the new engine's ``out`` tensor of each of its params, in its order.
    """

    def __init__(self, old, new_out: Sequence[torch.Tensor]):
        self.old = old
        self.old_out = [param.out for param in old.params]
        self.new_out = list(new_out)
        self.kept: Dict[int, List[Tuple[int, int, torch.Tensor]]] = {}
        """Old subgroup -> (old param, start, its weights there) saved from the memory."""
        self.released = set()

    @staticmethod
    def needed(old, new_out: Sequence[torch.Tensor]) -> bool:
        """Whether a new ``out`` shares memory with the old engine's weights (remainders)."""
        if not old.layout.remainders:
            return False
        spans = [_span(param.out) for param in old.params]
        for tensor in new_out:
            lo, hi = _span(tensor)
            if any(lo < b and a < hi for a, b in spans):
                return True
        return False

    def _old_ranges(self, new_param: int, start: int, length: int
                    ) -> Iterator[Tuple[int, int, int]]:
        """(old param, start, end) of old weights in new param's ``[start, start+length)``."""
        tensor = self.new_out[new_param]
        size = tensor.element_size()
        lo = tensor.data_ptr() + start * size
        hi = lo + length * size
        for param, out in enumerate(self.old_out):
            a, b = _span(out)
            if out.element_size() != size or not (lo < b and a < hi):
                continue
            yield param, (max(lo, a) - a) // size, (min(hi, b) - a) // size

    def save(self, new_pieces) -> None:
        """Before a new subgroup of ``new_pieces`` (param, start, length) is filled.

        Saves the old weights its write covers in the old subgroups not yet released.
        """
        for piece in new_pieces:
            for param, lo, hi in self._old_ranges(piece.param, piece.start, piece.length):
                for index, sg in enumerate(self.old.subgroups):
                    if index in self.released:
                        continue
                    for old_piece in sg.pieces:
                        if old_piece.param != param:
                            continue
                        a = max(lo, old_piece.start)
                        b = min(hi, old_piece.start + old_piece.length)
                        if a < b:
                            self.kept.setdefault(index, []).append(
                                (param, a, self.old_out[param][a:b].clone()))

    def release(self, index: int) -> None:
        """Old subgroup ``index`` is released: nothing reads its weights again."""
        self.released.add(index)
        self.kept.pop(index, None)

    @contextlib.contextmanager
    def reading(self, param: int, start: int, length: int):
        """Within the block the old param's weights in ``[start, start+length)`` are its own.

        The saved old weights are put back in the memory for the old engine's read, and
        the new engine's are restored after it.
        """
        swapped: List[Tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for entries in self.kept.values():
                for kept_param, at, saved in entries:
                    a, b = max(start, at), min(start + length, at + saved.numel())
                    if kept_param != param or a >= b:
                        continue
                    view = self.old_out[param][a:b]
                    swapped.append((view, view.clone()))
                    view.copy_(saved[a - at:b - at])
            yield
        finally:
            for view, current in reversed(swapped):
                view.copy_(current)

    def nbytes(self) -> int:
        """Bytes of the weights kept now."""
        return sum(t.numel() * t.element_size() for entries in self.kept.values()
                   for _, _, t in entries)


def keep_for(old, new) -> Optional[KeptWeights]:
    """A :class:`KeptWeights` for the fill of ``new`` from ``old`` where one is needed."""
    if old is None:
        return None
    new_out = [param.out for param in new.params]
    return KeptWeights(old, new_out) if KeptWeights.needed(old, new_out) else None
