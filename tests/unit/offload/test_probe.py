"""megatron_ext/offload/probe.py: the bandwidth probe moves its bytes through offload/io.py."""

import errno
import os

import numpy as np
import pytest
import torch

from megatron_ext.offload import blockio, probe, state_format
from megatron_ext.offload import io as oio
from megatron_ext.offload.probe import probe_bandwidth

MIB = 1 << 20


@pytest.fixture
def spy(monkeypatch):
    """Records the I/O threads' task lists and every pwrite/preadv the probe makes."""
    calls = {"runs": [], "writes": [], "reads": []}
    real_run, real_pwrite, real_preadv = blockio.IOThreads.run, os.pwrite, os.preadv

    def run(self, tasks):
        calls["runs"].append((self.threads, len(tasks)))
        return real_run(self, tasks)

    def pwrite(fd, data, offset):
        calls["writes"].append((len(data), offset, _address(data)))
        return real_pwrite(fd, data, offset)

    def preadv(fd, buffers, offset):
        calls["reads"].append((len(buffers[0]), offset, _address(buffers[0])))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(blockio.IOThreads, "run", run)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def _address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("direct_io", [False, True])
def test_probe_measures_a_directory_through_the_engines_io(tmp_path, spy, direct_io):
    result = probe_bandwidth(str(tmp_path), size_mb=4, block_mb=1, threads=2,
                             direct_io=direct_io, repeats=2)
    assert result.read_gbps > 0 and result.write_gbps > 0
    assert (result.size_mb, result.repeats) == (4, 2)
    assert os.listdir(tmp_path) == []
    # Each pass: the 4 blocks written, then read, as tasks of io.IOThreads with 2 threads.
    assert spy["runs"] == [(2, 4)] * 4
    # Every block moved whole, from and into ALIGN-aligned buffers (what O_DIRECT needs).
    for op in ("writes", "reads"):
        assert sorted(offset for _, offset, _ in spy[op]) == sorted(
            [i * MIB for i in range(4)] * 2)
        assert all(size == MIB and address % blockio.ALIGN == 0 for size, _, address in spy[op])


def test_probe_takes_direct_io_where_the_state_files_do(tmp_path):
    """The probe and StateFileIO decide O_DIRECT with the same io.open_direct."""
    state_io = oio.StateFileIO(direct_io=True)
    state_file = tmp_path / "state" / "sg.state"
    state_file.parent.mkdir()
    state_io.write(str(state_file), torch.zeros(3000), rank=0, subgroup=0, elements=1000,
                   step=1)
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    result = probe_bandwidth(str(probe_dir), size_mb=1, block_mb=1, direct_io=True)
    assert result.direct_io_used == state_io.direct_io_active
    assert os.listdir(probe_dir) == []


def test_probe_falls_back_when_open_refuses_direct_io(tmp_path, monkeypatch):
    """EINVAL at open (after Linux created the inode): buffered, and no file left behind."""
    real_open = os.open
    refused = []

    def open_without_direct(path, flags, mode=0o777, **kwargs):
        if flags & os.O_DIRECT:
            refused.append(path)
            os.close(real_open(path, flags & ~os.O_DIRECT, mode))
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", open_without_direct)
    result = probe_bandwidth(str(tmp_path), size_mb=2, block_mb=1, threads=2, direct_io=True)
    assert len(refused) == 1
    assert not result.direct_io_used and result.read_gbps > 0 and result.write_gbps > 0
    assert os.listdir(tmp_path) == []


def test_probe_reports_a_short_read_as_eio(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)
    with pytest.raises(OSError) as info:
        probe_bandwidth(str(tmp_path), size_mb=2, block_mb=1, threads=2)
    assert info.value.errno == errno.EIO and "shorter than written" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_probe_plan_block_is_the_engines_chunk():
    assert probe.PROBE_BLOCK_MB * MIB == state_format.MIN_CHUNK
    assert probe.probe_plan(10**9) == (probe.PROBE_MAX_MB, probe.PROBE_BLOCK_MB)
