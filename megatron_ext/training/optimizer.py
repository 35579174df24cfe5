"""The optimizer seam: the one place where training modes differ.

:func:`build_optimizer` returns a megatron-core ``MegatronOptimizer``, built by the run's
optimizer mode (:func:`megatron_ext.optim.modes.mode_of`): megatron-core's
DistributedOptimizer (or its non-distributed mixed-precision optimizer), megatron-core's own
host offload (``--optimizer-cpu-offload``, GPU only), or a registered mode's optimizer (the
offload engine's, ZenFlow's: DistributedOptimizer subclasses bound into megatron-core's
factory). Neither this module nor the loop names a mode.
"""

from __future__ import annotations

from megatron_ext.optim.modes import mode_of


def build_optimizer(cfg, model_chunks, runtime, plan=None):
    """Returns the optimizer of the run for this rank's model chunks.

    ``plan``: the run's memory plan, made before the model (the mode may size from it).

    Raises:
        UsageError: a mode the device cannot run (megatron-core's host offload on CPU).
    """
    return mode_of(cfg).build(cfg, model_chunks, runtime, plan=plan)


def build_scheduler(cfg, optimizer):
    """megatron-core's OptimizerParamScheduler, counting samples as Megatron-LM's does.

    The loop steps it by the samples of each iteration (:mod:`.batch_schedule`).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_ext.runtime.batch_schedule import scheduler_kwargs

    return OptimizerParamScheduler(optimizer, **scheduler_kwargs(cfg))
