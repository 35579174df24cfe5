"""Checkpoint integrity: a checksum of every file at save, all verified before a load.

At save, after every rank has written its files (dist_checkpointing's ``.distcp`` shards,
``.metadata``, ``common.pt``, ``metadata.json``, the random-number-generator files, an
optimizer mode's own files, e.g. the offload engine's states and manifests),
:func:`write_manifest` records the size and the xxh3-64 digest of each file in
``integrity.json`` inside the checkpoint, written atomically (temp name, fsync, rename)
and last, before the checkpoint is renamed into place and the 'latest' pointer moves.
Before anything of a checkpoint is read, :func:`verify` checks every file against it;
damage of any kind (a flipped byte, a truncated, empty, missing or replaced file, a
damaged manifest) is refused with one line that names the file and the newest older
checkpoint under the same directory that still verifies. A checkpoint without a manifest
(written before this format, or by Megatron-LM) loads as before, with a log line saying it
was not verified; but one whose common state carries :data:`COMMON_KEY` (every checkpoint
this project saves since the key exists) promised a manifest, and its missing manifest is
damage like any other missing file: refused in the same line, as nothing in it can be
verified. (There is no flag to load it unverified: restore ``integrity.json``, e.g. from
the copy it came from, or resume from the previous good checkpoint the line names.)

Hashing is shared out among the ranks (each hashes every world-size-th file, the results
are gathered over the host group), so a large checkpoint costs one read of it in total.

Files that an optimizer mode writes in a format of its own are checked by that mode
(:func:`megatron_ext.optim.modes.checkpoint_problems`). The pure logic (:func:`compare`) is
apart from the I/O.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import re
from typing import Iterable, List, Optional, Tuple

import xxhash

from megatron_ext.errors import UsageError
from megatron_ext.optim.modes import checkpoint_problems

log = logging.getLogger(__name__)

MANIFEST = "integrity.json"
# The common-state key (value: MANIFEST) by which a checkpoint says it was saved with a
# manifest: without the file, such a checkpoint is refused rather than loaded unverified.
COMMON_KEY = "integrity_manifest"
FORMAT = "megatron_ext-integrity"
VERSION = 1
_CHUNK = 8 << 20
# Errors of the storage (not of the program) that a failed save reports in one line.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES,
                  errno.EPERM, errno.ENOENT, errno.ESTALE}
_STORAGE_TEXT = re.compile(r"No space left on device|Disk quota exceeded|Read-only file system"
                           r"|Input/output error|Permission denied")
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


# Free bytes below which a failed write is put down to a full file system.
FULL_BELOW = 1 << 20


def storage_error(exc: BaseException, directory: Optional[str] = None) -> Optional[str]:
    """The storage failure behind ``exc`` in words (None when it is not one).

    Looks through the exception's causes: dist_checkpointing's writer processes report an
    OSError of theirs wrapped in other exceptions, or only as text. Some writers lose the
    errno on the way (torch's zip writer reports a short write as "unexpected pos N vs M"):
    with ``directory`` given, a failure while its file system has less than
    :data:`FULL_BELOW` bytes free is reported as the full file system it is.
    """
    why = _storage_error(exc)
    if why is None and directory is not None:
        try:
            st = os.statvfs(directory)
        except OSError:
            return None
        if st.f_bavail * st.f_frsize < FULL_BELOW:
            return f"No space left on device (the file system of {directory} is full)"
    return why


def _causes(exc: BaseException):
    """``exc`` and every exception behind it (causes, contexts, each rank's failure)."""
    seen = set()
    pending = [exc]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, tuple):  # torch.distributed.checkpoint's (exception, traceback)
            pending.extend(e for e in exc if isinstance(e, BaseException))
            continue
        yield exc
        # torch.distributed.checkpoint's CheckpointException keeps each rank's failure.
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            pending.extend(failures.values())
        pending.extend([exc.__cause__, exc.__context__])


def _storage_error(exc: BaseException) -> Optional[str]:
    for cause in _causes(exc):
        if isinstance(cause, OSError) and cause.errno in STORAGE_ERRNOS:
            where = f" ({cause.filename})" if cause.filename else ""
            return f"{os.strerror(cause.errno)}{where}"
        match = _STORAGE_TEXT.search(str(cause))
        if match:
            return match.group(0)
    return None


def usage_error_behind(exc: BaseException) -> Optional[UsageError]:
    """The UsageError that ``exc`` wraps (a rank's failure inside torch's checkpoint load)."""
    return next((c for c in _causes(exc) if isinstance(c, UsageError)), None)


def file_digest(path: str) -> Tuple[int, str]:
    """(size, xxh3-64 hex digest) of a file, read in chunks."""
    hasher = xxhash.xxh3_64()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            hasher.update(chunk)
    return size, hasher.hexdigest()


def list_files(directory: str) -> List[str]:
    """Every file under ``directory`` (relative paths, sorted), the manifest excepted."""
    found = []
    for dirpath, dirnames, files in os.walk(directory):
        dirnames.sort()
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), directory)
            if rel != MANIFEST:
                found.append(rel)
    return sorted(found)


def _gather(local: dict, group) -> dict:
    """The union of every rank's dict (over the host group; as it is for one process)."""
    import torch

    if group is None or not torch.distributed.is_initialized() \
            or torch.distributed.get_world_size(group) == 1:
        return local
    parts: List[Optional[dict]] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(parts, local, group=group)
    merged: dict = {}
    for part in parts:
        merged.update(part or {})
    return merged


def _digests(directory: str, names: Iterable[str], rank: int, world: int, group) -> dict:
    """{name: [size, digest] or [None, error]} of ``names``, each rank hashing its share."""
    local = {}
    for i, name in enumerate(names):
        if i % world != rank:
            continue
        try:
            local[name] = list(file_digest(os.path.join(directory, name)))
        except OSError as err:
            local[name] = [None, err.strerror or str(err)]
    return _gather(local, group)


def _rank_world(group) -> Tuple[int, int]:
    import torch

    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def write_manifest(directory: str, group=None) -> None:
    """Records size and digest of every file of the checkpoint at ``directory``.

    Collective over ``group`` (the host group; None for one process): call it on every
    rank once all ranks have written their files. Rank 0 writes the manifest atomically.
    """
    rank, world = _rank_world(group)
    names = list_files(directory)
    digests = _digests(directory, names, rank, world, group)
    if rank != 0:
        return
    files = {}
    for name in names:
        size, digest = digests[name]
        if size is None:
            raise OSError(errno.EIO, f"cannot read {name} to checksum it: {digest}",
                          os.path.join(directory, name))
        files[name] = {"size": size, "xxh3": digest}
    manifest = {"format": FORMAT, "version": VERSION, "algorithm": "xxh3_64", "files": files}
    path = os.path.join(directory, MANIFEST)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def inside(name: str) -> bool:
    """Whether ``name`` is a path below a directory: relative, normal, no ``..``. Pure.

    What a manifest may name: a file of its checkpoint (an entry such as
    ``../../etc/passwd`` would have the check read, and name, a file elsewhere).
    """
    return (bool(name) and not os.path.isabs(name) and os.path.normpath(name) == name
            and name != os.pardir and not name.startswith(os.pardir + os.sep))


def read_manifest(directory: str) -> Optional[dict]:
    """The manifest's ``files`` table, or None when the checkpoint has no manifest.

    Raises:
        ValueError: the manifest exists but is not a valid one (the reason in words; an
            entry outside the checkpoint's directory named).
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"cannot be read ({type(err).__name__})")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError("is not an integrity manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"has version {manifest.get('version')!r}, this program reads {VERSION}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int)
            and isinstance(v.get("xxh3"), str) for v in files.values()):
        raise ValueError("has no valid file table")
    for name in sorted(files):
        if not inside(name):
            raise ValueError(f"lists {name!r}, a path outside the checkpoint's directory")
    return files


def compare(expected: dict, actual: dict) -> List[Tuple[str, str]]:
    """(file, what is wrong) for each file whose size or digest differs. Pure.

    ``expected``: the manifest's table {name: {"size", "xxh3"}}; ``actual``: {name: [size,
    digest]} or [None, error text] for a file that cannot be read (missing).
    """
    problems = []
    for name in sorted(expected):
        want = expected[name]
        size, digest = actual.get(name, [None, "missing"])
        if size is None:
            problems.append((name, digest if digest != "No such file or directory"
                             else "missing"))
        elif size != want["size"]:
            problems.append((name, f"{size} bytes, {want['size']} were written"))
        elif digest != want["xxh3"]:
            problems.append((name, "content differs from what was written (checksum "
                             "mismatch)"))
    return problems


def find_problems(directory: str, group=None) -> Tuple[Optional[bool], List[Tuple[str, str]]]:
    """(has a manifest, [(file, problem)]) of the checkpoint at ``directory``. Collective.

    The first element is None when the manifest itself is damaged (then the list names it).
    """
    rank, world = _rank_world(group)
    try:
        expected = read_manifest(directory)
    except ValueError as err:
        return None, [(MANIFEST, f"integrity manifest {err}")]
    if expected is None:
        if promises_manifest(directory):
            return False, [(MANIFEST, "missing, though its common state (common.pt) says it was "
                                      "saved with one, so none of its files can be verified")]
        return False, checkpoint_problems(directory)
    actual = _digests(directory, sorted(expected), rank, world, group)
    problems = compare(expected, actual)
    if not problems:
        problems = checkpoint_problems(directory)
    return True, problems


def promises_manifest(directory: str) -> bool:
    """Whether the checkpoint's common state says it was saved with a manifest.

    Read with weights_only (megatron-core's loader, torch's default); a common state that
    cannot be read promises nothing here (the load then refuses it in one line).
    """
    try:
        common = read_common_state(directory)
    except Exception:  # noqa: BLE001 - damaged or missing: the load names it
        return False
    return isinstance(common, dict) and common.get(COMMON_KEY) == MANIFEST


def iterations(root: str) -> List[int]:
    """The iterations of the ``iter_NNNNNNN`` folders under ``root``, newest first."""
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    found = [int(m.group(1)) for m in map(_ITER_DIR.match, entries)
             if m and os.path.isdir(os.path.join(root, m.group(0)))]
    return sorted(found, reverse=True)


def newest_good(root: str, below: Optional[int] = None) -> Optional[Tuple[str, bool]]:
    """The newest complete checkpoint under the --save root ``root`` that verifies.

    Complete: dist_checkpointing's ``metadata.json`` is there (a folder without it was
    never a checkpoint, or lost its files); verifies: :func:`find_problems` finds none.

    Args:
        root: the directory of the ``iter_NNNNNNN`` folders.
        below: only iterations below this one.

    Returns:
        (its path, whether it has a manifest), or None when there is none. Local to this
        process (used on the error path only).
    """
    for iteration in iterations(root):
        if below is not None and iteration >= below:
            continue
        path = os.path.join(root, f"iter_{iteration:07d}")
        if not os.path.isfile(os.path.join(path, "metadata.json")):
            continue
        has_manifest, problems = find_problems(path)
        if not problems:
            return path, bool(has_manifest)
    return None


def previous_good(directory: str) -> Optional[Tuple[str, bool]]:
    """The newest checkpoint older than ``directory`` beside it that verifies.

    Returns:
        (its path, whether it has a manifest), or None when there is none. Local to this
        process (used on the error path only).
    """
    match = _ITER_DIR.match(os.path.basename(os.path.abspath(directory)))
    return newest_good(os.path.dirname(os.path.abspath(directory)),
                       below=int(match.group(1)) if match else None)


def resume_advice(path: str, verified: bool, what: str = "previous good") -> str:
    """How to resume from the checkpoint ``path``: the command that points 'latest' at it."""
    iteration = int(_ITER_DIR.match(os.path.basename(path)).group(1))
    tracker = os.path.join(os.path.dirname(path), "latest_checkpointed_iteration.txt")
    return (f"the {what} checkpoint is {path}{'' if verified else ' (no manifest)'}: "
            f"resume from it with 'echo {iteration} > {tracker}'")


def _advice(directory: str) -> str:
    found = previous_good(directory)
    if found is None:
        return "no older checkpoint there verifies: start from scratch or restore a copy"
    return resume_advice(*found)


def verify(directory: str, group=None) -> bool:
    """Checks every file of the checkpoint at ``directory`` before anything is loaded.

    Collective over ``group`` (the host group; None for one process).

    Returns:
        True when verified against its manifest; False when it has none (loaded as before).

    Raises:
        UsageError: a file is damaged, missing or different; the line names it and the
            previous checkpoint that verifies.
    """
    has_manifest, problems = find_problems(directory, group)
    if problems:
        name, what = problems[0]
        more = f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
        rank, world = _rank_world(group)
        advice = _advice(directory) if rank == 0 else "see rank 0"
        if world > 1:
            # The others wait for rank 0's line: under torchrun, the first rank to exit
            # makes the agent stop the rest, possibly before rank 0 has printed.
            import torch

            torch.distributed.barrier(group=group)
        raise UsageError(f"--load {directory}: {os.path.join(directory, name)}: {what}{more}: "
                         f"the checkpoint is damaged; {advice}")
    if not has_manifest:
        log.info("checkpoint %s has no %s (an older or Megatron-LM checkpoint): loading it "
                 "without verifying its files", directory, MANIFEST)
    return bool(has_manifest)


# ----------------------------------------------------------------- safe deserialization

def _numpy_safe_globals() -> list:
    """The numpy types an RNG state (np.random.get_state()) pickles into."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _safe_torch_load(source, where: str, what: str):
    """torch.load of ``source`` (a path or a file object) with weights_only=True."""
    import torch

    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        text = " ".join(str(err).split())
        # torch names the refused global ("unsupported GLOBAL posix.system ..."); any other
        # unpickling failure is bytes that are no pickle at all.
        found = re.search(r"[^.]*GLOBAL[^.]*(\.[^. ][^.]*)*", text)
        if found is None:
            detail = re.search(r"WeightsUnpickler error: ([^.]*)", text)
            raise UsageError(f"{where}: the {what} cannot be read (not a torch pickle: "
                             f"{detail.group(1).strip() if detail else text[:120]}); the "
                             "checkpoint is damaged") from None
        raise UsageError(f"{where}: the {what} holds objects outside the allowed types, which "
                         f"could run code when loaded; refusing it ({found.group(0).strip()[:200]})"
                         ) from None
    except Exception as err:  # noqa: BLE001 - damaged bytes fail the unpickler anywhere
        # Random bytes reach the unpickler's internals (IndexError, KeyError, TypeError,
        # struct.error, ...) as often as its own errors; every one means the same thing.
        raise UsageError(f"{where}: the {what} cannot be read ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:160] if str(err) else 'truncated'}); "
                         "the checkpoint is damaged") from None


def safe_load(path: str, what: str):
    """torch.load with weights_only=True (tensors, containers, numpy RNG states only).

    Raises:
        UsageError: the file holds other objects (which could run code when unpickled),
            or it is truncated or not a torch file.
    """
    return _safe_torch_load(path, path, what)


@contextlib.contextmanager
def weights_only_sharded_objects(directory: str):
    """Within: dist_checkpointing loads ShardedObjects with weights_only=True.

    ShardedObjects (Megatron-LM's ``rng_state``, the distributed optimizer's per-bucket
    states, and since megatron-core 0.17 the common state itself) are pickled bytes inside
    the ``.distcp`` files, and torch.distributed.checkpoint's load planner unpickles them
    with ``weights_only=False``: a planted object would run code. Here the load planners
    megatron-core uses (its MCoreLoadPlanner, and torch's default one with which 0.17+
    reads the common state) read them as :func:`safe_load` reads a file; one that holds
    anything else is refused (a UsageError inside torch's CheckpointException: see
    :func:`usage_error_behind`).
    """
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        obj = _safe_torch_load(value, f"{directory} ({fqn})", "checkpointed object")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    saved = [(cls, cls.__dict__.get("load_bytes")) for cls in (MCoreLoadPlanner,
                                                                 DefaultLoadPlanner)]
    for cls, _ in saved:
        cls.load_bytes = load_bytes
    try:
        yield
    finally:
        for cls, previous in saved:
            if previous is not None:
                cls.load_bytes = previous
            else:
                del cls.load_bytes


def read_common_state(directory: str):
    """The checkpoint's common state, every pickled object read weights_only.

    From ``common.pt`` (megatron-core reads it with torch's default, weights_only) or,
    in a checkpoint of megatron-core 0.17+ without one, from the ``common_state`` object
    in its ``.distcp`` files (read through :func:`weights_only_sharded_objects`).
    """
    from megatron.core import dist_checkpointing

    with weights_only_sharded_objects(directory):
        return dist_checkpointing.load_common_state_dict(directory)
