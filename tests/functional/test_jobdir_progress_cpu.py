"""Whole runs: one job per offload run id, nothing left on the paths, start-up and ETA lines,
ZenFlow's section of the iteration line.

The many refusals of planted or foreign directories are unit tests
(tests/unit/offload/test_jobdir.py); here real pretrain_gpt.py processes show the lock
between two jobs and what a run prints and leaves behind.
"""

from __future__ import annotations

import os
import re
import signal

from mext_testing import TINY, launch, run_pretrain, train_losses

ITERS = 8
BASE = [*TINY, "--train-iters", str(ITERS), "--log-interval", "1", "--eval-iters", "0",
        "--lr-decay-style", "cosine", "--use-distributed-optimizer"]
ETA = re.compile(r" \| ETA \d{2,}:\d{2}:\d{2} \|$")


def _offload(tier, *extra):
    # No bandwidths given: the start-up probe measures the path (tiny: subgroups of 10k).
    return [*BASE, "--bf16", "--offload-optimizer", "--offload-paths", str(tier),
            "--offload-subgroup-size", "10000", "--offload-host-cache-gb", "0.00036", *extra]


def _iteration_lines(text):
    return [line for line in text.splitlines() if line.startswith(" iteration")]


def test_second_job_with_the_same_run_id_refuses_and_the_first_is_unharmed(tmp_path):
    tier = tmp_path / "tier"
    tier.mkdir()
    solo = tmp_path / "solo.jsonl"
    result = run_pretrain([*_offload(tier), "--metrics-path", str(solo)])
    # What a run says while it starts, and what it leaves: nothing.
    for phase in ("building the model", "building the optimizer", "done; training from"):
        assert f"start-up: {phase}" in result.stdout, result.stdout[-3000:]
    assert re.search(rf"offload: probed {re.escape(str(tier))}: read [0-9.]+ GB/s, write "
                     r"[0-9.]+ GB/s \(median of 3 passes of 1 MiB, 4 threads", result.stdout)
    lines = _iteration_lines(result.stdout)
    assert len(lines) == ITERS and all(ETA.search(line) for line in lines), lines[:2]
    assert lines[-1].endswith("| ETA 00:00:00 |"), lines[-1]
    assert os.listdir(tier) == [], "the run left directories on its offload path"

    first_out = tmp_path / "first.jsonl"
    first = launch([*_offload(tier, "--offload-run-id", "shared"), "--metrics-path",
                    str(first_out)])
    seen = []
    try:
        for line in first.stdout:
            seen.append(line)
            if line.startswith(" iteration        1/"):
                break
        # Frozen with its lock held, mid-run: the second job comes now.
        first.send_signal(signal.SIGSTOP)
        assert first.poll() is None, "".join(seen)[-3000:]
        lock = tier / f"megatron_ext-{_user()}" / "shared" / "rank00000" / ".lock"
        assert lock.exists()
        second = run_pretrain(_offload(tier, "--offload-run-id", "shared"), check=False)
        errors = [line for line in second.stdout.splitlines() if line.startswith("error: ")]
        assert second.returncode == 2, second.stdout[-3000:]
        assert len(errors) == 1 and "Traceback" not in second.stdout, second.stdout[-3000:]
        assert "in use by another running job" in errors[0] and f"pid {first.pid}" in errors[0]
        first.send_signal(signal.SIGCONT)
        rest = first.communicate(timeout=300)[0]
    finally:
        first.send_signal(signal.SIGCONT)
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 0, ("".join(seen) + rest)[-3000:]
    assert train_losses(first_out) == train_losses(solo), "the second job disturbed the first"
    assert os.listdir(tier) == []


def test_zenflow_reports_on_the_iteration_line(tmp_path):
    result = run_pretrain([*BASE, "--zenflow", "--zenflow-select-interval", "8"])
    lines = _iteration_lines(result.stdout)
    assert len(lines) == ITERS
    section = re.compile(r"\| zenflow: rho \d\.\d{3} S \d+ stall \(ms\) \d+\.\d selected "
                         r"\d+\.\d% \|")
    assert all(section.search(line) and ETA.search(line) for line in lines), lines[-1]


def _user():
    from megatron_ext.offload.jobdir import user_name

    return user_name()
