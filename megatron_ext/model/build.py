"""Builds megatron-core's GPTModel (wrapped for mixed precision and DDP) from the config."""

from __future__ import annotations

import copy
import importlib.util
import logging
import warnings

import torch
import torch.nn.functional as F

from megatron_ext.errors import UsageError

log = logging.getLogger("megatron_ext")


def transformer_engine_available() -> bool:
    """Whether transformer_engine can be imported (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_layers(model_cfg, te_available: bool):
    """The layer implementation and core attention a run uses, and why (log lines).

    Megatron-LM's defaults are Transformer Engine with ``--attention-backend auto``. Without
    TE the run uses megatron-core's local modules; TE's attention kernels are replaced by
    the same exact attention: torch SDPA for auto / flash / fused, megatron-core's
    DotProductAttention for unfused and local (and for any choice under selective
    recompute, which recomputes that module's score matrix).

    Returns:
        (impl: "local" | "transformer_engine", attention: "sdpa" | "local" | a TE choice,
        notes: list of one-line log messages)

    Raises:
        UsageError: a combination Megatron-LM refuses too.
    """
    m, notes = model_cfg, []
    impl, attention = m.transformer_impl, m.attention_backend
    if impl == "transformer_engine" and not te_available:
        impl = "local"
        notes.append("--transformer-impl transformer_engine: Transformer Engine is not "
                     "installed; using megatron-core's local implementation")
    if impl == "transformer_engine":
        if attention == "sdpa":
            raise UsageError("--attention-backend sdpa is the local implementation's; with "
                             "--transformer-impl transformer_engine use auto, flash, fused or "
                             "unfused (or --transformer-impl local)")
        if attention == "local":
            raise UsageError("--attention-backend local needs --transformer-impl local "
                             "(as Megatron-LM's --spec local)")
        return impl, attention, notes
    if attention in ("auto", "flash", "fused", "unfused"):
        selective = m.recompute_granularity == "selective"
        target = "local" if attention == "unfused" or selective else "sdpa"
        what = ("megatron-core's DotProductAttention" if target == "local"
                else "torch scaled_dot_product_attention")
        reason = ("Transformer Engine picks the kernel" if attention == "auto"
                  else "this kernel is Transformer Engine's")
        notes.append(f"--attention-backend {attention}: {reason}; the local implementation "
                     f"computes the same attention with {what}")
        attention = target
    return impl, attention, notes


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
    from megatron.core.transformer.enums import AttnBackend

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
    impl, attention, _ = resolve_layers(m, transformer_engine_available())
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
        kv_channels=m.kv_channels,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        layernorm_zero_centered_gamma=m.apply_layernorm_1p,
        attention_softmax_in_fp32=m.attention_softmax_in_fp32,
        attention_backend=(AttnBackend[attention] if impl == "transformer_engine"
                           else AttnBackend.local),
        sequence_parallel=par.sequence_parallel and par.tensor_model_parallel_size > 1,
        deterministic_mode=cfg.training.deterministic_mode,
        # The fused cross entropy is a GPU kernel; on the CPU the unfused one (same math).
        cross_entropy_loss_fusion=m.cross_entropy_loss_fusion and on_gpu,
        cross_entropy_fusion_impl="native",
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
        # False: the schedule divides each micro-batch's token-summed loss by its tokens and
        # the micro-batch count (Megatron-LM's default); True: by the global batch's tokens.
        calculate_per_token_loss=cfg.training.calculate_per_token_loss,
    )


def _layer_spec(cfg, config):
    m = cfg.model
    impl, attention, _ = resolve_layers(m, transformer_engine_available())
    if impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=m.qk_layernorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = get_gpt_layer_local_spec(normalization=m.normalization,
                                        qk_layernorm=m.qk_layernorm)
    spec = copy.deepcopy(spec)
    if attention == "sdpa":
        from megatron_ext.model.sdpa_attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if config.layernorm_zero_centered_gamma or config.sequence_parallel:
        # torch's norms (the local spec's without Apex) do neither: use this project's.
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        from megatron_ext.model.norm import Norm

        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = Norm
        if m.qk_layernorm:
            layer.self_attention.submodules.q_layernorm = Norm
            layer.self_attention.submodules.k_layernorm = Norm
        return TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=Norm)
    return spec


def build_gpt_model(cfg, runtime, vocab_size: int, vp_stage=None, config=None):
    """Builds one bare GPTModel chunk of this rank (no wrappers) on the run's device.

    ``vp_stage``: the virtual pipeline stage of the chunk with the interleaved schedule
    (None without it). ``config``: the TransformerConfig to use (built when None).

    Returns:
        (GPTModel, TransformerConfig)
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    m, par = cfg.model, cfg.parallel
    if config is None:
        notes = resolve_layers(m, transformer_engine_available())[2]
        if not runtime.is_cpu:  # Transformer Engine is CUDA's: on a CPU run not news
            for note in notes:
                log.info(note)
        if par.sequence_parallel and par.tensor_model_parallel_size == 1:
            log.info("--sequence-parallel: off, tensor-parallel size is 1 (as Megatron-LM)")
        config = transformer_config(cfg, runtime)
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
        rotary_percent=m.rotary_percent,
        vp_stage=vp_stage,
    )
    if not runtime.is_cpu:
        model.cuda(torch.cuda.current_device())
    return model, config


def build_model(cfg, runtime, vocab_size: int):
    """Builds this rank's GPTModel chunks, each wrapped in Float16Module (bf16/fp16) and DDP.

    One chunk, or with the interleaved schedule (--num-layers-per-virtual-pipeline-stage)
    one per virtual stage: chunk i holds the layers of virtual stage i of this pipeline
    rank (megatron-core places them), the first stage's first chunk the embedding and the
    last stage's last chunk the output layer.

    Returns:
        (list of DDP-wrapped model chunks, TransformerConfig)
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_ext.runtime import mcore_compat

    par = cfg.parallel
    vpp = cfg.virtual_pipeline_size()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grads_in_fp32(cfg),
        overlap_grad_reduce=par.overlap_grad_reduce,
        overlap_param_gather=par.overlap_param_gather,
        use_distributed_optimizer=par.use_distributed_optimizer,
        bucket_size=par.ddp_bucket_size,
    )
    chunks = []
    config = None
    for stage in range(vpp or 1):
        model, config = build_gpt_model(cfg, runtime, vocab_size,
                                        vp_stage=stage if vpp else None, config=config)
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        staged = not runtime.is_cpu and stage_weights_on_host(cfg, model, ddp_config)
        # As Megatron-LM: only the first chunk's gradients are bucketed (the others' are
        # one bucket each, reduced when their last backward is done).
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                      disable_bucketing=stage > 0,
                                      **mcore_compat.ddp_layout_kwargs(model, ddp_config,
                                                                       stage > 0))
        if staged:  # the host copies are gone: DDP copied each into its buffer
            log.info("start-up: the weights are back on the GPU, in DDP's parameter buffer")
        # Same initial weights on every data-parallel rank.
        ddp.broadcast_params()
        chunks.append(ddp)
    return chunks, config


def ddp_buffer_bytes(params, ddp_config, grad_reduce_in_fp32: bool) -> int:
    """Bytes of the parameter and gradient buffers megatron-core's DDP allocates for params.

    The gradient buffer always (fp32 or the parameters' dtype), the parameter buffer with
    the distributed optimizer (the parameters' dtype); bucket padding left out.
    """
    total = 0
    for p in params:
        if not p.requires_grad:
            continue
        grad = 4 if grad_reduce_in_fp32 else p.element_size()
        total += p.numel() * (grad + (p.element_size() if ddp_config.use_distributed_optimizer
                                      else 0))
    return total


STAGING_MARGIN = 2 * 2**30
"""Free GPU memory kept beyond DDP's buffers before the weights need to step aside."""


def stage_weights_on_host(cfg, model, ddp_config) -> bool:
    """Moves the chunk's weights to host memory, when needed, before DDP wraps it.

    megatron-core's DDP allocates its whole gradient buffer and, with the distributed
    optimizer, its whole parameter buffer, and only then copies each weight into the
    parameter buffer and frees it: for a moment the GPU holds the weights twice beside the
    gradients (a 25.6B bf16 model: 3 x 47.6 GiB on a 139.8 GiB H200). With the weights in
    host memory meanwhile, the buffers are the start-up's peak. The values are the same:
    DDP copies each host weight into its buffer. Only with the distributed optimizer
    (without it DDP keeps the weights where they are).

    Returns:
        Whether the weights were moved (the knob ``MEGATRON_EXT_STAGE_WEIGHTS``:
        auto, when the free GPU memory is short of the buffers and a margin; always; never).
    """
    mode = cfg.plan.plan_stage_weights
    if mode == "never" or not ddp_config.use_distributed_optimizer:
        return False
    params = list(model.parameters())
    need = ddp_buffer_bytes(params, ddp_config, ddp_config.grad_reduce_in_fp32)
    free = torch.cuda.mem_get_info()[0]
    if mode == "auto" and free >= need + STAGING_MARGIN:
        return False
    moved = 0
    for p in params:
        if p.requires_grad and p.device.type == "cuda":
            p.data = p.data.to("cpu")
            moved += p.numel() * p.element_size()
    torch.cuda.empty_cache()  # DDP's buffers are single allocations: give back the blocks
    log.info("start-up: the weights (%.1f GB) wait in host memory while DDP builds its "
             "buffers (%.1f GB; %.1f GB of the GPU was free)", moved / 1e9, need / 1e9,
             free / 1e9)
    return True


def grads_in_fp32(cfg) -> bool:
    """Whether gradients are accumulated and reduced in fp32 (Megatron-LM's rule).

    With --bf16 they are, unless --grad-reduce-in-bf16; with --fp16 only under
    --accumulate-allreduce-grads-in-fp32; fp32 training has fp32 gradients anyway.
    """
    par = cfg.parallel
    if cfg.training.bf16:
        return not par.grad_reduce_in_bf16
    return par.accumulate_allreduce_grads_in_fp32


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
