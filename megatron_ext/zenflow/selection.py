"""Column importance, top-k selection, and the gather/scatter plan of the two sides.

A 2-D weight ``W[rows, cols]`` (megatron-core's layout: output rows, input columns) is
flattened and cut by the distributed optimizer into contiguous ranges, one per DP rank,
so a rank owns some whole rows and up to two partial ones, and every column spans ranks.
The importance of column ``j`` is the sum of ``grad[:, j]**2`` over the whole matrix: each
rank sums over the rows it owns, then one all-reduce over the DP group (of all matrices'
vectors at once) completes it. With tensor parallelism a column-parallel weight
(``partition_dim`` 0) holds every column on each TP rank (the vectors are summed over
TP too); a row-parallel one (``partition_dim`` 1) holds a slice of the columns (the
vectors are gathered over TP and the top-k taken over the whole matrix).

Within the rank's shard a matrix is a few **segments**, each a contiguous block of
``rows x (col_hi - col_lo)`` elements; selected and delayed columns of each segment are
gathered with one ``index_select`` and scattered back with one ``index_copy_``. Each side
keeps its states compacted, per param group, in the order of :class:`Plan`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence

import torch


@dataclasses.dataclass
class Segment:
    """A block of whole-width rows of one matrix, contiguous in the rank's shard."""

    offset: int
    """Position of the block's first element in the parameter's shard."""
    rows: int
    col_lo: int
    col_hi: int

    @property
    def width(self) -> int:
        """Columns of the block."""
        return self.col_hi - self.col_lo

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The block as ``[rows, width]`` inside the shard's flat tensor."""
        return flat[self.offset:self.offset + self.rows * self.width].view(self.rows, self.width)


def segments(start: int, end: int, cols: int) -> List[Segment]:
    """Blocks of the flattened range ``[start, end)`` of a matrix with ``cols`` columns."""
    out: List[Segment] = []
    pos = start
    while pos < end:
        col = pos % cols
        if col or end - pos < cols:  # a partial row
            hi = min(cols, col + end - pos)
            out.append(Segment(pos - start, 1, col, hi))
            pos += hi - col
        else:  # whole rows
            rows = (end - pos) // cols
            out.append(Segment(pos - start, rows, 0, cols))
            pos += rows * cols
    return out


@dataclasses.dataclass
class Matrix:
    """One 2-D weight's part of the rank's shard (no segments when the rank owns none)."""

    shard: int
    """Index of the parameter in the optimizer's shard list (-1: not in this rank's shard)."""
    key: int
    """Index of the weight among all 2-D weights of the model (the same on every DP rank)."""
    cols: int
    """Columns of the local (tensor-parallel) weight."""
    segments: List[Segment]
    tp_mode: str
    """How the importance vector combines over TP: sum (column-parallel), gather
    (row-parallel: each TP rank holds a slice of the columns) or none (not TP-split)."""
    col_offset: int
    """Index of the first local column in the whole matrix (gather mode)."""
    full_cols: int
    counts: bool
    """Counted in rho (False for TP duplicates, like megatron-core's grad norm)."""


def all_matrices(params: Sequence[torch.Tensor], tp_rank: int = 0,
                 tp_size: int = 1) -> List[Matrix]:
    """Every 2-D weight of the model, in ``params`` order, with no shard yet.

    ``params`` must list the model's parameters in the same order on every DP rank (the
    model's own order): the importance vectors are all-reduced in this order.
    """
    out = []
    for param in params:
        if param.dim() != 2:
            continue
        cols = param.shape[1]
        split = tp_size > 1 and getattr(param, "tensor_model_parallel", False)
        dim = getattr(param, "partition_dim", -1)
        mode = ("gather" if split and dim == 1 else "sum" if split and dim == 0 else "none")
        out.append(Matrix(shard=-1, key=len(out), cols=cols, segments=[], tp_mode=mode,
                          col_offset=tp_rank * cols if mode == "gather" else 0,
                          full_cols=cols * tp_size if mode == "gather" else cols, counts=False))
    return out


def matrices_of(shards: Sequence, tp_rank: int = 0, tp_size: int = 1,
                params: Optional[Sequence[torch.Tensor]] = None) -> tuple:
    """(every 2-D weight of the model, the rank's parts of them among ``shards``).

    ``shards``: see sharded_optimizer.Shard. ``params``: all parameters of the model in an
    order every DP rank shares (default: the shards' own, enough for one rank).
    """
    params = list(params) if params is not None else [s.model_param for s in shards]
    every = all_matrices(params, tp_rank, tp_size)
    key_of = {id(p): m.key for p, m in zip([p for p in params if p.dim() == 2], every)}
    owned = []
    for index, shard in enumerate(shards):
        param = shard.model_param
        if param.dim() != 2 or shard.numel == 0:
            continue
        spec = every[key_of[id(param)]]
        owned.append(dataclasses.replace(spec, shard=index,
                                          segments=segments(shard.start, shard.end, spec.cols),
                                          counts=shard.counts_in_norm))
    return every, owned


def column_energy(grad: torch.Tensor, matrix: Matrix) -> torch.Tensor:
    """Sum of squared gradient entries per local column over the rows this rank owns (fp64)."""
    energy = torch.zeros(matrix.cols, dtype=torch.float64, device=grad.device)
    for seg in matrix.segments:
        block = seg.view(grad).float()
        energy[seg.col_lo:seg.col_hi] += block.square().sum(0, dtype=torch.float64)
    return energy


def global_importance(local: List[torch.Tensor], matrices: List[Matrix], dp_group=None,
                      tp_group=None) -> List[torch.Tensor]:
    """Whole-matrix column importance from each rank's local vectors.

    ``local`` and ``matrices`` list every 2-D weight of the model (zeros where the rank
    owns none of it), in the same order on every rank. One all-reduce over the DP group
    for all matrices; over TP, one all-reduce of the column-parallel vectors and one
    all-gather of the row-parallel ones.
    """
    dist = torch.distributed
    if not local:
        return []
    sizes = [v.numel() for v in local]
    flat = torch.cat(local)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(flat, group=dp_group)
    vectors = list(flat.split(sizes))
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if tp_size > 1:
        summed = [i for i, m in enumerate(matrices) if m.tp_mode == "sum"]
        if summed:
            part = torch.cat([vectors[i] for i in summed])
            dist.all_reduce(part, group=tp_group)
            for i, v in zip(summed, part.split([sizes[i] for i in summed])):
                vectors[i] = v
        gathered = [i for i, m in enumerate(matrices) if m.tp_mode == "gather"]
        if gathered:
            part = torch.cat([vectors[i] for i in gathered])
            pieces = [torch.empty_like(part) for _ in range(tp_size)]
            dist.all_gather(pieces, part, group=tp_group)
            split = [p.split([sizes[i] for i in gathered]) for p in pieces]
            for j, i in enumerate(gathered):
                vectors[i] = torch.cat([s[j] for s in split])
    return vectors


def top_columns(importance: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices (ascending) of the ``round(ratio * n)`` (at least 1) most important columns.

    Ties go to the lower index (a stable sort), so every rank and layout agrees.
    """
    n = importance.numel()
    k = max(1, min(n, math.floor(ratio * n + 0.5)))
    order = torch.sort(importance, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


def local_mask(selected: torch.Tensor, matrix: Matrix) -> torch.Tensor:
    """Boolean mask over the local columns from whole-matrix selected indices."""
    mask = torch.zeros(matrix.full_cols, dtype=torch.bool, device=selected.device)
    mask[selected] = True
    return mask[matrix.col_offset:matrix.col_offset + matrix.cols]


# ---------------------------------------------------------------- plans


@dataclasses.dataclass
class Piece:
    """One run of a side's compact buffer.

    A whole shard of a parameter that is not a matrix, or the chosen columns of one
    segment of a matrix.
    """

    shard: int
    offset: int
    """Position in the side's compact buffer of its param group."""
    length: int
    segment: Optional[Segment] = None
    index: Optional[torch.Tensor] = None
    """Columns of the segment (relative to its col_lo), on the model's device."""

    def index_on(self, device: torch.device) -> torch.Tensor:
        """The columns on ``device`` (host-side gathers happen at re-selection only)."""
        return self.index if self.index.device == device else self.index.to(device)


@dataclasses.dataclass
class _WholeRuns:
    """The whole-shard pieces of one param group that share one storage, as two indices.

    ``source``: the pieces' elements in the flat storage; ``compact``: their places in the
    side's compact buffer. One ``index_select`` and one ``index_copy_`` move all of them
    instead of a copy per piece (a GPT's norms and biases are hundreds of small tensors:
    on the GPU, their launches cost more than their bytes).
    """

    storage: torch.Tensor
    """A 1-D tensor over the whole storage (the model's param or grad buffer)."""
    source: torch.Tensor
    compact: torch.Tensor


@dataclasses.dataclass
class Plan:
    """Where each element of a side's compact per-group buffers lives in the model."""

    pieces: Dict[int, List[Piece]]
    """Param group -> pieces in buffer order."""
    sizes: Dict[int, int]
    """Param group -> elements."""
    _runs: Dict[tuple, tuple] = dataclasses.field(default_factory=dict, repr=False,
                                                  compare=False)

    def _whole(self, group: int, flat_of) -> tuple:
        """(runs over shared storages, ids of the pieces they cover) for ``group``.

        The whole-shard pieces of the group whose tensors share a storage with another
        piece's (megatron-core's param and grad buffers) are moved by the runs; the others
        one by one. Recomputed whenever a piece's tensor lives elsewhere than at the last
        call (the key is every piece's storage and offset), so a replaced buffer is never
        written through stale indices.
        """
        whole = [p for p in self.pieces.get(group, ()) if p.segment is None and p.length]
        views = [flat_of(p.shard) for p in whole]
        key = (group, tuple((v.untyped_storage().data_ptr(), v.storage_offset(), v.numel(),
                             v.dtype, v.is_contiguous()) for v in views))
        cached = self._runs.get(key)
        if cached is not None:
            return cached
        by_storage: Dict[int, list] = {}
        for piece, view in zip(whole, views):
            if view.is_contiguous() and view.dim() == 1:
                by_storage.setdefault(view.untyped_storage().data_ptr(), []).append(
                    (piece, view))
        runs, covered = [], set()
        for members in by_storage.values():
            if len(members) < 2:
                continue
            view = members[0][1]
            source = torch.cat([torch.arange(v.storage_offset(), v.storage_offset() + v.numel())
                                for _, v in members])
            compact = torch.cat([torch.arange(p.offset, p.offset + p.length)
                                 for p, _ in members])
            runs.append(_WholeRuns(view.new_empty(0).set_(view.untyped_storage()),
                                   source.to(view.device), compact.to(view.device)))
            covered.update(id(p) for p, _ in members)
        if len(self._runs) > 8:  # buffers replaced again and again: keep the newest only
            self._runs.clear()
        self._runs[key] = (runs, covered)
        return runs, covered

    def _batched(self, group: int, flat_of, device: torch.device) -> tuple:
        """The runs and the pieces they cover, if the runs' storages are on ``device``."""
        runs, covered = self._whole(group, flat_of)
        if any(run.storage.device != device for run in runs):
            return [], set()  # e.g. host copies of a device model's states: piece by piece
        return runs, covered

    def gather(self, group: int, flat_of, out: torch.Tensor) -> torch.Tensor:
        """Fills ``out`` (the group's compact buffer) from ``flat_of(shard)`` tensors."""
        runs, covered = self._batched(group, flat_of, out.device)
        for run in runs:
            out.index_copy_(0, run.compact,
                            run.storage.index_select(0, run.source).to(out.dtype))
        for piece in self.pieces.get(group, ()):
            if id(piece) in covered:
                continue
            dst = out[piece.offset:piece.offset + piece.length]
            src = flat_of(piece.shard)
            if piece.segment is None:
                dst.copy_(src)
            elif piece.length:
                block = piece.segment.view(src)
                dst.view(piece.segment.rows, -1).copy_(
                    block.index_select(1, piece.index_on(block.device)))
        return out

    def scatter(self, group: int, values: torch.Tensor, flat_of) -> None:
        """Writes the group's compact ``values`` into ``flat_of(shard)`` tensors (cast)."""
        runs, covered = self._batched(group, flat_of, values.device)
        for run in runs:
            run.storage.index_copy_(0, run.source,
                                    values.index_select(0, run.compact).to(run.storage.dtype))
        for piece in self.pieces.get(group, ()):
            if id(piece) in covered:
                continue
            src = values[piece.offset:piece.offset + piece.length]
            dst = flat_of(piece.shard)
            if piece.segment is None:
                dst.copy_(src)
            elif piece.length:
                block = piece.segment.view(dst)
                block.index_copy_(1, piece.index_on(block.device),
                                  src.view(piece.segment.rows, -1).to(block.dtype))

    def total(self) -> int:
        """Elements over all groups."""
        return sum(self.sizes.values())


def build_plans(shards: Sequence, matrices: List[Matrix], masks: Dict[int, torch.Tensor],
                device) -> tuple:
    """(gpu plan, cpu plan) for local column ``masks`` (matrix shard index -> bool mask).

    The GPU side gets every parameter that is not a matrix and the selected columns of
    each matrix; the CPU side the other columns.
    """
    by_shard = {m.shard: m for m in matrices}
    sides = ({"pieces": {}, "sizes": {}}, {"pieces": {}, "sizes": {}})
    for index, shard in enumerate(shards):
        matrix = by_shard.get(index)
        if matrix is None:
            if shard.numel:
                _add(sides[0], shard.group, Piece(index, 0, shard.numel))
            continue
        mask = masks[index]
        for seg in matrix.segments:
            part = mask[seg.col_lo:seg.col_hi]
            for side, chosen in ((sides[0], part), (sides[1], ~part)):
                cols = torch.nonzero(chosen).flatten().to(device)
                if cols.numel():
                    _add(side, shard.group, Piece(index, 0, seg.rows * cols.numel(), seg, cols))
    return tuple(Plan(side["pieces"], side["sizes"]) for side in sides)


def _add(side: dict, group: int, piece: Piece) -> None:
    piece.offset = side["sizes"].get(group, 0)
    side["pieces"].setdefault(group, []).append(piece)
    side["sizes"][group] = piece.offset + piece.length
