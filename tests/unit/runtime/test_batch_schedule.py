"""Sample-based training: Megatron-LM's schedule lengths, iterations and batch ramp."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.checkpoint.scheduler import scheduler_in_samples
from megatron_ext.config import parse_config
from megatron_ext.errors import UsageError
from megatron_ext.runtime.batch_schedule import (
    scheduler_kwargs,
    train_iters_from_samples,
    train_samples_total,
)
from mext_testing import ramp_batches

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--lr", "1e-2", "--min-lr", "1e-4", "--mock-data", "--vocab-size", "100"]


def _cfg(*flags, world=1):
    cfg = parse_config([*BASE, *flags])
    cfg.check_world(world)
    return cfg


def _lrs(kwargs: dict, increments: list) -> list:
    """lr after each step of megatron-core's scheduler built with ``kwargs``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Holder:
        param_groups = [{"lr": 0.0}]

    holder = Holder()
    scheduler = OptimizerParamScheduler(holder, **kwargs)
    out = []
    for inc in increments:
        scheduler.step(increment=inc)
        out.append(holder.param_groups[0]["lr"])
    return out


def _megatron(gbs=None, **values):
    """Megatron-LM's scheduler arguments, written out by hand for each case."""
    out = {"init_lr": 0.0, "max_lr": 1e-2, "min_lr": 1e-4, "start_wd": 0.01, "end_wd": 0.01,
           "wd_incr_style": "constant", "lr_decay_style": "linear", "wsd_decay_steps": None,
           "lr_wsd_decay_style": None}
    out.update(values)
    return out


# (flags, Megatron-LM's scheduler values for them). GBS 8 in every case.
CASES = [
    (["--train-iters", "20", "--lr-warmup-iters", "3"],
     _megatron(lr_warmup_steps=24, lr_decay_steps=160, wd_incr_steps=160)),
    (["--train-iters", "20", "--lr-warmup-iters", "3", "--lr-decay-iters", "15",
      "--lr-decay-style", "cosine"],
     _megatron(lr_warmup_steps=24, lr_decay_steps=120, wd_incr_steps=160,
               lr_decay_style="cosine")),
    (["--train-iters", "20", "--lr-warmup-fraction", "0.25", "--lr-decay-iters", "16"],
     _megatron(lr_warmup_steps=32.0, lr_decay_steps=128, wd_incr_steps=160)),
    (["--train-iters", "20", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5",
      "--lr-warmup-iters", "2", "--lr-warmup-init", "1e-3"],
     _megatron(lr_warmup_steps=16, lr_decay_steps=160, wd_incr_steps=160, init_lr=1e-3,
               lr_decay_style="WSD", wsd_decay_steps=40, lr_wsd_decay_style="exponential")),
    (["--train-samples", "160", "--lr-warmup-samples", "20", "--lr-decay-samples", "140",
      "--lr-decay-style", "cosine"],
     _megatron(lr_warmup_steps=20, lr_decay_steps=140, wd_incr_steps=160,
               lr_decay_style="cosine")),
    (["--train-samples", "160", "--lr-warmup-fraction", "0.1"],
     _megatron(lr_warmup_steps=16.0, lr_decay_steps=160, wd_incr_steps=160)),
    (["--train-samples", "160", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "50",
      "--lr-wsd-decay-style", "minus_sqrt", "--lr-warmup-samples", "10"],
     _megatron(lr_warmup_steps=10, lr_decay_steps=160, wd_incr_steps=160,
               lr_decay_style="WSD", wsd_decay_steps=50, lr_wsd_decay_style="minus_sqrt")),
]


@pytest.mark.parametrize("flags,want", CASES, ids=[" ".join(c[0][2:]) for c in CASES])
def test_scheduler_lengths_are_megatron_lms_samples(flags, want):
    kwargs = scheduler_kwargs(_cfg(*flags, "--global-batch-size", "8"))
    assert kwargs == want
    # The same lr at every step, stepped by the global batch, as Megatron-LM's loop does.
    assert _lrs(kwargs, [8] * 20) == _lrs(want, [8] * 20)


def test_iteration_and_sample_flags_give_the_same_lrs():
    by_iters = scheduler_kwargs(_cfg("--train-iters", "20", "--lr-warmup-iters", "3",
                                     "--lr-decay-iters", "18", "--global-batch-size", "8"))
    by_samples = scheduler_kwargs(_cfg("--train-samples", "160", "--lr-warmup-samples", "24",
                                       "--lr-decay-samples", "144", "--global-batch-size", "8"))
    assert by_iters == by_samples


@pytest.mark.parametrize("rampup,train_samples,gbs", [
    ([2, 2, 12], 40, 8), ([4, 4, 100], 300, 16), ([2, 2, 1], 30, 6), ([8, 8, 1000], 200, 64),
    ([2, 6, 7], 50, 8),
])
def test_train_iters_follow_megatron_lms_ramp(rampup, train_samples, gbs):
    want = ramp_batches(train_samples, *rampup, gbs)
    assert train_iters_from_samples(train_samples, gbs, rampup) == len(want)
    cfg = _cfg("--train-samples", str(train_samples), "--global-batch-size", str(gbs),
               "--rampup-batch-size", *map(str, rampup))
    assert cfg.training.train_iters == len(want)
    assert train_samples_total(cfg.training) == max(sum(want), train_samples)


def test_the_ramp_sets_each_iterations_micro_batches():
    from megatron_ext.runtime.batch_schedule import BatchRamp

    cfg = _cfg("--train-samples", "120", "--global-batch-size", "16", "--rampup-batch-size",
               "4", "4", "40", "--micro-batch-size", "2", world=2)
    ramp, consumed, seen = BatchRamp(cfg.training, rank=0, dp=2), 0, []
    try:
        for _ in range(cfg.training.train_iters):
            micro = ramp.update(consumed)
            assert micro * 2 * 2 == ramp.global_batch_size
            seen.append(ramp.global_batch_size)
            consumed += ramp.global_batch_size
    finally:
        ramp.close()
    assert seen == ramp_batches(120, 4, 4, 40, 16)


def test_train_samples_without_ramp():
    cfg = _cfg("--train-samples", "100", "--global-batch-size", "8")
    assert cfg.training.train_iters == 12
    assert train_samples_total(cfg.training) == 100


@pytest.mark.parametrize("flags,message", [
    (["--train-iters", "5", "--train-samples", "40"], "give one of them"),
    (["--train-iters", "5", "--lr-warmup-samples", "4"],
     "--lr-warmup-samples does not go with --train-iters"),
    (["--train-iters", "5", "--lr-decay-samples", "4"],
     "--lr-decay-samples does not go with --train-iters"),
    (["--train-samples", "40", "--lr-warmup-iters", "1"],
     "--lr-warmup-iters does not go with --train-samples"),
    (["--train-samples", "40", "--lr-decay-iters", "4"],
     "--lr-decay-iters does not go with --train-samples"),
    (["--train-samples", "40", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"],
     "--lr-wsd-decay-iters does not go with --train-samples"),
    (["--train-iters", "5", "--rampup-batch-size", "2", "2", "10"],
     "--rampup-batch-size needs sample-based training"),
    (["--train-iters", "5", "--lr-warmup-iters", "1", "--lr-warmup-fraction", "0.1"],
     "--lr-warmup-fraction and --lr-warmup-iters"),
    (["--train-samples", "40", "--lr-warmup-samples", "1", "--lr-warmup-fraction", "0.1"],
     "--lr-warmup-fraction and --lr-warmup-samples"),
    (["--train-iters", "5", "--lr-decay-style", "WSD"], "give --lr-wsd-decay-iters"),
    (["--train-samples", "40", "--lr-decay-style", "WSD"], "give --lr-wsd-decay-samples"),
])
def test_mixing_units_is_refused_in_one_line(flags, message):
    with pytest.raises(UsageError, match=message) as err:
        parse_config([*BASE, *flags])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("rampup,gbs,world,message", [
    (["3", "1", "10"], "8", 1, "multiples of --micro-batch-size"),
    (["2", "4", "10"], "8", 1, "START plus a whole number of INCR"),
    (["2", "2", "10"], "8", 2, "multiples of --micro-batch-size x data-parallel size = 4"),
    (["8", "2", "10"], "8", 1, "nothing to ramp"),
    (["16", "2", "10"], "8", 1, "START plus a whole number"),
    (["2", "2", "0"], "8", 1, "must be positive"),
])
def test_a_ramp_that_does_not_fit_is_refused(rampup, gbs, world, message):
    with pytest.raises(UsageError, match=message) as err:
        _cfg("--train-samples", "100", "--global-batch-size", gbs, "--rampup-batch-size",
             *rampup, world=world)
    assert "\n" not in str(err.value)


def test_format_1_scheduler_state_is_converted_to_samples():
    cfg = _cfg("--train-iters", "20", "--lr-warmup-iters", "3", "--global-batch-size", "8")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Holder:
        param_groups = [{"lr": 0.0}]

    # What format 1 saved after 7 iterations: lengths and steps in iterations.
    legacy = {"max_lr": 1e-2, "lr_warmup_steps": 3, "num_steps": 7, "lr_decay_style": "linear",
              "lr_decay_steps": 20, "min_lr": 1e-4, "start_wd": 0.01, "end_wd": 0.01,
              "wd_incr_style": "constant", "wd_incr_steps": 20}
    holder = Holder()
    scheduler = OptimizerParamScheduler(holder, **scheduler_kwargs(cfg))
    scheduler.load_state_dict(scheduler_in_samples(legacy, 8))  # asserts the lengths agree
    assert scheduler.num_steps == 56
    expected = Holder()
    fresh = OptimizerParamScheduler(expected, **scheduler_kwargs(cfg))
    fresh.step(increment=56)
    assert holder.param_groups[0]["lr"] == expected.param_groups[0]["lr"]
    assert torch.isfinite(torch.tensor(holder.param_groups[0]["lr"]))
