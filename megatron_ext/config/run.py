"""The run's config: the sections of every concern, and the checks across them."""

from __future__ import annotations

import dataclasses

from megatron_ext.config.data import DataConfig
from megatron_ext.config.model import ModelConfig, ParallelConfig
from megatron_ext.config.outputs import CheckpointConfig, LoggingConfig
from megatron_ext.config.runtime import RuntimeConfig
from megatron_ext.config.training import OptimizerConfig, TrainingConfig
from megatron_ext.data.tokenizer import check_tokenizer_flags
from megatron_ext.errors import UsageError
from megatron_ext.memory.config import PlanConfig
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.optim.modes import enabled_modes
from megatron_ext.runtime.batch_schedule import check_rampup, train_iters_from_samples
from megatron_ext.runtime.faults import FaultConfig
from megatron_ext.zenflow.config import ZenFlowConfig


@dataclasses.dataclass
class RunConfig:
    """Everything a pretraining run is configured with, one section per concern."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    zenflow: ZenFlowConfig = dataclasses.field(default_factory=ZenFlowConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    plan: PlanConfig = dataclasses.field(default_factory=PlanConfig)
    faults: FaultConfig = dataclasses.field(default_factory=FaultConfig)

    def __post_init__(self):
        self._check_flags()
        self.zenflow.resolve_cpu_states(offload_optimizer=self.offload.offload_optimizer)
        self._check_schedule_flags()

    def _check_schedule_flags(self) -> None:
        """Iteration-based and sample-based flags do not mix (Megatron-LM asserts it)."""
        train, opt = self.training, self.optimizer
        if train.train_samples is None:
            unit, other = "--train-iters", {
                "--lr-warmup-samples": opt.lr_warmup_samples or None,
                "--lr-decay-samples": opt.lr_decay_samples,
                "--lr-wsd-decay-samples": opt.lr_wsd_decay_samples}
            warmup, wsd = ("--lr-warmup-iters", opt.lr_warmup_iters), opt.lr_wsd_decay_iters
            wsd_flag = "--lr-wsd-decay-iters"
        else:
            unit, other = "--train-samples", {
                "--lr-warmup-iters": opt.lr_warmup_iters or None,
                "--lr-decay-iters": opt.lr_decay_iters,
                "--lr-wsd-decay-iters": opt.lr_wsd_decay_iters}
            warmup, wsd = ("--lr-warmup-samples", opt.lr_warmup_samples), opt.lr_wsd_decay_samples
            wsd_flag = "--lr-wsd-decay-samples"
        mixed = [flag for flag, value in other.items() if value is not None]
        if mixed and (train.train_iters is not None or train.train_samples is not None):
            counted = "samples" if unit == "--train-samples" else "iterations"
            raise UsageError(f"{mixed[0]} does not go with {unit}: a run counts its schedule in "
                             f"{counted} only (as Megatron-LM); give the {counted[:-1]}-based "
                             "flag instead")
        if opt.lr_warmup_fraction is not None and warmup[1]:
            raise UsageError(f"--lr-warmup-fraction and {warmup[0]} both set the warm-up; give "
                             "one of them (as Megatron-LM)")
        if opt.lr_decay_style == "WSD" and wsd is None and not train.skip_train:
            raise UsageError(f"--lr-decay-style WSD needs the length of its annealing phase: "
                             f"give {wsd_flag} N (as Megatron-LM)")

    def _check_flags(self) -> None:
        """Checks of flag combinations that need no knowledge of the machine."""
        data, ckpt = self.data, self.checkpoint
        if data.mock_data and data.data_path:
            raise UsageError("--mock-data and --data-path are exclusive; give one of them")
        if not data.mock_data and not data.data_path:
            raise UsageError("no training data: give --data-path PREFIX (or --mock-data)")
        if data.data_path:
            # The weights' format, before anything starts (the files are read later).
            from megatron_ext.data.data_path import parse_data_path

            parse_data_path(data.data_path)
        check_tokenizer_flags(data)
        if data.tokenizer_type in (None, "NullTokenizer") and data.vocab_size is None:
            raise UsageError(
                "no vocabulary: give --tokenizer-type SentencePieceTokenizer --tokenizer-model "
                "FILE, or --vocab-size N"
            )
        if data.data_path and data.tokenizer_type is None:
            raise UsageError("--data-path needs --tokenizer-type (and --tokenizer-model)")
        if self.training.skip_train:
            # Megatron-LM: --skip-train enables --no-load-optim (nothing is trained).
            ckpt.load_optim = False
        if ckpt.finetune and not ckpt.load:
            raise UsageError("--finetune needs --load DIR (the pretrained checkpoint)")
        # The rules each enabled optimizer mode puts on the other flags (the plain mode's
        # always: megatron-core's --optimizer-cpu-offload), in the registry's order.
        for mode in enabled_modes(self):
            for requirement in mode.requirements:
                requirement.check(self)
        model = self.model
        if model.recompute_granularity == "selective" and model.attention_backend == "sdpa":
            # Selective recompute wraps megatron-core's core attention module; the SDPA
            # module keeps no score matrix, so there is nothing to recompute.
            raise UsageError(
                "--recompute-granularity selective has no effect with the SDPA core attention "
                "(it keeps no score matrix); use full, or --attention-backend auto or local"
            )
        if self.training.deterministic_mode and model.cross_entropy_loss_fusion:
            raise UsageError("--deterministic-mode: the fused cross entropy is not deterministic; "
                             "drop --cross-entropy-loss-fusion (as Megatron-LM)")
        if self.parallel.grad_reduce_in_bf16 and not self.training.bf16:
            raise UsageError("--grad-reduce-in-bf16 needs --bf16")

    def check_world(self, world_size: int) -> int:
        """Checks the parallel layout against the world size; returns the DP size."""
        par = self.parallel
        model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
        if world_size % model_parallel:
            raise UsageError(
                f"world size {world_size} is not divisible by tensor-parallel size "
                f"{par.tensor_model_parallel_size} x pipeline-parallel size "
                f"{par.pipeline_model_parallel_size}"
            )
        dp = world_size // model_parallel
        tp = par.tensor_model_parallel_size
        model = self.model
        if model.num_attention_heads % tp:
            raise UsageError(
                f"--num-attention-heads {model.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}"
            )
        groups = (model.num_query_groups if model.group_query_attention
                  else model.num_attention_heads)
        if groups % tp:
            raise UsageError(f"--num-query-groups {groups} is not divisible by "
                             f"--tensor-model-parallel-size {tp}")
        if par.sequence_parallel and tp > 1 and model.seq_length % tp:
            raise UsageError(f"--sequence-parallel: --seq-length {model.seq_length} is not "
                             f"divisible by --tensor-model-parallel-size {tp}")
        if model.num_layers % par.pipeline_model_parallel_size:
            raise UsageError(
                f"--num-layers {model.num_layers} is not divisible by "
                f"--pipeline-model-parallel-size {par.pipeline_model_parallel_size}"
            )
        vpp = self.virtual_pipeline_size()
        train = self.training
        per_step = train.micro_batch_size * dp
        if train.global_batch_size is None:
            train.global_batch_size = per_step
        if train.global_batch_size % per_step:
            raise UsageError(
                f"--global-batch-size {train.global_batch_size} is not divisible by "
                f"--micro-batch-size {train.micro_batch_size} x data-parallel size {dp}"
            )
        pp = par.pipeline_model_parallel_size
        micro_batches = train.global_batch_size // per_step
        if vpp is not None and micro_batches % pp:
            raise UsageError(
                f"the interleaved schedule needs a number of micro-batches that is a multiple of "
                f"--pipeline-model-parallel-size {pp}; --global-batch-size "
                f"{train.global_batch_size} / (--micro-batch-size {train.micro_batch_size} x "
                f"data-parallel size {dp}) gives {micro_batches}")
        if train.rampup_batch_size is not None:
            check_rampup(train.rampup_batch_size, train.global_batch_size, per_step,
                         pp if vpp is not None else None)
        if train.train_samples is not None:
            # Megatron-LM's update_train_iters: the iterations the samples (and the ramp) give.
            train.train_iters = train_iters_from_samples(
                train.train_samples, train.global_batch_size, train.rampup_batch_size)
        return dp

    def virtual_pipeline_size(self):
        """Model chunks per pipeline rank with the interleaved schedule; None without it.

        Megatron-LM's rules: from --num-layers-per-virtual-pipeline-stage (the layers of a
        pipeline stage must divide into chunks of that many) or
        --num-virtual-stages-per-pipeline-rank; one chunk is no interleaving.
        """
        par, layers = self.parallel, self.model.num_layers
        pp = par.pipeline_model_parallel_size
        per_chunk = par.num_layers_per_virtual_pipeline_stage
        vpp = par.num_virtual_stages_per_pipeline_rank
        if per_chunk is None and vpp is None:
            return None
        if layers % pp:
            raise UsageError(f"--num-layers {layers} is not divisible by "
                             f"--pipeline-model-parallel-size {pp}")
        if per_chunk is not None:
            if (layers // pp) % per_chunk:
                raise UsageError(
                    f"the {layers // pp} layers per pipeline stage (--num-layers {layers} / "
                    f"--pipeline-model-parallel-size {pp}) are not divisible by "
                    f"--num-layers-per-virtual-pipeline-stage {per_chunk}")
            vpp = layers // pp // per_chunk
        elif (layers // pp) % vpp:
            raise UsageError(f"the {layers // pp} layers per pipeline stage are not divisible "
                             f"by --num-virtual-stages-per-pipeline-rank {vpp}")
        if vpp == 1:
            return None
        if pp == 1:
            raise UsageError("the interleaved schedule (virtual pipeline stages) needs "
                             "--pipeline-model-parallel-size >= 2")
        if not par.overlap_p2p_comm and pp <= 2:
            raise UsageError("--no-overlap-p2p-communication with the interleaved schedule "
                             "needs --pipeline-model-parallel-size > 2 (Megatron-LM's rule)")
        return vpp

    def to_dict(self) -> dict:
        """The config as plain nested dicts (for logging and checkpoints)."""
        return dataclasses.asdict(self)
