"""Damaged checkpoints are refused before anything is loaded, in one line naming the file.

One tiny training run (with the offload engine, so its state files and manifest are in
the checkpoint) saves iterations 2 and 4; every case damages a copy of it.

- In-process (cheap): :func:`integrity.verify`, which ``pretrain_gpt.py --load`` calls before
  it reads anything, over every file kind x every damage (table below); the offload
  manifests of a checkpoint without an integrity manifest (older format); the manifest
  itself; the planted pickle (``safe_load``); the random-number-generator state (Megatron-LM's
  ``rng_state`` ShardedObject inside a ``.distcp`` file) reads with weights_only.
- Real ``pretrain_gpt.py`` processes for the end-to-end behaviour (one ``error:`` line,
  exit status 2, no traceback): a flipped byte in a ``.distcp`` file (which loaded silently
  before), a planted pickle as the rng state of a checkpoint without a manifest (it does
  not run), damaged rng bytes there (one line), a file system that fills
  during a save (the fault hook; and a real small tmpfs where this process may mount one).
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from megatron_ext.checkpoint import integrity
from megatron_ext.errors import UsageError
from megatron_ext.runtime.faults import CHECKPOINT_ENV
from mext_testing import PRETRAIN, ROOT, TINY, test_env

FLAGS = [*TINY, "--train-iters", "4", "--use-distributed-optimizer", "--lr-decay-style",
         "linear", "--log-interval", "1", "--eval-iters", "0"]
OFFLOAD = ["--offload-optimizer", "--offload-subgroup-size", "30000"]
POINTER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def saved(run_cache):
    """The checkpoints (iterations 2 and 4; once a session: tests damage copies of it)."""
    root = run_cache.run([*FLAGS, *OFFLOAD, "--save", "{run}/ckpt", "--save-interval",
                          "2"]).directory / "ckpt"
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
    "distcp data of the rng state": "__0_1.distcp",
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


def as_unverified(ck):
    """Makes ``ck`` a checkpoint without a manifest as an older version (or Megatron-LM)
    wrote it: no integrity.json, and no promise of one in its common state."""
    import torch

    (ck / integrity.MANIFEST).unlink()
    # The test's own checkpoint: its common state is trusted here.
    common = torch.load(ck / "common.pt", map_location="cpu", weights_only=False)
    assert common.pop(integrity.COMMON_KEY) == integrity.MANIFEST
    torch.save(common, ck / "common.pt")


def test_intact_checkpoint_verifies_and_one_without_manifest_loads_as_before(saved, tmp_path):
    root = copy_of(saved, tmp_path)
    assert integrity.verify(str(root / "iter_0000004")) is True
    as_unverified(root / "iter_0000004")
    assert integrity.verify(str(root / "iter_0000004")) is False


def test_a_manifest_deleted_from_a_checkpoint_that_promises_one_is_refused(saved, tmp_path):
    root = copy_of(saved, tmp_path)
    (root / "iter_0000004" / integrity.MANIFEST).unlink()
    with pytest.raises(UsageError) as info:
        integrity.verify(str(root / "iter_0000004"))
    line = one_line(info.value)
    assert f"{root / 'iter_0000004' / integrity.MANIFEST}: missing, though its common state " \
        "(common.pt) says it was saved with one" in line, line
    assert f"the previous good checkpoint is {root / 'iter_0000002'}" in line, line


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
    "a file outside its directory": (
        lambda p: _rewrite_manifest(p, lambda m: m["subgroups"][0].update(file="../../etc/passwd")),
        "offload manifest: subgroup entry 0 names '../../etc/passwd', a file outside its "
        "directory"),
}


@pytest.mark.parametrize("entry", ["../../etc/passwd", "/etc/passwd", "offload/../../x"])
def test_an_integrity_manifest_entry_outside_the_checkpoint_is_named(saved, tmp_path, entry):
    """The line names the manifest and the entry, and nothing outside is read."""
    root = copy_of(saved, tmp_path)
    ck = root / "iter_0000004"
    _rewrite_manifest(ck / integrity.MANIFEST,
                      lambda m: m["files"].update({entry: {"size": 1, "xxh3": "0"}}))
    read = []
    real = integrity.file_digest
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(integrity, "file_digest", lambda path: read.append(path) or real(path))
        with pytest.raises(UsageError) as info:
            integrity.verify(str(ck))
    line = one_line(info.value)
    assert line.startswith(f"--load {ck}: {ck / integrity.MANIFEST}: integrity manifest lists "
                           f"{entry!r}, a path outside the checkpoint's directory: the "
                           "checkpoint is damaged; "), line
    # (the previous checkpoint's files are read for the advice)
    assert all(os.path.realpath(path).startswith(f"{root}{os.sep}") for path in read), read


@pytest.mark.parametrize("damage", sorted(OFFLOAD_MANIFEST_DAMAGES))
def test_offload_manifest_of_an_unverified_checkpoint_is_one_line(saved, tmp_path, damage):
    """Without an integrity manifest (an older checkpoint) the offload manifests are still
    checked up front (they tracebacked in the engine's load)."""
    root = copy_of(saved, tmp_path)
    ck = root / "iter_0000004"
    as_unverified(ck)
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


RNG_FQN = "rng_state/shard_0.0_1.1"  # Megatron-LM's rng_state of (PP 0 of 1, TP 0 of 1)


def _read_metadata(ck):
    # The test's own checkpoint: its torch.distributed.checkpoint metadata is trusted here.
    with open(ck / ".metadata", "rb") as f:
        return pickle.load(f)


def _rng_location(ck):
    """(file, offset, length) of the rng_state object's bytes in the .distcp files."""
    meta = _read_metadata(ck)
    info = next(v for k, v in meta.storage_data.items() if k.fqn == RNG_FQN)
    return ck / info.relative_path, info.offset, info.length


def _replace_rng_bytes(ck, data: bytes) -> None:
    """Points the checkpoint's rng_state at ``data`` (appended to its .distcp file)."""
    meta = _read_metadata(ck)
    key = next(k for k in meta.storage_data if k.fqn == RNG_FQN)
    target = ck / meta.storage_data[key].relative_path
    offset = target.stat().st_size
    with open(target, "ab") as f:
        f.write(data)
    meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], offset=offset,
                                                 length=len(data))
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def test_planted_pickle_does_not_run_in_process(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "rank_00000.pt"
    _plant_pickle(path, marker)
    with pytest.raises(UsageError) as info:
        integrity.safe_load(str(path), "random-number-generator state")
    assert "could run code" in one_line(info.value)
    assert not marker.exists()


def test_rng_state_loads_with_weights_only(saved):
    target, offset, length = _rng_location(saved / "iter_0000004")
    with open(target, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    # The bytes dist_checkpointing hands the load planner, read as the load reads them.
    state = integrity._safe_torch_load(io.BytesIO(data), str(target), "rng state")
    # megatron-core stores the shards' data as a list; the data is Megatron-LM's list of one
    # state (no --data-parallel-random-init).
    (data,) = state
    assert isinstance(data, list) and len(data) == 1
    assert set(data[0]) >= {"random_rng_state", "np_rng_state", "torch_rng_state"}


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
    as_unverified(ck)
    marker = tmp_path / "ran"
    _plant_pickle(tmp_path / "planted.pt", marker)
    _replace_rng_bytes(ck, (tmp_path / "planted.pt").read_bytes())
    proc = run_load([*FLAGS, *OFFLOAD, "--load", str(root)])
    assert_one_error_line(proc, RNG_FQN, "could run code")
    assert not marker.exists()
    assert "without verifying its files" in proc.stdout


def test_damaged_rng_state_in_an_unverified_checkpoint_is_one_line(saved, tmp_path):
    root = copy_of(saved, tmp_path)
    ck = root / "iter_0000004"
    as_unverified(ck)
    target, offset, length = _rng_location(ck)
    with open(target, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(length))
    proc = run_load([*FLAGS, *OFFLOAD, "--load", str(root)])
    assert_one_error_line(proc, RNG_FQN, "cannot be read", "the checkpoint is damaged")


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
                    env={CHECKPOINT_ENV: "enospc:4"})
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
