"""Re-selection moves: every state element reaches its new side, with either CPU states.

Each element's three states carry its id (1000 x shard + position, plus 0.25 / 0.5 per
kind), so a lost, duplicated or misplaced element shows as a wrong value after the move.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.optim.sharded_optimizer import Shard
from megatron_ext.zenflow.cpu_states import KINDS, HostCpuStates, TieredCpuStates
from megatron_ext.zenflow.cpu_worker import CpuWorker
from megatron_ext.zenflow.moves import move_states
from megatron_ext.zenflow.selection import build_plans, matrices_of

SPECS = [  # shape, group, owned range of the flattened parameter
    ((7, 5), 0, 3, 33), ((13,), 0, 2, 9), ((3, 11), 1, 0, 33), ((6, 7), 0, 14, 28),
    ((9,), 1, 0, 9), ((4, 6), 1, 5, 22),
]
CPU = torch.device("cpu")


def shards():
    return [Shard(torch.zeros(shape), group, start, end) for shape, group, start, end in SPECS]


def masks(matrices, seed):
    gen = torch.Generator().manual_seed(seed)
    return {m.shard: torch.rand(m.cols, generator=gen) < 0.4 for m in matrices}


def ids(shard_list):
    """kind -> per-shard flat ids."""
    base = [torch.arange(s.start, s.end, dtype=torch.float32) + 1000 * i
            for i, s in enumerate(shard_list)]
    return {kind: [b + 0.25 * k for b in base] for k, kind in enumerate(KINDS)}


@pytest.mark.parametrize("place", ["host", "tiers"])
def test_every_element_reaches_its_new_side(place, make_offload_engine):
    shard_list = shards()
    matrices = matrices_of(shard_list)[1]
    old_gpu, old_cpu = build_plans(shard_list, matrices, masks(matrices, 1), CPU)
    new_gpu, new_cpu = build_plans(shard_list, matrices, masks(matrices, 2), CPU)
    assert new_cpu.sizes != old_cpu.sizes or new_cpu.pieces != old_cpu.pieces
    want = ids(shard_list)
    states = HostCpuStates() if place == "host" else TieredCpuStates(make_offload_engine)
    cpu = CpuWorker({}, torch.bfloat16, pin=False, states=states)
    try:
        cpu.resize(old_cpu.sizes)
        # The old states: ids gathered by the old plans (the CPU side's through its
        # interface: a refill of fresh states with them).
        gpu = {kind: {g: old_gpu.gather(g, want[kind].__getitem__, torch.empty(n))
                      for g, n in old_gpu.sizes.items()} for kind in KINDS}
        old_values = {kind: {g: old_cpu.gather(g, want[kind].__getitem__, torch.empty(n))
                             for g, n in old_cpu.sizes.items()} for kind in KINDS}

        def seed(group, start, length, views):
            for kind, view in zip(KINDS, views):
                view.copy_(old_values[kind][group][start:start + length])
        cpu.reselect(dict(old_cpu.sizes), seed)
        gpu_new = move_states(gpu, old_gpu, old_cpu, new_gpu, new_cpu, cpu, CPU)
        assert {g: t.numel() for g, t in gpu_new["master"].items()} == new_gpu.sizes
        for kind in KINDS:
            full = [torch.full((s.end - s.start,), float("nan")) for s in shard_list]
            for group in new_gpu.sizes:
                new_gpu.scatter(group, gpu_new[kind][group], full.__getitem__)
            for group, n in new_cpu.sizes.items():
                parts = [torch.empty(n) for _ in KINDS]
                states.read(group, 0, n, parts)
                new_cpu.scatter(group, parts[KINDS.index(kind)], full.__getitem__)
            for i, (got, expected) in enumerate(zip(full, want[kind])):
                assert torch.equal(got, expected), (kind, i)
        assert cpu.acc_steps == [0, 0]  # fresh accumulators of the new sizes
        assert {g: t.numel() for g, t in cpu.acc[0].items()} == new_cpu.sizes
    finally:
        cpu.close()
