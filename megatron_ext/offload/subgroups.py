"""Partition of a rank's optimizer shard into subgroups.

The shard is the concatenation, in the optimizer's parameter order, of the parts of the
model parameters this data-parallel rank updates. It is cut into subgroups of at most
``size`` elements; a subgroup is the unit of fetch, update and flush. A parameter may span
several subgroups, and a subgroup may hold parts of many parameters. Pure logic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Callable, List, Sequence, Tuple

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one shard parameter that lies in a subgroup."""

    param: int
    """Index of the shard parameter (in the optimizer's order)."""
    start: int
    """First element of the piece within that parameter's shard."""
    length: int
    """Number of elements."""
    offset: int
    """First element of the piece within the subgroup."""


@dataclasses.dataclass(frozen=True)
class Subgroup:
    """A contiguous range of the flattened shard."""

    index: int
    numel: int
    pieces: Tuple[Piece, ...]
    runs: Tuple[Tuple[int, int, int], ...]
    """(param group, offset, length): maximal spans of one optimizer param group, so that
    one Adam call with the group's hyperparameters covers each span."""


def partition(numels: Sequence[int], groups: Sequence[int], size: int) -> List[Subgroup]:
    """Cuts the concatenation of ``numels`` into subgroups of at most ``size`` elements.

    Args:
        numels: elements of each shard parameter, in order (zero-size ones are skipped).
        groups: the optimizer param group of each parameter.
        size: the largest subgroup.
    """
    if size <= 0:
        raise ValueError("subgroup size must be positive")
    subgroups: List[Subgroup] = []
    pieces: List[Piece] = []
    filled = 0

    def close() -> None:
        nonlocal pieces, filled
        if not pieces:
            return
        runs: List[List[int]] = []
        for piece in pieces:
            group = groups[piece.param]
            if runs and runs[-1][0] == group:
                runs[-1][2] += piece.length
            else:
                runs.append([group, piece.offset, piece.length])
        subgroups.append(Subgroup(len(subgroups), filled, tuple(pieces),
                                  tuple(tuple(r) for r in runs)))
        pieces, filled = [], 0

    for index, numel in enumerate(numels):
        start = 0
        while start < numel:
            take = min(numel - start, size - filled)
            pieces.append(Piece(index, start, take, filled))
            start += take
            filled += take
            if filled == size:
                close()
    close()
    return subgroups


def layout_fingerprint(numels: Sequence[int], groups: Sequence[int], size: int) -> str:
    """A digest of the layout: state files of another layout must not be loaded."""
    text = json.dumps({"numels": list(numels), "groups": list(groups), "size": size})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass
class ShardParam:
    """One parameter's part of the rank's shard, as the engine sees it."""

    numel: int
    group: int
    """Index of its optimizer param group (lr, weight decay, betas, eps)."""
    grad: Callable[[], torch.Tensor]
    """Returns the shard's reduce-scattered gradient (training dtype, model device)."""
    out: torch.Tensor
    """Where the updated weights go: the shard's slice of the model's param buffer."""
    init: Callable[[], torch.Tensor]
    """Returns the shard's current model weights (to build fp32 masters from)."""
