"""SIGTERM to the whole process group (``kill -TERM -- -PGID``, what Slurm and a shell's
job control do) saves at the signal, and the resumed run is the uninterrupted one, bitwise.

The signal reaches every process of the job: megatron-core's checkpoint writer processes
too. The run saves every 4 iterations before the signal, so a writer's helper process
from an earlier save exists when the signal comes (megatron-core's result-queue server
did, and died of it: BrokenPipeError at the save of the signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mext_testing import PRETRAIN, ROOT, TINY, launch, run_pretrain, test_env, train_losses

# Megatron-LM's default of 2 data-loader workers per rank: they get the signal too (killed,
# they broke the batch in flight with ConnectionResetError, and the save with it).
FLAGS = [*TINY, "--train-iters", "24", "--use-distributed-optimizer", "--lr-decay-style",
         "linear", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "2"]
POINTER = "latest_checkpointed_iteration.txt"


@pytest.mark.parametrize("nproc", [1, 2], ids=["single", "torchrun2"])
def test_sigterm_to_process_group_saves_and_resume_is_exact(tmp_path, nproc):
    straight = tmp_path / "straight.jsonl"
    run_pretrain([*FLAGS, "--metrics-path", str(straight)], nproc=nproc)
    ckpt, first = tmp_path / "ckpt", tmp_path / "first.jsonl"
    proc = launch([*FLAGS, "--save", str(ckpt), "--save-interval", "4",
                   "--metrics-path", str(first)], nproc=nproc, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if first.exists() and len(train_losses(first)) >= 6:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    for broken in ("BrokenPipeError", "EOFError", "ConnectionResetError"):
        assert broken not in out, out[-4000:]
    # torchrun itself ends with a traceback of its SignalException after its workers have
    # exited (torch's launcher; its workers exit 0): that one is the only traceback.
    assert out.count("Traceback") == out.count("SignalException: Process"), out[-4000:]
    assert "exit signal received: saving at iteration" in out, out[-4000:]
    stopped = int((ckpt / POINTER).read_text())
    assert 6 <= stopped < 24, out[-3000:]
    assert (ckpt / f"iter_{stopped:07d}" / "integrity.json").is_file()
    if nproc == 1:
        assert proc.returncode == 0, out[-3000:]
    assert len(train_losses(first)) == stopped
    second = tmp_path / "second.jsonl"
    run_pretrain([*FLAGS, "--load", str(ckpt), "--metrics-path", str(second)], nproc=nproc)
    assert train_losses(first) + train_losses(second) == train_losses(straight)


@pytest.mark.parametrize("save", [True, False], ids=["save", "no-save"])
def test_ctrl_c_mid_training_says_what_saves_in_one_line(tmp_path, save):
    """SIGINT stops where it lands and saves nothing: one line says so, and that SIGTERM
    saves; exit status 130, no traceback."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    flags = [*FLAGS, "--train-iters", "2000", "--metrics-path", str(metrics)]
    if save:
        flags += ["--save", str(ckpt), "--save-interval", "4"]
    proc = subprocess.Popen([sys.executable, PRETRAIN, *flags], cwd=ROOT, env=test_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(train_losses(metrics)) >= 6:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < 30
    assert proc.returncode == 130, (out + err)[-3000:]
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: interrupted (Ctrl-C) while "), lines
    if save:
        assert lines[0].endswith(": nothing saved since the last checkpoint; send SIGTERM to "
                                 "save a checkpoint and exit"), lines
        stopped = int((ckpt / POINTER).read_text())
        assert stopped % 4 == 0 and 4 <= stopped <= len(train_losses(metrics)), stopped
    else:
        assert lines[0].endswith(": nothing saved (no --save); with --save DIR, SIGTERM saves "
                                 "a checkpoint and exits"), lines
