"""The offload job directories (megatron_ext/offload/jobdir.py): what a shared path may hold.

Every component the engine creates or enters below DIR is refused in one line when it is a
planted symlink, another user's, or open to others; run ids are one safe path component;
one job per run id (ranks of one job coexist); stale directories (holder dead) are cleaned;
the end leaves nothing behind.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from megatron_ext.errors import UsageError
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.jobdir import (
    LOCK_NAME,
    JobDirs,
    check_run_id,
    default_run_id,
    user_name,
)
from mext_testing import ROOT, test_env

USER_DIR = f"megatron_ext-{user_name()}"
OTHER = "mext_jobdir_other"


@pytest.fixture(scope="module")
def other_uid():
    """The uid of a second user (created with useradd for this module, then removed)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a directory of another user is made with chown")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: cannot make a second user")
    subprocess.run(["userdel", OTHER], capture_output=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER],
                   check=True, capture_output=True)
    try:
        import pwd

        yield pwd.getpwnam(OTHER).pw_uid
    finally:
        subprocess.run(["userdel", OTHER], capture_output=True)


def _base(tmp_path):
    base = tmp_path / "scratch"
    base.mkdir(exist_ok=True)
    return base


def _refused(base, run_id="job", rank=0) -> str:
    with pytest.raises(UsageError) as info:
        JobDirs([str(base)], run_id, rank)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------ planted components


def _plant_symlink(base, component):
    """A symlink at ``component`` (0: megatron_ext-USER, 1: JOB, 2: rankNNNNN) to a decoy."""
    decoy = base.parent / "decoy"
    decoy.mkdir(mode=0o777)
    parts = [USER_DIR, "job", "rank00000"]
    parent = base
    for name in parts[:component]:
        parent = parent / name
        parent.mkdir(mode=0o700)
    (parent / parts[component]).symlink_to(decoy)
    return parent / parts[component], decoy


@pytest.mark.parametrize("component", [0, 1, 2], ids=["user-dir", "job-dir", "rank-dir"])
def test_planted_symlink_is_refused(tmp_path, component):
    base = _base(tmp_path)
    link, decoy = _plant_symlink(base, component)
    message = _refused(base)
    assert f"offload directory {link} is a symlink" in message
    assert os.listdir(decoy) == [], "something was written through the symlink"


@pytest.mark.parametrize("component", [0, 1, 2], ids=["user-dir", "job-dir", "rank-dir"])
def test_foreign_component_is_refused(tmp_path, other_uid, component):
    base = _base(tmp_path)
    path = base
    for name in [USER_DIR, "job", "rank00000"][:component + 1]:
        path = path / name
        path.mkdir(mode=0o700)
    os.chown(path, other_uid, other_uid)
    message = _refused(base)
    assert f"offload directory {path} is owned by uid {other_uid} ({OTHER})" in message


def test_planted_lock_file_symlink_is_refused(tmp_path):
    base = _base(tmp_path)
    rank = base / USER_DIR / "job" / "rank00000"
    rank.mkdir(parents=True, mode=0o700)
    for directory in (rank, rank.parent, rank.parent.parent):
        directory.chmod(0o700)
    (tmp_path / "target").write_text("keep")
    (rank / LOCK_NAME).symlink_to(tmp_path / "target")
    assert "lock file" in _refused(base) and "is a symlink" in _refused(base)
    assert (tmp_path / "target").read_text() == "keep"


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_component_open_to_others_is_refused(tmp_path, mode):
    base = _base(tmp_path)
    (base / USER_DIR).mkdir()
    (base / USER_DIR).chmod(mode)
    assert f"has mode {mode:04o}" in _refused(base) and "chmod 700" in _refused(base)


def test_world_writable_path_without_sticky_bit_is_refused(tmp_path):
    base = _base(tmp_path)
    base.chmod(0o777)
    assert "no sticky bit" in _refused(base)
    base.chmod(0o1777)  # like /tmp: accepted
    JobDirs([str(base)], "job", 0).close()


def test_created_components_are_owner_only_and_removed_at_the_end(tmp_path):
    base = _base(tmp_path)
    old = os.umask(0o022)
    try:
        ranks = [JobDirs([str(base)], "job", rank) for rank in range(2)]
    finally:
        os.umask(old)
    job = base / USER_DIR / "job"
    for path in (base / USER_DIR, job, job / "rank00000", job / "rank00001"):
        assert path.stat().st_mode & 0o777 == 0o700, path
    (job / "rank00001" / "sg00000.state").write_bytes(b"x")
    ranks[0].close()
    assert sorted(os.listdir(job)) == ["rank00001"], "rank 0 removed a directory of rank 1"
    ranks[1].close()
    assert os.listdir(base) == [], "the run left directories behind"


def test_a_directory_given_before_is_kept(tmp_path):
    """Only what the run made goes: a file of the user's own in megatron_ext-USER stays."""
    base = _base(tmp_path)
    (base / USER_DIR).mkdir(mode=0o700)
    (base / USER_DIR / "notes.txt").write_text("mine")
    JobDirs([str(base)], "job", 0).close()
    assert os.listdir(base / USER_DIR) == ["notes.txt"]


# ------------------------------------------------------------------ run ids

BAD_RUN_IDS = ["/abs/path", "../escape", "..", ".", "a/b", "", "white space", "tab\tid",
               "semi;colon"]


@pytest.mark.parametrize("run_id", BAD_RUN_IDS)
def test_run_id_outside_one_component_is_refused(run_id):
    with pytest.raises(UsageError, match="--offload-run-id.*one directory name"):
        OffloadConfig(offload_optimizer=True, offload_run_id=run_id)


@pytest.mark.parametrize("run_id", ["job-1", "slurm-123.4", "A_b.c-9", "..."])
def test_safe_run_id_is_accepted(run_id):
    assert check_run_id(run_id) == run_id
    OffloadConfig(offload_optimizer=True, offload_run_id=run_id)


@pytest.mark.parametrize("variable", ["SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"])
def test_run_id_from_the_environment_is_confined(variable):
    with pytest.raises(UsageError, match=f"{variable} '../../etc'.*set --offload-run-id"):
        default_run_id({variable: "../../etc"})
    assert default_run_id({variable: "4711"}).endswith("-4711")
    assert default_run_id({"TORCHELASTIC_RUN_ID": "none"}).startswith("run-")


# ------------------------------------------------------------------ one job per run id

HOLDER = textwrap.dedent("""
    import sys, time
    from megatron_ext.offload.jobdir import JobDirs
    dirs = JobDirs([sys.argv[1]], sys.argv[2], int(sys.argv[3]))
    print("ready", flush=True)
    time.sleep(600)
""")


def _holder(base, run_id, rank=0):
    """A process (another job) holding JOB/rankNNNNN; returns it once the lock is held."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(base), run_id, str(rank)],
                            cwd=ROOT, env=test_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_second_job_with_the_same_run_id_refuses(tmp_path):
    base = _base(tmp_path)
    first = _holder(base, "job")
    try:
        state = base / USER_DIR / "job" / "rank00000" / "sg00000.state"
        state.write_bytes(b"first job's state")
        message = _refused(base, "job", 0)
        assert "in use by another running job" in message
        assert f"(host {socket.gethostname()}, pid {first.pid})" in message
        assert state.read_bytes() == b"first job's state", "the refused job touched the state"
        # A rank the first job does not have is no conflict by itself; the job's rank 0 is.
        JobDirs([str(base)], "job", 1).close()
        assert state.exists()
    finally:
        first.kill()
        first.wait()


def test_ranks_of_one_job_share_the_job_directory(tmp_path):
    base = _base(tmp_path)
    holders = [_holder(base, "job", rank) for rank in range(2)]
    try:
        here = JobDirs([str(base)], "job", 2)
        assert sorted(os.listdir(base / USER_DIR / "job")) == [f"rank{r:05d}" for r in range(3)]
        here.close()
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()


def test_stale_directories_of_dead_jobs_are_removed(tmp_path):
    base = _base(tmp_path)
    dead = _holder(base, "dead-job")
    (base / USER_DIR / "dead-job" / "rank00000" / "sg00003.state").write_bytes(b"old")
    dead.send_signal(signal.SIGKILL)  # what kill -9 leaves: the directory, its lock free
    dead.wait()
    live = _holder(base, "live-job")
    try:
        # A directory locked from another host may be alive there: never removed.
        remote = base / USER_DIR / "remote-job" / "rank00000"
        remote.mkdir(parents=True, mode=0o700)
        remote.parent.chmod(0o700)
        (remote / LOCK_NAME).write_text("some-other-host 123 rank00000\n")
        here = JobDirs([str(base)], "new-job", 0)
        assert sorted(os.listdir(base / USER_DIR)) == [".setup.lock", "live-job", "new-job",
                                                        "remote-job"]
        assert os.listdir(base / USER_DIR / "live-job") == ["rank00000"]
        here.close()
    finally:
        live.kill()
        live.wait()


def test_requeued_job_takes_its_directory_over(tmp_path):
    """The same run id after its holder died (Slurm requeue): the old state files go."""
    base = _base(tmp_path)
    dead = _holder(base, "job")
    rank = base / USER_DIR / "job" / "rank00000"
    (rank / "sg00001.state").write_bytes(b"old")
    dead.kill()
    dead.wait()
    here = JobDirs([str(base)], "job", 0)
    assert os.listdir(rank) == [LOCK_NAME]
    with open(rank / LOCK_NAME, "rb") as f:
        with pytest.raises(BlockingIOError):
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    here.close()


def test_refusal_on_a_second_path_releases_the_first(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    (bad / USER_DIR).symlink_to(tmp_path)
    with pytest.raises(UsageError, match="is a symlink"):
        JobDirs([str(good), str(bad)], "job", 0)
    assert os.listdir(good) == []


# ------------------------------------------------------------------ a full path at start


@pytest.fixture
def full_lock_writes(monkeypatch):
    """os.pwrite fails with ENOSPC on files under the paths added to the returned list."""
    import errno

    from megatron_ext.offload import jobdir

    full = []
    real = os.pwrite

    def pwrite(fd, data, offset):
        where = os.readlink(f"/proc/self/fd/{fd}")
        if any(where.startswith(str(base) + os.sep) for base in full):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(jobdir.os, "pwrite", pwrite)
    return full


def test_a_path_too_full_for_the_lock_file_is_skipped(tmp_path, full_lock_writes, caplog):
    full, room = tmp_path / "full", tmp_path / "room"
    full.mkdir()
    room.mkdir()
    full_lock_writes.append(full)
    dirs = JobDirs([str(full), str(room)], "job", 0)
    try:
        assert dirs.bases == [str(room)]
        assert dirs.skipped == [(str(full), "No space left on device")]
        assert dirs.rank_dirs == [str(room / USER_DIR / "job" / "rank00000")]
        assert f"--offload-paths {full} skipped: No space left on device" in caplog.text
        # Nothing of the run is left on the full path.
        assert os.listdir(full) == []
    finally:
        dirs.close()
    assert os.listdir(room) == []


def test_every_path_full_is_one_line_and_leaves_nothing(tmp_path, full_lock_writes):
    bases = [tmp_path / "a", tmp_path / "b"]
    for base in bases:
        base.mkdir()
        full_lock_writes.append(base)
    with pytest.raises(UsageError) as info:
        JobDirs([str(b) for b in bases], "job", 0)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--offload-paths: no path has room for the job directory")
    assert all(f"{b}: No space left on device" in message for b in bases)
    assert all(os.listdir(b) == [] for b in bases)


def test_other_errors_of_the_lock_write_are_not_taken_for_a_full_path(tmp_path, monkeypatch):
    import errno

    from megatron_ext.offload import jobdir

    def pwrite(fd, data, offset):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(jobdir.os, "pwrite", pwrite)
    with pytest.raises(OSError) as info:
        JobDirs([str(_base(tmp_path))], "job", 0)
    assert info.value.errno == errno.EBADF
