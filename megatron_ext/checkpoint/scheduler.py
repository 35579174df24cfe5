"""The learning-rate scheduler's state in a checkpoint: Megatron-LM's rule for loading it.

megatron-core's OptimizerParamScheduler counts samples; format 1 (this project's earlier
checkpoints) counted iterations. A schedule that differs from the flags' is refused unless
``--override-opt_param-scheduler`` or ``--use-checkpoint-opt_param-scheduler`` says which wins.
"""

from __future__ import annotations

from megatron_ext.checkpoint.checkpoint_args import shown
from megatron_ext.errors import UsageError

# The schedule values megatron-core's OptimizerParamScheduler checks at load, with the
# flags that set them.
# Lengths are in samples (iterations x global batch with the iteration flags).
_SCHEDULE = (("max_lr", "--lr"), ("min_lr", "--min-lr"),
             ("lr_warmup_steps", "--lr-warmup-iters/samples/fraction, in samples"),
             ("lr_decay_steps", "--lr-decay-iters/samples or the training length, in samples"),
             ("lr_decay_style", "--lr-decay-style"), ("start_wd", "--weight-decay"),
             ("end_wd", "--weight-decay"),
             ("wd_incr_steps", "--train-iters/--train-samples, in samples"),
             ("wd_incr_style", "weight-decay style"))


def schedule_differences(saved: dict, scheduler) -> list:
    """'name: checkpoint X, flags Y' for each schedule value that differs. Pure."""
    out = []
    for key, flag in _SCHEDULE:
        if key in saved and saved[key] != getattr(scheduler, key, saved[key]):
            out.append(f"{key} ({flag}) {shown(saved[key])} in the checkpoint, "
                       f"{shown(getattr(scheduler, key))} from the flags")
    return out


def scheduler_in_samples(saved: dict, global_batch_size: int) -> dict:
    """A format-1 scheduler state (counted in iterations) counted in samples. Pure.

    Format 1 stepped the scheduler once per iteration of a constant global batch; its
    step counts and lengths times that batch are what Megatron-LM's scheduler counts.
    """
    out = dict(saved)
    for key in ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps"):
        if key in out:
            out[key] = out[key] * global_batch_size
    return out


def load_scheduler(scheduler, saved: dict, ck, path: str) -> None:
    """Loads the schedule by Megatron-LM's rule.

    The flags' schedule with --override-opt_param-scheduler, the checkpoint's with
    --use-checkpoint-opt_param-scheduler, else they must agree.
    """
    diff = schedule_differences(saved, scheduler)
    if diff and not (ck.override_opt_param_scheduler or ck.use_checkpoint_opt_param_scheduler):
        raise UsageError(f"--load {path}: the learning-rate schedule differs from the "
                         f"checkpoint's: {'; '.join(diff)}; add --override-opt_param-scheduler "
                         "(use the flags) or --use-checkpoint-opt_param-scheduler (keep the "
                         "checkpoint's)")
    scheduler.override_opt_param_scheduler = ck.override_opt_param_scheduler
    scheduler.use_checkpoint_opt_param_scheduler = not ck.override_opt_param_scheduler
    scheduler.load_state_dict(saved)
