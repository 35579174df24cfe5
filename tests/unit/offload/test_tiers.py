"""Offload tiers: tier specs, placement, rebalancing (pure), and the bandwidth probe (I/O)."""

import errno
import os
import random
from fractions import Fraction

import pytest

from megatron_ext.errors import UsageError
from megatron_ext.offload import placement, probe, tier_model
from megatron_ext.offload.paths import (
    TierFullError,
    TierSpec,
    check_free_space,
    format_tier_spec,
    parse_tier_spec,
)
from megatron_ext.offload.placement import Rebalancer, place_subgroups
from megatron_ext.offload.probe import ProbeResult, probe_bandwidth

GB = 10**9

# ------------------------------------------------------------------------ tier specs


@pytest.mark.parametrize("text,path,read,write", [
    ("/nvme", "/nvme", None, None),
    ("relative/dir", "relative/dir", None, None),
    ("/nvme@2", "/nvme", 2.0, 2.0),
    ("/nvme@6.5,3.25", "/nvme", 6.5, 3.25),
    ("/pfs@1e-1,2E0", "/pfs", 0.1, 2.0),
    ("/scratch/u@site/run", "/scratch/u@site/run", None, None),
    ("/scratch/u@site/", "/scratch/u@site/", None, None),
    ("/scratch/u@site/@2,1", "/scratch/u@site/", 2.0, 1.0),
    ("/a@b/c@3", "/a@b/c", 3.0, 3.0),
])
def test_parse_tier_spec(text, path, read, write):
    assert parse_tier_spec(text) == TierSpec(path, read, write)


@pytest.mark.parametrize("text,expected", [
    ("/x@fast,2", "/x@fast,2: bandwidths must be positive numbers in GB/s, "
                  "as DIR@READ_GBPS,WRITE_GBPS"),
    ("/x@0,1", "bandwidths must be positive"),
    ("/x@-1", "bandwidths must be positive"),
    ("/x@1,2,3", "bandwidths must be positive"),
    ("/x@1,", "bandwidths must be positive"),
    ("/x@nan", "bandwidths must be positive"),
    ("/x@inf,1", "bandwidths must be positive"),
    ("/x@", "bandwidths must be positive"),
    ("/home/u@site", "trailing '/'"),
    ("@1,2", "missing directory"),
    ("", "empty directory name"),
    ("  ", "empty directory name"),
])
def test_parse_tier_spec_rejects(text, expected):
    with pytest.raises(UsageError) as info:
        parse_tier_spec(text)
    message = str(info.value)
    assert expected in message
    assert message.startswith("--offload-paths")
    assert "\n" not in message


@pytest.mark.parametrize("spec", [
    TierSpec("/nvme"),
    TierSpec("/nvme", 6.5, 3.25),
    TierSpec("/slow", 0.004, 0.0021),
    TierSpec("/scratch/u@site", 2.0, 1.0),
    TierSpec("/scratch/u@site"),
    TierSpec("/a@b/c", 1.0, 1.0),
])
def test_format_tier_spec_round_trips(spec):
    back = parse_tier_spec(format_tier_spec(spec))
    assert back.path.rstrip("/") == spec.path.rstrip("/")
    for got, want in ((back.read_gbps, spec.read_gbps), (back.write_gbps, spec.write_gbps)):
        assert (got is None) == (want is None)
        if want is not None:
            assert got == pytest.approx(want, rel=0.01, abs=0.005)


@pytest.mark.parametrize("read,write,effective", [
    (2.0, 2.0, 1.0),
    (3.0, 6.0, 2.0),
    (None, 2.0, None),
    (2.0, None, None),
])
def test_effective_gbps(read, write, effective):
    assert TierSpec("/x", read, write).effective_gbps == effective


def test_tier_spec_rejects_non_positive_bandwidth():
    with pytest.raises(ValueError):
        TierSpec("/x", 0.0, 1.0)


# ------------------------------------------------------------------------ placement


def _loads(assignment, sizes, n):
    loads = [0] * n
    for path, size in zip(assignment, sizes):
        loads[path] += size
    return loads


def _sizes(kind, count, seed=0):
    rng = random.Random(seed)
    if kind == "equal":
        return [100] * count
    if kind == "short-last":  # how the engine cuts a shard: equal, the last one smaller
        return [100] * (count - 1) + [37]
    return [rng.randint(1, 100) for _ in range(count)]


@pytest.mark.parametrize("weights", [
    [1, 1], [3, 1], [1, 3], [2, 1, 1], [5, 3, 2], [0.7, 0.2, 0.1], [1, 0, 1], [10, 1],
    [6.2, 1.9, 1.9, 0.4], [1],
])
@pytest.mark.parametrize("kind", ["equal", "short-last", "mixed"])
@pytest.mark.parametrize("count", [1, 7, 40])
def test_bandwidth_placement_is_proportional_in_bytes(weights, kind, count):
    sizes = _sizes(kind, count)
    assignment = place_subgroups(sizes, weights)
    loads = _loads(assignment, sizes, len(weights))
    total = sum(sizes)
    for load, weight in zip(loads, weights):
        assert abs(load - total * weight / sum(weights)) <= max(sizes)
        if weight == 0:
            assert load == 0


@pytest.mark.parametrize("weights,pattern", [
    ([1, 1], [0, 1]),
    ([2, 2], [0, 1]),
    ([1, 1, 1], [0, 1, 2]),
    ([3, 1], [0, 1, 0, 0]),
    ([2, 1, 1], [0, 1, 2, 0]),
    ([1, 0, 1], [0, 2]),
])
def test_bandwidth_placement_interleaves(weights, pattern):
    count = len(pattern) * 6
    assert place_subgroups([100] * count, weights) == pattern * 6


@pytest.mark.parametrize("weights", [[1, 1], [1, 1, 1], [2, 1], [3, 2, 1]])
def test_bandwidth_placement_avoids_runs(weights):
    # A run longer than ceil(max share / min share) would mean a path waits while another
    # one idles, which the interleaving is there to avoid.
    assignment = place_subgroups([100] * 60, weights)
    longest = run = 1
    for previous, current in zip(assignment, assignment[1:]):
        run = run + 1 if current == previous else 1
        longest = max(longest, run)
    assert longest <= -(-max(weights) // min(weights))


def test_placement_is_deterministic_under_float_weights():
    sizes = _sizes("mixed", 200, seed=3)
    weights = [0.1, 0.2, 0.3, 0.4]
    assert place_subgroups(sizes, weights) == place_subgroups(list(sizes), list(weights))


@pytest.mark.parametrize("count,n", [(7, 3), (6, 2), (1, 4)])
def test_round_robin(count, n):
    assert place_subgroups([100] * count, [1] * n, "round-robin") == [i % n for i in range(count)]


@pytest.mark.parametrize("policy", ["bandwidth", "round-robin"])
def test_capacity_is_never_exceeded(policy):
    sizes = [100] * 10
    assignment = place_subgroups(sizes, [1, 1], policy, capacity=[300, None])
    assert _loads(assignment, sizes, 2) == [300, 700]


def test_full_path_share_goes_to_others_by_weight():
    sizes = [100] * 40
    assignment = place_subgroups(sizes, [1, 1, 2], capacity=[200, None, None])
    loads = _loads(assignment, sizes, 3)
    assert loads[0] == 200
    # The 3800 bytes left split 1:2 between paths 1 and 2.
    assert abs(loads[1] - 3800 / 3) <= 100
    assert abs(loads[2] - 2 * 3800 / 3) <= 100


@pytest.mark.parametrize("sizes,capacity,needed,expected", [
    ([100] * 10, [300, 500], 1000, "10 subgroups need 1.00 KB but only 800 B is free"),
    ([40, 40, 40], [60, 60], 40, "subgroup 2 (40 B) fits on no path"),
    ([100], [0, 50], 100, "free path 0: 0 B, path 1: 50 B"),
])
def test_tier_full_error(sizes, capacity, needed, expected):
    with pytest.raises(TierFullError) as info:
        place_subgroups(sizes, [1, 1], capacity=capacity)
    err = info.value
    assert isinstance(err, UsageError)
    assert expected in str(err) and "\n" not in str(err)
    assert err.needed_bytes == needed


def test_tier_full_error_names_paths():
    with pytest.raises(TierFullError, match="/nvme: 50 B, /pfs: 50 B"):
        place_subgroups([100, 100], [1, 1], capacity=[50, 50], names=["/nvme", "/pfs"])


def test_zero_weight_path_capacity_does_not_count():
    with pytest.raises(TierFullError):
        place_subgroups([100] * 3, [1, 0], capacity=[200, None])


@pytest.mark.parametrize("kwargs", [
    {"weights": []},
    {"weights": [0, 0]},
    {"weights": [-1, 2]},
    {"weights": [float("nan"), 1]},
    {"weights": [1, 1], "policy": "random"},
    {"weights": [1, 1], "capacity": [None]},
    {"weights": [1, 1], "sizes": [100, -1]},
])
def test_placement_rejects(kwargs):
    args = {"sizes": [100] * 4, **kwargs}
    with pytest.raises(ValueError):
        place_subgroups(**args)


def test_placement_of_nothing():
    assert place_subgroups([], [1, 2]) == []


# ------------------------------------------------------------------------ rebalancing


class Simulation:
    """Paths of given true bandwidths, the engine's loop of observe / end_step / apply."""

    def __init__(self, weights, sizes, **rebalancer_args):
        self.sizes = sizes
        self.n = len(weights)
        self.assignment = place_subgroups(sizes, weights)
        self.rebalancer = Rebalancer(weights, **rebalancer_args)
        self.moves = []  # (step, subgroup, from, to)
        self.step = 0

    def run(self, bandwidths, steps=1):
        for _ in range(steps):
            for path, load in enumerate(self.loads()):
                if load:  # each byte read once and written once
                    self.rebalancer.observe(path, 2 * load, 2 * load / (bandwidths[path] * GB))
            for subgroup, source, target in self.rebalancer.end_step(self.assignment,
                                                                     self.sizes):
                assert self.assignment[subgroup] == source
                self.assignment[subgroup] = target
                self.moves.append((self.step, subgroup, source, target))
            self.step += 1

    def loads(self):
        return _loads(self.assignment, self.sizes, self.n)


@pytest.mark.parametrize("patience", [1, 2, 3])
def test_slowed_path_loses_subgroups(patience):
    sim = Simulation([1.0, 1.0], [100] * 12, patience=patience)
    sim.run([1.0, 1.0], steps=5)
    assert sim.moves == []
    sim.run([1.0, 0.5], steps=patience + 6)
    assert sim.moves, "no subgroup left the slowed path"
    assert all(source == 1 and target == 0 for _, _, source, target in sim.moves)
    # EWMA (alpha 0.5) reaches the 0.7 threshold one step after the drop, then patience.
    assert sim.moves[0][0] >= 5 + patience
    assert sim.moves[-1][0] <= 5 + patience + 4
    # Bytes now track the observed bandwidth, 1 : 0.5 -> 800 : 400, to within a subgroup.
    assert abs(sim.loads()[1] - 400) <= 100
    assert sim.rebalancer.observed_gbps(1) == pytest.approx(0.5, rel=0.05)


def test_slowed_path_among_three():
    sizes = [100] * 24
    sim = Simulation([1.0, 1.0, 1.0], sizes, max_moves=2)
    sim.run([1.0, 1.0, 0.25], steps=15)
    loads = sim.loads()
    assert loads[2] < 800
    target = sum(sizes) * 0.25 / 2.25
    assert abs(loads[2] - target) <= 100
    assert abs(loads[0] - loads[1]) <= 100


def test_no_ping_pong_after_rebalancing():
    sim = Simulation([1.0, 1.0], [100] * 12)
    sim.run([1.0, 1.0], steps=3)
    sim.run([1.0, 0.5], steps=60)
    moved = [subgroup for _, subgroup, _, _ in sim.moves]
    assert moved and len(moved) == len(set(moved))
    assert sim.moves[-1][0] < 15


def test_recovered_path_gets_its_subgroups_back():
    sim = Simulation([1.0, 1.0], [100] * 12)
    original = list(sim.assignment)
    sim.run([1.0, 1.0], steps=3)
    sim.run([1.0, 0.5], steps=12)
    assert sim.loads() == [800, 400]
    sim.run([1.0, 1.0], steps=12)
    assert sim.loads() == [600, 600]
    assert sim.assignment == original


@pytest.mark.parametrize("weights", [[1.0, 1.0], [3.0, 1.0], [2.0, 1.0, 1.0]])
def test_noisy_throughput_causes_no_moves(weights):
    rng = random.Random(7)
    sim = Simulation(weights, _sizes("short-last", 30))
    for _ in range(200):
        sim.run([w * rng.uniform(0.85, 1.15) for w in weights])
    assert sim.moves == []
    assert sim.rebalancer.weights == weights


def test_short_dips_shorter_than_patience_cause_no_moves():
    sim = Simulation([1.0, 1.0], [100] * 12, alpha=1.0, patience=3)
    for step in range(60):
        # Each path in turn is at a third of its speed for two steps.
        slow = (step // 2) % 2
        sim.run([1.0 / 3 if path == slow else 1.0 for path in range(2)])
    assert sim.moves == []


def test_max_moves_per_step():
    sim = Simulation([1.0, 1.0], [100] * 40, max_moves=3, alpha=1.0, patience=1)
    sim.run([1.0, 0.25])
    assert len(sim.moves) == 3
    assert len({subgroup for _, subgroup, _, _ in sim.moves}) == 3
    sim.run([1.0, 0.25], steps=10)
    assert abs(sim.loads()[1] - 4000 * 0.25 / 1.25) <= 100


def test_max_moves_zero_only_observes():
    sim = Simulation([1.0, 1.0], [100] * 12, max_moves=0)
    sim.run([1.0, 0.25], steps=10)
    assert sim.moves == []
    assert sim.rebalancer.observed_gbps(1) < 0.6
    assert sim.rebalancer.reweight_count >= 1


def test_observed_gbps_and_weights():
    rebalancer = Rebalancer([2.0, 1.0], alpha=0.5)
    assert rebalancer.observed_gbps(0) is None
    rebalancer.observe(0, 3 * GB, 1.0)
    rebalancer.observe(0, 1 * GB, 1.0)
    rebalancer.end_step([0, 1], [100, 100])
    assert rebalancer.observed_gbps(0) == pytest.approx(2.0)
    assert rebalancer.observed_gbps(1) is None
    rebalancer.observe(0, 4 * GB, 1.0)
    rebalancer.end_step([0, 1], [100, 100])
    assert rebalancer.observed_gbps(0) == pytest.approx(3.0)
    assert rebalancer.weights == [2.0, 1.0]


def test_cached_subgroups_and_full_paths_are_not_moved():
    rebalancer = Rebalancer([1.0, 1.0], alpha=1.0, patience=1, max_moves=10)
    sizes = [100] * 8
    # Subgroups 0 and 1 live in the host cache (-1); the rest start all on path 0.
    assignment = [-1, -1, 0, 0, 0, 0, 0, 0]
    moves = rebalancer.end_step(assignment, sizes, free_bytes=[None, 0])
    assert moves == []
    moves = rebalancer.end_step(assignment, sizes, free_bytes=[None, 200])
    assert sorted(target for _, _, target in moves) == [1, 1]
    assert all(subgroup >= 2 for subgroup, _, _ in moves)
    moves = rebalancer.end_step(assignment, sizes)
    assert len(moves) == 3


@pytest.mark.parametrize("kwargs", [
    {"weights": []},
    {"weights": [0.0]},
    {"weights": [1.0], "alpha": 0.0},
    {"weights": [1.0], "slow_ratio": 1.0},
    {"weights": [1.0], "patience": 0},
    {"weights": [1.0], "max_moves": -1},
])
def test_rebalancer_rejects(kwargs):
    with pytest.raises(ValueError):
        Rebalancer(**kwargs)


def test_rebalancer_rejects_bad_observations():
    rebalancer = Rebalancer([1.0, 1.0])
    for args in ((2, 1, 1.0), (0, -1, 1.0), (0, 1, float("nan"))):
        with pytest.raises(ValueError):
            rebalancer.observe(*args)
    with pytest.raises(ValueError):
        rebalancer.end_step([0, 2], [1, 1])


def test_balancing_is_exact():
    # 0.1 + 0.2 != 0.3 in floats; the exact arithmetic sees a balanced state.
    weights = [Fraction(0.1), Fraction(0.2), Fraction(0.3)]
    assignment = place_subgroups([100] * 60, [0.1, 0.2, 0.3])
    assert placement._balancing_moves(assignment, [100] * 60, weights, [None] * 3, None,
                                  True) == []


# ------------------------------------------------------------------------ probe (I/O)


@pytest.mark.parametrize("direct_io", [False, True])
def test_probe_bandwidth(tmp_path, direct_io):
    result = probe_bandwidth(str(tmp_path), size_mb=4, block_mb=1, threads=2,
                             direct_io=direct_io)
    assert isinstance(result, ProbeResult)
    assert result.read_gbps > 0 and result.write_gbps > 0
    assert result.size_mb == 4
    assert result.direct_io_used in (True, False) and (direct_io or not result.direct_io_used)
    assert os.listdir(tmp_path) == []
    assert result.tier_spec("/x") == TierSpec("/x", result.read_gbps, result.write_gbps)


def test_probe_rounds_size_up_to_blocks(tmp_path):
    assert probe_bandwidth(str(tmp_path), size_mb=3, block_mb=2, threads=3).size_mb == 4


def test_probe_leaves_nothing_on_enospc(tmp_path, monkeypatch):
    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(probe.os, "pwrite", no_space)
    with pytest.raises(OSError) as info:
        probe_bandwidth(str(tmp_path), size_mb=2, block_mb=1, threads=2)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_probe_falls_back_when_direct_io_is_refused(tmp_path, monkeypatch):
    if not probe_bandwidth(str(tmp_path), size_mb=1, block_mb=1, direct_io=True).direct_io_used:
        pytest.skip(f"{tmp_path}: the file system does not take O_DIRECT at all")
    real_pwrite = os.pwrite
    calls = []

    def refuse_first(fd, data, offset):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(probe.os, "pwrite", refuse_first)
    result = probe_bandwidth(str(tmp_path), size_mb=2, block_mb=1, threads=1, direct_io=True)
    assert not result.direct_io_used and result.write_gbps > 0
    assert os.listdir(tmp_path) == []


def test_probe_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError):
        probe_bandwidth(str(tmp_path), size_mb=0)


def test_probe_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        probe_bandwidth(str(tmp_path / "missing"), size_mb=1, block_mb=1)


def test_check_free_space(tmp_path):
    assert check_free_space(str(tmp_path), 1) > 0
    with pytest.raises(TierFullError, match="needs 1.00 EB|needs .* but only"):
        check_free_space(str(tmp_path), 10**21)
    with pytest.raises(UsageError, match="directory not found"):
        check_free_space(str(tmp_path / "missing"), 1)


@pytest.mark.parametrize("subgroup_size,plan", [
    (100_000_000, (128, 8)),   # the default subgroup: capped
    (10_000_000, (115, 8)),    # 120 MB of state: one file of it, the engine's 8 MiB chunks
    (300_000, (4, 4)),         # 3.6 MB: one chunk, as the engine writes such a file
    (10_000, (1, 1)),          # the CPU tests' subgroups: a short probe
])
def test_probe_plan_follows_the_engine_transfer(subgroup_size, plan):
    assert probe.probe_plan(subgroup_size) == plan


def test_probe_reports_the_median_of_its_passes(tmp_path, monkeypatch):
    passes = iter([(1.0, 4.0), (9.0, 1.0), (2.0, 2.0)])  # (write s, read s), one outlier each
    monkeypatch.setattr(probe, "_probe_fd", lambda *args: next(passes))
    result = probe_bandwidth(str(tmp_path), size_mb=2, block_mb=1, threads=2, repeats=3)
    assert result.repeats == 3
    assert result.write_gbps == pytest.approx(2 * 2**20 / 1e9 / 2.0)
    assert result.read_gbps == pytest.approx(2 * 2**20 / 1e9 / 2.0)
    assert os.listdir(tmp_path) == []


def test_probe_repeats_really_move_the_bytes(tmp_path, monkeypatch):
    written = []
    real_pwrite = os.pwrite
    monkeypatch.setattr(probe.os, "pwrite", lambda fd, data, offset: written.append(
        len(data)) or real_pwrite(fd, data, offset))
    probe_bandwidth(str(tmp_path), size_mb=2, block_mb=1, threads=2, repeats=3)
    assert sum(written) == 3 * 2 * 2**20


# ------------------------------------------------------------------------ the tier model


@pytest.mark.parametrize("count,n,expected", [
    (0, 5, []), (1, 5, [2]), (2, 6, [1, 4]), (3, 6, [1, 3, 5]), (6, 6, [0, 1, 2, 3, 4, 5])])
def test_spread(count, n, expected):
    assert tier_model.spread(count, n) == expected


@pytest.mark.parametrize("sizes,budget,expected", [
    ([10] * 6, 0, []),
    ([10] * 6, 25, [1, 4]),
    ([10] * 6, 60, [0, 1, 2, 3, 4, 5]),
    ([10] * 6, 1000, [0, 1, 2, 3, 4, 5]),
    ([10, 10, 10, 10, 10, 1], 29, [1, 3, 5]),  # the small last one makes room for three
    ([], 100, []),
])
def test_fixed_device_subgroups(sizes, budget, expected):
    assert tier_model.fixed_device_subgroups(sizes, budget) == expected


@pytest.mark.parametrize("limit,peak,states,reserve,expected", [
    (100, 30, 0, 10, 60),     # first step: nothing on the device yet
    (100, 70, 40, 10, 60),    # the peak includes the tier's own 40
    (100, 95, 40, 10, 35),    # a larger peak later: the tier must shrink to 35
    (100, 120, 0, 10, 0),     # no room at all
    (100, 10, 40, 0, 100),    # a peak below the states (measured before they existed)
])
def test_device_budget(limit, peak, states, reserve, expected):
    assert tier_model.device_budget(limit, peak, states, reserve) == expected


@pytest.mark.parametrize("members,budget,candidates,joining,leaving", [
    ([], 25, [3, 1, 0, 2], [3, 1], []),
    ([], 25, [3, 5, 1], [3, 5, 1], []),        # the small one fits beside two full ones
    ([], 5, [0, 1, 5], [5], []),               # full ones skipped, the small one fits
    ([3, 1], 30, [], [], []),                  # sized: no growth without candidates
    ([3, 1, 0], 15, [], [], [0, 1]),           # the last to join leaves first
    ([3, 1, 0], 0, [], [], [0, 1, 3]),
])
def test_resize_device_tier(members, budget, candidates, joining, leaving):
    sizes = [10, 10, 10, 10, 10, 2]
    assert tier_model.resize_device_tier(members, sizes, budget, candidates) == (joining, leaving)


@pytest.mark.parametrize("bpe,h2d,d2h,device,expected", [
    (12, 24.0, 24.0, 100e9, 2e9),       # PCIe-bound: 24 GB/s / 12 B
    (8, 24.0, 12.0, 100e9, 1.5e9),      # the slower direction bounds it
    (12, 1200.0, 1200.0, 50e9, 50e9),   # device-bound
])
def test_stream_rate(bpe, h2d, d2h, device, expected):
    assert tier_model.stream_rate(bpe, h2d, d2h, device) == pytest.approx(expected)


@pytest.mark.parametrize("cpu,stream,expected", [
    (None, None, 0.5), (4e9, None, 0.5), (4e9, 4e9, 0.5), (1e9, 3e9, 0.75), (3e9, 1e9, 0.25)])
def test_stream_share_makes_both_sides_end_together(cpu, stream, expected):
    share = tier_model.stream_share(cpu, stream)
    assert share == pytest.approx(expected)
    if cpu and stream:
        n = 1e9
        assert share * n / stream == pytest.approx((1 - share) * n / cpu)


@pytest.mark.parametrize("sizes,share,expected", [
    ([10] * 4, 0.0, [False] * 4),
    ([10] * 4, 1.0, [True] * 4),
    ([10] * 4, 0.5, [True, False, True, False]),
    ([10] * 8, 0.25, [False, False, True, False, False, False, True, False]),
    ([10, 10, 10, 2], 0.75, [True, True, False, True]),
    ([], 0.5, []),
])
def test_split_updates(sizes, share, expected):
    got = tier_model.split_updates(sizes, share)
    assert got == expected
    if sizes:
        streamed = sum(s for s, on in zip(sizes, got) if on)
        assert abs(streamed - share * sum(sizes)) <= max(sizes) / 2 + 1e-9


def test_update_rates_follow_the_measurements():
    rates = tier_model.UpdateRates(alpha=0.5)
    assert rates.share() == 0.5
    rates.observe(4_000, 1.0, 0, 0.0)          # nothing streamed yet: the prior
    assert rates.share() == 0.5
    rates.observe(4_000, 1.0, 12_000, 1.0)
    assert rates.share() == pytest.approx(0.75)
    rates.observe(4_000, 1.0, 4_000, 1.0)      # the stream slows: EWMA 8000 vs 4000
    assert rates.stream == pytest.approx(8_000)
    assert rates.share() == pytest.approx(8 / 12)


def test_tier_records():
    assert str(tier_model.DEVICE_TIER) == "device" and str(tier_model.HOST_TIER) == "host"
    assert str(tier_model.Tier(tier_model.TierKind.PATH, 1)) == "path1"
    assert (tier_model.Tier(tier_model.TierKind.PATH, 1)
            == tier_model.Tier(tier_model.TierKind.PATH, 1))


# ---------------------------------------------------------------- auto sizes, the I/O floor


@pytest.mark.parametrize("available, ranks, reserve, pipeline, budget", [
    (100, 1, 10, 5, 85),
    (100, 2, 10, 5, 40),   # the node's ranks share it
    (100, 4, 0, 30, 0),    # never below 0
    (100, 0, 0, 0, 100),   # no rank count: one
])
def test_host_cache_budget(available, ranks, reserve, pipeline, budget):
    assert tier_model.host_cache_budget(available, ranks, reserve, pipeline) == budget


def test_pipeline_host_bytes():
    # Two gradient staging buffers and a scratch, 4 bytes per element, and one state buffer.
    assert tier_model.pipeline_host_bytes(1000, 12_000) == 24_000


@pytest.mark.parametrize("free, ranks, reserve, room", [
    (1000, 1, 100, 900), (1000, 2, 100, 400), (50, 1, 100, 0)])
def test_path_room(free, ranks, reserve, room):
    assert tier_model.path_room(free, ranks, reserve) == room


@pytest.mark.parametrize("paths, nbytes, cached, alternate, want", [
    # Six subgroups on two paths; the cache keeps 2 at the end of a step.
    ([0, 1, 0, 1, 0, 1], [10] * 6, 2, True, [20.0, 20.0]),  # 4 of 6 miss
    ([0, 1, 0, 1, 0, 1], [10] * 6, 2, False, [30.0, 30.0]),  # all miss
    ([0, 1, 0, 1, 0, 1], [10] * 6, None, True, [0.0, 0.0]),  # everything cached
    ([0, 1, 0, 1, 0, 1], [10] * 6, 6, False, [0.0, 0.0]),
    ([0, 1, 0, 1, 0, 1], [10] * 6, 0, True, [30.0, 30.0]),
    # The ends differ in size: an ascending step keeps the top, a descending the bottom.
    ([0, 0, 0, 0], [1, 2, 3, 40], 1, True, [46.0 - (1 + 40) / 2]),
])
def test_steady_path_io(paths, nbytes, cached, alternate, want):
    assert tier_model.steady_path_io(paths, nbytes, cached, alternate, max(paths) + 1) == want


def test_io_floor():
    seconds = tier_model.io_floor([2e9, 1e9, 0.0], [2e9, 0.0, 5e9], [2.0, 1.0, None],
                                  [1.0, 4.0, None])
    assert seconds == [1.0 + 2.0, 1.0, 0.0]  # no bandwidth known: nothing to divide by
