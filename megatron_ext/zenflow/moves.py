"""Re-selection: every state element moves to its side under the new plans.

Two ways, one per place of the CPU side's states (the states choose, through
:meth:`.cpu_states.CpuStates.move`); both are plain copies and give the same states:

* :meth:`Move.whole_groups` (states in host memory): one kind of state at a time, whole
  param groups. Each old GPU buffer crosses to the host in one copy, is scattered with the
  CPU side's old states by the old plans into full per-shard fp32 tensors, and these are
  gathered by the new plans into the new GPU buffer (one copy to the device) and the new
  CPU states. The kind's old states are dropped before the next kind: host memory holds
  the old states and about one kind more, and a GPU makes few large copies.
* :meth:`Move.segments` (states in the offload tiers): one matrix segment (or 1-D
  parameter) at a time, its three states are assembled on the host from the old GPU
  buffers and the CPU side's old states (read through the states' interface), then cut by
  the new plans into new GPU buffers and the CPU side's new states (which the CPU side
  fills, wherever it keeps them). Nothing of the size of the CPU side's states is held
  besides the old and the new states themselves.

No moment is lost or duplicated.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from megatron_ext.zenflow.selection import Plan

KINDS = ("master", "exp_avg", "exp_avg_sq")
"""The three states of every element: the fp32 master and Adam's two moments."""

ROWS_ELEMENTS = 1 << 22
"""Elements of a matrix segment assembled at a time by :meth:`Move.segments` (its rows
rounded down: 48 MB of fp32 states)."""

Fill = Callable[[int, int, int, List[torch.Tensor]], None]
"""``fill(group, start, length, [master, exp_avg, exp_avg_sq])``: writes elements
``[start, start + length)`` of ``group``'s three states into the fp32 views."""

States = Dict[str, Dict[int, torch.Tensor]]
"""kind -> param group -> compact fp32 tensor."""

Read = Callable[[int, int, int, List[torch.Tensor]], None]
"""``read(group, start, length, [master, exp_avg, exp_avg_sq])``: the CPU side's old
states' elements (:meth:`~.cpu_states.CpuStates.read`)."""

Replace = Callable[[Dict[int, int], Fill], None]
"""``replace(sizes, fill)``: the CPU side's new states of the per-group ``sizes``, written
by ``fill`` (which reads the old ones)."""


def _units(plan: Plan) -> Dict[tuple, tuple]:
    """(shard, segment offset or None) -> (group, piece) of every piece of ``plan``."""
    return {(p.shard, None if p.segment is None else p.segment.offset): (g, p)
            for g, pieces in plan.pieces.items() for p in pieces}


def _cut(piece, state: torch.Tensor) -> torch.Tensor:
    """The piece's columns of a unit's assembled state, flat."""
    if piece.segment is None:
        return state
    return state.index_select(1, piece.index_on(torch.device("cpu"))).reshape(-1)


def _blocks(piece, lo: int, hi: int):
    """(r0, r1, flat start) of the row blocks that cover ``[lo, hi)`` of a piece's elements.

    Blocks of ``ROWS_ELEMENTS`` aligned to the segment (neighbouring ranges share them);
    one block of the whole piece for a 1-D parameter.
    """
    seg = piece.segment
    if seg is None:
        yield 0, 1, 0
        return
    cols = piece.length // seg.rows
    step = max(1, ROWS_ELEMENTS // seg.width)
    r = (lo // cols) // step * step
    while r * cols < hi:
        r1 = min(seg.rows, r + step)
        yield r, r1, r * cols
        r = r1


@dataclasses.dataclass
class Move:
    """One re-selection's move: the GPU side's states and both sides' old and new plans.

    Between windows only (every accumulator consumed). The CPU side's states pick
    :meth:`whole_groups` or :meth:`segments`.
    """

    gpu: States
    """The GPU side's states under ``old_gpu`` (the CPU side's are under ``old_cpu``)."""
    old_gpu: Plan
    old_cpu: Plan
    new_gpu: Plan
    new_cpu: Plan
    shards: Sequence
    """The rank's optimizer shards (``group``, ``numel``): :meth:`whole_groups` rebuilds a
    param group's shards whole."""
    device: torch.device

    def whole_groups(self, cpu_old: States) -> Tuple[States, States]:
        """(the GPU side's new states, the CPU side's), one kind at a time.

        ``cpu_old``: the CPU side's old states, whole groups; each kind's dict is emptied
        once the kind has moved, and ``gpu``'s kind replaced (in place) by the new one, so
        that only one kind is held twice. The new CPU states are whole tensors per group.
        """
        groups = sorted({s.group for s in self.shards})
        new_cpu_sizes = dict(self.new_cpu.sizes)
        cpu_new: States = {}
        for kind in KINDS:
            old = cpu_old[kind]
            gpu_new, cpu_new[kind] = {}, {}
            for group in groups:
                full = {i: torch.empty(s.numel, dtype=torch.float32)
                        for i, s in enumerate(self.shards) if s.group == group}
                if group in self.gpu[kind]:
                    self.old_gpu.scatter(group, self.gpu[kind][group].cpu(), full.__getitem__)
                if group in old:
                    self.old_cpu.scatter(group, old[group], full.__getitem__)
                if group in self.new_gpu.sizes:
                    gpu_new[group] = self.new_gpu.gather(group, full.__getitem__, torch.empty(
                        self.new_gpu.sizes[group], dtype=torch.float32)).to(self.device)
                if group in new_cpu_sizes:
                    cpu_new[kind][group] = self.new_cpu.gather(group, full.__getitem__,
                                                               torch.empty(new_cpu_sizes[group]))
                del full
            self.gpu[kind] = gpu_new
            old.clear()
        return self.gpu, cpu_new

    def old_cpu_reads(self, group: int, start: int, length: int) -> List[Tuple[int, int, int]]:
        """The CPU side's old states that :meth:`segments`' fill of these new ones reads.

        ``(old group, start, length)`` of the rows of old CPU pieces that the new CPU
        elements ``[start, start + length)`` of ``group`` are cut from (a source may free
        what no later fill reads).
        """
        if not hasattr(self, "_old_cpu_units"):
            self._old_cpu_units = _units(self.old_cpu)
        out = []
        for piece in self.new_cpu.pieces.get(group, ()):
            lo, hi = max(start, piece.offset), min(start + length, piece.offset + piece.length)
            if lo >= hi:
                continue
            unit = self._old_cpu_units.get(
                (piece.shard, None if piece.segment is None else piece.segment.offset))
            if unit is None or not unit[1].length:
                continue
            old = unit[1]
            cols = 1 if old.segment is None else old.length // old.segment.rows
            for r0, r1, _ in _blocks(piece, lo - piece.offset, hi - piece.offset):
                if old.segment is None:
                    out.append((unit[0], old.offset, old.length))
                else:
                    out.append((unit[0], old.offset + r0 * cols, (r1 - r0) * cols))
        return out

    def segments(self, read: Read, replace: Replace) -> States:
        """The GPU side's new states; the CPU side's are written through ``replace``.

        ``read``: the CPU side's old states (also while ``replace`` runs). A matrix
        segment is assembled a block of rows at a time (``ROWS_ELEMENTS``): a rank's
        whole embedding is one segment, whose three fp32 states and their parts would
        otherwise be held whole (Llama-3-8B's: ~12 GB at once).
        """
        old_g, old_c = _units(self.old_gpu), _units(self.old_cpu)
        last: Dict[str, object] = {"key": None, "states": None}

        def assemble(key: tuple, r0: int, r1: int) -> List[torch.Tensor]:
            """Rows ``[r0, r1)`` of the unit's master, exp_avg and exp_avg_sq, fp32, host.

            ``[rows, width]`` for a matrix segment, flat (whole) for a 1-D parameter.
            """
            if last["key"] == (key, r0, r1):
                return last["states"]
            sources = [(side, unit) for side, unit in (("gpu", old_g.get(key)),
                                                        ("cpu", old_c.get(key)))
                       if unit is not None]
            first = sources[0][1][1]
            seg = first.segment
            shape = (first.length,) if seg is None else (r1 - r0, seg.width)
            states = [torch.empty(shape, dtype=torch.float32) for _ in KINDS]
            for side, (group, piece) in sources:
                if not piece.length:
                    continue
                cols = 1 if seg is None else piece.length // seg.rows
                lo, n = (0, piece.length) if seg is None else (r0 * cols, (r1 - r0) * cols)
                if side == "gpu":
                    parts = [self.gpu[kind][group][piece.offset + lo:piece.offset + lo + n]
                             .cpu() for kind in KINDS]
                else:
                    parts = [torch.empty(n) for _ in KINDS]
                    read(group, piece.offset + lo, n, parts)
                for state, part in zip(states, parts):
                    if seg is None:
                        state.copy_(part)
                    else:
                        state.index_copy_(1, piece.index_on(torch.device("cpu")),
                                          part.view(r1 - r0, -1))
            last["key"], last["states"] = (key, r0, r1), states
            return states

        def key_of(piece) -> tuple:
            return (piece.shard, None if piece.segment is None else piece.segment.offset)

        gpu_new = {kind: {g: torch.empty(n, dtype=torch.float32, device=self.device)
                          for g, n in self.new_gpu.sizes.items()} for kind in KINDS}
        for key, (group, piece) in _units(self.new_gpu).items():
            if not piece.length:
                continue
            for r0, r1, at in _blocks(piece, 0, piece.length):
                for kind, state in zip(KINDS, assemble(key, r0, r1)):
                    cut = _cut(piece, state)
                    start = piece.offset + at
                    gpu_new[kind][group][start:start + cut.numel()].copy_(cut)
        new_pieces = {g: [(p.offset, p) for p in pieces]
                      for g, pieces in self.new_cpu.pieces.items()}

        def fill(group: int, start: int, length: int, views: List[torch.Tensor]) -> None:
            for offset, piece in new_pieces.get(group, ()):
                lo, hi = max(start, offset), min(start + length, offset + piece.length)
                if lo >= hi:
                    continue
                for r0, r1, at in _blocks(piece, lo - offset, hi - offset):
                    cuts = [_cut(piece, state) for state in assemble(key_of(piece), r0, r1)]
                    a = max(lo, offset + at)
                    b = min(hi, offset + at + cuts[0].numel())
                    for view, cut in zip(views, cuts):
                        view[a - start:b - start].copy_(cut[a - offset - at:b - offset - at])

        replace(dict(self.new_cpu.sizes), fill)
        return gpu_new


def move_states(gpu: States, old_gpu: Plan, old_cpu: Plan, new_gpu: Plan, new_cpu: Plan,
                shards: Sequence, cpu, device: torch.device) -> States:
    """The GPU side's new states; the CPU side's are replaced through ``cpu.move``.

    ``cpu``: the :class:`~.cpu_worker.CpuWorker`. ``gpu``: the GPU side's states under
    ``old_gpu`` (its kinds may be replaced in place); the CPU side's are under ``old_cpu``.
    ``shards``: the rank's optimizer shards. The CPU side's states choose the way
    (:class:`Move`). Between windows only (every accumulator consumed).
    """
    return cpu.move(Move(gpu, old_gpu, old_cpu, new_gpu, new_cpu, shards, device))
