"""Megatron-LM's ``args`` of a checkpoint: what this run is, in Megatron-LM's names.

Megatron-LM's ``save_checkpoint`` stores its whole argparse Namespace as the common key
``args``; its ``load_checkpoint`` reads the parallel layout, ``consumed_train_samples``
and ``consumed_valid_samples`` from it, ``check_checkpoint_args`` compares the model
shape, and ``load_args_from_checkpoint`` / ``tools/checkpoint/loader_core.py`` take the
architecture, precision and tokenizer from it. :func:`megatron_args` writes those
attributes from this run's config (values only of types that load with
``weights_only=True``: megatron-core registers ``argparse.Namespace`` as a safe global);
:func:`train_state_of` reads a Megatron-LM checkpoint's progress back. Pure.
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch

from megatron_ext.checkpoint.checkpoint_args import SETTINGS


def _params_dtype(train) -> torch.dtype:
    return torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else torch.float32


def megatron_args(cfg, layout: dict, progress: dict, padded_vocab_size: int,
                  virtual_pipeline_size: Optional[int]) -> argparse.Namespace:
    """The Namespace Megatron-LM would have saved for this run.

    Args:
        cfg: the run config.
        layout: ``world_size``, ``tp``, ``pp``, ``dp`` of the run.
        progress: ``consumed_train_samples``, ``skipped_train_samples``, ``iteration``.
        padded_vocab_size: the model's vocabulary (padded as Megatron-LM pads it).
        virtual_pipeline_size: model chunks per pipeline rank, None without interleaving.
    """
    model, par, train, opt, data = (cfg.model, cfg.parallel, cfg.training, cfg.optimizer,
                                    cfg.data)
    # from_megatron is its own inverse: identity, or the negation of add_bias_linear.
    values = {s.megatron: s.from_megatron(getattr(model, s.field)) for s in SETTINGS}
    values.update(
        # The rest of the architecture.
        norm_epsilon=model.norm_epsilon,
        # Megatron-LM 0.16's parser stores --norm-epsilon and --apply-layernorm-1p under
        # TransformerConfig's names; older code (and --use-checkpoint-args) reads the above.
        layernorm_epsilon=model.norm_epsilon,
        layernorm_zero_centered_gamma=model.apply_layernorm_1p,
        # The kernels this project ran (never Apex's or Transformer Engine's fused ones):
        # Megatron-LM's tools copy these over their defaults, which need TE and Apex.
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        init_method_std=model.init_method_std,
        attention_softmax_in_fp32=model.attention_softmax_in_fp32,
        add_position_embedding=True,  # Megatron-LM's default; rope does not change it
        use_rotary_position_embeddings=False,
        rotary_interleaved=False,
        squared_relu=False,
        apply_query_key_layer_scaling=False,
        transformer_impl=model.transformer_impl,
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size,
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers,
        num_experts=None,
        # Parallel layout (load_checkpoint compares TP and PP; the rng and rerun states
        # are kept only at the same layout).
        world_size=layout["world_size"],
        tensor_model_parallel_size=layout["tp"],
        pipeline_model_parallel_size=layout["pp"],
        data_parallel_size=layout["dp"],
        context_parallel_size=1,
        expert_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size,
        num_layers_per_virtual_pipeline_stage=par.num_layers_per_virtual_pipeline_stage,
        sequence_parallel=par.sequence_parallel and layout["tp"] > 1,
        use_distributed_optimizer=par.use_distributed_optimizer,
        data_parallel_random_init=False,
        # Precision.
        bf16=train.bf16,
        fp16=train.fp16,
        params_dtype=_params_dtype(train),
        loss_scale=train.loss_scale,
        initial_loss_scale=train.initial_loss_scale,
        # Batches, length and progress.
        micro_batch_size=train.micro_batch_size,
        global_batch_size=train.global_batch_size,
        rampup_batch_size=train.rampup_batch_size,
        train_iters=train.train_iters,
        train_samples=train.train_samples,
        iteration=progress["iteration"],
        consumed_train_samples=progress["consumed_train_samples"],
        skipped_train_samples=progress["skipped_train_samples"],
        consumed_valid_samples=0,  # evaluation here always reads the first batches
        seed=train.seed,
        eval_iters=train.eval_iters,
        eval_interval=train.eval_interval,
        # Optimizer and schedule (what get_optimizer_param_scheduler reads).
        optimizer=opt.optimizer,
        lr=opt.lr,
        min_lr=opt.min_lr,
        lr_decay_style=opt.lr_decay_style,
        lr_warmup_iters=opt.lr_warmup_iters,
        lr_warmup_samples=opt.lr_warmup_samples,
        lr_warmup_fraction=opt.lr_warmup_fraction,
        lr_warmup_init=opt.lr_warmup_init,
        lr_decay_iters=opt.lr_decay_iters,
        lr_decay_samples=opt.lr_decay_samples,
        lr_wsd_decay_style=opt.lr_wsd_decay_style,
        lr_wsd_decay_iters=opt.lr_wsd_decay_iters,
        lr_wsd_decay_samples=opt.lr_wsd_decay_samples,
        weight_decay=opt.weight_decay,
        start_weight_decay=opt.weight_decay,
        end_weight_decay=opt.weight_decay,
        weight_decay_incr_style="constant",
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        sgd_momentum=opt.sgd_momentum,
        clip_grad=opt.clip_grad,
        decoupled_lr=opt.decoupled_lr,
        decoupled_min_lr=opt.decoupled_min_lr,
        # Data and tokenizer.
        tokenizer_type=data.tokenizer_type,
        tokenizer_model=data.tokenizer_model,
        vocab_size=data.vocab_size,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        mock_data=data.mock_data,
        data_path=list(data.data_path) or None,
        split=data.split,
        # Checkpoint.
        use_dist_ckpt=True,
        ckpt_format="torch_dist",
        no_save_optim=None,
        no_save_rng=None,
        use_mcore_models=True,
        use_legacy_models=False,
    )
    return argparse.Namespace(**values)


def train_state_of(common: dict) -> dict:
    """TrainState fields of a checkpoint that has none of this project's (Megatron-LM's).

    The iteration from ``iteration``; the data position from ``args``.
    """
    args = common.get("args")
    get = (lambda name: getattr(args, name, None) or 0) if args is not None else (lambda _: 0)
    iteration = int(common.get("iteration", 0))
    return {
        "iteration": iteration,
        "consumed_train_samples": int(get("consumed_train_samples")),
        "optimizer_steps": iteration,
        "skipped_iterations": 0,
        "num_floating_point_operations_so_far": float(
            common.get("num_floating_point_operations_so_far", 0) or 0),
    }


def layout_of(common: dict) -> Optional[tuple]:
    """(TP, PP) a checkpoint was saved at, from Megatron-LM's ``args``; None if unknown."""
    args = common.get("args")
    if args is None:
        return None
    return (getattr(args, "tensor_model_parallel_size", 1),
            getattr(args, "pipeline_model_parallel_size", 1))
