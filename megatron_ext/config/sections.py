"""Typed configs of the run, one dataclass per concern.

Every field has a docstring (the string under it): ``--help`` is generated from them.
Flag names and meanings follow Megatron-LM where Megatron-LM has the flag. Bounds of a
single field are checked in ``__post_init__``; checks that involve several sections or the
world size live in :mod:`megatron_ext.config.run`.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from megatron_ext.config.fields import option
from megatron_ext.errors import UsageError


def _positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")


@dataclasses.dataclass
class ModelConfig:
    """The GPT architecture."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Transformer hidden size."""
    num_attention_heads: int = 4
    """Number of attention heads (must divide --hidden-size)."""
    ffn_hidden_size: Optional[int] = None
    """Hidden size of the MLP. Default: 4 x hidden size, or (8/3) x hidden size rounded up
    to a multiple of 64 with --swiglu (Megatron-LM's rule)."""
    seq_length: int = 128
    """Sequence length of each training sample, in tokens."""
    max_position_embeddings: Optional[int] = None
    """Size of the learned position table (learned_absolute) and the RoPE cache.
    Default: --seq-length."""
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
    transformer_impl: str = option("local", choices=("local", "transformer_engine"))
    """Layer implementation: megatron-core's local modules (with core attention on
    torch's scaled_dot_product_attention), or Transformer Engine's (needs
    transformer_engine installed and a GPU)."""
    attention_backend: str = option("sdpa", choices=("sdpa", "unfused"))
    """Core attention of the local implementation: torch scaled_dot_product_attention
    (flash / memory-efficient kernels on GPU) or megatron-core's unfused
    DotProductAttention (materializes the full score matrix; for comparison)."""
    recompute_granularity: Optional[str] = option(None, choices=("full", "selective"))
    """Activation recomputation: full (recompute whole layers, see --recompute-method and
    --recompute-num-layers) or selective (recompute the core attention only)."""
    recompute_method: str = option("uniform", choices=("uniform", "block"))
    """With --recompute-granularity full: uniform (recompute every chunk of
    --recompute-num-layers layers) or block (only the first --recompute-num-layers
    layers of each pipeline stage)."""
    recompute_num_layers: int = 1
    """Layers per recomputation chunk (uniform) or recomputed layers per stage (block)."""

    def __post_init__(self):
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "seq_length", "max_position_embeddings", "num_query_groups",
                  "make_vocab_size_divisible_by", "recompute_num_layers")
        if self.hidden_size % self.num_attention_heads:
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
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if (self.position_embedding_type == "learned_absolute"
                and self.max_position_embeddings < self.seq_length):
            raise UsageError(
                f"--max-position-embeddings {self.max_position_embeddings} is smaller than "
                f"--seq-length {self.seq_length}"
            )
        if self.ffn_hidden_size is None:
            if self.swiglu:
                self.ffn_hidden_size = ((8 * self.hidden_size // 3 + 63) // 64) * 64
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
    """Accumulate and reduce gradients in fp32 (with --bf16)."""
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
                  "ddp_bucket_size", "distributed_timeout_minutes",
                  "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
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

    micro_batch_size: int = 2
    """Samples per micro-batch on each data-parallel rank."""
    global_batch_size: Optional[int] = None
    """Samples per iteration over all data-parallel ranks; a multiple of micro batch x DP
    (the quotient is the number of micro-batches accumulated). Default: micro batch x DP."""
    train_iters: int = 20
    """Number of iterations to train for (optimizer steps)."""
    exit_interval: Optional[int] = None
    """Save (when --save is given) and exit when the iteration is a multiple of this."""
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
    eval_interval: int = 1000
    """Evaluate on the validation split every this many iterations (and at the end)."""
    eval_iters: int = 10
    """Iterations (global batches) per evaluation; 0 disables evaluation."""
    log_interval: int = 10
    """Log the iteration breakdown every this many iterations."""

    def __post_init__(self):
        _positive(self, "micro_batch_size", "global_batch_size", "train_iters", "exit_interval",
                  "eval_interval", "log_interval", "loss_scale", "initial_loss_scale")
        if self.eval_iters < 0:
            raise UsageError("--eval-iters must be >= 0")
        if self.bf16 and self.fp16:
            raise UsageError("--bf16 and --fp16 are exclusive; choose one")


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW and the learning-rate schedule (megatron-core's OptimizerParamScheduler)."""

    optimizer: str = option("adam", choices=("adam", "sgd"))
    """Optimizer: adam (AdamW, decoupled weight decay) or sgd."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: str = option("cosine", choices=("constant", "linear", "cosine",
                                                    "inverse-square-root", "WSD"))
    """Shape of the learning-rate decay after warm-up."""
    lr_warmup_iters: int = 0
    """Iterations of linear learning-rate warm-up from 0."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the learning rate decays (default: --train-iters)."""
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

    def __post_init__(self):
        _positive(self, "lr", "adam_eps", "lr_decay_iters")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise UsageError(f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        if self.lr_warmup_iters < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise UsageError("--lr-warmup-iters, --weight-decay and --clip-grad must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UsageError(f"--{name.replace('_', '-')} must be in [0, 1)")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise UsageError("--optimizer-offload-fraction must be in [0, 1]")


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
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    data_cache_path: Optional[str] = None
    """Directory for megatron-core's dataset index caches (default: megatron-core's
    choice, a folder PREFIX/cache beside each data prefix)."""

    def __post_init__(self):
        _positive(self, "vocab_size", "tiktoken_num_special_tokens")
        if self.vocab_extra_ids < 0:
            raise UsageError("--vocab-extra-ids must be >= 0")
        if self.num_workers < 0:
            raise UsageError("--num-workers must be >= 0")


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

    def __post_init__(self):
        _positive(self, "save_interval")


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
        tb_only = [name for name in ("log_timers_to_tensorboard",
                                     "log_validation_ppl_to_tensorboard",
                                     "log_memory_to_tensorboard", "log_world_size_to_tensorboard")
                   if getattr(self, name)]
        if tb_only and not self.tensorboard_dir:
            raise UsageError(f"--{tb_only[0].replace('_', '-')} writes to TensorBoard: add "
                             "--tensorboard-dir DIR")


@dataclasses.dataclass
class RuntimeConfig:
    """Where the run executes."""

    device: str = option("auto", choices=("auto", "cuda", "cpu"))
    """Device to train on: cuda, cpu (megatron-core through the CPU compatibility layer,
    gloo), or auto (cuda when a GPU is visible)."""
