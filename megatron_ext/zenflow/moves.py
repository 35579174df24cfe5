"""Re-selection: every state element moves to its side under the new plans.

One matrix segment (or 1-D parameter) at a time, its three states (fp32 master, exp_avg,
exp_avg_sq) are assembled on the host from the old GPU buffers and the CPU side's old
states (read through :class:`~.cpu_states.CpuStates`), then cut by the new plans into new
GPU buffers and the CPU side's new states (which the CPU side fills through the same
interface, wherever it keeps them). Nothing of the size of the CPU side's states is held
besides the old and the new states themselves; no moment is lost or duplicated.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_ext.zenflow.cpu_states import KINDS
from megatron_ext.zenflow.cpu_worker import CpuWorker
from megatron_ext.zenflow.selection import Plan

States = Dict[str, Dict[int, torch.Tensor]]
"""kind -> param group -> compact fp32 tensor."""


def _units(plan: Plan) -> Dict[tuple, tuple]:
    """(shard, segment offset or None) -> (group, piece) of every piece of ``plan``."""
    return {(p.shard, None if p.segment is None else p.segment.offset): (g, p)
            for g, pieces in plan.pieces.items() for p in pieces}


def _cut(piece, state: torch.Tensor) -> torch.Tensor:
    """The piece's columns of a unit's assembled state, flat."""
    if piece.segment is None:
        return state
    return state.index_select(1, piece.index_on(torch.device("cpu"))).reshape(-1)


def move_states(gpu: States, old_gpu: Plan, old_cpu: Plan, new_gpu: Plan, new_cpu: Plan,
                cpu: CpuWorker, device: torch.device) -> States:
    """The GPU side's new states; the CPU side's are replaced (``cpu.reselect``).

    ``gpu``: the GPU side's states under ``old_gpu``; the CPU side's are under
    ``old_cpu``. Between windows only (every accumulator consumed).
    """
    old_g, old_c = _units(old_gpu), _units(old_cpu)
    last: Dict[str, object] = {"key": None, "states": None}

    def assemble(key: tuple) -> List[torch.Tensor]:
        """The unit's master, exp_avg and exp_avg_sq, fp32, on the host.

        ``[rows, width]`` for a matrix segment, flat for a 1-D parameter.
        """
        if last["key"] == key:
            return last["states"]
        sources = [(side, unit) for side, unit in (("gpu", old_g.get(key)),
                                                    ("cpu", old_c.get(key)))
                   if unit is not None]
        first = sources[0][1][1]
        seg = first.segment
        shape = (first.length,) if seg is None else (seg.rows, seg.width)
        states = [torch.empty(shape, dtype=torch.float32) for _ in KINDS]
        for side, (group, piece) in sources:
            if side == "gpu":
                parts = [gpu[kind][group][piece.offset:piece.offset + piece.length]
                         .cpu() for kind in KINDS]
            else:
                parts = [torch.empty(piece.length) for _ in KINDS]
                cpu.states.read(group, piece.offset, piece.length, parts)
            for state, part in zip(states, parts):
                if seg is None:
                    state.copy_(part)
                else:
                    state.index_copy_(1, piece.index_on(torch.device("cpu")),
                                      part.view(seg.rows, -1))
        last["key"], last["states"] = key, states
        return states

    gpu_new = {kind: {g: torch.empty(n, dtype=torch.float32, device=device)
                      for g, n in new_gpu.sizes.items()} for kind in KINDS}
    for key, (group, piece) in _units(new_gpu).items():
        for kind, state in zip(KINDS, assemble(key)):
            gpu_new[kind][group][piece.offset:piece.offset + piece.length].copy_(
                _cut(piece, state))
    new_pieces = {g: [(p.offset, p) for p in pieces] for g, pieces in new_cpu.pieces.items()}

    def fill(group: int, start: int, length: int, views: List[torch.Tensor]) -> None:
        for offset, piece in new_pieces.get(group, ()):
            lo, hi = max(start, offset), min(start + length, offset + piece.length)
            if lo >= hi:
                continue
            key = (piece.shard, piece.segment.offset)
            for view, state in zip(views, assemble(key)):
                view[lo - start:hi - start].copy_(_cut(piece, state)[lo - offset:hi - offset])

    cpu.reselect(dict(new_cpu.sizes), fill)
    return gpu_new
