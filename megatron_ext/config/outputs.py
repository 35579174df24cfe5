"""Configs of what a run writes: checkpoints, logs and metrics.

The conventions of every section are in :mod:`megatron_ext.config`.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from megatron_ext.config.checks import output_path, positive
from megatron_ext.config.megatron_compat import value_refusal
from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import option


@dataclasses.dataclass
class CheckpointConfig:
    """Saving and resuming (megatron-core dist_checkpointing, torch_dist format)."""

    save: Optional[str] = None
    """Directory to save checkpoints to (iter_NNNNNNN/ folders and a 'latest' pointer)."""
    load: Optional[str] = None
    """Directory to resume from (the iteration named by its 'latest' pointer)."""
    save_interval: Optional[int] = None
    """Save every this many iterations into --save (and at the end of training when --save
    is given). Without --save nothing is saved, as in Megatron-LM (a launch script whose
    --save line was dropped keeps running; the log says so at start-up)."""
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

    def save_note(self) -> Optional[str]:
        """The start-up's line when --save-interval is given without --save (else None)."""
        if self.save_interval and not self.save:
            return (f"--save-interval {self.save_interval} without --save: no checkpoint will "
                    "be saved (give --save DIR to save them)")
        return None

    def __post_init__(self):
        positive(self, "save_interval")
        output_path("--save", self.save)
        refused = value_refusal("--ckpt-format", self.ckpt_format)
        if refused:
            raise UsageError(refused)
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
        positive(self, "tensorboard_log_interval", "tensorboard_queue_size")
        output_path("--metrics-path", self.metrics_path, directory=False)
        output_path("--tensorboard-dir", self.tensorboard_dir)
        output_path("--wandb-save-dir", self.wandb_save_dir)
        if self.use_pytorch_profiler:
            output_path("--profile-dir", self.profile_dir)
        tb_only = [name for name in ("log_timers_to_tensorboard",
                                     "log_validation_ppl_to_tensorboard",
                                     "log_memory_to_tensorboard", "log_world_size_to_tensorboard")
                   if getattr(self, name)]
        if tb_only and not self.tensorboard_dir:
            raise UsageError(f"--{tb_only[0].replace('_', '-')} writes to TensorBoard: add "
                             "--tensorboard-dir DIR")
