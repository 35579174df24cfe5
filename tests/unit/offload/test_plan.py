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
    (0, 1, 3),        # no cache: the pipeline's three buffers, every state in a file
])
def test_cache_capacity(tmp_path, cache, n_paths, capacity):
    plan = make_plan(paths(tmp_path, [1.0] * n_paths), cache)
    assert plan.capacity == capacity


@pytest.mark.parametrize("cache, n_paths, message", [
    (2, 1, "the pipeline needs 3"),
    (7, 0, "holds 7 of the 8 subgroups of this rank and there is no --offload-paths"),
    (0, 0, "--offload-host-cache-gb 0 keeps none of the 8 subgroups of rank 0 in host memory "
           "and there is no --offload-paths for them: give --offload-paths DIR, or a positive "
           "--offload-host-cache-gb"),
])
def test_a_host_cache_too_small_is_one_clear_error(tmp_path, cache, n_paths, message):
    with pytest.raises(UsageError, match=message):
        make_plan(paths(tmp_path, [1.0] * n_paths), cache)


def test_no_host_cache_puts_every_state_in_a_file(tmp_path):
    plan = make_plan(paths(tmp_path, [1.0]), 0)
    assert plan.resident == frozenset() and plan.host_only() == 0
    assert plan.home == [0] * len(SIZES)
    assert "(0: no cache, the pipeline's buffers only)" in plan.describe()


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


# ---------------------------------------------------------------- auto sizes
# The host's share: (MemAvailable - reserve) / ranks - the pipeline's buffers (three fp32
# staging/scratch buffers of the largest subgroup and one state buffer); each cached
# subgroup one buffer of SG bytes. A path's room: its free space / ranks less the spares.
PIPELINE = 3 * 4 * max(NUMELS) + SG
SPARES = (plan_module.SPARES_PER_SIZE + 1) * SG


def mem_gb(buffers):
    """The MemAvailable (GB) that holds ``buffers`` cache buffers with no reserve."""
    return (PIPELINE + buffers * SG) / 1e9


def auto_plan(tiers, buffers, free=None, budget=None, **extra):
    """A plan with every size auto, MemAvailable and the paths' free space injected."""
    extra.setdefault("offload_host_reserve_gb", 0.0)
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[t.path for t in tiers],
                        offload_mem_available_gb=mem_gb(buffers),
                        offload_path_free_gb=[(SPARES + f) / 1e9 for f in free or []],
                        **extra)
    return TierPlan(cfg, NUMELS, SIZES, SG, tiers=tiers, rank=0, device=CPU,
                    device_budget_bytes=budget)


@pytest.fixture(autouse=True)
def one_rank_per_node(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)


HOOK = {"offload_device_memory_limit_gb": 1.0}  # a CPU run's device tier, turned on


def test_auto_fills_the_device_tier_to_its_budget_then_the_host_then_the_paths(tmp_path):
    # Device budget 2 kB: two subgroups, spread out. Host: four buffers, so one subgroup
    # without a file besides the pipeline's three. Paths: room for 3 + 2 kB.
    plan = auto_plan(paths(tmp_path, [1.0, 1.0]), 4, free=[3 * SG, 2 * SG], budget=2 * SG,
                     **HOOK)
    assert plan.device_members == [2, 6] and not plan.device_sized
    assert plan.capacity == 4 and plan.host_fits == 4
    assert plan.resident == frozenset({3})
    assert plan.home[2] == plan.home[6] == -1
    placed = plan.tier_bytes()
    assert placed == {"device": 2 * SG, "host": SG,
                      "path0": placed["path0"], "path1": placed["path1"]}
    assert placed["path0"] <= 3 * SG and placed["path1"] <= 2 * SG
    assert placed["path0"] + placed["path1"] == sum(SIZES) - 3 * SG
    assert plan.room == [3 * SG, 2 * SG]
    line = plan.describe()
    assert "device 2e-06 GB in 2 subgroups (auto: the plan's budget 2e-06 GB" in line
    assert "host cache 4e-06 GB, 4 subgroups, 1 of them without a file (auto: MemAvailable" \
        in line
    assert "path0" in line and "path1" in line and "(room 3e-06 GB)" in line


def test_without_a_budget_auto_waits_for_the_first_step(tmp_path):
    plan = auto_plan(paths(tmp_path, [1.0]), 3, free=[8 * SG], **HOOK)
    assert plan.device_members == [] and plan.device_budget is None
    with pytest.raises(TierFullError, match="no GPU budget from the memory plan"):
        auto_plan(paths(tmp_path, [1.0]), 3, free=[6 * SG], **HOOK)
    # With the budget, the same host and path hold the rest.
    plan = auto_plan(paths(tmp_path, [1.0]), 3, free=[6 * SG], budget=SG * 2, **HOOK)
    assert plan.device_bytes() == 2 * SG and plan.tier_bytes()["path0"] == sum(SIZES) - 2 * SG


@pytest.mark.parametrize("buffers, capacity", [(8, None), (20, None)])
def test_auto_host_without_paths_holds_everything_when_it_fits(buffers, capacity):
    assert auto_plan([], buffers).capacity == capacity


def test_auto_host_without_paths_refuses_in_one_line_with_the_numbers():
    with pytest.raises(UsageError) as err:
        auto_plan([], 7)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("host memory holds 7 of the 8 subgroups of rank 0")
    assert f"MemAvailable {mem_gb(7):.3g} GB less a reserve of 0 GB" in message
    assert "add --offload-paths DIR" in message


def test_auto_host_with_paths_takes_what_fits_and_the_paths_the_rest(tmp_path):
    plan = auto_plan(paths(tmp_path, [1.0]), 5, free=[20 * SG])
    assert plan.capacity == 5 and plan.resident == frozenset()  # the paths have room
    plan = auto_plan(paths(tmp_path, [1.0]), 5, free=[6 * SG])
    # 7.4 kB of state, 6 kB of room: two stay in host memory without a file.
    assert plan.capacity == 5 and len(plan.resident) == 2
    assert plan.tier_bytes()["host"] + plan.tier_bytes()["path0"] == sum(SIZES)
    assert plan.host_only() == 2
    with pytest.raises(TierFullError, match=r"host memory \(MemAvailable .*\) keeps at most 2"):
        auto_plan(paths(tmp_path, [1.0]), 5, free=[5 * SG])


def test_auto_host_too_small_for_the_pipeline(tmp_path):
    with pytest.raises(UsageError, match="host memory holds 2 subgroups .* the pipeline needs 3"):
        auto_plan(paths(tmp_path, [1.0]), 2, free=[20 * SG])


def test_the_node_s_ranks_share_host_memory_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[str(tmp_path)],
                        offload_mem_available_gb=2 * mem_gb(5), offload_host_reserve_gb=0.0,
                        offload_path_free_gb=[2 * (SPARES + 6 * SG) / 1e9])
    plan = TierPlan(cfg, NUMELS, SIZES, SG, tiers=[plan_module.TierSpec(str(tmp_path), 1.0, 1.0)],
                    rank=0, device=CPU)
    assert plan.capacity == 5 and plan.room == [6 * SG]


def test_the_host_reserve_defaults_to_a_tenth_of_mem_available(tmp_path):
    cfg = OffloadConfig(offload_optimizer=True, offload_mem_available_gb=100 * SG / 1e9)
    plan = TierPlan(cfg, NUMELS, SIZES, SG, tiers=paths(tmp_path, [1.0]), rank=0, device=CPU)
    assert plan.host.reserve == 10 * SG
    assert plan.capacity == min(8, (90 * SG - PIPELINE) // SG)


def test_a_cpu_run_without_the_knob_keeps_the_rule_from_before_auto(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGATRON_EXT_MEMAVAILABLE_GB", raising=False)
    assert make_plan(paths(tmp_path, [1.0])).capacity == 3
    assert make_plan([]).capacity is None
    assert make_plan([]).host is None


def test_the_first_step_shrinks_a_budgeted_device_tier_onto_a_path(tmp_path):
    plan = auto_plan(paths(tmp_path, [1.0]), 4, free=[20 * SG], budget=2 * SG,
                     offload_device_reserve_gb=0.0, offload_device_memory_limit_gb=5 * SG / 1e9,
                     offload_device_peak_gb=[[1, 4 * SG / 1e9]])
    limit, peak = plan.memory(step_count=0)
    assert peak == 4 * SG + 2 * SG  # the states count as held
    joining, leaving = plan.resize_device(limit, peak)
    assert joining == [] and leaving == [6]  # room for one: the last to join leaves
    plan.leave(6, to_host=False)  # before the fill: it has no state yet
    assert plan.device_members == [2] and plan.home[6] == 0 and 6 not in plan.resident
    assert plan.tier_of(6, cached=False, location=None).kind is TierKind.HOST


def test_the_first_step_shrinks_a_budgeted_device_tier_into_host_memory(tmp_path):
    # The path holds exactly the hosted subgroups; host memory has room for 8 buffers.
    plan = auto_plan(paths(tmp_path, [1.0]), 8, free=[5 * SG + 400], budget=2 * SG, **HOOK)
    assert plan.capacity == 6 and plan.resident == frozenset()
    plan.leave(6, to_host=False)
    assert plan.capacity == 7 and plan.resident == frozenset({6}) and plan.home[6] == -1


def test_a_device_tier_that_gives_back_where_nothing_has_room_is_one_line(tmp_path):
    plan = auto_plan(paths(tmp_path, [1.0]), 3, free=[5 * SG + 400], budget=2 * SG, **HOOK)
    with pytest.raises(UsageError) as err:
        plan.leave(6, to_host=False)
    assert "\n" not in str(err.value)
    assert "gives back subgroup 6" in str(err.value) and "neither the paths" in str(err.value)


def test_the_first_step_grows_a_budgeted_device_tier(tmp_path):
    plan = auto_plan(paths(tmp_path, [1.0]), 4, free=[20 * SG], budget=2 * SG,
                     offload_device_reserve_gb=0.0, offload_device_memory_limit_gb=9 * SG / 1e9,
                     offload_device_peak_gb=[[1, 4 * SG / 1e9]])
    joining, leaving = plan.resize_device(*plan.memory(step_count=0))
    assert leaving == [] and len(joining) == 3
    assert joining == [i for i in plan.promotion_order() if i not in (2, 6)][:3]


def test_giving_back_without_paths_checks_host_memory():
    plan = auto_plan([], 6, budget=2 * SG, **HOOK)
    assert plan.capacity is None and plan.host_fits == 6
    with pytest.raises(UsageError, match="host memory holds 6 of the 7 subgroups now on the host"):
        plan.leave(6, to_host=False)


@pytest.mark.parametrize("alternate, cache, want", [
    # 8 subgroups on one path; the last one has 400 bytes.
    (True, 3, (sum(SIZES) - (3 * SG + (2 * SG + 400)) / 2)),
    (False, 3, sum(SIZES)),
    (True, 8, 0.0),
])
def test_path_io_per_step(tmp_path, alternate, cache, want):
    plan = make_plan(paths(tmp_path, [1.0]), cache, offload_alternate_order=alternate)
    assert plan.path_io_per_step() == [want]


def test_rebalancing_stays_within_each_path_s_room(tmp_path):
    # Path 1 has room for exactly what it was given: however slow path 0 gets, nothing
    # moves there (before, a move could overfill a path that auto had sized).
    tiers = paths(tmp_path, [1.0, 1.0])
    plan = auto_plan(tiers, 3, free=[20 * SG, 20 * SG])
    room = [sum(SIZES[i] for i, h in enumerate(plan.home) if h == p) for p in (0, 1)]
    plan = auto_plan(tiers, 3, free=[20 * SG, room[1]])
    assert plan.room[1] == room[1] and plan.path_subgroups(1) == 4
    moves = []
    for _ in range(12):
        plan.observe_io(0, 10**8, 1.0)
        plan.observe_io(1, 10**8, 0.1)
        moves += plan.rebalance(bad_paths=set())
    assert moves == [] and plan.path_subgroups(1) == 4


def test_the_first_step_sizes_the_device_tier_from_what_the_allocator_needed(monkeypatch):
    """On a GPU the first sizing takes the caching allocator's reserved peak (the segments'
    slack beside the tensors: the next iteration needs it again) within what the process
    can hold (the CUDA context and other processes' memory left out): Llama-3-8B's first
    iteration allocated 85.75 GB at most but held ~91 GB, and the tier sized from the
    allocated peak and the device's whole memory left iteration 2 short (CUDA OOM,
    bench/results/2026-12-03c-h200 call4)."""
    total, context = 20 * SG, SG  # the device; memory outside the allocator
    allocated, reserved_peak, reserved_now = 11 * SG, 13 * SG, 4 * SG
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: reserved_peak)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved_now)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (total - context - reserved_now, total))
    cfg = OffloadConfig(offload_optimizer=True, offload_mem_available_gb=mem_gb(20),
                        offload_host_reserve_gb=0.0, offload_device_reserve_gb=SG / 1e9)
    plan = TierPlan(cfg, NUMELS, SIZES, SG, tiers=[], rank=0, device=torch.device("cuda", 0))
    assert plan.device_auto and plan.device_members == []
    limit, peak = plan.memory(step_count=0)
    assert (limit, peak) == (total - context, reserved_peak)
    joining, leaving = plan.resize_device(limit, peak)
    for index in joining:
        plan.join(index)
    # The next iteration: its reserved peak beside the tier, and the reserve, fit in what the
    # allocator can hold; the tier takes that room (19 - 1 - 13 kB: five subgroups).
    assert reserved_peak + plan.device_bytes() + SG <= total - context
    assert plan.device_bytes() == 5 * SG
