"""pretrain_gpt.py with --zenflow on the CPU: exact where it must be, resumable, measured.

The engine's semantics (windows, delayed application, re-selection that keeps every
moment, no race between the CPU threads) are proven against a plain-PyTorch reference in
tests/unit/zenflow/test_engine.py; here whole runs go through megatron-core's optimizer,
checkpoints and processes.
"""

from __future__ import annotations

import json
import math

import pytest

from mext_testing import (
    BF16,
    TINY,
    assert_loss_falls,
    baseline_losses,
    losses_of,
    precision_flags,
    read_metrics,
    run_pretrain,
    straight_and_resumed,
    train_losses,
)

ITERS = 20
BASE = [*TINY, "--train-iters", str(ITERS), "--use-distributed-optimizer"]
ZENFLOW = ["--zenflow"]
# Every column on the GPU side, one-step windows: plain Adam.
ALL_SELECTED = [*ZENFLOW, "--zenflow-topk-ratio", "1.0", "--zenflow-update-interval", "1"]
# Every step synchronous (warm-up), 30% of the columns on the GPU side, re-selected every
# 4 steps: the CPU side updates its columns inside the step, so this is plain Adam too.
ALL_WARMUP = [*ZENFLOW, "--zenflow-topk-ratio", "0.3", "--zenflow-full-warmup-steps",
              str(ITERS), "--zenflow-select-interval", "4"]
ASYNC = [*ZENFLOW, "--zenflow-select-interval", "8"]
# No re-selection.
FIXED = [*ZENFLOW, "--zenflow-select-interval", str(ITERS)]


def tier_flags(tmp_path) -> list:
    """Two tier paths, subgroups of 10k elements, three of them in the host cache."""
    dirs = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir(exist_ok=True)
        dirs.append(f"{tmp_path / f'tier{i}'}@{2 - i},1")
    return ["--offload-optimizer", "--offload-paths", *dirs, "--offload-subgroup-size", "10000",
            "--offload-host-cache-gb", "0.00036"]


@pytest.fixture(scope="module")
def baseline(run_cache):
    """Losses of the plain distributed optimizer, per precision (once per session)."""
    return baseline_losses(run_cache, BASE)


def run_zenflow(tmp_path, flags, name="zenflow.jsonl", **kwargs):
    out = tmp_path / name
    run_pretrain([*BASE, *flags, "--metrics-path", str(out)], **kwargs)
    return out


def shared_zenflow(run_cache, tmp_path, flags):
    """The run of ``flags`` (tier paths under ``tmp_path``), shared with the tests that start
    the same one (the session's run cache): its records."""
    return run_cache.run([*BASE, *flags], base=tmp_path).records


@pytest.mark.parametrize("place", ["host", "device"])
@pytest.mark.parametrize("precision", ["fp32"])
def test_all_columns_selected_equals_plain_adam(tmp_path, run_cache, baseline, precision,
                                                place):
    records = shared_zenflow(run_cache, tmp_path, [*ALL_SELECTED, *precision_flags(precision),
                                                   "--zenflow-accumulate", place])
    assert losses_of(records) == baseline(precision)
    assert records[-1]["zenflow/accumulate_on_device"] == float(place == "device")


def test_device_accumulation_equals_host_and_resumes_mid_window(tmp_path):
    """--zenflow-accumulate device (on the CPU the device is the CPU: the same code): the
    host's losses bit for bit, with one copy to the host per window; stopped at 6, mid-
    window (steps 5-6 summed on the device) with window 1's update pending, and resumed:
    still the same curve (the device's partial sum is in the checkpoint)."""
    flags = [*ASYNC, *BF16, "--log-interval", "1", "--eval-iters", "0",
             "--lr-decay-style", "linear"]
    host = run_zenflow(tmp_path, [*flags, "--zenflow-accumulate", "host"], name="host.jsonl")
    device = [*flags, "--zenflow-accumulate", "device", "--save", str(tmp_path / "ckpt")]
    first = run_zenflow(tmp_path, [*device, "--exit-interval", "6"], name="first.jsonl")
    second = run_zenflow(tmp_path, [*device, "--load", str(tmp_path / "ckpt")],
                         name="second.jsonl")
    records = [r for r in read_metrics(first) + read_metrics(second) if "lm_loss" in r]
    assert losses_of(records) == train_losses(host)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert all(r["zenflow/accumulate_on_device"] == 1.0 for r in records)
    copies = [r["iteration"] for r in records if r["zenflow/d2h_copies"] > 0]
    assert copies == [4, 8, 12, 16, 20]  # one per window, at its end
    hosted = [r for r in read_metrics(host) if "lm_loss" in r]
    assert all(r["zenflow/d2h_copies"] == 1.0 and r["zenflow/accumulate_on_device"] == 0.0
               for r in hosted)
    # bf16 grads: 2 bytes per delayed element per step on the host; the window's fp32
    # mean once per 4 steps on the device: half of that per step.
    host_d2h = sum(r["zenflow/d2h_bytes"] for r in hosted)
    device_d2h = sum(r["zenflow/d2h_bytes"] for r in records)
    assert device_d2h == pytest.approx(host_d2h / 2, rel=0.05)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_synchronous_steps_equal_plain_adam(tmp_path, run_cache, baseline, precision):
    """The CPU side's Adam, accumulation, unscaling and clipping match megatron-core's."""
    records = shared_zenflow(run_cache, tmp_path, [*ALL_WARMUP, *precision_flags(precision)])
    assert losses_of(records) == baseline(precision)
    # Not trivially so: 70% of the matrix columns were updated by the CPU side.
    last = [r for r in records if "zenflow/selected_ratio" in r][-1]
    assert 0.25 < last["zenflow/selected_ratio"] < 0.35
    assert last["zenflow/h2d_bytes"] > 0


def test_async_windows_train_and_report(tmp_path, baseline):
    # --profile rides along (the same run): iterations 11-12 hold a window end (12).
    prof = tmp_path / "prof"
    out = run_zenflow(tmp_path, [*ASYNC, *BF16, "--profile", "--use-pytorch-profiler",
                                 "--profile-step-start", "10",
                                 "--profile-step-end", "12", "--profile-dir", str(prof)])
    records = [r for r in read_metrics(out) if "lm_loss" in r]
    losses = losses_of(records)
    assert_loss_falls(losses)
    assert losses != baseline("bf16")  # the delayed columns really are delayed
    assert len(records) == ITERS
    for r in records:
        assert 0.0 < r["zenflow/rho"] < 1.0
        assert r["zenflow/update_interval"] == 4
        assert abs(r["zenflow/selected_ratio"] - 0.1) < 0.03
        assert r["zenflow/d2h_bytes"] > 0
    # Windows end at 4, 8, 12, 16, 20; a window's CPU update enters the model at the end
    # of the next one (8: window 4's), and a re-selection (12, 20) first applies the
    # pending update and the one it just ran, so 16 has nothing to apply. With log
    # interval 1, exactly those records carry H2D bytes, twice as many at re-selections.
    uploads = {r["iteration"]: r["zenflow/h2d_bytes"] for r in records
               if r["zenflow/h2d_bytes"] > 0}
    assert sorted(uploads) == [8, 12, 20]
    assert uploads[12] == pytest.approx(2 * uploads[8], rel=0.05)
    # Re-selection at steps 12 and 20 (interval 8, from step 1, at window ends).
    assert math.isnan(records[10]["zenflow/retention"])
    assert 0.0 <= records[11]["zenflow/retention"] <= 1.0
    # Only the selected columns and 1-D parameters keep fp32 state on the device.
    last = records[-1]
    assert 0 < last["zenflow/device_state_gib"] < 0.25 * last["zenflow/host_state_gib"]
    # The profile: the optimizer's labelled ranges, once per profiled step (the flush only
    # at 12, twice: the pending update, then the re-selection's), and a Chrome trace.
    table = (prof / "rank0-iter11-12.txt").read_text()
    assert table.startswith("iterations 11-12, rank 0")
    calls = {line.split()[0]: int(line.split()[-1]) for line in table.splitlines()
             if line.strip().startswith(("zenflow/", "optimizer/"))}
    assert calls["zenflow/gpu_update"] == 2 and calls["zenflow/send_delayed_grads"] == 2
    assert calls["optimizer/grad_norm"] == 2 and calls["zenflow/flush_pending"] == 2
    assert json.loads((prof / "rank0-iter11-12.json").read_text())["traceEvents"]


@pytest.mark.parametrize("stop_at", [6, 12])
def test_resume_is_exact(tmp_path, run_cache, stop_at):
    """Stopped mid-window with a CPU update pending (6), or at a re-selection (12)."""
    flags = [*BASE, *ASYNC, *BF16]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=stop_at, runs=run_cache)
    assert losses_of(resumed) == losses_of(straight)
    ckpt = tmp_path / "ckpt" / f"iter_{stop_at:07d}"
    assert (ckpt / "zenflow" / "rank00000.pt").is_file()


@pytest.fixture(scope="module")
def plain_checkpoint(run_cache):
    """A checkpoint of the plain distributed optimizer after 4 iterations (once a session;
    the tests only load it)."""
    return run_cache.run([*BASE, "--train-iters", "4", "--save", "{run}/ckpt"]).directory / "ckpt"


def test_finetune_from_a_plain_checkpoint(tmp_path, plain_checkpoint):
    ckpt = plain_checkpoint
    out = run_zenflow(tmp_path, [*ASYNC, "--finetune", "--load", str(ckpt),
                                 "--train-iters", "8", "--save", str(tmp_path / "ft")])
    assert len(train_losses(out)) == 8
    assert (tmp_path / "ft" / "latest_checkpointed_iteration.txt").read_text() == "8"


def test_plain_checkpoint_without_finetune_is_one_line_error(plain_checkpoint):
    result = run_pretrain([*BASE, *ASYNC, "--load", str(plain_checkpoint)], check=False)
    assert result.returncode == 2, result.stdout[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--finetune" in lines[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize("precision", ["bf16"])
@pytest.mark.parametrize("selection", ["fixed", "reselect"])
def test_cpu_side_in_offload_tiers_equals_host_memory(tmp_path, run_cache, precision,
                                                      selection):
    """The CPU side's master and moments in the offload engine (host cache + two paths):
    the same losses as with them in host memory, bit for bit, and they did use the paths;
    also with re-selections (at 8 and 16), which move states between the GPU side and a
    new engine's files."""
    flags = [*(FIXED if selection == "fixed" else ASYNC), *precision_flags(precision)]
    memory = shared_zenflow(run_cache, tmp_path, flags)
    records = shared_zenflow(run_cache, tmp_path, [*flags, *tier_flags(tmp_path)])
    assert losses_of(records) == losses_of(memory)
    for path in (0, 1):
        assert sum(r.get(f"offload/path{path}_write_bytes", 0) for r in records) > 0
        assert sum(r.get(f"offload/path{path}_read_bytes", 0) for r in records) > 0


@pytest.mark.parametrize("selection,stop_at", [("fixed", 6), ("reselect", 10)])
def test_cpu_side_in_offload_tiers_resume_is_exact(tmp_path, run_cache, selection, stop_at):
    """Resumed from a checkpoint (after a re-selection in the second case: the engine of
    the second selection saved its files): the same curve."""
    flags = [*BASE, *(FIXED if selection == "fixed" else ASYNC), *BF16,
             *tier_flags(tmp_path)]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=stop_at, runs=run_cache)
    assert losses_of(resumed) == losses_of(straight)
    manifest = (tmp_path / "ckpt" / f"iter_{stop_at:07d}" / "zenflow" / "offload"
                / "rank00000")
    assert (manifest / "manifest.json").is_file()

