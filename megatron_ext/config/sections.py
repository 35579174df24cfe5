"""Typed configs of the run, one dataclass per concern.

Every field has a docstring (the string under it): ``--help`` is generated from them.
Flag names and meanings follow Megatron-LM where Megatron-LM has the flag. Bounds of a
single field are checked in ``__post_init__``; checks that involve several sections or the
world size live in :mod:`megatron_ext.config.run`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional

from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import knob, option


def _required(*pairs) -> None:
    """Megatron-LM has no default for these flags either: a run must give them."""
    for flag, value in pairs:
        if value is None:
            raise UsageError(f"{flag} is required (Megatron-LM has no default for it either)")


def _positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")


def _output_path(flag: str, path: Optional[str], directory: bool = True) -> None:
    """Refuses now an output path that the run could not create or write when it gets there.

    A --save that is a file would otherwise fail at the first save, after the training.
    """
    if path is None:
        return
    kind = "directory" if directory else "file"
    if os.path.exists(path):
        if os.path.isdir(path) != directory:
            what = "a directory" if directory else "a file path"
            raise UsageError(f"{flag} {path}: is a {'file' if directory else 'directory'}; "
                             f"give {what}")
        writable = path if directory else os.path.dirname(os.path.abspath(path))
    else:
        writable = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(writable):
            writable = os.path.dirname(writable)
        if not os.path.isdir(writable):
            raise UsageError(f"{flag} {path}: {writable} is a file, so the {kind} cannot be "
                             "created there; give another path")
    if not os.access(writable, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {writable} is not writable by this user")


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
        _required(("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                  ("--num-attention-heads", self.num_attention_heads),
                  ("--seq-length", self.seq_length),
                  ("--max-position-embeddings", self.max_position_embeddings))
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
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
        _positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "ddp_bucket_size", "distributed_timeout_minutes", "context_parallel_size",
                  "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
        if self.context_parallel_size != 1:
            raise UsageError(f"--context-parallel-size {self.context_parallel_size}: context "
                             "parallelism is not supported (it needs Transformer Engine's "
                             "attention, which this project does not wire); use 1")
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


@dataclasses.dataclass
class TrainingConfig:
    """Batch sizes, iterations, precision and logging cadence."""

    micro_batch_size: Optional[int] = None
    """Samples per micro-batch on each data-parallel rank (required)."""
    global_batch_size: Optional[int] = None
    """Samples per iteration over all data-parallel ranks; a multiple of micro batch x DP
    (the quotient is the number of micro-batches accumulated). Default: micro batch x DP."""
    train_iters: Optional[int] = None
    """Number of iterations to train for. The training length is required, as Megatron-LM:
    this or --train-samples."""
    train_samples: Optional[int] = None
    """Number of samples to train for, instead of --train-iters (Megatron-LM's sample-based
    training): the iterations are --train-samples / --global-batch-size (rounded down), or
    as the --rampup-batch-size ramp consumes them; the learning-rate flags are then the
    sample-based ones (--lr-warmup-samples, --lr-decay-samples, --lr-wsd-decay-samples)."""
    rampup_batch_size: Optional[List[int]] = option(None, nargs=3,
                                                    metavar=("START", "INCR", "SAMPLES"))
    """Ramp the global batch size up (needs --train-samples, as Megatron-LM): start at START
    samples, grow by INCR up to --global-batch-size, spreading the (global - START) / INCR
    increments evenly over the first SAMPLES samples. START and INCR must be multiples of
    micro batch x DP."""
    exit_interval: Optional[int] = None
    """Save (when --save is given) and exit when the iteration is a multiple of this."""
    exit_duration_in_mins: Optional[int] = None
    """Save (when --save is given) and exit after this many minutes since the start of the
    process (checked after each iteration, agreed across ranks)."""
    manual_gc: bool = False
    """Disable Python's threshold-based garbage collector and collect at fixed points
    (every --manual-gc-interval iterations, around evaluations), so ranks pause together."""
    manual_gc_interval: int = 0
    """With --manual-gc: collect every this many iterations (0: only at the start and around
    evaluations)."""
    manual_gc_eval: bool = option(True, negate="--no-manual-gc-eval")
    """With --manual-gc: do not collect at the start and end of each evaluation."""
    empty_unused_memory_level: int = option(0, choices=(0, 1, 2))
    """Release the CUDA caching allocator's unused blocks (torch.cuda.empty_cache): 1 after
    forward/backward, 2 also after the optimizer step; 0 never. No-op on the CPU."""
    calculate_per_token_loss: bool = False
    """Average the loss over all tokens of the global batch (every micro-batch and DP rank
    weighted by its tokens) instead of the mean of the per-micro-batch token means."""
    deterministic_mode: bool = False
    """Deterministic kernels: torch.use_deterministic_algorithms(True),
    CUBLAS_WORKSPACE_CONFIG and NCCL_ALGO=Ring, megatron-core's deterministic_mode (no
    --cross-entropy-loss-fusion, as Megatron-LM)."""
    seed: int = 1234
    """Random seed of weights, dropout and data order."""
    bf16: bool = False
    """Train in bfloat16 with fp32 master weights."""
    fp16: bool = False
    """Train in float16 with fp32 master weights and dynamic loss scaling."""
    loss_scale: Optional[float] = None
    """Static loss scale for --fp16 (default: dynamic scaling)."""
    initial_loss_scale: float = 2.0**32
    """Initial dynamic loss scale for --fp16."""
    eval_interval: Optional[int] = None
    """Evaluate on the validation split every this many iterations; unset (the default, as
    Megatron-LM core_v0.16.1): only at the end of training."""
    eval_iters: int = 100
    """Iterations (global batches) per evaluation; 0 disables evaluation."""
    log_interval: int = 100
    """Log the iteration breakdown every this many iterations."""
    skip_train: bool = False
    """Do not train: load --load (model weights; implies --no-load-optim), evaluate on
    the validation split at the loaded iteration, and exit without saving (Megatron-LM's
    flag). Needs --eval-iters > 0."""

    def __post_init__(self):
        _required(("--micro-batch-size", self.micro_batch_size))
        if self.train_iters is None and self.train_samples is None and not self.skip_train:
            raise UsageError("the training length is required: give --train-iters N or "
                             "--train-samples N (Megatron-LM has no default for it either)")
        if self.train_iters is not None and self.train_samples is not None:
            raise UsageError("--train-iters and --train-samples both give the training length; "
                             "give one of them (as Megatron-LM)")
        if self.train_samples is not None and self.train_samples < 0:
            raise UsageError(f"--train-samples must be >= 0, got {self.train_samples}")
        if self.rampup_batch_size is not None:
            if self.train_samples is None:
                raise UsageError("--rampup-batch-size needs sample-based training: give "
                                 "--train-samples instead of --train-iters (as Megatron-LM)")
            start, incr, samples = self.rampup_batch_size
            if start <= 0 or incr <= 0 or samples <= 0:
                raise UsageError(f"--rampup-batch-size {start} {incr} {samples}: the start batch "
                                 "size, the increment and the ramp's samples must be positive")
        if self.manual_gc_interval < 0:
            raise UsageError("--manual-gc-interval must be >= 0")
        _positive(self, "micro_batch_size", "global_batch_size", "exit_interval",
                  "exit_duration_in_mins",
                  "eval_interval", "log_interval", "loss_scale", "initial_loss_scale")
        if self.train_iters is not None and self.train_iters < 0:
            raise UsageError(f"--train-iters must be >= 0, got {self.train_iters} (0: no "
                             "training, only the evaluation at the end with --eval-iters)")
        if self.skip_train and self.eval_iters == 0:
            raise UsageError("--skip-train only evaluates: give --eval-iters N > 0")
        if self.eval_iters < 0:
            raise UsageError("--eval-iters must be >= 0")
        if self.bf16 and self.fp16:
            raise UsageError("--bf16 and --fp16 are exclusive; choose one")


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW and the learning-rate schedule (megatron-core's OptimizerParamScheduler)."""

    optimizer: str = option("adam", choices=("adam", "sgd"))
    """Optimizer: adam (AdamW, decoupled weight decay) or sgd."""
    lr: Optional[float] = None
    """Peak learning rate (required)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: str = option("linear", choices=("constant", "linear", "cosine",
                                                    "inverse-square-root", "WSD"))
    """Shape of the learning-rate decay after warm-up."""
    lr_warmup_iters: int = 0
    """Iterations of linear learning-rate warm-up from --lr-warmup-init (with --train-iters)."""
    lr_warmup_samples: int = 0
    """Samples of linear learning-rate warm-up (with --train-samples)."""
    lr_warmup_fraction: Optional[float] = None
    """Warm up over this fraction of the decay length (instead of --lr-warmup-iters or
    --lr-warmup-samples)."""
    lr_warmup_init: float = 0.0
    """Learning rate the warm-up starts from."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the learning rate decays (default: --train-iters)."""
    lr_decay_samples: Optional[int] = None
    """Samples over which the learning rate decays, with --train-samples (default:
    --train-samples)."""
    lr_wsd_decay_style: str = option("exponential", choices=("exponential", "linear", "cosine",
                                                             "minus_sqrt"))
    """Shape of the annealing phase of --lr-decay-style WSD."""
    lr_wsd_decay_iters: Optional[int] = None
    """Iterations of the annealing phase of --lr-decay-style WSD (with --train-iters; WSD
    needs it, as Megatron-LM)."""
    lr_wsd_decay_samples: Optional[int] = None
    """Samples of the annealing phase of --lr-decay-style WSD (with --train-samples; WSD
    needs it, as Megatron-LM)."""
    decoupled_lr: Optional[float] = None
    """Peak learning rate of the input embedding and the output layer (their own schedule
    of the same shape; megatron-core's decoupled_lr)."""
    decoupled_min_lr: Optional[float] = None
    """Final learning rate of the input embedding and the output layer with --decoupled-lr."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norms)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.9
    """Momentum of --optimizer sgd."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    optimizer_cpu_offload: bool = False
    """megatron-core's own optimizer offload (HybridDeviceOptimizer): keep the fp32 states
    of a fraction of the parameters in host memory and step them with torch's CPU AdamW.
    GPU only; kept as the baseline the offload engine is measured against."""
    optimizer_offload_fraction: float = 1.0
    """Fraction of the parameters (by elements) whose states --optimizer-cpu-offload
    moves to the host."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With --optimizer-cpu-offload: overlap the gradient D2H and parameter H2D copies
    with the CPU optimizer (megatron-core's option)."""
    use_precision_aware_optimizer: bool = False
    """Store the optimizer's master weights and Adam moments in the dtypes of
    --main-params-dtype, --exp-avg-dtype and --exp-avg-sq-dtype (Megatron-LM's flags); the
    Adam math stays fp32. Honoured by --offload-optimizer on every tier (GPU, host, paths:
    8 instead of 12 bytes per element with bf16 moments). Without --offload-optimizer it is
    refused: megatron-core implements it with Transformer Engine's FusedAdam, which this
    project does not wire."""
    main_params_dtype: str = option("fp32", choices=("fp32", "fp16"))
    """Dtype of the master weights with --use-precision-aware-optimizer."""
    exp_avg_dtype: str = option("fp32", choices=("fp32", "fp16", "bf16", "fp8"))
    """Dtype of Adam's first moment with --use-precision-aware-optimizer (storage only; the
    math is fp32). fp8 is Megatron-LM's choice and refused here."""
    exp_avg_sq_dtype: str = option("fp32", choices=("fp32", "fp16", "bf16", "fp8"))
    """Dtype of Adam's second moment with --use-precision-aware-optimizer (storage only;
    the math is fp32). fp8 is Megatron-LM's choice and refused here."""

    def __post_init__(self):
        _required(("--lr", self.lr))
        _positive(self, "lr", "adam_eps", "lr_decay_iters", "decoupled_lr", "lr_decay_samples",
                  "lr_wsd_decay_iters", "lr_wsd_decay_samples")
        if self.lr_warmup_samples < 0:
            raise UsageError("--lr-warmup-samples must be >= 0")
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction < 1.0:
            raise UsageError(f"--lr-warmup-fraction must be in [0, 1), got "
                             f"{self.lr_warmup_fraction}")
        if not 0.0 <= self.lr_warmup_init <= self.lr:
            raise UsageError(f"--lr-warmup-init {self.lr_warmup_init} must be in [0, --lr "
                             f"{self.lr}]")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise UsageError("--decoupled-min-lr needs --decoupled-lr")
        if self.decoupled_min_lr is not None and not 0 <= self.decoupled_min_lr <= \
                self.decoupled_lr:
            raise UsageError(f"--decoupled-min-lr {self.decoupled_min_lr} must be in "
                             f"[0, --decoupled-lr {self.decoupled_lr}]")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise UsageError(f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        if self.lr_warmup_iters < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise UsageError("--lr-warmup-iters, --weight-decay and --clip-grad must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UsageError(f"--{name.replace('_', '-')} must be in [0, 1)")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise UsageError("--optimizer-offload-fraction must be in [0, 1]")
        dtypes = {"--main-params-dtype": self.main_params_dtype,
                  "--exp-avg-dtype": self.exp_avg_dtype,
                  "--exp-avg-sq-dtype": self.exp_avg_sq_dtype}
        for flag, value in dtypes.items():
            if value != "fp32" and not self.use_precision_aware_optimizer:
                raise UsageError(f"{flag} {value} needs --use-precision-aware-optimizer "
                                 "(megatron-core's rule: without it every state is fp32)")
            if value == "fp8":
                raise UsageError(f"{flag} fp8 is not supported (Transformer Engine's fp8 "
                                 "states); use bf16 or fp16")

    def state_layout(self):
        """The offload engine's state dtypes (:class:`~megatron_ext.offload.states.StateLayout`)."""
        from megatron_ext.offload.states import StateLayout

        return StateLayout.from_names(self.main_params_dtype, self.exp_avg_dtype,
                                      self.exp_avg_sq_dtype)


@dataclasses.dataclass
class DataConfig:
    """Corpus, split and tokenizer."""

    data_path: List[str] = option(default_factory=list, nargs="+", metavar="[WEIGHT] PREFIX")
    """One or more dataset prefixes (PREFIX.bin / PREFIX.idx from tools/preprocess_data.py),
    each optionally preceded by its sampling weight: '0.7 a_text_document 0.3 b_text_document'."""
    split: str = "969,30,1"
    """Comma-separated proportions of train, validation and test documents."""
    mock_data: bool = False
    """Train on megatron-core's synthetic MockGPTDataset instead of --data-path (smoke runs;
    the vocabulary comes from --vocab-size or the tokenizer)."""
    tokenizer_type: Optional[str] = option(
        None, choices=("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                       "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                       "NullTokenizer"))
    """Tokenizer, as Megatron-LM's class of that name: GPT2BPETokenizer (--vocab-file,
    --merge-file; EOD <|endoftext|>), SentencePieceTokenizer (--tokenizer-model plus
    Megatron-LM's special tokens <CLS> <SEP> <EOD> <MASK> past its pieces; EOD <EOD>),
    GPTSentencePieceTokenizer (the model as it is; EOD </s>), Llama2Tokenizer (<s> before
    every text; EOD </s>), HuggingFaceTokenizer (--tokenizer-model a local directory or
    tokenizer.json; EOD its eos token), TikTokenizer (--tokenizer-model a tiktoken JSON
    vocabulary, --tiktoken-pattern; EOD </s>), or NullTokenizer (ids as they are,
    --vocab-size)."""
    tokenizer_model: Optional[str] = None
    """The tokenizer's file: a SentencePiece .model (SentencePieceTokenizer,
    GPTSentencePieceTokenizer, Llama2Tokenizer), a Hugging Face tokenizer directory or
    tokenizer.json (HuggingFaceTokenizer; local files only), or Megatron-LM's tiktoken
    JSON vocabulary (TikTokenizer)."""
    vocab_size: Optional[int] = None
    """Vocabulary size for NullTokenizer and --mock-data without a tokenizer; with
    TikTokenizer the whole vocabulary, special tokens included (default 131072)."""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer's vocabulary (GPT-2's vocab.json)."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer's BPE merges (GPT-2's merges.txt)."""
    vocab_extra_ids: int = 0
    """SentencePieceTokenizer: add this many <extra_id_N> special tokens (T5 sentinels)."""
    tiktoken_pattern: Optional[str] = option(None, choices=("v1", "v2"))
    """TikTokenizer's pre-tokenization regex: Megatron-LM's v1 or v2 pattern."""
    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: ids 0..N-1 are special tokens (the given ones, then <SPECIAL_i>
    fillers); the vocabulary file's tokens follow."""
    tokenizer_special_tokens: Optional[List[str]] = option(None, nargs="+", metavar="TOKEN")
    """TikTokenizer's special tokens, in id order; must include <unk> <s> </s> (the
    default is just those three)."""
    tiktoken_special_tokens: Optional[List[str]] = option(None, nargs="+", metavar="TOKEN")
    """Megatron-LM's older spelling of --tokenizer-special-tokens (used when that is not
    given)."""
    eod_mask_loss: bool = False
    """Do not compute the loss on end-of-document tokens."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    mmap_bin_files: bool = option(True, negate="--no-mmap-bin-files")
    """Read the PREFIX.bin files with plain reads instead of memory-mapping them."""
    create_attention_mask_in_dataloader: bool = option(
        True, negate="--no-create-attention-mask-in-dataloader")
    """Accepted for Megatron-LM scripts: the data loader never builds the dense attention
    mask here (attention is causal by construction in every backend), so the flag only
    confirms what happens anyway."""
    data_cache_path: Optional[str] = None
    """Directory for megatron-core's dataset index caches (default: megatron-core's
    choice, a folder PREFIX/cache beside each data prefix)."""

    def __post_init__(self):
        _positive(self, "vocab_size", "tiktoken_num_special_tokens")
        if self.vocab_extra_ids < 0:
            raise UsageError("--vocab-extra-ids must be >= 0")
        if self.num_workers < 0:
            raise UsageError("--num-workers must be >= 0")
        _output_path("--data-cache-path", self.data_cache_path)


@dataclasses.dataclass
class CheckpointConfig:
    """Saving and resuming (megatron-core dist_checkpointing, torch_dist format)."""

    save: Optional[str] = None
    """Directory to save checkpoints to (iter_NNNNNNN/ folders and a 'latest' pointer)."""
    load: Optional[str] = None
    """Directory to resume from (the iteration named by its 'latest' pointer)."""
    save_interval: Optional[int] = None
    """Save every this many iterations (and at the end of training when --save is given)."""
    finetune: bool = False
    """Load only the model weights from --load: iteration, data position, optimizer and
    scheduler start fresh."""
    load_optim: bool = option(True, negate="--no-load-optim")
    """Do not load the optimizer state from --load (the fp32 masters are rebuilt from the
    loaded weights)."""
    load_rng: bool = option(True, negate="--no-load-rng")
    """Do not load the random-number-generator states from --load."""
    ckpt_format: str = option("torch_dist", choices=("torch", "torch_dist", "torch_dcp",
                                                     "fsdp_dtensor"))
    """Checkpoint format: torch_dist (megatron-core dist_checkpointing, the default as
    Megatron-LM) is the only one written and read here; the others are refused."""
    dist_ckpt_strictness: str = option(
        "assume_ok_unexpected", choices=("assume_ok_unexpected", "log_unexpected", "log_all",
                                         "raise_unexpected", "raise_all", "return_unexpected",
                                         "return_all", "ignore_all"))
    """How dist_checkpointing's load treats keys of the checkpoint and of the model that do
    not match (megatron-core StrictHandling); return_unexpected / return_all are refused
    (nothing here reads the returned lists: use log_all)."""

    use_checkpoint_args: bool = False
    """Take the model's architecture (layers, hidden size, heads, FFN size, positions,
    normalization, SwiGLU, biases, dropout, ...) from the --load checkpoint instead of the
    flags (Megatron-LM's flag). Without it, architecture settings that differ from the
    checkpoint's are refused, naming them."""
    override_opt_param_scheduler: bool = option(False, flag="--override-opt_param-scheduler")
    """On --load, set the learning-rate and weight-decay schedule (--lr, --min-lr,
    --lr-warmup-iters, decay iterations, --lr-decay-style, --weight-decay) from the flags
    and ignore the checkpoint's (Megatron-LM's flag); e.g. to extend --train-iters."""
    use_checkpoint_opt_param_scheduler: bool = option(
        False, flag="--use-checkpoint-opt_param-scheduler")
    """On --load, keep the checkpoint's learning-rate and weight-decay schedule and ignore
    the flags' (Megatron-LM's flag). Without this or --override-opt_param-scheduler, a
    schedule that differs from the checkpoint's is refused, naming what differs."""

    def __post_init__(self):
        _positive(self, "save_interval")
        _output_path("--save", self.save)
        if self.ckpt_format != "torch_dist":
            raise UsageError(f"--ckpt-format {self.ckpt_format}: only torch_dist "
                             "(megatron-core dist_checkpointing) is supported; use torch_dist")
        if self.dist_ckpt_strictness.startswith("return_"):
            raise UsageError(f"--dist-ckpt-strictness {self.dist_ckpt_strictness}: nothing "
                             "here reads the returned key lists; use log_all or raise_all")
        if self.use_checkpoint_args and not self.load:
            raise UsageError("--use-checkpoint-args needs --load DIR (the checkpoint to take "
                             "the model settings from)")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise UsageError("--override-opt_param-scheduler and "
                             "--use-checkpoint-opt_param-scheduler are exclusive; give one")


@dataclasses.dataclass
class LoggingConfig:
    """Metrics: stdout line, JSONL and wandb."""

    metrics_path: Optional[str] = None
    """Append one JSON record per logged iteration (and per evaluation) to this file."""
    wandb_project: Optional[str] = None
    """wandb project name; wandb logging is on when it is given (rank 0 only)."""
    wandb_exp_name: Optional[str] = None
    """wandb run name."""
    wandb_save_dir: Optional[str] = None
    """Directory of the wandb run files (default: <--save>/wandb or ./wandb)."""
    wandb_mode: str = option("offline", choices=("offline", "online", "disabled"))
    """wandb mode: offline (default; files only, sync later with 'wandb sync'), online, or
    disabled."""
    log_throughput: bool = False
    """Add the throughput (TFLOP/s per GPU, 6N estimate) to the stdout line; the metrics
    record always has it."""
    log_params_norm: bool = False
    """Compute and log the L2 norm of the parameters (fp32, over all model-parallel ranks)."""
    log_num_zeros_in_grad: bool = False
    """Count and log the zero entries of the gradients (megatron-core's optimizer)."""
    timing_log_level: int = option(0, choices=(0, 1, 2))
    """Detail of the timers: 0 the iteration breakdown, 1 and 2 finer timers."""
    profile: bool = False
    """Profile iterations --profile-step-start+1 to --profile-step-end on --profile-ranks,
    as Megatron-LM: by itself, an nsys capture range (cudaProfilerStart/Stop and NVTX
    ranges around those steps; run under 'nsys profile --capture-range=cudaProfilerApi
    --capture-range-end=stop'; needs CUDA); with --use-pytorch-profiler, torch.profiler
    (CPU and CUDA)."""
    use_pytorch_profiler: bool = False
    """With --profile: torch.profiler instead of an nsys range. Writes a table of the
    operators and labelled ranges by time and a Chrome trace to --profile-dir
    (rankN-iterA-B.txt/.json), and, as Megatron-LM, the trace to --tensorboard-dir for
    TensorBoard's profiler plugin when that is given."""
    profile_step_start: int = 10
    """Profiling starts after this many iterations (the first profiled one is the next)."""
    profile_step_end: int = 12
    """Last profiled iteration (1-based)."""
    profile_ranks: List[int] = option(default_factory=lambda: [0], nargs="+", metavar="RANK")
    """Global ranks that profile."""
    profile_dir: str = "profile"
    """Directory of --use-pytorch-profiler's files (rankN-iterA-B.txt and .json)."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard event files to this directory (the last rank writes, as in
    Megatron-LM), with Megatron-LM's tag names ('lm loss', 'learning-rate', 'batch-size',
    'grad-norm', 'loss-scale', 'lm loss validation', ... and their 'vs samples' twins)."""
    tensorboard_log_interval: int = 1
    """Write the training scalars to TensorBoard every this many iterations."""
    tensorboard_queue_size: int = 1000
    """Events TensorBoard's writer queues before it flushes to disk."""
    log_timers_to_tensorboard: bool = False
    """Write 'iteration-time' and the timers of --timing-log-level (1: forward-backward,
    all-grads-sync, optimizer; 2: also forward-compute, backward-compute) as '<name>-time',
    in seconds per iteration, every --log-interval iterations."""
    log_loss_scale_to_tensorboard: bool = option(True,
                                                 negate="--no-log-loss-scale-to-tensorboard")
    """Do not write 'loss-scale' to TensorBoard (written by default, as in Megatron-LM)."""
    log_validation_ppl_to_tensorboard: bool = False
    """Write 'lm loss validation ppl' (the validation perplexity) to TensorBoard."""
    log_memory_to_tensorboard: bool = False
    """Write CUDA memory statistics (mem-reserved-bytes, mem-allocated-bytes,
    mem-max-allocated-bytes, mem-allocated-count) to TensorBoard; needs a GPU."""
    log_world_size_to_tensorboard: bool = False
    """Write 'world-size' to TensorBoard."""

    def __post_init__(self):
        if self.profile and not 0 <= self.profile_step_start < self.profile_step_end:
            raise UsageError("--profile needs 0 <= --profile-step-start < --profile-step-end "
                             "(it profiles iterations start+1 to end)")
        if self.use_pytorch_profiler and not self.profile:
            raise UsageError("--use-pytorch-profiler chooses how --profile profiles; add "
                             "--profile")
        _positive(self, "tensorboard_log_interval", "tensorboard_queue_size")
        _output_path("--metrics-path", self.metrics_path, directory=False)
        _output_path("--tensorboard-dir", self.tensorboard_dir)
        _output_path("--wandb-save-dir", self.wandb_save_dir)
        if self.use_pytorch_profiler:
            _output_path("--profile-dir", self.profile_dir)
        tb_only = [name for name in ("log_timers_to_tensorboard",
                                     "log_validation_ppl_to_tensorboard",
                                     "log_memory_to_tensorboard", "log_world_size_to_tensorboard")
                   if getattr(self, name)]
        if tb_only and not self.tensorboard_dir:
            raise UsageError(f"--{tb_only[0].replace('_', '-')} writes to TensorBoard: add "
                             "--tensorboard-dir DIR")


def _step_sync(text: str) -> str:
    if text not in ("device", "stream"):
        raise ValueError("give stream (wait for the training stream only, the default) or "
                         "device (for every stream)")
    return text


@dataclasses.dataclass
class RuntimeConfig:
    """Where the run executes."""

    device: str = option("auto", choices=("auto", "cuda", "cpu"))
    """Device to train on: cuda, cpu (megatron-core through the CPU compatibility layer,
    gloo), or auto (cuda when a GPU is visible)."""

    step_sync: str = knob("stream", env="MEGATRON_EXT_STEP_SYNC", parse=_step_sync)
    """What the phase timers wait for on a GPU. ``stream`` (the default): the training stream
    only; copies an optimizer leaves running on its own streams (ZenFlow's delayed gradients
    to the host, the CPU update's weights to the GPU) go on into the next iteration, and
    whatever waits for them later pays for them there. ``device``: every stream of the
    device, so each phase's time includes those copies. The iteration time is wall time
    either way."""
