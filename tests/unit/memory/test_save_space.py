"""One checkpoint's size in the plan, and the --save disk checked against it at start."""

from __future__ import annotations

import collections
import types

import pytest

from megatron_ext.config import parse_config
from megatron_ext.errors import UsageError
from megatron_ext.memory import machine as machine_mod
from megatron_ext.memory.machine import GB, target_machine
from megatron_ext.memory.plan import make_plan
from megatron_ext.memory.shape import model_shape
from megatron_ext.memory.startup import plan_before_start

# A 1.28B-parameter bf16 GPT (its checkpoint 17.9 GB).
FLAGS = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
         "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--lr", "1e-4", "--train-iters", "10", "--mock-data",
         "--vocab-size", "32000", "--bf16", "--use-distributed-optimizer"]
CPU = types.SimpleNamespace(is_cpu=True, world_size=1, device=None)
Usage = collections.namedtuple("Usage", "total used free")


def _cfg(*more):
    cfg = parse_config([*FLAGS, *more])
    cfg.check_world(1)
    return cfg


@pytest.mark.parametrize("mode, per_parameter", [
    ([], 2 + 4 + 8),  # bf16 weights, fp32 masters, two fp32 moments
    (["--offload-optimizer"], 2 + 10),  # the state files: remainders and moments
    (["--zenflow"], 2 + 12 + 8 * 0.9),  # fp32 states and the delayed columns' two windows
])
def test_checkpoint_size_is_weights_and_the_modes_states(tmp_path, mode, per_parameter):
    cfg = _cfg(*mode, "--save", str(tmp_path))
    shape = model_shape(cfg, 32001, 1)
    plan = make_plan(cfg, shape, target_machine(1000, 1000, [], None))
    assert plan.checkpoint_weights_bytes == shape.total_params * 2
    assert plan.checkpoint_bytes == pytest.approx(shape.total_params * per_parameter, rel=1e-6)
    assert not plan.refusals  # the target machine has no --save disk to check


def test_no_save_no_checkpoint():
    plan = make_plan(_cfg(), model_shape(_cfg(), 32001, 1), target_machine(1000, 1000, [], None))
    assert plan.checkpoint_bytes == 0 and not plan.refusals


def test_save_disk_too_small_for_one_checkpoint_is_refused_at_start(tmp_path, monkeypatch):
    asked = []

    def disk_usage(path):
        asked.append(path)
        return Usage(100 * GB, 95 * GB, 5 * GB)

    monkeypatch.setattr(machine_mod.shutil, "disk_usage", disk_usage)
    monkeypatch.setenv("MEGATRON_EXT_MEMAVAILABLE_GB", "1000")  # the host is not the question
    save = tmp_path / "runs" / "ckpt"  # not made yet: its nearest existing parent is asked
    cfg = _cfg("--save", str(save))
    with pytest.raises(UsageError) as err:
        plan_before_start(cfg, CPU, 32001)
    assert asked == [str(tmp_path)]
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"memory plan: --save {save}: one checkpoint takes 17.9 GB (weights 2.55, ")
    assert line.endswith(f"optimizer states 15.3) and {tmp_path} has 5 GB free: free "
                         "space there, or give --save a directory on a larger disk")


def test_save_disk_that_holds_a_checkpoint_is_not_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(machine_mod.shutil, "disk_usage",
                        lambda path: Usage(100 * GB, 50 * GB, 50 * GB))
    monkeypatch.setenv("MEGATRON_EXT_MEMAVAILABLE_GB", "1000")
    plan = plan_before_start(_cfg("--save", str(tmp_path)), CPU, 32001)
    assert not plan.refusals
    assert plan.machine.save_dir == str(tmp_path) and plan.machine.save_free_bytes == 50 * GB


def test_the_knob_stands_in_for_the_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_EXT_SAVE_FREE_GB", "7")
    m = machine_mod.measure(_cfg("--save", str(tmp_path)), CPU, environ={})
    assert m.save_free_bytes == 7 * GB
