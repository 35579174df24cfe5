"""Re-selection moves: every state element reaches its new side, with either CPU states.

Each element's three states carry its id (1000 x shard + position, plus 0.25 / 0.5 per
kind), so a lost, duplicated or misplaced element shows as a wrong value after the move.
The two ways of moving (whole groups for host memory, segments for the tiers) give the same
states bit for bit, and the host's frees each old kind before it builds the next.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.optim.sharded_optimizer import Shard
from megatron_ext.zenflow.cpu_states import HostCpuStates, TieredCpuStates
from megatron_ext.zenflow.cpu_worker import CpuWorker
from megatron_ext.zenflow.moves import KINDS, move_states
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
        gpu_new = move_states(gpu, old_gpu, old_cpu, new_gpu, new_cpu, shard_list, cpu,
                              CPU)
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


def random_states(plan, seed):
    """kind -> group -> random fp32 values of ``plan``'s sizes (exp_avg_sq >= 0, as Adam
    keeps it: the tiers' remainders use its sign bit)."""
    gen = torch.Generator().manual_seed(seed)
    return {kind: {g: torch.randn(n, generator=gen).abs() if kind == "exp_avg_sq" else
                   torch.randn(n, generator=gen) for g, n in plan.sizes.items()}
            for kind in KINDS}


def seeded(cpu, sizes, values):
    """``cpu``'s states of ``sizes`` set to ``values`` (kind -> group -> tensor)."""
    def seed(group, start, length, views):
        for kind, view in zip(KINDS, views):
            view.copy_(values[kind][group][start:start + length])
    cpu.resize(sizes)
    cpu.reselect(dict(sizes), seed)


def test_host_and_tiers_moves_give_identical_states(make_offload_engine):
    """Whole groups (host memory) and segments (tiers): the same states, bit for bit."""
    shard_list = shards()
    matrices = matrices_of(shard_list)[1]
    old_gpu, old_cpu = build_plans(shard_list, matrices, masks(matrices, 3), CPU)
    new_gpu, new_cpu = build_plans(shard_list, matrices, masks(matrices, 4), CPU)
    gpu_values, cpu_values = random_states(old_gpu, 5), random_states(old_cpu, 6)
    got = {}
    for place, states in (("host", HostCpuStates()),
                          ("tiers", TieredCpuStates(make_offload_engine))):
        cpu = CpuWorker({}, torch.bfloat16, pin=False, states=states)
        try:
            seeded(cpu, old_cpu.sizes, cpu_values)
            gpu = {kind: {g: t.clone() for g, t in v.items()} for kind, v in gpu_values.items()}
            gpu_new = move_states(gpu, old_gpu, old_cpu, new_gpu, new_cpu, shard_list, cpu, CPU)
            cpu_new = {}
            for group, n in new_cpu.sizes.items():
                cpu_new[group] = [torch.full((n,), float("nan")) for _ in KINDS]
                states.read(group, 0, n, cpu_new[group])
            got[place] = (gpu_new, cpu_new, {g: t.numel() for g, t in cpu.upload.items()})
        finally:
            cpu.close()
    (host_gpu, host_cpu, host_upload), (tier_gpu, tier_cpu, tier_upload) = got["host"], \
        got["tiers"]
    assert host_upload == tier_upload == new_cpu.sizes
    for kind in KINDS:
        assert host_gpu[kind].keys() == tier_gpu[kind].keys() == new_gpu.sizes.keys()
        for group in new_gpu.sizes:
            assert torch.equal(host_gpu[kind][group], tier_gpu[kind][group]), (kind, group)
    assert host_cpu.keys() == tier_cpu.keys() == new_cpu.sizes.keys()
    for group in new_cpu.sizes:
        for k, kind in enumerate(KINDS):
            assert not host_cpu[group][k].isnan().any(), (kind, group)
            assert torch.equal(host_cpu[group][k], tier_cpu[group][k]), (kind, group)


class _SpyPlan:
    """A plan whose ``gather`` calls are recorded (with what the CPU side holds then)."""

    def __init__(self, plan, on_gather):
        self._plan, self._on_gather = plan, on_gather

    def __getattr__(self, name):
        return getattr(self._plan, name)

    def gather(self, group, flat_of, out):
        result = self._plan.gather(group, flat_of, out)
        self._on_gather(group, result)
        return result


def test_host_move_frees_each_old_kind_before_the_next():
    """Host memory holds the old states and one kind's new ones at most, while moving.

    At each new CPU tensor of kind ``k`` the old states of the kinds before ``k`` are gone
    (the states' ``host_bytes``), the GPU side's kinds before ``k`` are the new ones, and
    only kind ``k``'s new CPU tensors exist besides those of the moved kinds.
    """
    shard_list = shards()
    matrices = matrices_of(shard_list)[1]
    old_gpu, old_cpu = build_plans(shard_list, matrices, masks(matrices, 1), CPU)
    new_gpu, new_cpu = build_plans(shard_list, matrices, masks(matrices, 2), CPU)
    states = HostCpuStates()
    cpu = CpuWorker({}, torch.bfloat16, pin=False, states=states)
    try:
        seeded(cpu, old_cpu.sizes, random_states(old_cpu, 7))
        gpu = random_states(old_gpu, 8)
        old_gpu_kinds = dict(gpu)
        old_kind_bytes = 4 * sum(old_cpu.sizes.values())
        assert states.host_bytes() == 3 * old_kind_bytes
        seen = []

        def on_gather(group, tensor):
            k = len(seen) // len(new_cpu.sizes)  # the kind being built: groups in order
            seen.append((k, group, states.host_bytes()))
            assert states.host_bytes() == (3 - k) * old_kind_bytes, seen
            for j, kind in enumerate(KINDS):
                assert (gpu[kind] is old_gpu_kinds[kind]) == (j >= k), (kind, seen)

        gpu_new = move_states(gpu, old_gpu, old_cpu, new_gpu, _SpyPlan(new_cpu, on_gather),
                              shard_list, cpu, CPU)
        assert [k for k, _, _ in seen] == [k for k in range(3) for _ in new_cpu.sizes]
        assert [g for _, g, _ in seen] == sorted(new_cpu.sizes) * 3
        assert gpu_new is gpu and all(gpu[kind] is not old_gpu_kinds[kind] for kind in KINDS)
        assert states.host_bytes() == 3 * 4 * sum(new_cpu.sizes.values())
    finally:
        cpu.close()
