"""The optimizer seam: the one place where training modes differ.

:func:`build_optimizer` returns a megatron-core ``MegatronOptimizer``. Today that is
megatron-core's DistributedOptimizer (or its non-distributed mixed-precision optimizer),
or megatron-core's own host offload (``--optimizer-cpu-offload``, GPU only), or the
offload engine's optimizer (``--offload-optimizer``), or ZenFlow's (``--zenflow``): both
DistributedOptimizer subclasses bound into megatron-core's factory. The loop never names
them.
"""

from __future__ import annotations

import torch

from megatron_ext.errors import UsageError


def megatron_optimizer_config(cfg):
    """megatron-core's OptimizerConfig of the run."""
    from megatron.core.optimizer import OptimizerConfig

    opt, train = cfg.optimizer, cfg.training
    return OptimizerConfig(
        optimizer=opt.optimizer,
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        sgd_momentum=opt.sgd_momentum,
        clip_grad=opt.clip_grad,
        bf16=train.bf16,
        fp16=train.fp16,
        params_dtype=(torch.bfloat16 if train.bf16 else torch.float16 if train.fp16
                      else torch.float32),
        loss_scale=train.loss_scale,
        initial_loss_scale=train.initial_loss_scale,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
        optimizer_cpu_offload=opt.optimizer_cpu_offload,
        optimizer_offload_fraction=(opt.optimizer_offload_fraction if opt.optimizer_cpu_offload
                                    else 0.0),
        overlap_cpu_optimizer_d2h_h2d=opt.overlap_cpu_optimizer_d2h_h2d,
        # The embedding and output layer's own peak / final learning rate (param groups
        # with max_lr / min_lr that megatron-core's scheduler reads).
        decoupled_lr=opt.decoupled_lr,
        decoupled_min_lr=opt.decoupled_min_lr,
        log_num_zeros_in_grad=cfg.logging.log_num_zeros_in_grad,
    )


def build_optimizer(cfg, model_chunks, runtime):
    """Returns the optimizer of the run for this rank's model chunks.

    Raises:
        UsageError: a mode the device cannot run (megatron-core's host offload on CPU).
    """
    from megatron.core.optimizer import get_megatron_optimizer

    if cfg.optimizer.optimizer_cpu_offload and runtime.is_cpu:
        raise UsageError("--optimizer-cpu-offload is megatron-core's GPU-to-host offload and "
                         "needs a GPU; on the CPU the optimizer states are already in host memory")
    if cfg.zenflow.zenflow:
        from megatron_ext.zenflow.optimizer import zenflow_optimizer

        with zenflow_optimizer(cfg.zenflow, runtime.rank, cfg.offload):
            return get_megatron_optimizer(megatron_optimizer_config(cfg), model_chunks)
    if cfg.offload.offload_optimizer:
        from megatron_ext.offload.optimizer import offloaded_distributed_optimizer
        from megatron_ext.runtime.faults import Faults

        with offloaded_distributed_optimizer(cfg.offload, runtime.rank,
                                             cfg.optimizer.state_layout(),
                                             Faults(cfg.faults.offload_fault)):
            return get_megatron_optimizer(megatron_optimizer_config(cfg), model_chunks)
    return get_megatron_optimizer(megatron_optimizer_config(cfg), model_chunks)


def build_scheduler(cfg, optimizer):
    """megatron-core's OptimizerParamScheduler, counting samples as Megatron-LM's does.

    The loop steps it by the samples of each iteration (:mod:`.batch_schedule`).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_ext.runtime.batch_schedule import scheduler_kwargs

    return OptimizerParamScheduler(optimizer, **scheduler_kwargs(cfg))
