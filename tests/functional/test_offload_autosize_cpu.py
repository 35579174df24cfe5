"""pretrain_gpt.py --offload-optimizer with every size auto, on the CPU.

The machine's capacities are injected (MEGATRON_EXT_MEMAVAILABLE_GB, MEGATRON_EXT_PATH_FREE_GB):
the host cache takes what fits in the host's share, the paths the rest, and the run trains
as the plain optimizer does, bit for bit; the metrics show the split and the I/O floor (the
bytes that must cross the paths per step over the bandwidth they showed). A run that cannot
fit is refused in one line before it trains.
"""

from __future__ import annotations

import pytest

from megatron_ext.config import parse_config
from megatron_ext.memory.machine import Machine
from megatron_ext.memory.plan import plan_run
from mext_testing import TINY, TINY_VOCAB_IDS, baseline_losses, losses_of, read_metrics, run_pretrain

ITERS = 8
BASE = [*TINY, "--train-iters", str(ITERS), "--use-distributed-optimizer"]
# ~120k parameters in subgroups of 10k elements: 12 subgroups of 120 KB of fp32 state.
SUBGROUP = 10_000
STATE = 12 * SUBGROUP
PIPELINE = 3 * 4 * SUBGROUP + STATE  # the pipeline's host buffers (tier_model)
SPARES = 3 * STATE  # a path's room is its free space less two spares and a temporary file
AUTO = ["--offload-optimizer", "--offload-subgroup-size", str(SUBGROUP),
        "--offload-host-reserve-gb", "0"]


def _on_the_host() -> int:
    """What the plan counts for the device (weights, gradients, activations, ...), which a
    CPU run keeps in host memory beside the cache (MemoryPlan.host_view)."""
    cfg = parse_config([*BASE, *AUTO])
    cfg.check_world(1)
    cpu = Machine(name="cpu", gpu_total_bytes=None, gpu_free_bytes=None,
                  host_available_bytes=10**12)
    return plan_run(cfg, TINY_VOCAB_IDS + 1, 1, cpu).gpu.used


def machine(host_buffers: int, path_subgroups=()) -> dict:
    """The environment of a machine whose host holds the model and ``host_buffers`` state
    buffers and whose paths have room for ``path_subgroups`` subgroups each."""
    host = _on_the_host() + PIPELINE + host_buffers * STATE
    env = {"MEGATRON_EXT_MEMAVAILABLE_GB": str(host / 1e9),
           "LOCAL_WORLD_SIZE": "1"}
    if path_subgroups:
        env["MEGATRON_EXT_PATH_FREE_GB"] = ",".join(str((SPARES + k * STATE) / 1e9)
                                                    for k in path_subgroups)
    return env


@pytest.fixture(scope="module")
def baseline(run_cache):
    return baseline_losses(run_cache, BASE)


def test_auto_sizes_split_the_states_between_host_and_paths(tmp_path, baseline):
    # Host: 6 buffers (3 for the pipeline, 3 that keep subgroups without a file); paths:
    # room for 5 and 4 subgroups. 12 subgroups: 3 stay in host memory, 9 go to the paths.
    dirs = [tmp_path / "fast", tmp_path / "slow"]
    for d in dirs:
        d.mkdir()
    out = tmp_path / "m.jsonl"
    result = run_pretrain([*BASE, *AUTO, "--offload-paths", f"{dirs[0]}@2,1", f"{dirs[1]}@1,1",
                           "--metrics-path", str(out)], env=machine(6, (5, 4)))
    records = read_metrics(out)
    assert losses_of(records) == baseline("fp32")
    line = next(s for s in result.stdout.splitlines() if "offload: rank 0 tiers:" in s)
    assert "device 0 GB in 0 subgroups (auto: no GPU on this run)" in line
    assert "host cache 0.00072 GB, 6 subgroups, 3 of them without a file (auto: MemAvailable" \
        in line
    assert f"path0 {dirs[0]}" in line and f"path1 {dirs[1]}" in line
    offload = [r for r in records if "offload/cache_hit_rate" in r]
    last = offload[-1]
    assert last["offload/host_cache_subgroups"] == 6
    assert last["offload/host_only_subgroups"] == 3
    assert last["offload/path0_subgroups"] <= 5 and last["offload/path1_subgroups"] <= 4
    assert last["offload/path0_subgroups"] + last["offload/path1_subgroups"] == 9
    assert last["offload/device_subgroups_n"] == 0
    # The I/O floor: the planned bytes over the bandwidth each path showed in this run.
    for record in offload[1:]:
        floors = []
        for i in range(2):
            half = record[f"offload/path{i}_floor_bytes"] / 2
            read = record[f"offload/path{i}_read_gbps"]
            write = record[f"offload/path{i}_write_gbps"]
            assert half > 0 and read > 0 and write > 0, record
            floors.append(half / (read * 1e9) + half / (write * 1e9))
        assert record["offload/io_floor_s"] == pytest.approx(max(floors), rel=1e-9)
        assert record["offload/io_floor_bytes"] == pytest.approx(
            record["offload/path0_floor_bytes"] + record["offload/path1_floor_bytes"])
        bound = max(record["time/forward_backward_s"], record["offload/io_floor_s"])
        assert record["offload/roofline_ratio"] == pytest.approx(
            record["time/iteration_s"] / bound, rel=1e-9)
    # A bound: over the steady iterations the time spent is at least the floor's (a flush
    # may end in the next iteration, so one iteration alone may fall short of its floor).
    steady_records = offload[2:]
    assert sum(r["time/iteration_s"] for r in steady_records) >= 0.9 * sum(
        max(r["time/forward_backward_s"], r["offload/io_floor_s"]) for r in steady_records)
    # 9 subgroups with files, 3 cache buffers for them: 6 miss per step, each read once
    # and written once; the run moved that much once steady.
    assert last["offload/io_floor_bytes"] == pytest.approx(2 * 6 * STATE, rel=0.1)
    steady = [r["offload/io_bytes"] for r in offload[2:]]
    assert sum(steady) / len(steady) == pytest.approx(last["offload/io_floor_bytes"], rel=0.1)


@pytest.mark.parametrize("plan_check", [True, False], ids=["plan", "engine"])
def test_auto_host_without_paths_that_cannot_hold_the_states_is_one_line(tmp_path, plan_check):
    """The memory plan refuses it before anything is built (it sizes the host as the engine
    does); with --no-plan-check the engine's own check says it, in one line too."""
    extra = [] if plan_check else ["--no-plan-check"]
    result = run_pretrain([*BASE, *AUTO, *extra], env=machine(11), check=False)
    assert result.returncode != 0
    errors = [s for s in result.stdout.splitlines() if s.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stdout, result.stdout[-3000:]
    if plan_check:
        assert errors[0].startswith("error: memory plan: the optimizer states need "), errors
    else:
        assert errors[0].startswith("error: host memory holds 11 of the 12 subgroups of rank 0")
    assert "add --offload-paths DIR" in errors[0]


def test_auto_host_without_paths_takes_everything_when_it_fits(tmp_path, baseline):
    out = tmp_path / "m.jsonl"
    result = run_pretrain([*BASE, *AUTO, "--metrics-path", str(out)], env=machine(12))
    assert losses_of(read_metrics(out)) == baseline("fp32")
    assert "12 subgroups, 12 of them without a file" in result.stdout
