"""Batches and learning-rate steps counted in samples, as Megatron-LM counts them.

Megatron-LM's OptimizerParamScheduler counts samples whatever the training length is given
in: with --train-iters its warm-up, decay and weight-decay lengths are iterations x global
batch, and each iteration steps it by the samples it consumed. :func:`scheduler_kwargs`
gives those lengths (pure); :class:`BatchRamp` follows --rampup-batch-size by
Megatron-LM's rule (:func:`ramp_batch_size`); :func:`train_iters_from_samples` is Megatron-LM's
``update_train_iters``.
"""

from __future__ import annotations

from typing import List, Optional

from megatron_ext.errors import UsageError


def check_rampup(rampup: List[int], global_batch_size: int, per_step: int,
                 interleaved_pp: Optional[int] = None) -> None:
    """Refuses a ramp whose batch sizes the run cannot take.

    Every batch size of the ramp (START + k x INCR up to --global-batch-size) must be a
    whole number of micro-batches of every DP rank (megatron-core's consistency check),
    and with the interleaved schedule a multiple of the pipeline size in micro-batches.

    Args:
        rampup: START, INCR, SAMPLES of --rampup-batch-size.
        global_batch_size: the batch size the ramp ends at.
        per_step: micro batch x data-parallel size.
        interleaved_pp: the pipeline size with the interleaved schedule, else None.

    Raises:
        UsageError: the ramp does not fit.
    """
    start, incr, _ = rampup
    flag = f"--rampup-batch-size {' '.join(map(str, rampup))}"
    if start == global_batch_size:
        raise UsageError(f"{flag}: START is --global-batch-size already, so there is nothing to "
                         "ramp; drop --rampup-batch-size")
    if start > global_batch_size or (global_batch_size - start) % incr:
        raise UsageError(f"{flag}: --global-batch-size {global_batch_size} must be START plus "
                         "a whole number of INCR (as Megatron-LM)")
    if start % per_step or incr % per_step:
        raise UsageError(f"{flag}: START and INCR must be multiples of --micro-batch-size x "
                         f"data-parallel size = {per_step}, so that every batch of the ramp is "
                         "whole micro-batches on every rank")
    if interleaved_pp and (start // per_step % interleaved_pp or incr // per_step % interleaved_pp):
        raise UsageError(f"{flag}: the interleaved schedule needs every batch of the ramp to be a "
                         f"multiple of --pipeline-model-parallel-size {interleaved_pp} "
                         f"micro-batches ({interleaved_pp * per_step} samples)")


def ramp_batch_size(consumed: int, rampup: List[int], global_batch_size: int) -> int:
    """The global batch after ``consumed`` samples under --rampup-batch-size. Pure.

    Megatron-LM's rule (megatron-core 0.16's ramp calculator; 0.19 dropped the ramp and
    ignores the flag, so it is kept here, the same on every megatron-core): the
    (global - START) / INCR increments are spread evenly over the first SAMPLES samples,
    one INCR per SAMPLES / increments samples; past SAMPLES the full global batch.
    """
    start, incr, samples = rampup
    if consumed > samples:
        return global_batch_size
    per_increment = samples / ((global_batch_size - start) // incr)
    return start + int(consumed / per_increment) * incr


def train_iters_from_samples(train_samples: int, global_batch_size: int,
                             rampup: Optional[List[int]] = None) -> int:
    """The iterations of a --train-samples run (Megatron-LM's ``update_train_iters``).

    Without a ramp, the whole global batches in the samples. With one, the ramp's
    iterations while the consumed samples are within both the ramp and the training
    samples, then the whole global batches left; a partial last batch is dropped.
    """
    if rampup is None:
        return train_samples // global_batch_size
    iterations = consumed = 0
    while consumed <= rampup[2] and consumed <= train_samples:
        consumed += ramp_batch_size(consumed, rampup, global_batch_size)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch_size
    return iterations


def train_samples_total(train) -> int:
    """Samples the training iterations consume (the size of the training split to build)."""
    if train.train_iters is None:
        return 0
    if train.rampup_batch_size is None:
        return max(train.train_iters * train.global_batch_size, train.train_samples or 0)
    consumed = 0
    for _ in range(train.train_iters):
        consumed += ramp_batch_size(consumed, train.rampup_batch_size, train.global_batch_size)
    return max(consumed, train.train_samples or 0)


def scheduler_kwargs(cfg) -> dict:
    """OptimizerParamScheduler's lengths, in samples, as Megatron-LM sets them. Pure.

    Iteration-based (--train-iters): warm-up, decay, WSD annealing and weight-decay
    lengths are the iteration flags x --global-batch-size; sample-based (--train-samples):
    the sample flags as they are. --lr-warmup-fraction: that fraction of the decay length.
    """
    opt, train = cfg.optimizer, cfg.training
    gbs = train.global_batch_size
    if train.train_samples is None:
        iters = train.train_iters or 0
        decay = (opt.lr_decay_iters or iters) * gbs
        wd_incr = iters * gbs
        wsd = opt.lr_wsd_decay_iters * gbs if opt.lr_wsd_decay_iters is not None else None
        warmup = opt.lr_warmup_iters * gbs
    else:
        decay = opt.lr_decay_samples or train.train_samples
        wd_incr = train.train_samples
        wsd = opt.lr_wsd_decay_samples
        warmup = opt.lr_warmup_samples
    if opt.lr_warmup_fraction is not None:
        warmup = opt.lr_warmup_fraction * decay
    return {
        "init_lr": opt.lr_warmup_init,
        "max_lr": opt.lr,
        "min_lr": opt.min_lr,
        "lr_warmup_steps": warmup,
        # megatron-core asserts warm-up < decay; a run that ends inside its warm-up (or a
        # --train-iters 0 one) gets a decay just past it, which it never reaches.
        "lr_decay_steps": max(decay, warmup + 1),
        "lr_decay_style": opt.lr_decay_style,
        "start_wd": opt.weight_decay,
        "end_wd": opt.weight_decay,
        "wd_incr_steps": wd_incr,
        "wd_incr_style": "constant",
        "wsd_decay_steps": wsd if opt.lr_decay_style == "WSD" else None,
        "lr_wsd_decay_style": opt.lr_wsd_decay_style if opt.lr_decay_style == "WSD" else None,
    }


class BatchRamp:
    """The global batch and micro-batches of each iteration.

    Constant, or the --rampup-batch-size ramp (:func:`ramp_batch_size`), updated from the
    consumed samples before each iteration. The batch is checked as megatron-core's
    calculator checks it: whole micro-batches on every DP rank.
    """

    def __init__(self, train, rank: int, dp: int):
        self._rampup = train.rampup_batch_size
        self._final = train.global_batch_size
        self._per_step = train.micro_batch_size * dp
        self._batch = self._final

    def update(self, consumed_samples: int) -> int:
        """Sets the batch of the iteration after ``consumed_samples``; its micro-batches."""
        if self._rampup is not None:
            self._batch = ramp_batch_size(consumed_samples, self._rampup, self._final)
        if self._batch % self._per_step:
            # check_rampup refuses such a ramp before the run; this is megatron-core's check.
            raise RuntimeError(f"global batch {self._batch} is not a whole number of micro "
                               f"batches x data-parallel size ({self._per_step})")
        return self._batch // self._per_step

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per DP rank of the current iteration."""
        return self._batch // self._per_step

    @property
    def global_batch_size(self) -> int:
        """Samples of the current iteration over all DP ranks."""
        return self._batch

    def close(self) -> None:
        """Nothing to release (kept for the loop's tidy-up)."""
