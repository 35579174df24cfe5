"""The tier plan: host-cache capacity, placement over the paths, the device tier, the split."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.offload import plan as plan_module
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.paths import TierFullError
from megatron_ext.offload.plan import TierPlan
from megatron_ext.offload.tier_model import TierKind, Updater

SG = 1000  # bytes of a full subgroup's state in these tests
SIZES = [SG] * 7 + [400]  # eight subgroups, the last one short
NUMELS = [s // 10 for s in SIZES]
CPU = torch.device("cpu")


def paths(tmp_path, gbps):
    from megatron_ext.offload.paths import TierSpec

    out = []
    for i, rate in enumerate(gbps):
        (tmp_path / f"p{i}").mkdir(exist_ok=True)
        out.append(TierSpec(str(tmp_path / f"p{i}"), read_gbps=rate, write_gbps=rate))
    return out


def make_plan(tiers, cache_subgroups=None, **extra):
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[t.path for t in tiers],
                        offload_host_cache_gb=(None if cache_subgroups is None
                                               else cache_subgroups * SG / 1e9), **extra)
    return TierPlan(cfg, NUMELS, SIZES, SG, tiers=tiers, rank=0, device=CPU)


@pytest.mark.parametrize("cache, n_paths, capacity", [
    (None, 0, None),  # everything in host memory, no budget
    (None, 1, 3),     # the pipeline's three buffers
    (5, 1, 5),
    (8, 0, None),     # all eight fit: no budget needed
])
def test_cache_capacity(tmp_path, cache, n_paths, capacity):
    plan = make_plan(paths(tmp_path, [1.0] * n_paths), cache)
    assert plan.capacity == capacity


@pytest.mark.parametrize("cache, n_paths, message", [
    (2, 1, "the pipeline needs 3"),
    (7, 0, "holds 7 of the 8 subgroups of this rank and there is no --offload-paths"),
])
def test_a_host_cache_too_small_is_one_clear_error(tmp_path, cache, n_paths, message):
    with pytest.raises(UsageError, match=message):
        make_plan(paths(tmp_path, [1.0] * n_paths), cache)


def test_placement_is_proportional_to_bandwidth_and_interleaved(tmp_path):
    plan = make_plan(paths(tmp_path, [3.0, 1.0]), 3)
    on = [sum(SIZES[i] for i, h in enumerate(plan.home) if h == p) for p in (0, 1)]
    assert abs(on[0] / sum(on) - 0.75) <= SG / sum(SIZES), plan.home
    assert plan.resident == frozenset()
    assert plan.path_subgroups(0) + plan.path_subgroups(1) == len(SIZES)
    assert plan.tier_bytes() == {"device": 0, "host": 0, "path0": on[0], "path1": on[1]}


def test_subgroups_the_paths_cannot_hold_stay_in_the_cache(tmp_path, monkeypatch):
    reserve = (plan_module.SPARES_PER_SIZE + 1) * SG
    monkeypatch.setattr(plan_module, "check_free_space", lambda path, need: reserve + 4 * SG)
    plan = make_plan(paths(tmp_path, [1.0]), 7)
    # Four of the eight fit on the path; the other four, from the middle, stay in the cache.
    assert plan.resident == frozenset({2, 3, 4, 5}), plan.resident
    assert plan.home == [0, 0, -1, -1, -1, -1, 0, 0]
    assert plan.tier_of(3, cached=True, location=None).kind is TierKind.HOST
    assert plan.tier_bytes()["host"] == 4 * SG


def test_paths_and_cache_too_small_is_one_clear_error(tmp_path, monkeypatch):
    reserve = (plan_module.SPARES_PER_SIZE + 1) * SG
    monkeypatch.setattr(plan_module, "check_free_space", lambda path, need: reserve + 2 * SG)
    with pytest.raises(TierFullError, match="a larger --offload-host-cache-gb helps too"):
        make_plan(paths(tmp_path, [1.0]), 4)


def test_fixed_device_tier_is_spread_and_needs_no_host_buffer(tmp_path):
    plan = make_plan(paths(tmp_path, [1.0]), 3, offload_device_cache_gb=str(2 * SG / 1e9))
    assert plan.device_members == [2, 6], plan.device_members
    assert plan.device_bytes() == 2 * SG
    assert [plan.on_device(i) for i in range(8)] == [i in (2, 6) for i in range(8)]
    assert plan.home[2] == plan.home[6] == -1 and plan.resident == frozenset()
    kinds = [plan.tier_of(i, cached=False, location=0).kind for i in range(8)]
    assert kinds == [TierKind.DEVICE if i in (2, 6) else TierKind.PATH for i in range(8)]
    assert plan.tier_bytes()["device"] == 2 * SG
    assert sum(plan.tier_bytes().values()) == sum(SIZES)


def test_auto_device_tier_is_none_on_the_cpu_without_the_memory_hook(monkeypatch):
    # auto is the default: a CPU run has no device memory to measure, so no device tier
    # (it was refused before auto became the default).
    monkeypatch.delenv("MEGATRON_EXT_DEVICE_MEMORY_LIMIT_GB", raising=False)
    for budget in (None, 4 * SG):
        plan = TierPlan(OffloadConfig(offload_optimizer=True), NUMELS, SIZES, SG, tiers=[],
                        rank=0, device=CPU, device_budget_bytes=budget)
        assert plan.device_members == [] and not plan.device_auto and plan.device_sized


def test_auto_device_tier_sizes_from_the_peak_then_gives_back(tmp_path):
    plan = make_plan(paths(tmp_path, [1.0]), 8, offload_device_cache_gb="auto",
                     offload_device_reserve_gb=0.0,
                     offload_device_memory_limit_gb=10 * SG / 1e9,
                     offload_device_peak_gb=((1, 6 * SG / 1e9), (3, 8.5 * SG / 1e9)))
    assert plan.device_members == [] and not plan.device_sized
    limit, peak = plan.memory(step_count=0)
    assert (limit, peak) == (10 * SG, 6 * SG)
    joining, leaving = plan.resize_device(limit, peak)
    # Room for 4 kB: paths first, spread out (bit-reversed order).
    assert leaving == [] and joining == plan.promotion_order()[:4] == [0, 4, 2, 6]
    for index in joining:
        plan.join(index)
    plan.device_sized = True
    assert plan.device_bytes() == 4 * SG
    limit, peak = plan.memory(step_count=2)  # the peak grew: 8.5 kB besides the states
    assert peak == 8.5 * SG + 4 * SG
    joining, leaving = plan.resize_device(limit, peak)
    assert joining == [] and leaving == [6, 2, 4]  # the last to join leave first
    for index in leaving:
        plan.leave(index, to_host=True)
    assert plan.device_members == [0]
    assert plan.resident == frozenset()  # they have a path to go back to


def test_leaving_without_a_path_makes_a_subgroup_resident():
    plan = make_plan([], offload_device_cache_gb=str(2 * SG / 1e9))
    index = plan.device_members[0]
    plan.leave(index, to_host=True)
    assert index in plan.resident and not plan.on_device(index)
    plan.join(index)
    assert index not in plan.resident and plan.on_device(index)


@pytest.mark.parametrize("share, gpu_update, want", [(None, True, 0.0), (0.5, True, 0.5),
                                                     (0.5, False, 0.0), (1.0, True, 1.0)])
def test_the_split_between_cpu_and_streamed_updates(share, gpu_update, want):
    plan = make_plan([], offload_stream_share=share, offload_gpu_update=gpu_update,
                     offload_device_cache_gb=str(SG / 1e9))
    assert plan.stream_share() == want
    order = list(range(8))[::-1]
    assigned = plan.assign(order)
    assert set(assigned) == set(range(8))
    assert [i for i in order if assigned[i] is Updater.DEVICE] == plan.device_members
    hosted = [i for i in order if not plan.on_device(i)]
    streamed = sum(NUMELS[i] for i in hosted if assigned[i] is Updater.STREAM)
    assert abs(streamed - want * sum(NUMELS[i] for i in hosted)) <= max(NUMELS)


def test_rebalance_skips_a_failed_path(tmp_path):
    plan = make_plan(paths(tmp_path, [1.0, 1.0]), 3)
    before = list(plan.home)
    for _ in range(6):  # path 0 runs at a tenth of path 1's throughput
        plan.observe_io(0, 10**8, 1.0)
        plan.observe_io(1, 10**8, 0.1)
        assert plan.rebalance(bad_paths={1}) == []
    assert plan.home == before
    moves = []
    for _ in range(6):
        plan.observe_io(0, 10**8, 1.0)
        plan.observe_io(1, 10**8, 0.1)
        moves += plan.rebalance(bad_paths=set())
    assert moves and all(source == 0 and target == 1 for _, source, target in moves)
    assert plan.home.count(1) > before.count(1)
