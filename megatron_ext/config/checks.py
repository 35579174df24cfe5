"""Checks of single config fields that several sections share."""

from __future__ import annotations

import os
from typing import Optional

from megatron_ext.errors import UsageError


def required(*pairs) -> None:
    """Megatron-LM has no default for these flags either: a run must give them."""
    for flag, value in pairs:
        if value is None:
            raise UsageError(f"{flag} is required (Megatron-LM has no default for it either)")


def positive(section: object, *names: str) -> None:
    """Refuses a value <= 0 of any of the named fields (None is allowed: not given)."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")


def output_path(flag: str, path: Optional[str], directory: bool = True) -> None:
    """Refuses now an output path that the run could not create or write when it gets there.

    A --save that is a file would otherwise fail at the first save, after the training.
    """
    if path is None:
        return
    kind = "directory" if directory else "file"
    if os.path.exists(path):
        if os.path.isdir(path) != directory:
            what = "a directory" if directory else "a file path"
            raise UsageError(f"{flag} {path}: is a {'file' if directory else 'directory'}; "
                             f"give {what}")
        writable = path if directory else os.path.dirname(os.path.abspath(path))
    else:
        writable = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(writable):
            writable = os.path.dirname(writable)
        if not os.path.isdir(writable):
            raise UsageError(f"{flag} {path}: {writable} is a file, so the {kind} cannot be "
                             "created there; give another path")
    if not os.access(writable, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {writable} is not writable by this user")
