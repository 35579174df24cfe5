"""One run per --save directory (megatron_ext/checkpoint/save_lock.py).

A second holder is refused in one line naming the directory and the holder; a dead holder's
lock (SIGKILL) is free; a forked child does not keep it; the end leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_ext.checkpoint import save_lock
from megatron_ext.checkpoint.save_lock import LOCK_NAME, SaveLock, holder_text, job_id
from megatron_ext.errors import UsageError
from mext_testing import ROOT, test_env


def _refused(root) -> str:
    with pytest.raises(UsageError) as info:
        SaveLock(str(root))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    root = tmp_path / "ckpt"
    held = SaveLock(str(root))
    try:
        info = json.loads((root / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid()
        message = _refused(root)
        assert message.startswith(f"--save {root} is in use by another running job (host ")
        assert f"pid {os.getpid()}" in message and "give this run another --save" in message
    finally:
        held.release()
    # Released: the file is gone and the next run takes the directory.
    assert not (root / LOCK_NAME).exists()
    SaveLock(str(root)).release()


def test_a_directory_it_created_and_left_empty_is_removed(tmp_path):
    root = tmp_path / "new"
    SaveLock(str(root), created_root=True).release()
    assert not root.exists()
    kept = tmp_path / "given"
    kept.mkdir()
    SaveLock(str(kept)).release()
    assert kept.is_dir() and os.listdir(kept) == []


def test_a_stale_lock_file_is_a_free_lock(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LOCK_NAME).write_text('{"host": "elsewhere", "pid": 1, "job": "Slurm job 7"}\n')
    held = SaveLock(str(root))
    assert json.loads((root / LOCK_NAME).read_text())["pid"] == os.getpid()
    held.release()


HOLDER = textwrap.dedent("""
    import sys, time
    from megatron_ext.checkpoint.save_lock import SaveLock
    lock = SaveLock(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_holder_killed_with_sigkill_lets_the_next_run_in(tmp_path):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], cwd=ROOT,
                            env=test_env({"SLURM_JOB_ID": "4242"}), stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        message = _refused(root)
        assert f"pid {proc.pid}, Slurm job 4242)" in message
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    held = SaveLock(str(root))  # the kernel dropped the dead holder's lock
    held.release()


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    root = tmp_path / "ckpt"
    held = SaveLock(str(root))
    ready, tell = os.pipe()
    pid = os.fork()
    if pid == 0:  # a long-lived child (a data-loader worker); the fork hooks have run
        os.write(tell, b"1")
        time.sleep(30)
        os._exit(0)
    os.close(tell)
    assert os.read(ready, 1) == b"1"
    os.close(ready)
    try:
        # The parent dies (its descriptor closes, the file stays): the child's copy of the
        # descriptor must not keep the lock.
        held._finalizer.detach()
        os.close(held.fd)
        SaveLock(str(root)).release()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_lock_file_that_is_a_symlink_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    assert "is a symlink: remove it" in _refused(root)


@pytest.mark.parametrize("raw, text", [
    (b'{"host": "n1", "pid": 7, "job": "Slurm job 3"}', "host n1, pid 7, Slurm job 3"),
    (b'{"host": "n1", "pid": 7, "job": null}', "host n1, pid 7"),
    (b"", ""),
    (b"\xff garbage", ""),
    (b"[1, 2]", ""),
])
def test_holder_text(raw, text):
    assert holder_text(raw) == text


def test_job_id():
    assert job_id({"SLURM_JOB_ID": "12"}) == "Slurm job 12"
    assert job_id({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert job_id({"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun run abc"


def test_take_without_save_takes_nothing():
    assert save_lock.take(None, runtime=None) is None


def test_take_on_rank_0_holds_it_and_refuses_a_second_run(tmp_path):
    from types import SimpleNamespace

    one = SimpleNamespace(rank=0, world_size=1, host_group=None)
    root = tmp_path / "new"
    held = save_lock.take(str(root), one)
    try:
        assert (root / LOCK_NAME).is_file()
        with pytest.raises(UsageError, match="is in use by another running job"):
            save_lock.take(str(root), one)
    finally:
        held.release()
    assert not root.exists()  # created at start-up, nothing saved: removed again
