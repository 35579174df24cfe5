"""--offload-optimizer with two processes (torchrun, gloo): DP=2 and TP=2 equal the plain
optimizer bit for bit, resume is exact, and two ranks of one node sharing a path never do
I/O on it at the same time."""

from __future__ import annotations

from collections import defaultdict

import pytest

from mext_testing import (
    BF16,
    TINY,
    losses_of,
    read_metrics,
    run_pretrain,
    stopped_and_resumed,
    train_losses,
)

BASE = [*TINY, "--train-iters", "20", "--use-distributed-optimizer"]
LAYOUTS = {"dp2": [*BF16],
           "dp2-overlap": [*BF16, "--overlap-grad-reduce", "--overlap-param-gather",
                           "--global-batch-size", "16"],
           "tp2": [*BF16, "--tensor-model-parallel-size", "2"],
           "dp2-fp32": []}
# Each rank's shard (~60k elements) in subgroups of 5000, three of them cached.
SMALL = ["--offload-subgroup-size", "5000", "--offload-host-cache-gb", "0.00018"]
TRACE = "MEGATRON_EXT_OFFLOAD_TRACE"


def paths(tmp_path) -> list:
    dirs = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir(exist_ok=True)
        dirs.append(f"{tmp_path / f'tier{i}'}@{2 - i},1")
    return ["--offload-paths", *dirs, *SMALL]


# The I/O trace of every offload run: the dp2 run is also the straight run of the resume
# test and the run whose ranks take turns on a path (the session's run cache shares it).
TRACED = {TRACE: "{run}/trace.txt"}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_ranks_offload_equals_plain(tmp_path, run_cache, layout):
    flags = [*BASE, *LAYOUTS[layout]]
    plain = run_cache.run(flags, nproc=2)
    offload = run_cache.run([*flags, "--offload-optimizer", *paths(tmp_path)], nproc=2,
                            env=TRACED, base=tmp_path)
    assert offload.losses == plain.losses


def test_two_ranks_offload_resume_is_exact(tmp_path, run_cache):
    flags = [*BASE, *BF16, "--offload-optimizer", *paths(tmp_path)]
    straight = run_cache.run(flags, nproc=2, env=TRACED, base=tmp_path).records
    resumed = stopped_and_resumed(tmp_path, flags, stop_at=10, nproc=2)
    assert losses_of(resumed) == losses_of(straight)


def _overlaps(trace_text: str) -> tuple:
    """(pairs of I/O intervals of different processes on one path that overlap, ops per pid)."""
    by_path = defaultdict(list)
    pids = defaultdict(int)
    for line in trace_text.splitlines():
        pid, _, _, path, start, end, _ = line.split()
        by_path[path].append((float(start), float(end), pid))
        pids[pid] += 1
    overlaps = 0
    for ops in by_path.values():
        ops.sort()
        for (s1, e1, p1), (s2, e2, p2) in zip(ops, ops[1:]):
            if p1 != p2 and s2 < e1:
                overlaps += 1
    return overlaps, dict(pids)


def test_ranks_of_one_node_take_turns_on_a_path(tmp_path, run_cache):
    run = run_cache.run([*BASE, *BF16, "--offload-optimizer", *paths(tmp_path)], nproc=2,
                        env=TRACED, base=tmp_path)
    overlaps, pids = _overlaps((run.directory / "trace.txt").read_text())
    assert len(pids) == 2 and min(pids.values()) > 100, pids
    assert overlaps == 0


def test_without_concurrency_control_ranks_collide(tmp_path):
    """The check above can fail: with the lock off (and I/O slowed to make it long), the two
    ranks' operations on a path do overlap."""
    trace = tmp_path / "trace.txt"
    run_pretrain([*BASE, *BF16, "--offload-optimizer", *paths(tmp_path),
                  "--no-offload-concurrency-control", "--no-offload-rebalance"], nproc=2,
                 env={TRACE: str(trace),
                      "MEGATRON_EXT_OFFLOAD_FAULT": "slow:0:10:1;slow:1:10:1"})
    overlaps, _ = _overlaps(trace.read_text())
    assert overlaps > 0


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_two_ranks_all_tiers_equal_plain(tmp_path, run_cache, layout):
    """Device tier (4 of each rank's ~12 subgroups), host cache and two paths, with the
    streamed update forced on (the CPU's "device" is the CPU): the plain optimizer's
    losses bit for bit."""
    flags = [*BASE, *LAYOUTS[layout]]  # TINY's cosine decay
    plain = run_cache.run(flags, nproc=2)
    offload = tmp_path / "offload.jsonl"
    run_pretrain([*flags, "--offload-optimizer", *paths(tmp_path), "--offload-device-cache-gb",
                  "0.00024", "--metrics-path", str(offload)], nproc=2,
                 env={"MEGATRON_EXT_OFFLOAD_STREAM_SHARE": "0.5"})
    assert train_losses(offload) == plain.losses
    last = [r for r in read_metrics(offload) if "offload/cache_hit_rate" in r][-1]
    assert last["offload/device_subgroups_n"] == 4
    assert last["offload/streamed_subgroups"] > 0 and last["offload/io_bytes"] > 0
