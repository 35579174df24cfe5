"""The entry into megatron-core's optimizer factory, which every optimizer mode builds through.

:func:`build_megatron_optimizer` calls ``get_megatron_optimizer`` with the run's
megatron-core ``OptimizerConfig``; given the subclass a mode bound into the factory
(:func:`~megatron_ext.optim.sharded_optimizer.bound_distributed_optimizer`), it checks that
the factory built that class for every optimizer of the chain.
"""

from __future__ import annotations

from typing import Optional

import torch


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


def build_megatron_optimizer(cfg, model_chunks, bound: Optional[type] = None):
    """megatron-core's optimizer of the run for this rank's model chunks.

    Args:
        cfg: the run's config.
        model_chunks: this rank's model chunks (DDP-wrapped).
        bound: the subclass bound into the factory (the ``with`` value of
            ``bound_distributed_optimizer``), or None for megatron-core's own optimizer.

    Raises:
        RuntimeError: the factory ignored the binding (see
            :func:`~megatron_ext.optim.sharded_optimizer.check_bound`).
    """
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(megatron_optimizer_config(cfg), model_chunks)
    if bound is None:
        return optimizer
    from megatron_ext.optim.sharded_optimizer import check_bound

    return check_bound(optimizer, bound)
