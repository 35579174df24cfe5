"""The plan's size of one checkpoint against what a run saves, for each optimizer mode."""

from __future__ import annotations

import os

import pytest

from mext_testing import TINY, read_metrics, run_pretrain

# 3.4M parameters: the files' fixed part (metadata, RNG states, scheduler) is under 3%.
WIDER = [*TINY, "--num-layers", "4", "--hidden-size", "256", "--vocab-size", "1000",
         "--train-iters", "1", "--bf16"]


@pytest.mark.parametrize("mode", [
    [], ["--use-distributed-optimizer", "--offload-optimizer"],
    ["--use-distributed-optimizer", "--zenflow"]], ids=["plain", "offload", "zenflow"])
def test_planned_checkpoint_size_is_what_is_saved(tmp_path, mode):
    metrics = tmp_path / "m.jsonl"
    run_pretrain([*WIDER, *mode, "--save", str(tmp_path / "ckpt"), "--metrics-path",
                  str(metrics)])
    planned = next(r["memory/plan_checkpoint_bytes"] for r in read_metrics(metrics)
                   if "memory/plan_checkpoint_bytes" in r)
    saved = sum(os.path.getsize(os.path.join(root, name))
                for root, _, names in os.walk(tmp_path / "ckpt" / "iter_0000001")
                for name in names)
    assert 0.9 * saved <= planned <= 1.05 * saved, (planned, saved)
