"""pretrain_gpt.py with --offload-optimizer on the CPU: same losses, exact resume, faults.

The equivalence of every combination of the off switches is proven on the engine itself
(tests/unit/offload/test_engine.py, 16 combinations x host-only/one/two paths x fp32/bf16,
bit for bit against torch's AdamW); here whole runs cover all switches on, all off and each
one off, through megatron-core's real optimizer, checkpoints and processes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict
from pathlib import Path

import pytest

from mext_testing import (
    BF16,
    TINY,
    baseline_losses,
    launch,
    losses_of,
    precision_flags,
    read_metrics,
    run_pretrain,
    straight_and_resumed,
    train_losses,
)

ITERS = 20
# TINY's cosine decay: the same command as the other modules' plain runs, which the
# session's run cache then shares (mext_testing.RunCache).
BASE = [*TINY, "--train-iters", str(ITERS), "--use-distributed-optimizer"]
# ~120k parameters in subgroups of 10k elements (120 KB of state each), three of them in
# the host cache: most of the state lives on the paths.
SMALL = ["--offload-subgroup-size", "10000", "--offload-host-cache-gb", "0.00036"]
TRACE = "MEGATRON_EXT_OFFLOAD_TRACE"
FAULT = "MEGATRON_EXT_OFFLOAD_FAULT"


def path_flags(tmp_path: Path, count: int) -> list:
    """``count`` tier directories: the first twice as fast to read as the others."""
    if count == 0:
        return []
    dirs = []
    for i in range(count):
        directory = tmp_path / f"tier{i}"
        directory.mkdir(exist_ok=True)
        dirs.append(f"{directory}@{2 if i == 0 else 1},1")
    return ["--offload-paths", *dirs, *SMALL]


@pytest.fixture(scope="module")
def baseline(run_cache):
    """Losses of the plain distributed optimizer, per precision (once per session)."""
    return baseline_losses(run_cache, BASE)


def run_offload(tmp_path, flags, env=None, name="offload.jsonl", check=True):
    out = tmp_path / name
    result = run_pretrain([*BASE, "--offload-optimizer", *flags, "--metrics-path", str(out)],
                          env=env, check=check)
    return result, out


def shared_offload(run_cache, tmp_path, flags, env=None):
    """The offload run of ``flags`` (its tier paths under ``tmp_path``), shared with the
    tests that start the same one (the session's run cache): paths are the run's own."""
    return run_cache.run([*BASE, "--offload-optimizer", *flags], env=env, base=tmp_path)


LAYOUTS = {
    "host-only": (0, []),
    "one-path": (1, []),
    "two-paths": (2, []),
    "two-paths-all-off": (2, ["--no-offload-alternate-order",
                              "--no-offload-delayed-grad-conversion",
                              "--no-offload-concurrency-control", "--no-offload-rebalance"]),
    "two-paths-no-alternate": (2, ["--no-offload-alternate-order"]),
    "two-paths-no-delayed": (2, ["--no-offload-delayed-grad-conversion"]),
    "two-paths-no-concurrency": (2, ["--no-offload-concurrency-control"]),
    "two-paths-no-rebalance-direct-crc": (2, ["--no-offload-rebalance", "--offload-direct-io",
                                              "--offload-checksum", "crc32c"]),
}


# bf16 runs every layout; fp32 the ends (all on, all off) of each placement.
MATRIX = [("bf16", layout) for layout in sorted(LAYOUTS)] + [
    ("fp32", layout) for layout in sorted(LAYOUTS) if not layout.startswith("two-paths-no")]


@pytest.mark.parametrize("precision,layout", MATRIX)
def test_offload_matches_plain_optimizer(tmp_path, run_cache, baseline, precision, layout):
    n_paths, switches = LAYOUTS[layout]
    run = shared_offload(run_cache, tmp_path, [*precision_flags(precision),
                                               *path_flags(tmp_path, n_paths), *switches])
    records = run.records
    assert losses_of(records) == baseline(precision)
    last = [r for r in records if "offload/cache_hit_rate" in r][-1]
    # No fp32 master or moment tensor outside the engine (megatron-core's are freed).
    assert last["offload/device_state_gib"] == 0
    if n_paths:
        assert last["offload/io_bytes"] > 0, "nothing went through the paths"
        # The run's files are gone after it (checkpoints keep their own copies).
        for i in range(n_paths):
            assert (run.directory / f"tier{i}").is_dir()
            assert not list((run.directory / f"tier{i}").rglob("sg*"))
    if precision == "bf16" and layout == "one-path":
        # The stdout line of every iteration carries the offload breakdown.
        lines = [line for line in run.stdout.splitlines() if line.startswith(" iteration")]
        assert len(lines) == ITERS
        assert all("offload (ms): stall" in line and "cache hits" in line for line in lines)


def test_fp16_offload_matches_plain_optimizer(tmp_path, run_cache, baseline):
    run = shared_offload(run_cache, tmp_path, [*precision_flags("fp16"),
                                               *path_flags(tmp_path, 2)])
    assert run.losses == baseline("fp16")


def test_no_host_cache_keeps_the_states_in_files_and_the_losses(tmp_path, run_cache):
    """--offload-host-cache-gb 0: the host holds the pipeline's three buffers only, every
    subgroup lives in a file on the path, and the run is the default cache's, bitwise."""
    (tmp_path / "tier0").mkdir()
    flags = [*BF16, "--offload-paths", f"{tmp_path / 'tier0'}@1,1", "--offload-subgroup-size",
             "10000"]
    default = shared_offload(run_cache, tmp_path, flags).losses
    out = tmp_path / "nocache.jsonl"
    proc = launch([*BASE, "--offload-optimizer", *flags, "--offload-host-cache-gb", "0",
                   "--metrics-path", str(out)])
    files = set()
    while proc.poll() is None:  # the run's files are removed at its end: look meanwhile
        try:
            files |= {p.name for p in (tmp_path / "tier0").rglob("sg*.state")}
        except FileNotFoundError:  # the run's directory went away during the walk (its end)
            pass
        time.sleep(0.02)
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, text[-3000:]
    assert files == {f"sg{i:05d}.state" for i in range(12)}, files
    assert "(0: no cache, the pipeline's buffers only)" in text
    records = read_metrics(out)
    assert losses_of(records) == default
    last = [r for r in records if "offload/cache_hit_rate" in r][-1]
    assert last["offload/host_cache_subgroups"] == 3 and last["offload/host_only_subgroups"] == 0
    assert last["offload/path0_subgroups"] == 12 and last["offload/io_bytes"] > 0


def test_files_follow_the_bandwidth_proportion(tmp_path):
    trace = tmp_path / "trace.txt"
    _, out = run_offload(tmp_path, [*BF16, *path_flags(tmp_path, 2), "--no-offload-rebalance"],
                         env={TRACE: str(trace)})
    written = defaultdict(int)
    for line in trace.read_text().splitlines():
        _, _, op, path, _, _, nbytes = line.split()
        if op == "write":
            written[path] += int(nbytes)
    paths = [str(tmp_path / "tier0"), str(tmp_path / "tier1")]
    share = written[paths[0]] / (written[paths[0]] + written[paths[1]])
    # tier0: read 2, write 1 GB/s -> 1/(1/2 + 1) = 0.667; tier1: 0.5. Expected share 0.571,
    # within one subgroup of the 12 (the last one is smaller).
    assert abs(share - 0.667 / 1.167) < 1 / 12 + 0.01, share
    last = [r for r in read_metrics(out) if "offload/cache_hit_rate" in r][-1]
    assert last["offload/path0_subgroups"] == 7 and last["offload/path1_subgroups"] == 5


@pytest.mark.parametrize("layout", ["host-only", "two-paths"])
def test_offload_resume_is_exact(tmp_path, run_cache, layout):
    flags = [*BASE, "--offload-optimizer", *BF16,
             *path_flags(tmp_path, 0 if layout == "host-only" else 2)]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=10, runs=run_cache)
    assert losses_of(resumed) == losses_of(straight)
    manifest = json.loads((tmp_path / "ckpt" / "iter_0000010" / "offload" / "rank00000" /
                           "manifest.json").read_text())
    # host-only runs with the default subgroup size (one subgroup for this model).
    assert manifest["step"] == 10
    assert len(manifest["subgroups"]) == (1 if layout == "host-only" else 12)
    if layout == "two-paths":
        hows = {entry["how"] for entry in manifest["subgroups"]}
        assert hows == {"linked", "written"}, hows


def test_kill_during_flush_then_resume(tmp_path, run_cache):
    flags = [*BF16, *path_flags(tmp_path, 2)]
    straight = shared_offload(run_cache, tmp_path, flags).losses
    ckpt = tmp_path / "ckpt"
    first = tmp_path / "first.jsonl"
    proc = launch([*BASE, "--offload-optimizer", *flags, "--save", str(ckpt), "--save-interval",
                   "5", "--metrics-path", str(first)], env={FAULT: "kill-in-flush:8"},
                  start_new_session=True)
    proc.wait(timeout=300)
    # Like Slurm ending a job step: what the dead process started (dist_checkpointing's
    # helper processes keep its stdout open) goes with it, unless it has already gone.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out = proc.communicate()[0]
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    partial = [p for p in tmp_path.rglob(".sg*") if "tmp" in p.name]
    assert partial, "the kill did not happen inside a write"
    _, second = run_offload(tmp_path, [*flags, "--load", str(ckpt)], name="second.jsonl")
    assert train_losses(first)[:5] + train_losses(second) == straight


def _one_error_line(result) -> str:
    lines = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stdout[-3000:]
    assert len(lines) == 1, result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    return lines[0]


def test_corrupted_tier_file_is_detected(tmp_path):
    result, _ = run_offload(tmp_path, [*BF16, *path_flags(tmp_path, 1)],
                            env={FAULT: "corrupt-after-flush:3"}, check=False)
    line = _one_error_line(result)
    assert "checksum mismatch" in line and str(tmp_path / "tier0") in line


def test_truncated_checkpoint_file_is_detected(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = [*BF16, *path_flags(tmp_path, 1)]
    run_offload(tmp_path, [*flags, "--save", str(ckpt), "--exit-interval", "4"])
    state = ckpt / "iter_0000004" / "offload" / "rank00000" / "sg00005.state"
    os.truncate(state, state.stat().st_size - 4096)
    result, _ = run_offload(tmp_path, [*flags, "--load", str(ckpt)], check=False)
    line = _one_error_line(result)
    assert str(state) in line and "checkpoint is damaged" in line


def test_full_path_spills_to_the_other(tmp_path, baseline):
    result, out = run_offload(tmp_path, [*BF16, *path_flags(tmp_path, 2)],
                              env={FAULT: "enospc:0"})
    assert "now go to" in result.stdout and "No space left" in result.stdout
    assert train_losses(out) == baseline("bf16")
    last = [r for r in read_metrics(out) if "offload/cache_hit_rate" in r][-1]
    assert last["offload/path0_subgroups"] == 0


def test_full_only_path_is_a_clear_error(tmp_path):
    result, _ = run_offload(tmp_path, [*BF16, *path_flags(tmp_path, 1)],
                            env={FAULT: "enospc:0"}, check=False)
    line = _one_error_line(result)
    assert "No space left" in line and "last checkpoint is intact" in line


def test_vanished_path_is_a_clear_error(tmp_path):
    result, _ = run_offload(tmp_path, [*BF16, *path_flags(tmp_path, 2)],
                            env={FAULT: "vanish:1:4"}, check=False)
    line = _one_error_line(result)
    assert "does not exist" in line and str(tmp_path / "tier1") in line


def test_throttled_path_loses_subgroups(tmp_path):
    # Bandwidths as given are equal; from step 3 on, I/O on tier1 takes 8x as long.
    dirs = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir()
        dirs.append(f"{tmp_path / f'tier{i}'}@1,1")
    _, out = run_offload(tmp_path, [*BF16, "--offload-paths", *dirs, *SMALL],
                         env={FAULT: "slow:1:8:3"})
    counts = [r["offload/path1_subgroups"] for r in read_metrics(out)
              if "offload/cache_hit_rate" in r]
    assert counts[0] == 6, counts
    first_move = next(i for i, c in enumerate(counts) if c < 6)
    assert first_move <= 3 + 6, counts  # within 6 steps of the slowdown
    assert counts[-1] <= 3, counts


def test_two_jobs_on_one_path_keep_apart(tmp_path, baseline):
    """Two jobs started at once on the same path each see only their own state."""
    flags = [*BASE, *BF16, "--offload-optimizer", *path_flags(tmp_path, 1)]
    outs = [tmp_path / f"job{i}.jsonl" for i in range(2)]
    procs = [launch([*flags, "--metrics-path", str(out)]) for out in outs]
    for proc in procs:
        text = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, text[-3000:]
    for out in outs:
        assert train_losses(out) == baseline("bf16")


# ---------------------------------------------------------------- the hierarchy of tiers

STREAM = "MEGATRON_EXT_OFFLOAD_STREAM_SHARE"
# 12 subgroups of 120 KB (fp32 masters) or 100 KB (bf16 weights: masters as remainders):
# a device tier of 4.5 subgroups holds 4 of them.
DEVICE = ["--offload-device-cache-gb", "0.0005"]
DEVICE_BF16 = ["--offload-device-cache-gb", "0.00045"]


def tier_flags(tmp_path, layout: str, bf16_remainders: bool = False) -> list:
    """Flags of a tier combination: device only, device + host, device + host + two paths.

    ``bf16_remainders``: sized for 10 bytes per element (bf16 weights, remainders on).
    """
    device = DEVICE_BF16 if bf16_remainders else DEVICE
    if layout == "device-only":
        return ["--offload-device-cache-gb", "1", "--offload-subgroup-size", "10000"]
    if layout == "device+host":
        return [*device, "--offload-subgroup-size", "10000"]
    return [*device, *path_flags(tmp_path, 2)]


# bf16: every combination, with and without the streamed update (on the CPU the "device"
# is the CPU, so the test hook STREAM forces a share through it); fp32 in the resume test.
TIER_MATRIX = [("device-only", False), ("device+host", True), ("all-tiers", False),
               ("all-tiers", True)]


@pytest.mark.parametrize("layout,stream", TIER_MATRIX,
                         ids=[f"{lay}{'-streamed' if s else ''}" for lay, s in TIER_MATRIX])
def test_state_tiers_match_plain_optimizer(tmp_path, run_cache, baseline, layout, stream):
    # bf16: the masters as remainders (the default; the whole masters of
    # --no-store-param-remainders: tests/functional/test_remainders_cpu.py).
    records = shared_offload(run_cache, tmp_path, ["--bf16", *tier_flags(tmp_path, layout, True)],
                             env={STREAM: "0.5"} if stream else None).records
    assert losses_of(records) == baseline("bf16")
    last = [r for r in records if "offload/cache_hit_rate" in r][-1]
    assert last["offload/state_bytes_per_element"] == 10
    assert last["offload/device_subgroups_n"] == (12 if layout == "device-only" else 4)
    assert (last["offload/streamed_subgroups"] > 0) == stream
    assert (last["offload/io_bytes"] > 0) == (layout == "all-tiers")


def test_all_tiers_resume_is_exact_fp32(tmp_path, run_cache, baseline, monkeypatch):
    monkeypatch.setenv(STREAM, "0.5")
    flags = [*BASE, "--offload-optimizer", *tier_flags(tmp_path, "all-tiers")]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=10, runs=run_cache)
    assert losses_of(straight) == baseline("fp32")
    assert losses_of(resumed) == losses_of(straight)
    manifest = json.loads((tmp_path / "ckpt" / "iter_0000010" / "offload" / "rank00000" /
                           "manifest.json").read_text())
    assert len(manifest["subgroups"]) == 12 and manifest["state_dtypes"] == ["fp32"] * 3
    assert {entry["how"] for entry in manifest["subgroups"]} == {"linked", "written"}


def test_auto_device_tier_sizes_itself_and_gives_back(tmp_path, baseline):
    # 1 MB of "device" memory; besides the states, a peak of 0.3 MB until step 6 (room for
    # 5 subgroups of 120 KB with 0.1 MB reserve), then 0.6 MB (room for 2).
    env = {"MEGATRON_EXT_DEVICE_MEMORY_LIMIT_GB": "0.001",
           "MEGATRON_EXT_DEVICE_PEAK_GB": "1:0.0003,6:0.0006", STREAM: "0.5"}
    # Sized in subgroups of 120 KB: whole masters.
    result, out = run_offload(tmp_path, ["--bf16", "--offload-device-cache-gb", "auto",
                                         "--offload-device-reserve-gb", "0.0001",
                                         "--no-store-param-remainders",
                                         *path_flags(tmp_path, 2)], env=env)
    records = read_metrics(out)
    assert losses_of(records) == baseline("bf16")
    tiers = [r["offload/device_subgroups_n"] for r in records if "offload/cache_hit_rate" in r]
    assert tiers[0] == 5 and tiers[-1] == 2, tiers
    assert "device tier (auto): 5 of 12 subgroups" in result.stdout
    assert "device tier gives back 3 subgroups" in result.stdout


def test_bf16_moments_train_with_8_bytes_per_element(tmp_path, baseline):
    """8 bytes with whole masters; 6 with remainders (the default), the same losses."""
    moments = ["--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
               "--exp-avg-sq-dtype", "bf16"]
    _, out = run_offload(tmp_path, [*moments, "--no-store-param-remainders",
                                    *tier_flags(tmp_path, "all-tiers")], env={STREAM: "0.5"})
    records = read_metrics(out)
    last = [r for r in records if "offload/cache_hit_rate" in r][-1]
    assert last["offload/state_bytes_per_element"] == 8
    losses, plain = losses_of(records), baseline("bf16")
    assert losses != plain  # the moments really are rounded to bf16
    assert max(abs(a - b) for a, b in zip(losses, plain)) < 0.05 * plain[0]
    _, out = run_offload(tmp_path, [*moments, *tier_flags(tmp_path, "all-tiers")],
                         env={STREAM: "0.5"}, name="remainders.jsonl")
    records = read_metrics(out)
    last = [r for r in records if "offload/cache_hit_rate" in r][-1]
    assert last["offload/state_bytes_per_element"] == 6
    assert losses_of(records) == losses
