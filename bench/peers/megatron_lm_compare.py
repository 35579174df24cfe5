"""Compares the tensors of two ``torch_dist`` checkpoint folders, bit for bit.

Used by ``bench/peers/megatron_lm_resume.sh`` to compare what this project and Megatron-LM saved
after the same iterations (model weights and the distributed optimizer's states, by their
sharded keys). Only tensors are read (torch DCP with the keys of the checkpoint's metadata,
on one process); the pickled objects in the files (common state, rng, ...) are not
unpickled.

Usage: ``python bench/peers/megatron_lm_compare.py DIR_A DIR_B`` (each an ``iter_NNNNNNN``
folder). Prints one line per key that differs and a summary line; exits 0 when every
tensor both hold is bitwise equal and they hold the same tensor keys, 1 otherwise.
"""
from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def read_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint folder, whole, on the CPU, by its key."""
    reader = dcp.FileSystemReader(folder)
    metadata = reader.read_metadata()
    tensors = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": meant so
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """Lines for the keys that differ (or that only one holds) and the count of equal ones."""
    lines = [f"only in the first: {key}" for key in sorted(a.keys() - b.keys())]
    lines += [f"only in the second: {key}" for key in sorted(b.keys() - a.keys())]
    equal = 0
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            lines.append(f"{key}: {tuple(x.shape)} {x.dtype} against {tuple(y.shape)} {y.dtype}")
        elif torch.equal(x, y):
            equal += 1
        else:
            delta = (x.double() - y.double()).abs()
            lines.append(f"{key}: {int((x != y).sum())} of {x.numel()} elements differ, "
                         f"max |difference| {delta.max().item():.3e}")
    return lines, equal


def main() -> None:
    """Compares the two folders of the command line."""
    if len(sys.argv) != 3:
        sys.exit("usage: python bench/peers/megatron_lm_compare.py DIR_A DIR_B")
    lines, equal = compare(read_tensors(sys.argv[1]), read_tensors(sys.argv[2]))
    for line in lines:
        print(f"  {line}")
    verdict = "bitwise equal" if not lines else f"{len(lines)} differ"
    print(f"{equal} tensors bitwise equal, {len(lines)} not: {verdict}")
    sys.exit(1 if lines else 0)


if __name__ == "__main__":
    main()
