"""A checkpoint's full model in one process (TP=1, PP=1), for the tools.

The tools (convert, generate, evaluate) read a checkpoint of any saved TP/PP layout:
megatron-core's dist_checkpointing reshards on load, so a TP=1 PP=1 GPTModel built from
the checkpoint's own model settings loads it whole. The settings come from the
checkpoint's common state: this project's ``config`` (the RunConfig as nested dicts), or
a Megatron-LM ``args`` namespace where only that exists.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Optional

import torch

from megatron_ext.errors import UsageError
from megatron_ext.runtime.dtypes import DTYPES as STATE_DTYPES

# The common-state marker of a checkpoint that holds model weights only (no optimizer,
# scheduler or data position), e.g. one converted from Hugging Face.
WEIGHTS_ONLY = "weights_only"


def resolve_checkpoint(load: str) -> str:
    """The iteration folder that ``load`` names.

    ``load`` is a --save root (its 'latest' pointer) or an ``iter_NNNNNNN`` folder.

    Raises:
        UsageError: neither.
    """
    from megatron_ext.checkpoint import load_checks

    if not os.path.isdir(load):
        raise UsageError(f"--load {load}: no such directory")
    if os.path.isfile(os.path.join(load, "metadata.json")):
        return load
    path = load_checks.latest_checkpoint(load)
    if path is None:
        raise UsageError(f"--load {load}: not a checkpoint (no {load_checks.TRACKER} and no "
                         "metadata.json); give the --save directory of a run")
    return path


def read_common(path: str) -> dict:
    """The common state of the checkpoint at ``path`` (an iteration folder)."""
    from megatron_ext.checkpoint import integrity

    try:
        return integrity.read_common_state(path)
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - any unreadable file is bad input here
        raise UsageError(f"--load {path}: cannot read the checkpoint's common state ({err})")


def _args_dict(common: dict) -> Optional[dict]:
    """Megatron-LM's saved ``args`` as a dict, or None."""
    args = common.get("args")
    if args is None:
        return None
    return dict(args) if isinstance(args, dict) else dict(vars(args))


_DTYPE_NAMES = {**{dtype: name for name, dtype in STATE_DTYPES.items()}, torch.uint8: "fp8"}
"""Megatron-LM's args hold the state dtypes as torch dtypes (its validate_args maps them;
fp8 to uint8)."""


def saved_sections(common: dict) -> dict:
    """The run's config sections as dicts, from ``config`` or Megatron-LM's ``args``.

    Raises:
        UsageError: the checkpoint records no model settings.
    """
    from megatron_ext.config.run import RunConfig

    if isinstance(common.get("config"), dict) and "model" in common["config"]:
        return common["config"]
    args = _args_dict(common)
    if args is None:
        raise UsageError("the checkpoint records no model settings (no 'config' or 'args' in "
                         "its common state); it was not written by megatron_ext or Megatron-LM")
    args = {k: _DTYPE_NAMES.get(v, v) if isinstance(v, torch.dtype) else v
            for k, v in args.items()}
    sections = {}
    for section in dataclasses.fields(RunConfig):
        names = {f.name for f in dataclasses.fields(section.default_factory)}
        sections[section.name] = {k: v for k, v in args.items() if k in names}
    # Megatron-LM keeps the positive form of these switches.
    if "add_bias_linear" in args:
        sections["model"]["disable_bias_linear"] = not args["add_bias_linear"]
    return sections


def _section(cls, values: dict, **overrides):
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in (values or {}).items() if k in names}
    kwargs.update(overrides)
    return cls(**kwargs)


def model_config(common: dict):
    """The ModelConfig the checkpoint was trained with."""
    from megatron_ext.config.model import ModelConfig

    return _section(ModelConfig, saved_sections(common)["model"])


def run_config(common: dict, *, device: str = "cpu", fp32: bool = True, data: Optional[dict] = None,
               training: Optional[dict] = None, load: Optional[str] = None):
    """A RunConfig for one process from the checkpoint's settings.

    Model, training (batch sizes, seed, evaluation) and data settings are the run's;
    parallelism is TP=1 PP=1, the plain optimizer, no offload or ZenFlow, no logging
    backends. ``data`` and ``training`` override fields of those sections; without
    ``data`` the run is on mock data (the model's users need no corpus).
    """
    from megatron_ext.config.data import DataConfig
    from megatron_ext.config.model import ModelConfig, ParallelConfig
    from megatron_ext.config.outputs import CheckpointConfig, LoggingConfig
    from megatron_ext.config.run import RunConfig
    from megatron_ext.config.runtime import RuntimeConfig
    from megatron_ext.config.training import OptimizerConfig, TrainingConfig

    saved = saved_sections(common)
    # Values a checkpoint without a training section (a converted one) still needs.
    train = {"micro_batch_size": 1, "train_iters": 1, **saved.get("training", {})}
    if train.get("train_samples") is not None:
        # A --train-samples run records the iterations it derived too; the flags give one.
        train["train_iters"] = None
    if fp32:
        train.update(bf16=False, fp16=False)
    train.update(training or {})
    if data is None:
        vocab = saved.get("data", {}).get("vocab_size") or 1
        data = {"mock_data": True, "data_path": [], "tokenizer_type": None,
                "tokenizer_model": None, "vocab_file": None, "merge_file": None,
                "tiktoken_pattern": None, "vocab_size": vocab}
    data_values = {**saved.get("data", {}), **data}
    return RunConfig(
        model=_section(ModelConfig, saved["model"]),
        parallel=ParallelConfig(),
        training=_section(TrainingConfig, train),
        # The plain optimizer: the tools never step it, and a run's precision-aware states
        # (honoured with --offload-optimizer only) would not validate without the offload.
        optimizer=_section(OptimizerConfig, {"lr": 1e-4, **saved.get("optimizer", {})},
                           optimizer_cpu_offload=False, use_precision_aware_optimizer=False,
                           main_params_dtype="fp32", exp_avg_dtype="fp32",
                           exp_avg_sq_dtype="fp32"),
        data=_section(DataConfig, data_values),
        checkpoint=CheckpointConfig(load=load),
        logging=LoggingConfig(wandb_mode="disabled"),
        runtime=RuntimeConfig(device=device),
    )


def saved_vocab_size(path: str) -> int:
    """The (padded) vocabulary size of the checkpoint's embedding, from its metadata."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(path)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in metadata:
            return int(metadata[key].global_shape[0])
    raise UsageError(f"--load {path}: the checkpoint holds no embedding weights")


def initialize_single(cfg):
    """torch.distributed and megatron-core's parallel state for this one process."""
    from megatron_ext.runtime.distributed import initialize, read_process_env

    _, world, _ = read_process_env()
    if world != 1:
        raise UsageError("the tools run as one process (not under torchrun); any saved TP/PP "
                         "layout is resharded into it")
    return initialize(cfg)


def build_bare_model(cfg, runtime, vocab_size: int):
    """The full GPTModel (TP=1, PP=1) of ``cfg``, in eval mode."""
    from megatron_ext.model.build import build_gpt_model

    model, _ = build_gpt_model(cfg, runtime, vocab_size)
    if cfg.training.bf16:
        model = model.to(torch.bfloat16)
    elif cfg.training.fp16:
        model = model.to(torch.float16)
    return model.eval()


def load_weights(model, path: str) -> None:
    """Loads the model weights of the checkpoint at ``path`` into ``model`` (any layout).

    Its files are verified against its manifest first (as ``pretrain_gpt.py --load`` does).
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_ext.checkpoint import integrity

    integrity.verify(path)
    try:
        with integrity.weights_only_sharded_objects(path):
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    except UsageError:
        raise
    # torch's CheckpointException (a file that does not read) is a BaseException.
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - the user's input
        raise UsageError(f"--load {path}: the checkpoint's weights do not fit the model its "
                         f"settings describe ({str(err).splitlines()[0][:300]})")
    model.load_state_dict(loaded["model"])


def load_model(load: str, device: str = "cpu", fp32: bool = True):
    """The full model of a checkpoint, ready for inference.

    Returns:
        (GPTModel, RunConfig, Runtime, common state)
    """
    path = resolve_checkpoint(load)
    common = read_common(path)
    cfg = run_config(common, device=device, fp32=fp32)
    cfg.check_world(1)
    runtime = initialize_single(cfg)
    model = build_bare_model(cfg, runtime, saved_vocab_size(path))
    load_weights(model, path)
    return model, cfg, runtime, common


def save_weights_checkpoint(model, cfg, root: str) -> str:
    """Saves ``model`` as a weights-only checkpoint (iteration 0) under ``root``.

    pretrain_gpt.py loads it with ``--load ROOT --finetune`` (and the model flags the
    config holds). Written to a temporary folder with its integrity manifest and renamed,
    then the pointer.

    Returns:
        the iteration folder.
    """
    from megatron_ext.checkpoint import checkpointing as ckpt
    from megatron_ext.checkpoint import integrity
    from megatron_ext.runtime import mcore_compat

    final = ckpt.checkpoint_name(root, 0)
    tmp = final + ".tmp"
    os.makedirs(root, exist_ok=True)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    state = {
        "model": model.sharded_state_dict(),
        "checkpoint_version": ckpt.FORMAT_VERSION,
        "train_state": dataclasses.asdict(ckpt.TrainState()),
        "config": {"model": dataclasses.asdict(cfg.model)},
        "world_size": 1,
        WEIGHTS_ONLY: True,
        integrity.COMMON_KEY: integrity.MANIFEST,
    }
    mcore_compat.save_checkpoint(state, tmp)
    integrity.write_manifest(tmp)
    ckpt.publish(root, tmp, final, 0)
    return final


# The data-section fields that make the tokenizer (pretrain_gpt.py's tokenizer flags).
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_size", "vocab_file",
                    "merge_file", "vocab_extra_ids", "tiktoken_pattern",
                    "tiktoken_num_special_tokens", "tokenizer_special_tokens",
                    "tiktoken_special_tokens")
# Those that name files: the run's are not kept when another tokenizer type is given.
_TOKENIZER_FILES = {"tokenizer_model": "--tokenizer-model", "vocab_file": "--vocab-file",
                    "merge_file": "--merge-file"}


def tokenizer_settings(common: dict, given: Optional[dict] = None) -> dict:
    """The data-section fields of the tokenizer: the flags given, else the run's.

    Args:
        common: the checkpoint's common state.
        given: tokenizer fields from a tool's flags (None values: not given). A tokenizer
            type other than the run's drops the run's files (its model, vocabulary, merges).

    Raises:
        UsageError: no tokenizer is recorded or given, or a file it needs is gone.
    """
    saved = saved_sections(common).get("data", {})
    given = {k: v for k, v in (given or {}).items() if v is not None}
    settings = {k: saved[k] for k in TOKENIZER_FIELDS if saved.get(k) is not None}
    if given.get("tokenizer_type", settings.get("tokenizer_type")) != \
            settings.get("tokenizer_type"):
        for field in _TOKENIZER_FILES:
            settings.pop(field, None)
    settings.update(given)
    if settings.get("tokenizer_type") is None and settings.get("vocab_size"):
        settings["tokenizer_type"] = "NullTokenizer"  # --mock-data --vocab-size N runs
    if settings.get("tokenizer_type") is None:
        raise UsageError("the checkpoint records no tokenizer: give --tokenizer-type with "
                         "its files, as pretrain_gpt.py takes them")
    for field, flag in _TOKENIZER_FILES.items():
        path = settings.get(field)
        if path and not os.path.exists(path):
            origin = flag if field in given else f"the run's {flag}"
            raise UsageError(f"{origin} {path}: not found (give {flag} with the file)")
    # Explicitly empty, so that merged over the run's data section they replace its files.
    for field in (*_TOKENIZER_FILES, "tiktoken_pattern"):
        settings.setdefault(field, None)
    return settings
