"""Builds megatron-core's GPTModel (wrapped for mixed precision and DDP) from the config."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F

from megatron_ext.errors import UsageError


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Pads a vocabulary size up to a multiple of ``divisible_by * tp`` (Megatron-LM's rule)."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def _dtype(cfg) -> torch.dtype:
    if cfg.training.bf16:
        return torch.bfloat16
    if cfg.training.fp16:
        return torch.float16
    return torch.float32


def transformer_config(cfg, runtime):
    """megatron-core TransformerConfig of the run."""
    from megatron.core.transformer import TransformerConfig

    m, par = cfg.model, cfg.parallel
    dtype = _dtype(cfg)
    vpp = cfg.virtual_pipeline_size()
    # Interleaved schedule: Megatron-LM overlaps the p2p with compute unless told not to
    # (then batched p2p); without interleaving megatron-core's defaults stay.
    p2p = ({"overlap_p2p_comm": par.overlap_p2p_comm, "batch_p2p_comm": not par.overlap_p2p_comm}
           if vpp else {})
    on_gpu = not runtime.is_cpu
    add_bias = not m.disable_bias_linear
    activation_fusion = on_gpu and (m.swiglu or add_bias)
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=add_bias,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        bf16=cfg.training.bf16,
        fp16=cfg.training.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        **p2p,
        use_cpu_initialization=runtime.is_cpu,
        perform_initialization=True,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method if m.recompute_granularity == "full" else None,
        recompute_num_layers=m.recompute_num_layers if m.recompute_granularity == "full" else None,
        # Fused kernels (torch.compile / jit) only where they pay off: on the GPU.
        bias_activation_fusion=activation_fusion,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        # Frees a stage's output once sent. Not with the interleaved schedule on the CPU:
        # its sends are overlapped (gloo's isend still reads the tensor after the schedule
        # moved on), and freeing the storage under it sent garbage (NaN losses).
        deallocate_pipeline_outputs=on_gpu or not vpp,
        # Sum the per-micro-batch losses of the schedule as Megatron-LM's GPT does.
        calculate_per_token_loss=False,
    )


def _layer_spec(cfg, config):
    m = cfg.model
    if m.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise UsageError("--transformer-impl transformer_engine: transformer_engine is not "
                             "installed; install it (GPU machines) or use --transformer-impl local")
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = get_gpt_layer_local_spec(normalization=m.normalization)
    if m.attention_backend == "sdpa":
        from megatron_ext.model.sdpa_attention import SDPAttention

        spec = copy.deepcopy(spec)
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_model(cfg, runtime, vocab_size: int):
    """Builds this rank's GPTModel chunks, each wrapped in Float16Module (bf16/fp16) and DDP.

    One chunk, or with the interleaved schedule (--num-layers-per-virtual-pipeline-stage)
    one per virtual stage: chunk i holds the layers of virtual stage i of this pipeline
    rank (megatron-core places them), the first stage's first chunk the embedding and the
    last stage's last chunk the output layer.

    Returns:
        (list of DDP-wrapped model chunks, TransformerConfig)
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(cfg, runtime)
    m, par = cfg.model, cfg.parallel
    vpp = cfg.virtual_pipeline_size()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=par.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=par.overlap_grad_reduce,
        overlap_param_gather=par.overlap_param_gather,
        use_distributed_optimizer=par.use_distributed_optimizer,
        bucket_size=par.ddp_bucket_size,
    )
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=_layer_spec(cfg, config),
            vocab_size=vocab_size,
            max_sequence_length=m.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                               vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=vp_stage),
            share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type,
            rotary_base=m.rotary_base,
            vp_stage=vp_stage,
        )
        if not runtime.is_cpu:
            model.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        # As Megatron-LM: only the first chunk's gradients are bucketed (the others' are
        # one bucket each, reduced when their last backward is done).
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                      disable_bucketing=stage > 0)
        # Same initial weights on every data-parallel rank.
        ddp.broadcast_params()
        chunks.append(ddp)
    return chunks, config


def count_parameters(model_chunks) -> int:
    """Parameters of this rank's chunks (shared embeddings counted once)."""
    seen = set()
    total = 0
    for chunk in model_chunks:
        for p in chunk.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total
