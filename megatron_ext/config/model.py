"""Configs of the model and its parallel layout (Megatron-LM's model and parallelism flags).

The conventions of every section are in :mod:`megatron_ext.config`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_ext.config.checks import positive, required
from megatron_ext.config.megatron_compat import value_refusal
from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import option


@dataclasses.dataclass
class ModelConfig:
    """The GPT architecture."""

    num_layers: Optional[int] = None
    """Number of transformer layers (required)."""
    hidden_size: Optional[int] = None
    """Transformer hidden size (required)."""
    num_attention_heads: Optional[int] = None
    """Number of attention heads (required; must divide --hidden-size unless --kv-channels
    is given)."""
    ffn_hidden_size: Optional[int] = None
    """Hidden size of the MLP. Default: 4 x hidden size, or int(8 x hidden size / 3 / 64) x 64
    (rounded down) with --swiglu, as Megatron-LM."""
    seq_length: Optional[int] = None
    """Sequence length of each training sample, in tokens (required)."""
    max_position_embeddings: Optional[int] = None
    """Size of the learned position table (learned_absolute) and the RoPE cache; required
    and >= --seq-length, as Megatron-LM."""
    kv_channels: Optional[int] = None
    """Size of each attention head (the projection width per head). Default: hidden size
    / attention heads."""
    normalization: str = option("LayerNorm", choices=("LayerNorm", "RMSNorm"))
    """Normalization layer: LayerNorm (GPT-2 style) or RMSNorm (Llama style)."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""
    swiglu: bool = False
    """Use a SwiGLU MLP (Llama style) instead of GeLU."""
    position_embedding_type: str = option("learned_absolute", choices=("learned_absolute", "rope"))
    """Position embedding: learned absolute positions (GPT-2) or rotary (RoPE, Llama)."""
    rotary_base: int = 10000
    """Base period of the rotary embedding (with --position-embedding-type rope)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that the rotary embedding rotates (the rest pass
    unrotated)."""
    apply_layernorm_1p: bool = False
    """Zero-centered norm weights: the norms compute (1 + weight) x normalized input and
    their weights start at 0 (megatron-core's layernorm_zero_centered_gamma)."""
    qk_layernorm: bool = False
    """Normalize the queries and keys per head (a norm layer each) before attention."""
    add_qkv_bias: bool = False
    """Give the query/key/value projection a bias even with --disable-bias-linear."""
    attention_softmax_in_fp32: bool = False
    """Compute the attention softmax in fp32 with --bf16/--fp16 (megatron-core's unfused
    core attention; SDPA and Transformer Engine's kernels accumulate in fp32 already)."""
    use_mcore_models: bool = False
    """Accepted for Megatron-LM scripts, where it is deprecated and ignored: the model is
    always megatron-core's GPTModel here."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of sharing the input embedding."""
    disable_bias_linear: bool = False
    """Remove the biases of the linear layers (Llama style)."""
    group_query_attention: bool = False
    """Use grouped-query attention (GQA): --num-query-groups key/value heads."""
    num_query_groups: int = 1
    """Number of key/value head groups with --group-query-attention."""
    hidden_dropout: float = 0.1
    """Dropout probability after attention and MLP."""
    attention_dropout: float = 0.1
    """Dropout probability of the attention weights."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    make_vocab_size_divisible_by: int = 128
    """Pad the tokenizer's vocabulary up to a multiple of this x tensor-parallel size
    (Megatron-LM's rule), so embedding shards are even and GEMMs aligned."""
    transformer_impl: str = option("transformer_engine", choices=("local", "transformer_engine"))
    """Layer implementation: Transformer Engine's (the default, as Megatron-LM; without
    transformer_engine installed the run falls back to local and says so in one log line)
    or megatron-core's local modules."""
    attention_backend: str = option("auto", choices=("auto", "flash", "fused", "unfused",
                                                     "local", "sdpa"))
    """Core attention, Megatron-LM's choices: auto (Transformer Engine picks; with the local
    implementation torch's scaled_dot_product_attention, or megatron-core's
    DotProductAttention under --recompute-granularity selective), flash / fused / unfused
    (Transformer Engine's kernels; without it, the same exact attention from SDPA
    (flash, fused) or megatron-core's DotProductAttention (unfused), with one log line),
    local (megatron-core's DotProductAttention, materializes the score matrix). This
    project adds sdpa: torch scaled_dot_product_attention explicitly."""
    no_gradient_accumulation_fusion: bool = False
    """Accepted for Megatron-LM scripts: gradient accumulation is never fused into the
    weight-gradient GEMM here (that kernel is Apex's / Transformer Engine's), so the
    gradients are the same with or without the flag."""
    no_masked_softmax_fusion: bool = False
    """Accepted for Megatron-LM scripts: the masked softmax is never fused here (the core
    attention is SDPA, Transformer Engine's, or megatron-core's unfused softmax): same
    math either way."""
    no_rope_fusion: bool = False
    """Accepted for Megatron-LM scripts (which need it without Transformer Engine): rotary
    embeddings are applied by megatron-core's unfused code here (the fused kernel is
    Transformer Engine's), so the math is the same with or without the flag."""
    no_persist_layer_norm: bool = False
    """Accepted for Megatron-LM scripts (which need it for the local implementation's
    RMSNorm without Apex): the persistent layer-norm kernel is Apex's and never used here,
    so the math is the same with or without the flag."""
    cross_entropy_loss_fusion: bool = False
    """Megatron-LM's fused cross entropy: the same loss from a fused kernel. Used on the GPU;
    on the CPU the unfused loss is computed (same math)."""
    recompute_granularity: Optional[str] = option(None, choices=("full", "selective"))
    """Activation recomputation: full (recompute whole layers, see --recompute-method and
    --recompute-num-layers) or selective (recompute the core attention only)."""
    recompute_method: Optional[str] = option(None, choices=("uniform", "block"))
    """With --recompute-granularity full (required there, as Megatron-LM): uniform
    (recompute every chunk of --recompute-num-layers layers) or block (only the first
    --recompute-num-layers layers of each pipeline stage)."""
    recompute_num_layers: Optional[int] = None
    """Layers per recomputation chunk (uniform) or recomputed layers per stage (block);
    required with --recompute-granularity full."""

    def __post_init__(self):
        required(("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                  ("--num-attention-heads", self.num_attention_heads),
                  ("--seq-length", self.seq_length),
                  ("--max-position-embeddings", self.max_position_embeddings))
        positive(self, "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "seq_length", "max_position_embeddings", "num_query_groups",
                  "make_vocab_size_divisible_by", "recompute_num_layers", "kv_channels")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise UsageError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.recompute_granularity == "full" and (self.recompute_method is None
                                                     or self.recompute_num_layers is None):
            raise UsageError("--recompute-granularity full needs --recompute-method "
                             "{uniform,block} and --recompute-num-layers N (as Megatron-LM)")
        if self.recompute_granularity == "selective" and self.recompute_method is not None:
            raise UsageError("--recompute-method is for --recompute-granularity full; "
                             "selective recompute has no method (as Megatron-LM)")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise UsageError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; choose a head count that divides the hidden size"
            )
        if self.group_query_attention and self.num_attention_heads % self.num_query_groups:
            raise UsageError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--num-query-groups {self.num_query_groups}"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UsageError(f"--{name.replace('_', '-')} must be in [0, 1)")
        if self.max_position_embeddings < self.seq_length:
            raise UsageError(
                f"--max-position-embeddings {self.max_position_embeddings} must be greater than "
                f"or equal to --seq-length {self.seq_length} (as Megatron-LM)"
            )
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.swiglu:
                # Megatron-LM's rule: 2/3 of 4h, rounded DOWN to a multiple of 64.
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size


@dataclasses.dataclass
class ParallelConfig:
    """Tensor, pipeline and data parallelism."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (PP); micro-batches flow through the stages with
    megatron-core's 1F1B schedule."""
    use_distributed_optimizer: bool = False
    """Shard the fp32 master weights and optimizer states across data-parallel ranks
    (ZeRO-1, megatron-core's DistributedOptimizer)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduce with the backward pass."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gather of the distributed optimizer with the next
    forward pass (needs --use-distributed-optimizer)."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32. With --bf16 this is on unless
    --grad-reduce-in-bf16 (Megatron-LM's rule)."""
    grad_reduce_in_bf16: bool = False
    """With --bf16: accumulate and reduce gradients in bf16 (half the bytes of the reduce and
    of the offload engine's gradient copies) instead of Megatron-LM's default fp32."""
    sequence_parallel: bool = False
    """Sequence parallelism: shard the activations outside the tensor-parallel regions
    (norms, dropout) along the sequence over the TP ranks. Off when TP is 1 (with a log
    line, as Megatron-LM)."""
    context_parallel_size: int = 1
    """Context-parallel size (CP). Only 1 is supported: megatron-core's context parallelism
    needs Transformer Engine's attention, which this project does not wire."""
    distributed_backend: str = option("nccl", choices=("nccl", "gloo"))
    """Backend of torch.distributed: nccl on GPUs (the default); gloo is what runs with
    --device cpu (either value is accepted there)."""
    ddp_bucket_size: Optional[int] = None
    """Elements per gradient-reduce bucket (default: megatron-core's choice)."""
    distributed_timeout_minutes: int = 10
    """Timeout of collective operations, in minutes."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Interleaved 1F1B: each pipeline rank holds several model chunks (virtual stages)
    of this many layers, and megatron-core's interleaved schedule runs them (needs
    --pipeline-model-parallel-size >= 2, and a number of micro-batches that is a multiple
    of it)."""
    num_virtual_stages_per_pipeline_rank: Optional[int] = None
    """Interleaved 1F1B, given as the number of model chunks (virtual stages) per
    pipeline rank instead of --num-layers-per-virtual-pipeline-stage."""
    overlap_p2p_comm: bool = option(True, negate="--no-overlap-p2p-communication")
    """With the interleaved schedule, do not overlap the pipeline's send/receive with the
    chunks' compute (batched p2p instead; Megatron-LM then needs
    --pipeline-model-parallel-size > 2)."""

    def __post_init__(self):
        positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "ddp_bucket_size", "distributed_timeout_minutes", "context_parallel_size",
                  "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
        refused = value_refusal("--context-parallel-size", self.context_parallel_size)
        if refused:
            raise UsageError(refused)
        if self.grad_reduce_in_bf16 and self.accumulate_allreduce_grads_in_fp32:
            raise UsageError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 "
                             "are exclusive; choose one")
        if (self.num_layers_per_virtual_pipeline_stage is not None
                and self.num_virtual_stages_per_pipeline_rank is not None):
            raise UsageError("--num-layers-per-virtual-pipeline-stage and "
                             "--num-virtual-stages-per-pipeline-rank both set the interleaved "
                             "schedule's chunks; give one of them")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise UsageError("--overlap-param-gather needs --use-distributed-optimizer")
