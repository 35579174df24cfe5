"""Resolving the tier paths (megatron_ext/offload/optimizer.py): a path the bandwidth probe
finds full is skipped when another has room, refused in one line when none has."""

from __future__ import annotations

import errno
import os

import pytest

from megatron_ext.errors import UsageError
from megatron_ext.offload import optimizer
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.probe import ProbeResult


def _config(paths):
    return OffloadConfig(offload_optimizer=True, offload_paths=paths)


@pytest.fixture
def probe_finds_full(monkeypatch):
    """The probe fails with ENOSPC on the paths added to the returned list (one process)."""
    full = []

    def probe(path, **kwargs):
        if path in full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return ProbeResult(read_gbps=2.0, write_gbps=1.0, direct_io_used=False, size_mb=1,
                           repeats=1)

    monkeypatch.setattr(optimizer, "probe_bandwidth", probe)
    monkeypatch.setattr(optimizer, "_broadcast", lambda value: value)
    return full


def test_a_path_the_probe_finds_full_is_skipped(tmp_path, probe_finds_full, capsys):
    full, room = str(tmp_path / "full"), str(tmp_path / "room")
    os.mkdir(full)
    os.mkdir(room)
    probe_finds_full.append(full)
    specs = optimizer.resolve_tiers(_config([full, room]), rank=0)
    assert [(s.path, s.read_gbps, s.write_gbps) for s in specs] == [(room, 2.0, 1.0)]
    assert f"--offload-paths {full} skipped: No space left on device" in capsys.readouterr().out


def test_given_bandwidths_are_kept_beside_a_skipped_path(tmp_path, probe_finds_full):
    full, given = str(tmp_path / "full"), str(tmp_path / "given")
    os.mkdir(full)
    os.mkdir(given)
    probe_finds_full.append(full)
    specs = optimizer.resolve_tiers(_config([full, f"{given}@3,4"]), rank=0)
    assert [(s.path, s.read_gbps, s.write_gbps) for s in specs] == [(given, 3.0, 4.0)]


def test_every_path_full_is_one_line(tmp_path, probe_finds_full):
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for path in paths:
        os.mkdir(path)
        probe_finds_full.append(path)
    with pytest.raises(UsageError) as info:
        optimizer.resolve_tiers(_config(paths), rank=0)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"--offload-paths: no path has room ({', '.join(paths)}: "
                                      "full while probing")
