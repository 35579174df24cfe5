"""State files of the offload engine: round trips, corruption, unsafe paths, ENOSPC, O_DIRECT."""

from __future__ import annotations

import errno
import os
import re
import stat
import time

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.offload import io as oio
from megatron_ext.offload import state_format
from megatron_ext.offload.blockio import ALIGN, aligned_empty
from megatron_ext.offload.io import StateFileIO
from megatron_ext.offload.state_format import OffloadStateError, read_header, secure_makedirs

IS_ROOT = os.geteuid() == 0
ID = {"rank": 3, "subgroup": 5}


def _payload(elements: int, seed: int = 0) -> torch.Tensor:
    """3 * elements fp32 of random bits (NaNs included), so equality is bitwise."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (12 * elements,), dtype=torch.uint8, generator=gen)
    return raw.view(torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _write(tmp_path, elements=1000, step=7, name="sg00005.state", **io_kwargs):
    path = str(tmp_path / name)
    payload = _payload(elements, seed=step)
    StateFileIO(**io_kwargs).write(path, payload, elements=elements, step=step, **ID)
    return path, payload


def _read(path, elements=1000, **io_kwargs):
    out = torch.empty(3 * elements, dtype=torch.float32)
    step = StateFileIO(**io_kwargs).read(path, out, elements=elements, **ID)
    return out, step


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _o_direct_supported(directory) -> bool:
    probe = os.path.join(directory, ".probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        assert e.errno == errno.EINVAL
        return False
    finally:
        if os.path.lexists(probe):
            os.unlink(probe)
    os.close(fd)
    return True


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 2 blocks, so that small payloads span many chunks (and threads)."""
    monkeypatch.setattr(state_format, "MIN_CHUNK", 2 * ALIGN)


# -- aligned buffers ---------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, 4, 4096, 12 * 1001, 3 << 20])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_aligned_empty(nbytes, dtype):
    t = aligned_empty(nbytes, dtype)
    assert t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.numel() * t.element_size() == nbytes
    assert t.data_ptr() % ALIGN == 0
    # The storage reaches a block boundary past the data, for whole-block O_DIRECT.
    room = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    assert room >= -(-nbytes // ALIGN) * ALIGN


def test_aligned_empty_refuses_partial_elements():
    with pytest.raises(ValueError):
        aligned_empty(6, torch.float32)


# -- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("checksum", oio.CHECKSUMS)
@pytest.mark.parametrize("direct_io", [False, True])
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("elements", [1, 1000, 50_000])  # 1 block; unaligned; 74 chunks
def test_round_trip(tmp_path, small_chunks, checksum, direct_io, threads, elements):
    path = str(tmp_path / "sg00005.state")
    payload = _payload(elements)
    io = StateFileIO(threads=threads, direct_io=direct_io, checksum=checksum)
    size = io.write(path, payload, elements=elements, step=42, **ID)
    nbytes = 12 * elements
    assert size == os.path.getsize(path) == ALIGN + -(-nbytes // ALIGN) * ALIGN
    out = torch.full_like(payload, 7.0)
    assert io.read(path, out, elements=elements, **ID) == 42
    assert torch.equal(_bits(out), _bits(payload))
    header = read_header(path)
    assert header["checksum"] == checksum and header["step"] == 42
    assert (header["rank"], header["subgroup"], header["elements"]) == (3, 5, elements)
    assert header["payload_bytes"] == nbytes and header["file_bytes"] == size
    assert len(header["chunk_digests"]) == -(-nbytes // header["chunk_bytes"])
    io.close()


def test_round_trip_real_chunk_size(tmp_path):
    """Default geometry: 8 MiB chunks, a 24 MB payload is 3 chunks, the last one partial."""
    elements = 2_000_000
    path, payload = _write(tmp_path, elements=elements, threads=4)
    header = read_header(path)
    assert header["chunk_bytes"] == state_format.MIN_CHUNK and len(header["chunk_digests"]) == 3
    out, step = _read(path, elements=elements, threads=4)
    assert step == 7 and torch.equal(_bits(out), _bits(payload))


def test_chunk_count_is_bounded():
    for nbytes in [0, 1, 12, 8 << 20, (8 << 20) + 1, 3 << 30, 12 * 10**8, 10**11]:
        chunk = oio.chunk_bytes(nbytes)
        assert chunk % ALIGN == 0 and chunk >= state_format.MIN_CHUNK
        assert -(-nbytes // chunk) <= state_format.MAX_CHUNKS


def test_format_is_independent_of_threads(tmp_path, small_chunks):
    path, payload = _write(tmp_path, elements=20_000, threads=4, checksum="crc32c")
    out, _ = _read(path, elements=20_000, threads=1)
    assert torch.equal(_bits(out), _bits(payload))


@pytest.mark.parametrize("src_aligned", [True, False])
@pytest.mark.parametrize("dst_aligned", [True, False])
def test_direct_io_aligned_and_unaligned_tensors(tmp_path, small_chunks, monkeypatch,
                                                 src_aligned, dst_aligned):
    """Aligned tensors go straight to the disk; others through the bounce buffers."""
    monkeypatch.setattr(oio, "BOUNCE_BYTES", ALIGN)  # several bounces per chunk
    elements = 5000  # 60000 bytes: 7 chunks, an unaligned tail

    def buffer(aligned):
        t = aligned_empty(12 * elements + ALIGN)
        t = t[:12 * elements] if aligned else t[4:4 + 12 * elements]
        return t.view(torch.float32)

    src, dst = buffer(src_aligned), buffer(dst_aligned)
    assert (src.data_ptr() % ALIGN == 0) == src_aligned
    src.copy_(_payload(elements))
    io = StateFileIO(threads=4, direct_io=True)
    path = str(tmp_path / "sg.state")
    io.write(path, src, elements=elements, step=1, **ID)
    io.read(path, dst, elements=elements, **ID)
    assert torch.equal(_bits(dst), _bits(src))


def test_direct_io_on_tmp(tmp_path):
    """/tmp here is ext4 on a virtio disk, which takes O_DIRECT; tmpfs may not."""
    supported = _o_direct_supported(str(tmp_path))
    io = StateFileIO(direct_io=True)
    path = str(tmp_path / "sg.state")
    io.write(path, _payload(1000), elements=1000, step=1, **ID)
    io.read(path, torch.empty(3000), elements=1000, **ID)
    assert io.direct_io_active == supported


def test_direct_io_falls_back_where_refused(tmp_path, monkeypatch):
    """A filesystem without O_DIRECT (EINVAL at open, after creating the inode, as Linux
    does): buffered I/O instead, remembered, and no empty temp file left behind."""
    real_open = os.open
    direct_opens = []

    def open_without_direct(path, flags, mode=0o777, **kwargs):
        if flags & os.O_DIRECT:
            direct_opens.append(path)
            if flags & os.O_CREAT:
                os.close(real_open(path, flags & ~os.O_DIRECT, mode))
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", open_without_direct)
    io = StateFileIO(direct_io=True, threads=4)
    assert io.direct_io_active
    path = str(tmp_path / "sg.state")
    payload = _payload(1000)
    for step in (1, 2):
        io.write(path, payload, elements=1000, step=step, **ID)
        out = torch.empty(3000)
        assert io.read(path, out, elements=1000, **ID) == step
        assert torch.equal(_bits(out), _bits(payload))
    assert not io.direct_io_active
    assert len(direct_opens) == 1
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".spare-")] == ["sg.state"]


def _write_and_check(io, path, step, n=1000):
    payload = _payload(n) + step
    io.write(path, payload, elements=n, step=step, **ID)
    out = torch.empty(3 * n)
    assert io.read(path, out, elements=n, **ID) == step
    assert torch.equal(_bits(out), _bits(payload))
    return os.stat(path).st_ino


@pytest.mark.parametrize("direct", [False, True])
def test_replaced_files_are_recycled(tmp_path, direct):
    """The file a write replaces becomes a spare, and a later write of that size
    overwrites it instead of allocating a new file; never more than SPARES_PER_SIZE."""
    io = StateFileIO(direct_io=direct, threads=4)
    path = str(tmp_path / "sg.state")
    inodes = [_write_and_check(io, path, step) for step in range(1, 7)]
    assert inodes[2] == inodes[0] and inodes[3] == inodes[1] and inodes[4] == inodes[0]
    spares = [n for n in os.listdir(tmp_path) if n.startswith(".spare-")]
    assert len(spares) == 1
    other = str(tmp_path / "other.state")  # same size: shares the spares of the directory
    for step in range(1, 4):
        _write_and_check(io, other, step)
    spares = [n for n in os.listdir(tmp_path) if n.startswith(".spare-")]
    assert 1 <= len(spares) <= oio.SPARES_PER_SIZE
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_a_checkpoint_link_is_never_overwritten(tmp_path):
    io = StateFileIO(direct_io=False, threads=4)
    path = str(tmp_path / "sg.state")
    _write_and_check(io, path, 1)
    saved = tmp_path / "checkpoint.state"
    os.link(path, saved)
    before = saved.read_bytes()
    for step in range(2, 8):
        _write_and_check(io, path, step)
    assert saved.read_bytes() == before
    assert os.stat(saved).st_nlink == 1


def test_a_symlink_under_a_spare_name_is_not_followed(tmp_path):
    io = StateFileIO(direct_io=False, threads=4)
    path = str(tmp_path / "sg.state")
    _write_and_check(io, path, 1)
    size = os.stat(path).st_size
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * size)
    os.symlink(victim, tmp_path / f".spare-{size}-planted")
    for step in range(2, 5):
        _write_and_check(io, path, step)
    assert victim.read_bytes() == b"x" * size
    assert not (tmp_path / f".spare-{size}-planted").exists()


def test_trace(tmp_path):
    events = []
    io = StateFileIO(trace=lambda *event: events.append(event))
    path = str(tmp_path / "sg.state")
    t0 = time.monotonic()
    size = io.write(path, _payload(100), elements=100, step=1, **ID)
    io.read(path, torch.empty(300), elements=100, **ID)
    assert [(op, p, n) for op, p, _, _, n in events] == [("write", path, size),
                                                         ("read", path, size)]
    assert t0 <= events[0][2] <= events[0][3] <= events[1][2] <= events[1][3]


# -- damaged files -----------------------------------------------------------------------


@pytest.mark.parametrize("checksum", ["xxh3", "crc32c"])
@pytest.mark.parametrize("where", [0, 4095, 11_999])  # first, last of block 1, last byte
def test_flipped_payload_byte(tmp_path, checksum, where):
    path, _ = _write(tmp_path, checksum=checksum)
    _flip(path, ALIGN + where)
    pattern = f"{re.escape(path)} is corrupt.*{checksum} checksum"
    with pytest.raises(OffloadStateError, match=pattern):
        _read(path)


@pytest.mark.parametrize("checksum", oio.CHECKSUMS)
@pytest.mark.parametrize("where", [0, 9, 20, 40, 56, 80, 3000, 4090])
def test_flipped_header_byte(tmp_path, checksum, where):
    """Magic, version, rank, step, algorithm, digest table, padding, header digest."""
    path, _ = _write(tmp_path, checksum=checksum)
    _flip(path, where)
    with pytest.raises(OffloadStateError, match=re.escape(path)):
        _read(path)
    with pytest.raises(OffloadStateError, match=re.escape(path)):
        read_header(path)


def test_flipped_padding_byte(tmp_path):
    path, _ = _write(tmp_path, checksum="none")  # 12000 bytes: padding from 4096 + 12000
    _flip(path, ALIGN + 12_000 + 7)
    with pytest.raises(OffloadStateError, match="padding"):
        _read(path)


@pytest.mark.parametrize("size", [0, 100, ALIGN, 2 * ALIGN, 3 * ALIGN])
def test_truncated_file(tmp_path, size):
    path, _ = _write(tmp_path)  # 4 blocks
    os.truncate(path, size)
    with pytest.raises(OffloadStateError, match=f"{re.escape(path)} is (truncated|corrupt)"):
        _read(path)


def test_file_with_extra_bytes(tmp_path):
    path, _ = _write(tmp_path)
    with open(path, "ab") as f:
        f.write(bytes(ALIGN))
    with pytest.raises(OffloadStateError, match="corrupt"):
        _read(path)


def test_not_a_state_file(tmp_path):
    path = tmp_path / "sg.state"
    path.write_bytes(b"x" * 3 * ALIGN)
    with pytest.raises(OffloadStateError, match="bad magic"):
        _read(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(OffloadStateError, match="does not exist"):
        _read(str(tmp_path / "nope.state"))


@pytest.mark.parametrize("expected", [{"rank": 4}, {"subgroup": 6}, {"elements": 999}])
def test_state_of_another_rank_subgroup_or_size(tmp_path, expected):
    path, _ = _write(tmp_path)
    want = {**ID, "elements": 1000, **expected}
    out = torch.empty(3 * want["elements"])
    with pytest.raises(OffloadStateError, match=f"{re.escape(path)} holds rank 3 subgroup 5"):
        StateFileIO().read(path, out, **want)


def test_output_of_wrong_size(tmp_path):
    path, _ = _write(tmp_path)
    with pytest.raises(OffloadStateError, match="12000 payload bytes, expected 11996"):
        StateFileIO().read(path, torch.empty(2999), elements=1000, **ID)


def test_is_a_usage_error():
    assert issubclass(OffloadStateError, UsageError)


# -- unsafe paths ------------------------------------------------------------------------


@pytest.mark.skipif(not IS_ROOT, reason="chown to another uid needs root")
def test_file_of_another_user(tmp_path):
    path, _ = _write(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(OffloadStateError, match="owned by uid 65534"):
        _read(path)
    with pytest.raises(OffloadStateError, match="owned by uid 65534"):
        read_header(path)


def test_symlink_at_path(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    link = tmp_path / "sg.state"
    link.symlink_to(target)
    with pytest.raises(OffloadStateError, match=f"{re.escape(str(link))} is a symlink"):
        _read(str(link))
    path, payload = _write(tmp_path, name="sg.state")
    assert not os.path.islink(path) and target.read_bytes() == b"keep me"
    out, _ = _read(path)
    assert torch.equal(_bits(out), _bits(payload))


def test_fifo_at_path_does_not_hang(tmp_path):
    path = str(tmp_path / "sg.state")
    os.mkfifo(path, 0o600)
    with pytest.raises(OffloadStateError, match="not a regular file"):
        _read(path)


def test_modes(tmp_path):
    old_umask = os.umask(0)  # the modes must not depend on a permissive umask
    try:
        secure_makedirs(str(tmp_path / "a" / "b" / "rank00003"))
    finally:
        os.umask(old_umask)
    for d in ["a", "a/b", "a/b/rank00003"]:
        assert stat.S_IMODE(os.stat(tmp_path / d).st_mode) == 0o700
    path, _ = _write(tmp_path / "a" / "b" / "rank00003")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secure_makedirs(str(tmp_path / "a" / "b" / "rank00003"))  # existing: fine


def test_secure_makedirs_refuses(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("")
    with pytest.raises(OffloadStateError, match="is a symlink"):
        secure_makedirs(str(tmp_path / "link"))
    with pytest.raises(OffloadStateError, match="not a directory"):
        secure_makedirs(str(tmp_path / "file"))
    if IS_ROOT:
        os.chown(tmp_path / "real", 65534, 65534)
        with pytest.raises(OffloadStateError, match="owned by uid 65534"):
            secure_makedirs(str(tmp_path / "real"))


# -- failures while writing --------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 4])
def test_enospc_propagates_and_keeps_the_old_file(tmp_path, small_chunks, monkeypatch, threads):
    elements = 20_000  # 240000 bytes: 30 chunks
    path, old = _write(tmp_path, elements=elements, step=1)
    real_pwrite = os.pwrite
    calls = []

    def pwrite_until_full(fd, data, offset):
        calls.append(offset)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite_until_full)
    with pytest.raises(OSError) as info:
        StateFileIO(threads=threads).write(path, _payload(elements, seed=2), elements=elements,
                                           step=2, **ID)
    assert info.value.errno == errno.ENOSPC and type(info.value) is OSError
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["sg00005.state"]
    out, step = _read(path, elements=elements)
    assert step == 1 and torch.equal(_bits(out), _bits(old))


def test_write_refuses_non_contiguous(tmp_path):
    with pytest.raises(ValueError, match="contiguous"):
        StateFileIO().write(str(tmp_path / "x"), torch.zeros(4, 4).t(), elements=1, step=0,
                            **ID)


# -- throughput (printed, not asserted) --------------------------------------------------


def test_throughput_print(tmp_path, capsys):
    nbytes = 256 << 20
    src = aligned_empty(nbytes, torch.float32).fill_(1.5)
    dst = aligned_empty(nbytes, torch.float32).fill_(0.0)  # touch pages before timing
    path = str(tmp_path / "big.state")
    lines = []
    for threads in (1, 4):
        io = StateFileIO(threads=threads)
        t0 = time.perf_counter()
        io.write(path, src, elements=nbytes // 12, step=1, **ID)
        t1 = time.perf_counter()
        io.read(path, dst, elements=nbytes // 12, **ID)
        t2 = time.perf_counter()
        io.close()
        lines.append(f"offload io, 256 MiB on {tmp_path.parent}, threads={threads}: write "
                     f"{nbytes / (t1 - t0) / 1e9:.2f} GB/s, read {nbytes / (t2 - t1) / 1e9:.2f} "
                     f"GB/s (page cache)")
        os.unlink(path)
    assert torch.equal(dst, src)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
