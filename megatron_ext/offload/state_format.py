"""The offload state file's format, and the checks a file or directory passes first.

Before a state file or directory is trusted: ownership, no symlinks, a regular file. No
threads and no payload I/O here: :mod:`.io` writes and reads the files.

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

import errno
import os
import stat
import struct
from typing import Callable, Dict, List, Optional, Tuple

import crc32c
import numpy as np
import xxhash

from megatron_ext.errors import UsageError
from megatron_ext.offload.blockio import ALIGN, round_up

MIN_CHUNK = 8 << 20
"""Smallest chunk: large enough that a syscall and a hash call amortize their overhead."""
MAGIC = b"MEXTOFS1"
VERSION = 1
MAX_CHUNKS = 256
"""Most chunks of a file: bounds the digest table so that it fits the header block."""

_FIXED = struct.Struct("<8sIIqqqqq8sqII")
_DIGEST = struct.Struct("<Q")
_DIGESTS_AT = _FIXED.size
_HEADER_DIGEST_AT = ALIGN - _DIGEST.size
assert _DIGESTS_AT + MAX_CHUNKS * _DIGEST.size <= _HEADER_DIGEST_AT

HASHERS: Dict[str, Optional[Callable[[memoryview], int]]] = {
    "xxh3": xxhash.xxh3_64_intdigest,
    "crc32c": crc32c.crc32c,
    "none": None,
}
CHECKSUMS = tuple(HASHERS)

RESTART_HINT = "restart from the last checkpoint with --load"
OWN_DIR = "give each run and user an offload directory of its own"


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
        raise OffloadStateError(f"offload directory {path} is a symlink: {OWN_DIR}")
    if not stat.S_ISDIR(st.st_mode):
        raise OffloadStateError(f"offload directory {path} exists and is not a directory: "
                                f"remove it or {OWN_DIR}")
    check_owner(st, f"offload directory {path}")


def check_owner(st: os.stat_result, what: str) -> None:
    """Refuses a file or directory of another user (a shared scratch directory's trap)."""
    if st.st_uid != os.geteuid():
        raise OffloadStateError(f"{what} is owned by uid {st.st_uid}, not by this user "
                                f"(uid {os.geteuid()}): {OWN_DIR}")


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
    fd, _, size = open_for_read(path, lambda p, flags: (os.open(p, flags), False))
    try:
        block = bytearray(ALIGN)
        got = os.preadv(fd, [block], 0)
    finally:
        os.close(fd)
    if got < ALIGN:
        raise truncated(path, size, ALIGN)
    return parse_header(bytes(block), path, size)


def chunk_bytes(payload_bytes: int) -> int:
    """The chunk size of a payload: at least MIN_CHUNK, at most MAX_CHUNKS chunks, aligned."""
    return round_up(max(MIN_CHUNK, -(-payload_bytes // MAX_CHUNKS)))


def corrupt(path: str, what: str) -> OffloadStateError:
    """The error of a state file whose bytes are not what its header says."""
    return OffloadStateError(f"offload state file {path} is corrupt ({what}): {RESTART_HINT}")


def truncated(path: str, size: int, expected: int) -> OffloadStateError:
    """The error of a state file shorter than its format says."""
    return OffloadStateError(f"offload state file {path} is truncated ({size} bytes, expected "
                             f"{expected}): {RESTART_HINT}")


def open_for_read(path: str, opener: Callable[[str, int], Tuple[int, bool]]):
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
                                    f"{OWN_DIR}") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OffloadStateError(f"offload state file {path} is not a regular file: remove "
                                    f"it, and {OWN_DIR}")
        check_owner(st, f"offload state file {path}")
    except BaseException:
        os.close(fd)
        raise
    return fd, direct, st.st_size


def pack_header(block: np.ndarray, *, rank: int, subgroup: int, elements: int, step: int,
                 payload_bytes: int, algo: str, chunk: int, digests: List[int]) -> None:
    """Writes a header block (``ALIGN`` bytes) into ``block``, its digest last."""
    block[:] = 0
    buf = memoryview(block)
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, ALIGN, rank, subgroup, elements, step,
                     payload_bytes, algo.encode(), chunk, len(digests), 0)
    for i, digest in enumerate(digests):
        _DIGEST.pack_into(buf, _DIGESTS_AT + i * _DIGEST.size, digest)
    _DIGEST.pack_into(buf, _HEADER_DIGEST_AT, xxhash.xxh3_64_intdigest(buf[:_HEADER_DIGEST_AT]))


def parse_header(block: bytes, path: str, size: int) -> dict:
    """Validates a header block against itself and the file size; returns its fields."""
    if size < ALIGN:
        raise truncated(path, size, ALIGN)
    (magic, version, header_bytes, rank, subgroup, elements, step, payload_bytes, algo, chunk,
     nchunks, _) = _FIXED.unpack_from(block, 0)
    if magic != MAGIC:
        raise OffloadStateError(f"offload state file {path} is not a megatron_ext offload "
                                f"state file (bad magic {magic!r}): remove it or {OWN_DIR}")
    if version != VERSION:
        raise OffloadStateError(f"offload state file {path} has format version {version}, this "
                                f"build reads version {VERSION}: {RESTART_HINT}")
    (stored,) = _DIGEST.unpack_from(block, _HEADER_DIGEST_AT)
    if xxhash.xxh3_64_intdigest(block[:_HEADER_DIGEST_AT]) != stored:
        raise corrupt(path, "header checksum mismatch")
    algo = algo.rstrip(b"\0").decode("ascii", "replace")
    # The header digest matched, so what follows can only fail for a file this build did
    # not write; still checked, since the geometry drives offsets and allocations.
    if (algo not in HASHERS or header_bytes != ALIGN or payload_bytes < 0 or chunk <= 0
            or chunk % ALIGN or nchunks != -(-payload_bytes // chunk) or nchunks > MAX_CHUNKS):
        raise corrupt(path, "invalid header fields")
    expected = ALIGN + round_up(payload_bytes)
    if size < expected:
        raise truncated(path, size, expected)
    if size > expected:
        raise corrupt(path, f"{size} bytes, the header says {expected}")
    digests = [_DIGEST.unpack_from(block, _DIGESTS_AT + i * _DIGEST.size)[0]
               for i in range(nchunks)]
    return {"version": version, "rank": rank, "subgroup": subgroup, "elements": elements,
            "step": step, "checksum": algo, "payload_bytes": payload_bytes,
            "chunk_bytes": chunk, "chunk_digests": digests, "file_bytes": size}
