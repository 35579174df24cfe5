"""The largest token id of a .bin, read within a bound (the data check at start)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.data import datasets


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_large_file_is_sampled_across_its_length(tmp_path, monkeypatch, where):
    # 1 MiB of uint16 tokens, a budget of 64 KiB in 64 windows of 512 ids: a part of the
    # corpus made by another tokenizer, 1/32 of it, at the start, in the middle or at the end
    # (a single window's worth at the ends, which are always read).
    tokens = np.zeros(1 << 19, dtype=np.uint16)
    run = {"first": 512, "middle": len(tokens) // 32, "last": 512}[where]
    at = {"first": 0, "middle": len(tokens) // 2, "last": len(tokens) - 512}[where]
    tokens[at:at + run] = 40000
    path = tmp_path / "c.bin"
    tokens.tofile(path)
    monkeypatch.setattr(datasets, "_MAX_SCAN_BYTES", 64 << 10)
    assert datasets.largest_token_id(str(path), np.dtype(np.uint16)) == 40000


def test_read_stays_within_the_bound(tmp_path, monkeypatch):
    tokens = np.zeros(1 << 19, dtype=np.uint16)
    # A single id between two windows (the 11th, at 83144, and the 12th, at 91458) is not read.
    tokens[87000] = 7
    path = tmp_path / "c.bin"
    tokens.tofile(path)
    monkeypatch.setattr(datasets, "_MAX_SCAN_BYTES", 64 << 10)
    assert datasets.largest_token_id(str(path), np.dtype(np.uint16)) == 0
    monkeypatch.setattr(datasets, "_MAX_SCAN_BYTES", 1 << 20)  # the whole file
    assert datasets.largest_token_id(str(path), np.dtype(np.uint16)) == 7
