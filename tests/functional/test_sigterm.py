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
import time

import pytest

from mext_testing import TINY, launch, run_pretrain, train_losses

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
