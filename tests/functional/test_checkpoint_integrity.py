"""Damaged checkpoints are refused before anything is loaded, in one line naming the file.

One tiny training run (with the offload engine, so its state files and manifest are in
the checkpoint) saves iterations 2 and 4; every case damages a copy of it.

- In-process (cheap): :func:`integrity.verify`, which ``pretrain_gpt.py --load`` calls before
  it reads anything, over every file kind x every damage (table below); the offload
  manifests of a checkpoint without an integrity manifest (older format); the manifest
  itself; the planted pickle in the random-number-generator file (``safe_load``).
- Real ``pretrain_gpt.py`` processes for the end-to-end behaviour (one ``error:`` line,
  exit status 2, no traceback): a flipped byte in a ``.distcp`` file (which loaded silently
  before), a planted pickle in a checkpoint without a manifest, a file system that fills
  during a save (the fault hook; and a real small tmpfs where this process may mount one).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_ext.errors import UsageError
from megatron_ext.training import integrity
from mext_testing import PRETRAIN, ROOT, TINY, run_pretrain, test_env

FLAGS = [*TINY, "--train-iters", "4", "--use-distributed-optimizer", "--lr-decay-style",
         "linear", "--log-interval", "1", "--eval-iters", "0"]
OFFLOAD = ["--offload-optimizer", "--offload-subgroup-size", "30000"]
POINTER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity") / "ckpt"
    run_pretrain([*FLAGS, *OFFLOAD, "--save", str(root), "--save-interval", "2"])
    assert (root / POINTER).read_text() == "4"
    return root


def copy_of(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root


def flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def zero_length(path):
    os.truncate(path, 0)


def delete(path):
    path.unlink()


def garbage(path):
    """Same size, other bytes (a file replaced by another)."""
    path.write_bytes(os.urandom(max(path.stat().st_size, 16)))


DAMAGES = {"flip": flip, "truncate": truncate, "zero-length": zero_length, "delete": delete,
           "garbage": garbage}
FILES = {
    "distcp data": "__0_1.distcp",
    "distcp metadata": ".metadata",
    "common state": "common.pt",
    "metadata.json": "metadata.json",
    "rng state": "rng/rank_00000.pt",
    "offload state": "offload/rank00000/sg00001.state",
    "offload manifest": "offload/rank00000/manifest.json",
}


def one_line(err: UsageError) -> str:
    line = str(err)
    assert "\n" not in line
    return line


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("kind", sorted(FILES))
def test_every_damaged_file_is_refused_naming_it(saved, tmp_path, kind, damage):
    root = copy_of(saved, tmp_path)
    target = root / "iter_0000004" / FILES[kind]
    DAMAGES[damage](target)
    with pytest.raises(UsageError) as info:
        integrity.verify(str(root / "iter_0000004"))
    line = one_line(info.value)
    assert f"{target}: " in line and "the checkpoint is damaged" in line, line
    assert f"the previous good checkpoint is {root / 'iter_0000002'}" in line, line
    assert f"echo 2 > {root / POINTER}" in line


def test_intact_checkpoint_verifies_and_one_without_manifest_loads_as_before(saved, tmp_path):
    root = copy_of(saved, tmp_path)
    assert integrity.verify(str(root / "iter_0000004")) is True
    (root / "iter_0000004" / integrity.MANIFEST).unlink()
    assert integrity.verify(str(root / "iter_0000004")) is False


@pytest.mark.parametrize("damage", ["flip", "truncate", "zero-length", "garbage"])
def test_damaged_integrity_manifest_is_refused(saved, tmp_path, damage):
    root = copy_of(saved, tmp_path)
    target = root / "iter_0000004" / integrity.MANIFEST
    DAMAGES[damage](target)
    with pytest.raises(UsageError) as info:
        integrity.verify(str(root / "iter_0000004"))
    line = one_line(info.value)
    # A flipped byte in the JSON may leave it valid JSON: then a file's entry differs.
    assert str(root / "iter_0000004") in line and "damaged" in line, line


def test_no_older_checkpoint_verifies(saved, tmp_path):
    root = copy_of(saved, tmp_path)
    flip(root / "iter_0000002" / "common.pt")
    flip(root / "iter_0000004" / "common.pt")
    with pytest.raises(UsageError) as info:
        integrity.verify(str(root / "iter_0000004"))
    assert "no older checkpoint there verifies" in one_line(info.value)


def _rewrite_manifest(path, change):
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


OFFLOAD_MANIFEST_DAMAGES = {
    "garbage": (lambda p: p.write_bytes(b"\x8f not json at all"), "not valid JSON"),
    "empty": (lambda p: p.write_bytes(b""), "not valid JSON"),
    "short subgroup list": (lambda p: _rewrite_manifest(p, lambda m: m["subgroups"].pop()),
                            "lists 3 subgroups, the directory holds 4"),
    "missing step": (lambda p: _rewrite_manifest(p, lambda m: m.pop("step")), "'step' missing"),
}


@pytest.mark.parametrize("damage", sorted(OFFLOAD_MANIFEST_DAMAGES))
def test_offload_manifest_of_an_unverified_checkpoint_is_one_line(saved, tmp_path, damage):
    """Without an integrity manifest (an older checkpoint) the offload manifests are still
    checked up front (they tracebacked in the engine's load)."""
    root = copy_of(saved, tmp_path)
    ck = root / "iter_0000004"
    (ck / integrity.MANIFEST).unlink()
    make, expected = OFFLOAD_MANIFEST_DAMAGES[damage]
    make(ck / "offload" / "rank00000" / "manifest.json")
    with pytest.raises(UsageError) as info:
        integrity.verify(str(ck))
    line = one_line(info.value)
    assert str(ck / "offload" / "rank00000" / "manifest.json") in line and expected in line, line


PLANT = """
import os, torch
class Planted:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
torch.save({{"random": Planted()}}, "{path}")
"""


def _plant_pickle(path, marker):
    subprocess.run([sys.executable, "-c", PLANT.format(marker=marker, path=path)], check=True,
                   timeout=120)


def test_planted_pickle_does_not_run_in_process(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "rank_00000.pt"
    _plant_pickle(path, marker)
    with pytest.raises(UsageError) as info:
        integrity.safe_load(str(path), "random-number-generator state")
    assert "could run code" in one_line(info.value)
    assert not marker.exists()


def test_rng_state_loads_with_weights_only(saved):
    state = integrity.safe_load(str(saved / "iter_0000004" / "rng" / "rank_00000.pt"), "rng")
    assert set(state) >= {"random", "numpy", "torch"}


def run_load(args, env=None):
    return subprocess.run([sys.executable, PRETRAIN, *args], cwd=ROOT, env=test_env(env),
                          capture_output=True, text=True, timeout=300)


def assert_one_error_line(proc, *expected):
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_flipped_byte_in_data_is_refused_end_to_end(saved, tmp_path):
    """The case that loaded with exit status 0 and other losses."""
    root = copy_of(saved, tmp_path)
    target = root / "iter_0000004" / "__0_1.distcp"
    flip(target)
    proc = run_load([*FLAGS, *OFFLOAD, "--train-iters", "6", "--override-opt_param-scheduler",
                     "--load", str(root)])
    assert_one_error_line(proc, str(target), "checksum mismatch", str(root / "iter_0000002"))
    assert "loaded " not in proc.stdout


def test_planted_pickle_in_an_unverified_checkpoint_does_not_run(saved, tmp_path):
    root = copy_of(saved, tmp_path)
    ck = root / "iter_0000004"
    (ck / integrity.MANIFEST).unlink()
    marker = tmp_path / "ran"
    _plant_pickle(ck / "rng" / "rank_00000.pt", marker)
    proc = run_load([*FLAGS, *OFFLOAD, "--load", str(root)])
    assert_one_error_line(proc, "rank_00000.pt", "could run code")
    assert not marker.exists()
    assert "without verifying its files" in proc.stdout


def _assert_save_failed_cleanly(proc, root):
    assert_one_error_line(proc, "saving iteration 4 failed", "No space left on device",
                          f"the previous checkpoint {root / 'iter_0000002'} and the pointer are "
                          "intact")
    assert (root / POINTER).read_text() == "2"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == \
        ["iter_0000002"]
    assert integrity.verify(str(root / "iter_0000002")) is True


def test_full_file_system_during_a_save_is_one_line(tmp_path):
    """ENOSPC injected after megatron-core's files of iteration 4 are written."""
    root = tmp_path / "ckpt"
    proc = run_load([*FLAGS, "--save", str(root), "--save-interval", "2"],
                    env={integrity.FAULT_ENV: "enospc:4"})
    _assert_save_failed_cleanly(proc, root)


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    # One checkpoint of the plain tiny run is ~2.1 MiB: the second does not fit.
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode()[:200]}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def test_really_full_file_system_during_a_save_is_one_line(small_tmpfs):
    root = small_tmpfs / "ckpt"
    proc = run_load([*FLAGS, "--save", str(root), "--save-interval", "2"])
    _assert_save_failed_cleanly(proc, root)


def test_storage_error_is_found_behind_wrappers():
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/x/y")
        except OSError as inner:
            raise RuntimeError("worker failed") from inner
    except RuntimeError as outer:
        assert integrity.storage_error(outer) == "No space left on device (/x/y)"
    assert integrity.storage_error(RuntimeError("Local process 1 encountered an error: "
                                                "[Errno 28] No space left on device")) \
        == "No space left on device"
    assert integrity.storage_error(ValueError("a bug")) is None


def test_a_write_that_lost_its_errno_on_a_full_file_system_is_named(monkeypatch, tmp_path):
    """torch's zip writer reports a short write on a full disk without an errno (CI's tmpfs)."""
    err = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected "
                       "pos 704 vs 598")
    room = os.statvfs_result((4096, 4096, 1000, 900, 900, 100, 50, 50, 0, 255))
    full = os.statvfs_result((4096, 4096, 1000, 3, 3, 100, 50, 50, 0, 255))
    monkeypatch.setattr(integrity.os, "statvfs", lambda d: room)
    assert integrity.storage_error(err, str(tmp_path)) is None
    monkeypatch.setattr(integrity.os, "statvfs", lambda d: full)
    assert integrity.storage_error(err, str(tmp_path)) == \
        f"No space left on device (the file system of {tmp_path} is full)"
    assert integrity.storage_error(err) is None
