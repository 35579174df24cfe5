"""Node-local tier locks: exclusion across processes and threads, dead holders, unsafe files."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from megatron_ext.errors import UsageError
from megatron_ext.offload.locks import NodeLocks, default_lock_dir
from mext_testing import ROOT, test_env

IS_ROOT = os.geteuid() == 0

# Each section appends "pid start end" while it holds the lock, then the next one starts.
SECTIONS = """
import os, sys, time
from megatron_ext.offload.locks import NodeLocks
lock_dir, tier, log, workdir, enabled = sys.argv[1:]
locks = NodeLocks(enabled=enabled == "1", lock_dir=lock_dir)
open(os.path.join(workdir, f"ready-{os.getpid()}"), "w").close()
while not os.path.exists(os.path.join(workdir, "go")):
    time.sleep(0.001)
fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
for _ in range(20):
    with locks.hold(tier):
        start = time.monotonic()
        time.sleep(0.005)
        end = time.monotonic()
        os.write(fd, f"{os.getpid()} {start} {end}\\n".encode())
"""

# Takes the lock, optionally forks a long-lived child, says so, and waits to be killed.
HOLDER = """
import os, sys, time
from megatron_ext.offload.locks import NodeLocks
lock_dir, tier, workdir, fork = sys.argv[1:]
locks = NodeLocks(lock_dir=lock_dir)
with locks.hold(tier):
    if fork == "1":
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        open(os.path.join(workdir, "child"), "w").write(str(child))
    open(os.path.join(workdir, "held"), "w").close()
    time.sleep(60)
"""


def _python(script, *args):
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=ROOT,
                            env=test_env())


def _wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _run_sections(tmp_path, enabled):
    lock_dir, tier, log = tmp_path / "locks", tmp_path / "tier", tmp_path / "log"
    tier.mkdir()
    procs = [_python(SECTIONS, lock_dir, tier, log, tmp_path, int(enabled)) for _ in range(2)]
    _wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == 2)
    (tmp_path / "go").touch()
    assert [p.wait(timeout=30) for p in procs] == [0, 0]
    sections = sorted((float(s), float(e), int(pid))
                      for pid, s, e in (line.split() for line in log.read_text().splitlines()))
    assert len(sections) == 40 and len({pid for _, _, pid in sections}) == 2
    overlaps, last_end = 0, 0.0
    for start, end, _ in sections:
        overlaps += start < last_end
        last_end = max(last_end, end)
    return overlaps


def test_processes_never_overlap(tmp_path):
    assert _run_sections(tmp_path, enabled=True) == 0


def test_disabled_lets_processes_overlap(tmp_path):
    """The control: without the lock, the same sections do overlap."""
    assert _run_sections(tmp_path, enabled=False) > 0


@pytest.mark.parametrize("fork", [False, True])
def test_killed_holder_does_not_stall_others(tmp_path, fork):
    """SIGKILL while holding; with fork, a child of the holder outlives it (a data loader
    worker): the child must not keep the inherited lock alive."""
    lock_dir, tier = tmp_path / "locks", tmp_path / "tier"
    tier.mkdir()
    holder = _python(HOLDER, lock_dir, tier, tmp_path, int(fork))
    child = None
    try:
        _wait_for(lambda: (tmp_path / "held").exists())
        if fork:
            child = int((tmp_path / "child").read_text())
        locks = NodeLocks(lock_dir=str(lock_dir))
        probe = os.open(locks.lock_path(str(tier)), os.O_RDWR)
        with pytest.raises(BlockingIOError):  # the holder really holds it
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(probe)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        acquired = threading.Event()

        def take():
            with locks.hold(str(tier)):
                acquired.set()

        t0 = time.monotonic()
        threading.Thread(target=take, daemon=True).start()
        assert acquired.wait(timeout=2.0), "lock still held after its holder was killed"
        assert time.monotonic() - t0 < 2.0
        locks.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if child is not None:
            os.kill(child, signal.SIGKILL)


def test_threads_of_one_process_exclude_each_other(tmp_path):
    locks = NodeLocks(lock_dir=str(tmp_path / "locks"))
    inside, overlaps = [], []

    def section():
        for _ in range(10):
            with locks.hold(str(tmp_path)):
                inside.append(1)
                overlaps.append(len(inside) > 1)
                time.sleep(0.001)
                inside.pop()

    threads = [threading.Thread(target=section) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(overlaps) == 30 and not any(overlaps)
    assert locks.wait_s > 0.0
    locks.close()


def test_wait_time_is_recorded(tmp_path):
    locks = NodeLocks(lock_dir=str(tmp_path / "locks"))
    taken = threading.Event()

    def hold_a_while():
        with locks.hold(str(tmp_path)):
            taken.set()
            time.sleep(0.2)

    holder = threading.Thread(target=hold_a_while)
    holder.start()
    taken.wait()
    before = locks.wait_s
    with locks.hold(str(tmp_path)):
        pass
    holder.join()
    assert locks.wait_s - before >= 0.1
    locks.close()


def test_nested_hold_keeps_the_lock(tmp_path):
    locks = NodeLocks(lock_dir=str(tmp_path / "locks"))
    probe = os.open(locks.lock_path(str(tmp_path)), os.O_RDWR | os.O_CREAT, 0o600)
    with locks.hold(str(tmp_path)):
        with locks.hold(str(tmp_path)):
            pass
        with pytest.raises(BlockingIOError):  # the inner exit did not release it
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(probe)
    locks.close()


def test_lock_file_is_per_real_path(tmp_path):
    locks = NodeLocks(lock_dir=str(tmp_path / "locks"))
    (tmp_path / "nvme").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "nvme")
    (tmp_path / "pfs").mkdir()
    assert locks.lock_path(str(tmp_path / "alias")) == locks.lock_path(str(tmp_path / "nvme"))
    assert locks.lock_path(str(tmp_path / "pfs")) != locks.lock_path(str(tmp_path / "nvme"))


def test_modes(tmp_path):
    old_umask = os.umask(0)
    try:
        locks = NodeLocks(lock_dir=str(tmp_path / "locks"))
        with locks.hold(str(tmp_path)):
            pass
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(tmp_path / "locks").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(locks.lock_path(str(tmp_path))).st_mode) == 0o600
    locks.close()


def test_disabled_creates_nothing(tmp_path):
    locks = NodeLocks(enabled=False, lock_dir=str(tmp_path / "locks"))
    with locks.hold(str(tmp_path)):
        pass
    assert not (tmp_path / "locks").exists() and locks.wait_s == 0.0


def test_default_lock_dir_is_node_local():
    uid = os.geteuid()
    expected = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else None
    assert default_lock_dir().endswith(f"/megatron_ext-locks-{uid}")
    if expected:
        assert default_lock_dir() == f"/dev/shm/megatron_ext-locks-{uid}"


def test_symlink_at_lock_file_is_refused(tmp_path):
    locks = NodeLocks(lock_dir=str(tmp_path / "locks"))
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, locks.lock_path(str(tmp_path)))
    with pytest.raises(UsageError, match="is a symlink"):
        with locks.hold(str(tmp_path)):
            pass


@pytest.mark.skipif(not IS_ROOT, reason="chown to another uid needs root")
def test_lock_file_of_another_user_is_refused(tmp_path):
    locks = NodeLocks(lock_dir=str(tmp_path / "locks"))
    path = locks.lock_path(str(tmp_path))
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    os.chown(path, 65534, 65534)
    with pytest.raises(UsageError, match="owner uid 65534"):
        with locks.hold(str(tmp_path)):
            pass


def test_unsafe_lock_dir_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UsageError, match="symlink"):
        NodeLocks(lock_dir=str(tmp_path / "link"))
    if IS_ROOT:
        os.chown(tmp_path / "real", 65534, 65534)
        with pytest.raises(UsageError, match="owned by uid 65534"):
            NodeLocks(lock_dir=str(tmp_path / "real"))
