"""State files of the offload engine: threaded aligned I/O, O_DIRECT, checksums, atomic writes.

Each data-parallel rank keeps the fp32 optimizer state of its subgroups (master params,
Adam ``exp_avg`` and ``exp_avg_sq``: one contiguous tensor of ``3 * n`` fp32 elements) in
one file per subgroup, rewritten every step. A file is written under a temporary name in
its directory and renamed over the old one, so a reader sees the old state or the new
one, never a mix, and a crash mid-write leaves the previous file intact.

The block I/O under the files (aligned buffers, O_DIRECT opens, whole ``pwrite``/``preadv``
transfers, the pool of I/O threads) is :mod:`.blockio`, which the bandwidth probe
(:mod:`megatron_ext.offload.probe`) moves its bytes with too, so that it measures the
engine's own I/O.

Temporary files are recycled: a replaced file whose inode nothing else links (no
checkpoint hard link) is kept as a spare (``.spare-SIZE-TOKEN``, at most
``SPARES_PER_SIZE`` per size and directory), and the next write of that size claims it by
renaming it to its temporary name and overwrites it. On ext4, O_DIRECT writes that extend
a file hold the inode lock exclusively, so the I/O threads of a new file write one at a
time; overwrites of written blocks run in parallel (8 threads, 512 MiB, on the dev
machine's virtio disk, 2026-11-30: 1.94-2.04 GB/s into a new file, 3.26-3.69 GB/s
overwriting). The spare is never the file being replaced, so the guarantee above holds.

File format (version 1, all integers little-endian)::

    offset 0     header block, ALIGN (4096) bytes:
                 0    magic            8s   b"MEXTOFS1"
                 8    version          u32  1
                 12   header bytes     u32  4096
                 16   rank             i64
                 24   subgroup         i64
                 32   elements         i64  n, elements of the subgroup (payload: 3n fp32)
                 40   step             i64  the optimizer step the state belongs to
                 48   payload bytes    i64  L
                 56   checksum algo    8s   b"xxh3", b"crc32c" or b"none", NUL padded
                 64   chunk bytes      i64  C, a multiple of ALIGN
                 72   chunks           u32  ceil(L / C), at most MAX_CHUNKS
                 76   reserved         u32  0
                 80   chunk digests    u64 each, one per chunk (0 with algo "none")
                 ...  zeros
                 4088 header digest   u64  xxh3_64 of bytes [0, 4088)
    offset 4096  payload, L bytes, then zeros up to a multiple of ALIGN

The file is therefore exactly ``4096 + roundup(L, 4096)`` bytes. Chunk ``i`` covers payload
bytes ``[i*C, min((i+1)*C, L))``; one I/O thread writes or reads a chunk and hashes it, so
hashing runs in parallel with the other threads' syscalls (xxhash and crc32c release the
GIL on large buffers). The header digest always uses xxh3, whatever the payload
algorithm, so that the algorithm field itself is covered; with ``"none"`` a reader still
checks the header digest, magic, version, identity, geometry and the file size, and that
the padding after the payload is zero.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import struct
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import crc32c
import numpy as np
import torch
import xxhash

from megatron_ext.errors import UsageError
from megatron_ext.offload.blockio import (
    ALIGN,
    IOThreads,
    aligned_empty,
    open_direct,
    pread_full,
    pwrite_all,
    round_up,
)

log = logging.getLogger(__name__)

"""Alignment of O_DIRECT buffers, file offsets and lengths; also the header size."""

MAGIC = b"MEXTOFS1"
VERSION = 1
MIN_CHUNK = 8 << 20
"""Smallest chunk: large enough that a syscall and a hash call amortize their overhead."""
MAX_CHUNKS = 256
"""Most chunks of a file: bounds the digest table so that it fits the header block."""
BOUNCE_BYTES = 8 << 20
"""Per-thread bounce buffer for O_DIRECT I/O from or to an unaligned tensor."""
SPARES_PER_SIZE = 2
"""Recycled files kept per file size and directory (see the module docstring)."""

_FIXED = struct.Struct("<8sIIqqqqq8sqII")
_DIGEST = struct.Struct("<Q")
_DIGESTS_AT = _FIXED.size
_HEADER_DIGEST_AT = ALIGN - _DIGEST.size
assert _DIGESTS_AT + MAX_CHUNKS * _DIGEST.size <= _HEADER_DIGEST_AT

_HASHERS: Dict[str, Optional[Callable[[memoryview], int]]] = {
    "xxh3": xxhash.xxh3_64_intdigest,
    "crc32c": crc32c.crc32c,
    "none": None,
}
CHECKSUMS = tuple(_HASHERS)

RESTART_HINT = "restart from the last checkpoint with --load"
_OWN_DIR = "give each run and user an offload directory of its own"


class OffloadStateError(UsageError):
    """An offload state file or directory that cannot be trusted: corrupt, foreign, unsafe."""


def secure_makedirs(path: str) -> None:
    """Creates a directory tree for state files and checks that only we control its leaf.

    Directories created here get mode 0o700 (whatever the umask). An existing leaf is
    accepted only if it is a real directory (not a symlink) owned by the current user.

    Args:
        path: The directory.

    Raises:
        OffloadStateError: The leaf is a symlink, not a directory, or another user's.
    """
    path = os.path.abspath(path)
    missing: List[str] = []
    head = path
    while not os.path.lexists(head):
        missing.append(head)
        head = os.path.dirname(head)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            continue  # another rank of the node created it first
        os.chmod(directory, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OffloadStateError(f"offload directory {path} is a symlink: {_OWN_DIR}")
    if not stat.S_ISDIR(st.st_mode):
        raise OffloadStateError(f"offload directory {path} exists and is not a directory: "
                                f"remove it or {_OWN_DIR}")
    _check_owner(st, f"offload directory {path}")


def _check_owner(st: os.stat_result, what: str) -> None:
    """Refuses a file or directory of another user (a shared scratch directory's trap)."""
    if st.st_uid != os.geteuid():
        raise OffloadStateError(f"{what} is owned by uid {st.st_uid}, not by this user "
                                f"(uid {os.geteuid()}): {_OWN_DIR}")


def _recyclable(st: os.stat_result, size: int) -> bool:
    """Whether a file may be overwritten as a spare.

    It must be ours, regular, ``size`` bytes, and linked from nowhere else (a checkpoint's
    hard link keeps it).
    """
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
            and st.st_size == size)


def read_header(path: str) -> dict:
    """Reads and validates the header of a state file, without reading its payload.

    Args:
        path: The state file.

    Returns:
        A dict with ``version``, ``rank``, ``subgroup``, ``elements``, ``step``,
        ``checksum``, ``payload_bytes``, ``chunk_bytes``, ``chunk_digests`` (list of int)
        and ``file_bytes``.

    Raises:
        OffloadStateError: The file is unsafe (symlink, foreign owner), corrupt or truncated.
    """
    fd, _, size = _open_for_read(path, lambda p, flags: (os.open(p, flags), False))
    try:
        block = bytearray(ALIGN)
        got = os.preadv(fd, [block], 0)
    finally:
        os.close(fd)
    if got < ALIGN:
        raise _truncated(path, size, ALIGN)
    return _parse_header(bytes(block), path, size)


class StateFileIO:
    """Writes and reads state files with a pool of I/O threads.

    One instance may serve several tiers and several caller threads at once. Not the
    place for cross-process coordination: see :class:`megatron_ext.offload.locks.NodeLocks`.

    Attributes:
        direct_io_active: False once a directory refused O_DIRECT (EINVAL at open, as on
            older tmpfs); I/O in that directory then stays buffered.
    """

    def __init__(self, threads: int = 4, direct_io: bool = False, checksum: str = "xxh3",
                 trace: Optional[Callable[[str, str, float, float, int], None]] = None):
        """Configures the I/O.

        Args:
            threads: I/O threads per call; each writes or reads whole chunks.
            direct_io: Bypass the page cache with O_DIRECT (falls back to buffered I/O per
                directory where the filesystem refuses it).
            checksum: Payload checksum of written files: "xxh3", "crc32c" or "none". Reads
                verify with the algorithm recorded in the file.
            trace: Called as ``trace(op, path, t_start, t_end, nbytes)`` (``op`` "write" or
                "read", times from ``time.monotonic``) after each successful call.
        """
        if threads < 1:
            raise ValueError(f"StateFileIO: threads must be >= 1, got {threads}")
        if checksum not in _HASHERS:
            raise ValueError(f"StateFileIO: checksum must be one of {CHECKSUMS}, got {checksum!r}")
        if direct_io and not hasattr(os, "O_DIRECT"):
            raise ValueError("StateFileIO: O_DIRECT is not available on this platform")
        self.threads = threads
        self.direct_io = direct_io
        self.direct_io_active = direct_io
        self.checksum = checksum
        self.trace = trace
        self._buffered_dirs: Set[str] = set()
        self._local = threading.local()
        self._workers = IOThreads(threads, "offload-io")

    def close(self) -> None:
        """Stops the I/O threads; the instance starts new ones if used again."""
        self._workers.close()

    def write(self, path: str, payload: torch.Tensor, *, rank: int, subgroup: int,
              elements: int, step: int) -> int:
        """Atomically replaces the state file at ``path`` with ``payload``.

        Args:
            path: The state file; a symlink there is replaced, never followed.
            payload: Contiguous CPU tensor of any dtype, written as its bytes.
            rank: Data-parallel rank that owns the state.
            subgroup: Subgroup id within the rank.
            elements: Elements of the subgroup (the payload normally holds 3 * elements fp32).
            step: Optimizer step the state belongs to.

        Returns:
            Bytes written: the size of the file.

        Raises:
            OSError: From the filesystem, unwrapped (ENOSPC lets the caller spill to another
                tier); the temporary file is removed and an older file at ``path`` is kept.
        """
        t_start = time.monotonic()
        src = _as_bytes(payload, "payload")
        nbytes = src.size
        chunk = chunk_bytes(nbytes)
        nchunks = -(-nbytes // chunk)
        algo = self.checksum
        digests = [0] * nchunks
        directory, base = os.path.split(os.path.abspath(path))
        tmp = os.path.join(directory, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        size = ALIGN + round_up(nbytes)
        claimed = self._claim_spare(directory, tmp, size)
        if claimed is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            claimed = self._open(tmp, flags, 0o600, directory)
        fd, direct = claimed
        spare = None
        try:
            try:
                aligned = src.ctypes.data % ALIGN == 0
                self._workers.run([
                    (lambda i=i: self._write_chunk(fd, src, i, chunk, direct, aligned, algo,
                                                   digests))
                    for i in range(nchunks)])
                block = self._block()
                _pack_header(block, rank=rank, subgroup=subgroup, elements=elements, step=step,
                             payload_bytes=nbytes, algo=algo, chunk=chunk, digests=digests)
                pwrite_all(fd, memoryview(block), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            spare = self._retire(path, directory, size)
            os.rename(tmp, path)
        except BaseException:
            for name in (tmp, spare):
                if name is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name)
            raise
        _fsync_dir(directory)
        if spare is not None:
            # A hard link made since (a checkpoint's) keeps the old file: never recycle it.
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(spare).st_nlink != 1:
                    os.unlink(spare)
        if self.trace is not None:
            self.trace("write", path, t_start, time.monotonic(), size)
        return size

    def read(self, path: str, out: torch.Tensor, *, rank: int, subgroup: int,
             elements: int) -> int:
        """Reads the payload of the state file at ``path`` into ``out``, verifying it.

        Args:
            path: The state file.
            out: Contiguous CPU tensor of exactly the payload's size in bytes.
            rank: Expected rank in the header.
            subgroup: Expected subgroup id in the header.
            elements: Expected element count in the header.

        Returns:
            The optimizer step recorded in the header.

        Raises:
            OffloadStateError: The file is a symlink or another user's, is truncated or
                corrupt, or belongs to another rank, subgroup or size. ``out`` may then
                hold partial data.
        """
        t_start = time.monotonic()
        dst = _as_bytes(out, "out")
        directory = os.path.dirname(os.path.abspath(path))
        fd, direct, size = _open_for_read(
            path, lambda p, flags: self._open(p, flags, 0, directory))
        try:
            block = self._block()
            _pread_exact(fd, memoryview(block), 0, path, size)
            header = _parse_header(block.tobytes(), path, size)
            found = (header["rank"], header["subgroup"], header["elements"])
            if found != (rank, subgroup, elements):
                raise OffloadStateError(
                    f"offload state file {path} holds rank {found[0]} subgroup {found[1]} "
                    f"({found[2]} elements), expected rank {rank} subgroup {subgroup} "
                    f"({elements} elements): {_OWN_DIR}, or {RESTART_HINT}")
            if header["payload_bytes"] != dst.size:
                raise OffloadStateError(
                    f"offload state file {path} holds {header['payload_bytes']} payload bytes, "
                    f"expected {dst.size}: {_OWN_DIR}, or {RESTART_HINT}")
            hasher = _HASHERS[header["checksum"]]
            chunk, digests = header["chunk_bytes"], header["chunk_digests"]
            aligned = dst.ctypes.data % ALIGN == 0
            self._workers.run([
                (lambda i=i: self._read_chunk(fd, dst, i, chunk, direct, aligned, hasher,
                                              digests[i], header["checksum"], path, size))
                for i in range(len(digests))])
        finally:
            os.close(fd)
        if self.trace is not None:
            self.trace("read", path, t_start, time.monotonic(), size)
        return header["step"]

    # -- internals ---------------------------------------------------------------------

    def _claim_spare(self, directory: str, tmp: str, size: int):
        """A recycled file of ``size`` bytes renamed to ``tmp`` and opened; None if none."""
        prefix = f".spare-{size}-"
        try:
            names = [n for n in os.listdir(directory) if n.startswith(prefix)]
        except OSError:
            return None
        for name in names:
            try:
                os.rename(os.path.join(directory, name), tmp)
            except FileNotFoundError:  # another thread claimed it first
                continue
            try:
                fd, direct = self._open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                        directory)
            except OSError:  # e.g. a symlink planted under a spare's name
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                continue
            if _recyclable(os.fstat(fd), size):
                return fd, direct
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return None

    def _retire(self, path: str, directory: str, size: int) -> Optional[str]:
        """Links the file about to be replaced as a spare when it may be recycled."""
        try:
            if not _recyclable(os.lstat(path), size):
                return None
            prefix = f".spare-{size}-"
            if sum(n.startswith(prefix) for n in os.listdir(directory)) >= SPARES_PER_SIZE:
                return None
            spare = os.path.join(directory, prefix + secrets.token_hex(4))
            os.link(path, spare, follow_symlinks=False)
            return spare
        except OSError:
            return None

    def _open(self, path: str, flags: int, mode: int, directory: str):
        """Opens with O_DIRECT when configured and the directory allows it; (fd, direct)."""
        if self.direct_io and directory not in self._buffered_dirs:
            fd = open_direct(path, flags, mode)
            if fd is not None:
                return fd, True
            self._buffered_dirs.add(directory)
            self.direct_io_active = False
            log.warning("offload: %s refuses O_DIRECT; using buffered I/O there", directory)
        return os.open(path, flags, mode), False

    def _block(self) -> np.ndarray:
        """The calling thread's aligned ALIGN-byte buffer, for the header and payload tails."""
        block = getattr(self._local, "block", None)
        if block is None:
            block = self._local.block = aligned_empty(ALIGN).numpy()
        return block

    def _bounce(self) -> np.ndarray:
        """The calling thread's aligned bounce buffer, for O_DIRECT with an unaligned tensor."""
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = aligned_empty(BOUNCE_BYTES).numpy()
        return bounce

    def _write_chunk(self, fd: int, src: np.ndarray, i: int, chunk: int, direct: bool,
                     aligned: bool, algo: str, digests: List[int]) -> None:
        start = i * chunk
        piece = src[start:start + chunk]
        hasher = _HASHERS[algo]
        if hasher is not None:
            digests[i] = hasher(memoryview(piece))
        offset = ALIGN + start
        body = len(piece) // ALIGN * ALIGN
        if direct and not aligned:
            bounce = self._bounce()
            for lo in range(0, body, len(bounce)):
                hi = min(lo + len(bounce), body)
                bounce[:hi - lo] = piece[lo:hi]
                pwrite_all(fd, memoryview(bounce[:hi - lo]), offset + lo)
        elif body:
            pwrite_all(fd, memoryview(piece[:body]), offset)
        tail = len(piece) - body
        if tail:
            # The unaligned end of the payload goes out as one zero-padded block, so that
            # O_DIRECT can write it and the file ends on a block boundary.
            block = self._block()
            block[:tail] = piece[body:]
            block[tail:] = 0
            pwrite_all(fd, memoryview(block), offset + body)

    def _read_chunk(self, fd: int, dst: np.ndarray, i: int, chunk: int, direct: bool,
                    aligned: bool, hasher: Optional[Callable], digest: int, algo: str,
                    path: str, size: int) -> None:
        start = i * chunk
        piece = dst[start:start + chunk]
        offset = ALIGN + start
        body = len(piece) // ALIGN * ALIGN
        if direct and not aligned:
            bounce = self._bounce()
            for lo in range(0, body, len(bounce)):
                hi = min(lo + len(bounce), body)
                _pread_exact(fd, memoryview(bounce[:hi - lo]), offset + lo, path, size)
                piece[lo:hi] = bounce[:hi - lo]
        elif body:
            _pread_exact(fd, memoryview(piece[:body]), offset, path, size)
        tail = len(piece) - body
        if tail:
            block = self._block()
            _pread_exact(fd, memoryview(block), offset + body, path, size)
            piece[body:] = block[:tail]
            if block[tail:].any():
                raise _corrupt(path, "nonzero bytes in the padding after the payload")
        if hasher is not None and hasher(memoryview(piece)) != digest:
            raise _corrupt(path, f"{algo} checksum mismatch in payload chunk {i}")


def chunk_bytes(payload_bytes: int) -> int:
    """The chunk size of a payload: at least MIN_CHUNK, at most MAX_CHUNKS chunks, aligned."""
    return round_up(max(MIN_CHUNK, -(-payload_bytes // MAX_CHUNKS)))


def _as_bytes(tensor: torch.Tensor, name: str) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU tensor, got {tensor.device} "
                         f"contiguous={tensor.is_contiguous()}")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _corrupt(path: str, what: str) -> OffloadStateError:
    return OffloadStateError(f"offload state file {path} is corrupt ({what}): {RESTART_HINT}")


def _truncated(path: str, size: int, expected: int) -> OffloadStateError:
    return OffloadStateError(f"offload state file {path} is truncated ({size} bytes, expected "
                             f"{expected}): {RESTART_HINT}")


def _open_for_read(path: str, opener: Callable[[str, int], Tuple[int, bool]]):
    """Opens a state file for reading and checks that it is a regular file of ours.

    Args:
        path: The state file.
        opener: ``opener(path, flags) -> (fd, direct)``.

    Returns:
        ``(fd, direct, size)``.
    """
    # O_NONBLOCK: a FIFO planted at the path must not hang the open; no effect on files.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd, direct = opener(path, flags)
    except FileNotFoundError:
        raise OffloadStateError(
            f"offload state file {path} does not exist: {RESTART_HINT}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OffloadStateError(f"offload state file {path} is a symlink: remove it, and "
                                    f"{_OWN_DIR}") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OffloadStateError(f"offload state file {path} is not a regular file: remove "
                                    f"it, and {_OWN_DIR}")
        _check_owner(st, f"offload state file {path}")
    except BaseException:
        os.close(fd)
        raise
    return fd, direct, st.st_size


def _pack_header(block: np.ndarray, *, rank: int, subgroup: int, elements: int, step: int,
                 payload_bytes: int, algo: str, chunk: int, digests: List[int]) -> None:
    block[:] = 0
    buf = memoryview(block)
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, ALIGN, rank, subgroup, elements, step,
                     payload_bytes, algo.encode(), chunk, len(digests), 0)
    for i, digest in enumerate(digests):
        _DIGEST.pack_into(buf, _DIGESTS_AT + i * _DIGEST.size, digest)
    _DIGEST.pack_into(buf, _HEADER_DIGEST_AT, xxhash.xxh3_64_intdigest(buf[:_HEADER_DIGEST_AT]))


def _parse_header(block: bytes, path: str, size: int) -> dict:
    """Validates a header block against itself and the file size; returns its fields."""
    if size < ALIGN:
        raise _truncated(path, size, ALIGN)
    (magic, version, header_bytes, rank, subgroup, elements, step, payload_bytes, algo, chunk,
     nchunks, _) = _FIXED.unpack_from(block, 0)
    if magic != MAGIC:
        raise OffloadStateError(f"offload state file {path} is not a megatron_ext offload "
                                f"state file (bad magic {magic!r}): remove it or {_OWN_DIR}")
    if version != VERSION:
        raise OffloadStateError(f"offload state file {path} has format version {version}, this "
                                f"build reads version {VERSION}: {RESTART_HINT}")
    (stored,) = _DIGEST.unpack_from(block, _HEADER_DIGEST_AT)
    if xxhash.xxh3_64_intdigest(block[:_HEADER_DIGEST_AT]) != stored:
        raise _corrupt(path, "header checksum mismatch")
    algo = algo.rstrip(b"\0").decode("ascii", "replace")
    # The header digest matched, so what follows can only fail for a file this build did
    # not write; still checked, since the geometry drives offsets and allocations.
    if (algo not in _HASHERS or header_bytes != ALIGN or payload_bytes < 0 or chunk <= 0
            or chunk % ALIGN or nchunks != -(-payload_bytes // chunk) or nchunks > MAX_CHUNKS):
        raise _corrupt(path, "invalid header fields")
    expected = ALIGN + round_up(payload_bytes)
    if size < expected:
        raise _truncated(path, size, expected)
    if size > expected:
        raise _corrupt(path, f"{size} bytes, the header says {expected}")
    digests = [_DIGEST.unpack_from(block, _DIGESTS_AT + i * _DIGEST.size)[0]
               for i in range(nchunks)]
    return {"version": version, "rank": rank, "subgroup": subgroup, "elements": elements,
            "step": step, "checksum": algo, "payload_bytes": payload_bytes,
            "chunk_bytes": chunk, "chunk_digests": digests, "file_bytes": size}


def _pread_exact(fd: int, buf: memoryview, offset: int, path: str, size: int) -> None:
    got = pread_full(fd, buf, offset)
    if got < len(buf):
        # The size was checked at open, so the file shrank under us.
        raise _truncated(path, offset + got, offset + len(buf))


def _fsync_dir(directory: str) -> None:
    """Makes the rename durable: the new directory entry lives in the directory's data."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some network filesystems cannot fsync a directory; their rename is synchronous.
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)
