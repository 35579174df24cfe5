"""The offload engine's part of a checkpoint: state files and a manifest per rank.

A checkpoint's ``offload/rankNNNNN/`` directory holds one state file per subgroup (the
format of :mod:`.io`, checksummed) and ``manifest.json``: the schema below. This module is
the one place that knows that format: :func:`save` and :func:`open_rank` write and read it
for the engine, :func:`check_manifest` and :func:`manifest_problems` verify it for the
checkpoint's integrity check. Those two are light at import (no torch), for the tools.

Manifest (JSON object, version :data:`MANIFEST_VERSION`)::

    version         1
    rank            the data-parallel rank
    step            the Adam step of every state file
    fingerprint     the shard layout (sizes, param groups, subgroup size)
    subgroup_size   --offload-subgroup-size
    checksum        the files' payload checksum
    state_dtypes    [master, exp_avg, exp_avg_sq] dtype names
    param_remainders  whether the fp32 masters are stored as 16-bit remainders beside the
                    bf16 weights (absent in older manifests: whole)
    subgroups       [{"subgroup": i, "elements": n, "file": "sgNNNNN.state",
                      "how": "written" | "linked" | "copied"}, ...] in subgroup order
    ...             the caller's fields (the parallel layout it checks on load)
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

from megatron_ext.errors import UsageError

if TYPE_CHECKING:
    import torch

    from megatron_ext.offload.config import OffloadConfig
    from megatron_ext.offload.states import StateLayout
    from megatron_ext.offload.store import SubgroupStore

MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"


def rank_directory(directory: str, rank: int) -> str:
    """Rank ``rank``'s directory under a checkpoint's offload directory."""
    return os.path.join(directory, f"rank{rank:05d}")


def _write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------- the engine's save and load


def save(store: "SubgroupStore", directory: str, fields: dict, extra: dict) -> None:
    """Puts the store's state files under ``directory`` with a manifest.

    Subgroups held in memory (device tier, host cache) are written there directly; the
    others are hard-linked from their path (a tier file is never rewritten in place while
    linked: the io layer recycles only replaced files that nothing else links), or copied
    where a link is impossible (another file system).

    Args:
        store: the engine's store, with no I/O in flight.
        directory: the checkpoint's offload directory.
        fields: the engine's fields (:func:`engine_fields`).
        extra: the caller's fields (what it checks on load, e.g. the parallel layout).
    """
    # io imports torch: this module stays light for the integrity check's tools.
    from megatron_ext.offload.blockio import aligned_empty
    from megatron_ext.offload.state_format import secure_makedirs

    rank_dir = rank_directory(directory, store.rank)
    secure_makedirs(rank_dir)
    entries = []
    staging = None
    for index, sg in enumerate(store.subgroups):
        name = f"sg{index:05d}.state"
        target = os.path.join(rank_dir, name)
        if store.plan.on_device(index) or index in store.cache:
            if store.plan.on_device(index):
                buffer = store.device_state(index)
                if buffer.is_cuda:
                    if staging is None:
                        staging = aligned_empty(store.buffer_bytes, pin=True)
                    staging[:store.sizes[index]].copy_(buffer)
                    buffer = staging
            else:
                buffer = store.cache.get(index).buffer
            store.io.write(target, buffer[:store.sizes[index]], rank=store.rank,
                           subgroup=index, elements=sg.numel, step=store.version[index])
            how = "written"
        else:
            source = store.file(index, store.location[index])
            try:
                os.link(source, target)
                how = "linked"
            except OSError:
                shutil.copyfile(source, target)
                with open(target, "rb") as f:
                    os.fsync(f.fileno())
                how = "copied"
        entries.append({"subgroup": index, "elements": sg.numel, "file": name, "how": how})
    manifest = {"version": MANIFEST_VERSION, "rank": store.rank, **fields,
                "subgroups": entries, **extra}
    _write_json_atomic(os.path.join(rank_dir, MANIFEST_NAME), manifest)


def engine_fields(step: int, fingerprint: str, cfg: "OffloadConfig",
                  layout: "StateLayout") -> dict:
    """The manifest's fields that describe the engine's states (checked on load)."""
    return {"step": step, "fingerprint": fingerprint,
            "subgroup_size": cfg.offload_subgroup_size, "checksum": cfg.offload_checksum,
            "state_dtypes": layout.names, "param_remainders": layout.remainders}


def saved_layout(manifest: dict, layout: "StateLayout") -> "StateLayout":
    """The layout of a manifest's files: ``layout`` with the masters stored its way.

    :func:`open_rank` has checked the dtypes; older manifests store whole masters.
    """
    return layout.with_remainders(bool(manifest.get("param_remainders", False)))


def open_rank(directory: str, rank: int, expect: dict, *, fingerprint: str,
              layout: "StateLayout", cfg: "OffloadConfig"
              ) -> Tuple[dict, Callable[..., None]]:
    """Checks rank ``rank``'s manifest against this run; (manifest, a reader of its files).

    The reader, ``read(store, index, buffer, saved=None)``, fills a host buffer with
    subgroup ``index``'s saved state and checks that it is of the manifest's step;
    ``saved``: the files' layout when it is not the store's (:func:`saved_layout`: the
    masters stored the other way, which the caller converts).

    Raises:
        UsageError: no manifest for this rank, or one saved with other settings (the
            caller's ``expect``, the shard layout, the state dtypes).
    """
    from megatron_ext.offload.io import StateFileIO
    from megatron_ext.offload.state_format import RESTART_HINT, OffloadStateError

    rank_dir = rank_directory(directory, rank)
    manifest_path = os.path.join(rank_dir, MANIFEST_NAME)
    if not os.path.isfile(manifest_path):
        raise UsageError(f"checkpoint has no offloaded optimizer state for rank {rank} "
                         f"({manifest_path} missing): it was saved with another world size "
                         "or without --offload-optimizer; use --no-load-optim to start the "
                         "optimizer fresh")
    with open(manifest_path, "rb") as f:
        data = f.read()
    why = check_manifest(data)
    if why is not None:  # the integrity check says so first; a caller may not have run it
        raise UsageError(f"{manifest_path}: offload manifest: {why}: the checkpoint is "
                         "damaged; resume from an earlier one, or use --no-load-optim")
    manifest = json.loads(data)
    for key, value in expect.items():
        if manifest.get(key) != value:
            raise UsageError(
                f"{manifest_path}: saved with {key}={manifest.get(key)}, this run has "
                f"{value}: resume with the same parallel layout, or --no-load-optim")
    if manifest.get("fingerprint") != fingerprint:
        raise UsageError(
            f"{manifest_path}: the optimizer shard layout differs (model, parallel layout or "
            "--offload-subgroup-size changed): resume with the same settings, or "
            "--no-load-optim")
    saved_dtypes = manifest.get("state_dtypes", ["fp32", "fp32", "fp32"])
    if saved_dtypes != layout.names:
        raise UsageError(
            f"{manifest_path}: optimizer states saved as {'/'.join(saved_dtypes)} "
            f"(master/exp_avg/exp_avg_sq), this run stores {'/'.join(layout.names)}: "
            "resume with the same --main-params-dtype/--exp-avg-dtype/--exp-avg-sq-dtype, "
            "or --no-load-optim")
    reader = StateFileIO(threads=cfg.offload_io_threads, direct_io=cfg.offload_direct_io,
                         checksum=manifest.get("checksum", cfg.offload_checksum))

    def read(store: "SubgroupStore", index: int, buffer: "torch.Tensor",
             saved: Optional["StateLayout"] = None) -> None:
        name = os.path.join(rank_dir, manifest["subgroups"][index]["file"])
        numel = store.subgroups[index].numel
        size = store.sizes[index] if saved is None else saved.nbytes(numel)
        try:
            step = reader.read(name, buffer[:size], rank=rank, subgroup=index, elements=numel)
        except OffloadStateError as err:
            # The io layer's advice is to resume from a checkpoint: this is one.
            raise OffloadStateError(f"{str(err).split(': ' + RESTART_HINT)[0]}: the "
                                    "checkpoint is damaged; resume from an earlier one, or "
                                    "use --no-load-optim to start the optimizer fresh"
                                    ) from None
        if step != manifest["step"]:
            raise OffloadStateError(f"{name}: state of step {step}, the manifest says "
                                    f"{manifest['step']}: the checkpoint is inconsistent")
    return manifest, read


# ---------------------------------------------------------------- verification


def check_manifest(data: bytes) -> Optional[str]:
    """What is wrong with an offload engine manifest's bytes (None when well-formed). Pure."""
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return "not valid JSON"
    if not isinstance(manifest, dict):
        return "not a JSON object"
    for key, kind in (("step", int), ("rank", int), ("subgroups", list)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            return f"'{key}' missing or not a{'n integer' if kind is int else ' list'}"
    for i, entry in enumerate(manifest["subgroups"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) \
                or entry.get("subgroup") != i or not isinstance(entry.get("elements"), int):
            return f"subgroup entry {i} is malformed"
        if os.path.basename(entry["file"]) != entry["file"] or entry["file"] in ("", ".", ".."):
            return f"subgroup entry {i} names {entry['file']!r}, a file outside its directory"
    return None


def manifest_paths(directory: str) -> List[str]:
    """The offload manifests under a checkpoint (relative paths, sorted)."""
    found = []
    for dirpath, dirnames, files in os.walk(directory):
        dirnames.sort()
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), directory)
            parts = rel.split(os.sep)
            if len(parts) >= 2 and parts[-1] == MANIFEST_NAME and "offload" in parts[:-1]:
                found.append(rel)
    return sorted(found)


def manifest_problems(directory: str) -> List[Tuple[str, str]]:
    """[(file, problem)] of the offload manifests under the checkpoint at ``directory``.

    Each manifest must be well-formed (:func:`check_manifest`), every file it lists must
    exist, and its directory must hold no more state files than it lists.
    """
    problems = []
    for name in manifest_paths(directory):
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as err:
            problems.append((name, err.strerror or str(err)))
            continue
        why = check_manifest(data)
        if why is None:
            manifest = json.loads(data)
            listed = len(manifest["subgroups"])
            for entry in manifest["subgroups"]:
                if not os.path.isfile(os.path.join(os.path.dirname(path), entry["file"])):
                    why = f"lists {entry['file']}, which is missing"
                    break
            else:
                present = [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".state")]
                if len(present) > listed:
                    why = f"lists {listed} subgroups, the directory holds {len(present)}"
        if why:
            problems.append((name, f"offload manifest: {why}"))
    return problems
