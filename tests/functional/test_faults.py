"""The faults a user meets: each one ``error:`` line, before anything is overwritten.

Real ``pretrain_gpt.py`` (and ``tools/preprocess_data.py``) processes, one per fault:

- a second run given the same ``--save`` while the first runs: refused at start-up naming
  the directory and the holder, the first run's checkpoints untouched; after the first is
  killed with SIGKILL, a run resumes there (its lock died with it);
- a checkpoint whose ``integrity.json`` was deleted (its ``common.pt`` says it was saved
  with one): refused, naming the previous good checkpoint, not loaded unverified;
- ``latest_checkpointed_iteration.txt`` naming a deleted iteration: the line names the
  newest complete checkpoint and how to resume from it;
- a TP=2 checkpoint of the plain distributed optimizer loaded at TP=1: one line saying what
  differs and how to load it (it was a CheckpointingException traceback);
- an offload path that is full at start: skipped with a warning beside a path with room,
  one line when it is the only one; nothing of the run left on it;
- preprocess_data.py on a full output disk: one line, no ``.tmp-PID`` file left.

Full file systems are real tmpfs mounts where this process may mount one (root), else
those tests are skipped.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mext_testing import PRETRAIN, ROOT, TINY, launch, run_pretrain, test_env

FLAGS = [*TINY, "--train-iters", "4", "--use-distributed-optimizer", "--lr-decay-style",
         "linear"]
POINTER = "latest_checkpointed_iteration.txt"


def run(args, env=None, script=PRETRAIN, timeout=300):
    """A process with stdout and stderr apart (the error line is all of stderr)."""
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT,
                          env=test_env(env), capture_output=True, text=True, timeout=timeout)


def one_error_line(proc, *expected) -> str:
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def saved(run_cache):
    """Checkpoints of iterations 2 and 4 of the tiny run (plain distributed optimizer; once
    a session: tests damage copies of it)."""
    root = run_cache.run([*FLAGS, "--save", "{run}/ckpt", "--save-interval",
                          "2"]).directory / "ckpt"
    assert (root / POINTER).read_text() == "4"
    return root


def copy_of(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root


# ------------------------------------------------------------------ one run per --save


def _wait_for(predicate, proc, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"the first run ended before {what}:\n" + \
            proc.communicate()[0][-3000:]
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_second_run_on_the_same_save_is_refused_and_a_killed_run_resumes(tmp_path):
    root = tmp_path / "ckpt"
    long_run = [*TINY, "--train-iters", "100000", "--use-distributed-optimizer",
                "--save", str(root), "--save-interval", "10"]
    first = launch(long_run, start_new_session=True)
    try:
        _wait_for(lambda: (root / POINTER).is_file(), first, "its first checkpoint")
        # Megatron-LM's flags of a short run on the same directory: it would save iterations
        # 2 and 4 there and move 'latest' back.
        second = run([*FLAGS, "--save", root, "--save-interval", "2"])
        one_error_line(second, f"--save {root} is in use by another running job",
                       f"pid {first.pid}", "give this run another --save")
        # Only the first run's checkpoints (every 10 iterations) are there.
        assert int((root / POINTER).read_text()) % 10 == 0
        assert all(int(p.name[5:12]) % 10 == 0 for p in root.glob("iter_*")), \
            sorted(os.listdir(root))
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # a crash: the lock file stays, the lock dies
        first.communicate(timeout=60)
    assert (root / ".megatron_ext-save.lock").exists()
    stopped = int((root / POINTER).read_text())
    resumed = run([*long_run, "--load", root, "--exit-interval", stopped + 2])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert int((root / POINTER).read_text()) == stopped + 2
    # At its end the run lets go of the directory and leaves no lock file behind.
    assert not (root / ".megatron_ext-save.lock").exists()


# ------------------------------------------------------------------ checkpoints


def test_a_deleted_integrity_manifest_is_refused_not_loaded_unverified(saved, tmp_path):
    root = copy_of(saved, tmp_path)
    ck = root / "iter_0000004"
    (ck / "integrity.json").unlink()
    # A flipped byte, which no manifest is there any more to catch.
    data = bytearray((ck / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (ck / "__0_0.distcp").write_bytes(bytes(data))
    proc = run([*FLAGS, "--train-iters", "6", "--override-opt_param-scheduler", "--load", root])
    one_error_line(proc, f"{ck / 'integrity.json'}: missing, though its common state",
                   f"the previous good checkpoint is {root / 'iter_0000002'}",
                   f"echo 2 > {root / POINTER}")


def test_a_pointer_to_a_deleted_iteration_names_the_newest_complete_checkpoint(saved,
                                                                               tmp_path):
    root = copy_of(saved, tmp_path)
    shutil.rmtree(root / "iter_0000004")
    (root / "iter_0000003").mkdir()  # a folder that is no checkpoint is not named
    proc = run([*FLAGS, "--train-iters", "6", "--override-opt_param-scheduler", "--load", root])
    one_error_line(proc, f"{POINTER} names iteration 4 but {root / 'iter_0000004'} does not "
                   f"exist; the newest complete checkpoint is {root / 'iter_0000002'}: resume "
                   f"from it with 'echo 2 > {root / POINTER}'")


def test_tp2_distributed_optimizer_checkpoint_at_tp1_is_one_line(tmp_path):
    root = tmp_path / "tp2"
    run_pretrain([*FLAGS, "--train-iters", "2", "--tensor-model-parallel-size", "2",
                  "--save", str(root)], nproc=2)
    proc = run([*FLAGS, "--load", root])
    one_error_line(proc, "its optimizer state was saved at TP=2 PP=1 by the distributed "
                   "optimizer (dp_reshardable sharding)", "this run has TP=1 PP=1",
                   "--tensor-model-parallel-size 2", "--no-load-optim")
    assert "building the model" not in proc.stdout  # refused before anything was built
    # What the line offers works: the weights and the iteration, a fresh optimizer.
    fresh = run([*FLAGS, "--load", root, "--no-load-optim"])
    assert fresh.returncode == 0, fresh.stdout[-3000:] + fresh.stderr[-3000:]


# ------------------------------------------------------------------ full disks


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 64 KiB tmpfs, filled up."""
    mount = tmp_path / "full"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def _fill(mount) -> None:
    with open(mount / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC


def test_a_full_offload_path_at_start_is_skipped_or_refused_in_one_line(full_tmpfs, tmp_path):
    room = tmp_path / "room"
    room.mkdir()
    _fill(full_tmpfs)
    offload = [*FLAGS, "--train-iters", "2", "--offload-optimizer", "--offload-subgroup-size",
               "30000"]
    # Bandwidths given: no probe, so the first write on the path is the job directory's lock.
    proc = run([*offload, "--offload-paths", f"{full_tmpfs}@1,1", f"{room}@1,1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert f"--offload-paths {full_tmpfs} skipped: No space left on device" in proc.stdout
    assert sorted(os.listdir(full_tmpfs)) == ["filler"]
    # The memory plan would refuse this run before the start too (it sees the path's free
    # space); the engine's own refusal, on the lock file's write, is what is tested here.
    proc = run([*offload, "--offload-paths", f"{full_tmpfs}@1,1", "--no-plan-check"])
    one_error_line(proc, "--offload-paths: no path has room for the job directory",
                   f"{full_tmpfs}: No space left on device")
    assert sorted(os.listdir(full_tmpfs)) == ["filler"]


PREPROCESS = str(ROOT / "tools" / "preprocess_data.py")


def test_preprocess_on_a_full_disk_is_one_line_and_leaves_no_temporary_file(full_tmpfs,
                                                                           tmp_path):
    data = tmp_path / "data.jsonl"
    # ~120 KB of uint16 tokens: more than the 64 KiB file system holds.
    data.write_text("".join(json.dumps({"text": " ".join(str((i + j) % 90 + 1)
                                                          for j in range(40))}) + "\n"
                            for i in range(1500)))
    proc = run(["--input", data, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                "--output-prefix", full_tmpfs / "corpus", "--workers", "1"], script=PREPROCESS)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith(f"error: --output-prefix {full_tmpfs / 'corpus'}: writing the "
                                "dataset failed: No space left on device"), lines[-1]
    assert sum(line.startswith("error") for line in lines) == 1
    assert os.listdir(full_tmpfs) == []
