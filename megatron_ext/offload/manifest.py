"""The offload engine's checkpoint manifests, verified beside the integrity check. Light.

The engine writes ``offload/.../manifest.json`` next to its ``.state`` files in a checkpoint
(one per rank); :func:`offload_problems` checks every such manifest and the files it names,
:func:`check_offload_manifest` is the pure check of one manifest's bytes. The checkpoint
integrity check asks for them through the offload mode
(:meth:`megatron_ext.offload.mode.OffloadMode.checkpoint_problems`), so the format is
known in this package only. No torch here: the checks run in tools too.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

MANIFEST_NAME = "manifest.json"
STATE_SUFFIX = ".state"


def check_offload_manifest(data: bytes) -> Optional[str]:
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
        if os.path.basename(entry["file"]) != entry["file"]:
            return f"subgroup entry {i} names a file outside its directory"
    return None


def _files(directory: str) -> List[str]:
    """Every file under ``directory`` (relative paths, sorted)."""
    found = []
    for dirpath, dirnames, files in os.walk(directory):
        dirnames.sort()
        for name in files:
            found.append(os.path.relpath(os.path.join(dirpath, name), directory))
    return sorted(found)


def offload_problems(directory: str) -> List[Tuple[str, str]]:
    """Problems of the offload engine's manifests under the checkpoint (its own format)."""
    problems = []
    for name in _files(directory):
        parts = name.split(os.sep)
        if len(parts) < 2 or parts[-1] != MANIFEST_NAME or "offload" not in parts[:-1]:
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as err:
            problems.append((name, err.strerror or str(err)))
            continue
        why = check_offload_manifest(data)
        if why is None:
            manifest = json.loads(data)
            listed = len(manifest["subgroups"])
            for entry in manifest["subgroups"]:
                if not os.path.isfile(os.path.join(os.path.dirname(path), entry["file"])):
                    why = f"lists {entry['file']}, which is missing"
                    break
            else:
                present = [f for f in os.listdir(os.path.dirname(path))
                           if f.endswith(STATE_SUFFIX)]
                if len(present) > listed:
                    why = f"lists {listed} subgroups, the directory holds {len(present)}"
        if why:
            problems.append((name, f"offload manifest: {why}"))
    return problems
