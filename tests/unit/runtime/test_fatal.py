"""The failure report: one line per job, the other ranks ended, the phase and the status."""

import threading

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.runtime import fatal
from megatron_ext.runtime.faults import CUDA_OOM_MESSAGE


@pytest.fixture
def job():
    """Rank 0 of a 2-rank job on an in-process store; detached after the test."""
    store = torch.distributed.HashStore()
    yield store
    fatal.detach()


def _errors(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_describe():
    with pytest.raises(RuntimeError) as info, fatal.during("outer"), fatal.during("inner"):
        raise RuntimeError("boom\nsecond line")
    assert fatal.describe(info.value) == (
        "RuntimeError while inner: boom (the traceback is above)")
    oom = torch.OutOfMemoryError(CUDA_OOM_MESSAGE)
    assert fatal.describe(oom, lambda kind: f"try the {kind} flags") == (
        "out of memory on cuda:0 while running (asked 2.00 GiB, 1.10 GiB free of 139.81 GiB): "
        "try the device flags")
    assert fatal.describe(UsageError("--lr nan: must be finite")) == "--lr nan: must be finite"
    assert fatal.describe(KeyboardInterrupt()) == "interrupted (Ctrl-C) while running"
    assert fatal.describe(KeyboardInterrupt(), interrupted="nothing saved") == (
        "interrupted (Ctrl-C) while running: nothing saved")


def test_worker_error_names_the_worker_s_line():
    err = RuntimeError("Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback "
                       "(most recent call last):\n  File x\nRuntimeError: injected fault at data\n")
    assert fatal.describe(err) == ("RuntimeError while running: Caught RuntimeError in "
                                   "DataLoader worker process 0. RuntimeError: injected fault "
                                   "at data (the traceback is above)")


def test_exit_codes():
    assert fatal.exit_code(KeyboardInterrupt()) == 130
    assert fatal.exit_code(UsageError("x")) == 2
    assert fatal.exit_code(MemoryError()) == 1


def test_first_failing_rank_prints_and_flags(job, capsys):
    fatal.attach(job, 0, 2).watch.stop()
    err = torch.OutOfMemoryError(CUDA_OOM_MESSAGE)
    fatal.announce(err)
    fatal.announce(err)  # reported once
    out = capsys.readouterr()
    assert len(_errors(out.err)) == 1 and "Traceback" not in out.err
    assert job.get(fatal.current_job().failed_key) == b"0"


def test_a_later_failing_rank_is_quiet(job, capsys, monkeypatch):
    monkeypatch.setattr(fatal, "PRINT_WAIT_S", 0.2)
    first = fatal.attach(job, 1, 2)
    first.watch.stop()
    job.add(first.claim_key, 1)  # rank 1 claimed the line already
    fatal.announce(RuntimeError("a consequence"))
    assert _errors(capsys.readouterr().err) == []


def test_a_bug_keeps_its_traceback(job, capsys):
    fatal.attach(job, 0, 1)
    try:
        raise ValueError("a bug")
    except ValueError as err:
        fatal.announce(err)
    err = capsys.readouterr().err
    assert "Traceback" in err and _errors(err) == [
        "error: ValueError while running: a bug (the traceback is above)"]


def test_watch_ends_the_process_when_a_peer_failed(job, monkeypatch, capsys):
    ended = threading.Event()
    monkeypatch.setattr(fatal, "POLL_S", 0.05)
    monkeypatch.setattr(fatal, "exit_now", lambda code: ended.set())
    this = fatal.attach(job, 1, 2)
    assert not ended.wait(0.3)
    job.set(this.failed_key, "0")
    assert ended.wait(5)
    assert "rank 1: stopping: another rank of the job failed (rank 0)" in capsys.readouterr().err


def test_watch_takes_an_unreachable_store_as_a_failure(monkeypatch):
    class Gone:
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

    ended = threading.Event()
    monkeypatch.setattr(fatal, "POLL_S", 0.02)
    monkeypatch.setattr(fatal, "exit_now", lambda code: ended.set())
    try:
        fatal.attach(Gone(), 1, 2)
        assert ended.wait(5)
    finally:
        fatal.detach()


def test_watch_leaves_a_failing_rank_to_itself(job, monkeypatch):
    ended = threading.Event()
    monkeypatch.setattr(fatal, "POLL_S", 0.02)
    monkeypatch.setattr(fatal, "exit_now", lambda code: ended.set())
    this = fatal.attach(job, 0, 2)
    this.failing = True
    job.set(this.failed_key, "0")
    assert not ended.wait(0.3)


def test_before_rendezvous_rank_0_prints(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert fatal.run_main(lambda: (_ for _ in ()).throw(UsageError("bad flag"))) == 2
    assert _errors(capsys.readouterr().err) == ["error: bad flag"]


def test_before_rendezvous_another_rank_waits_for_rank_0(monkeypatch, capsys):
    slept = []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(fatal.time, "sleep", slept.append)
    assert fatal.run_main(lambda: (_ for _ in ()).throw(UsageError("bad flag"))) == 2
    # Still alive after the wait: its own error, printed.
    assert slept == [fatal.BEFORE_RENDEZVOUS_WAIT_S]
    assert _errors(capsys.readouterr().err) == ["error: bad flag"]


def test_bounded():
    assert fatal.bounded(lambda: None, 1.0)
    assert not fatal.bounded(threading.Event().wait, 0.1)
    assert fatal.bounded(lambda: 1 / 0, 1.0)  # swallowed
