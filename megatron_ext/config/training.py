"""Configs of the training schedule and the optimizer (Megatron-LM's flags of both).

The conventions of every section are in :mod:`megatron_ext.config`.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from megatron_ext.config.checks import positive, required
from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import option


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
        required(("--micro-batch-size", self.micro_batch_size))
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
        positive(self, "micro_batch_size", "global_batch_size", "exit_interval",
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
        required(("--lr", self.lr))
        positive(self, "lr", "adam_eps", "lr_decay_iters", "decoupled_lr", "lr_decay_samples",
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
