"""The model settings of a checkpoint: ``--use-checkpoint-args`` and the mismatch check.

With ``--use-checkpoint-args`` (Megatron-LM's flag) the model's architecture comes from
the checkpoint, as Megatron-LM's ``load_args_from_checkpoint`` sets it; without it, the
architecture settings that differ from the checkpoint's are named in one line before
anything is loaded (megatron-core would otherwise fail deep in the load with a
CheckpointingException, or load weights of the same shapes into another architecture).

A checkpoint of this project holds its run config (``config``, this project's field
names) and ``padded_vocab_size``; one of Megatron-LM holds ``args`` (an argparse
Namespace, Megatron-LM's names). :data:`SETTINGS` maps one onto the other. The logic is
pure: it takes the common state as a dict and returns values or differences.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_ext.errors import UsageError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One model setting: this project's ModelConfig field and Megatron-LM's arg name."""

    field: str
    megatron: str
    from_megatron: Callable[[Any], Any] = lambda v: v
    shape: bool = True
    """Part of the architecture (a difference is refused without --use-checkpoint-args);
    False for settings that only --use-checkpoint-args takes over (dropout)."""

    @property
    def flag(self) -> str:
        """The command-line flag of the setting."""
        return "--" + self.field.replace("_", "-")


# The settings Megatron-LM's load_args_from_checkpoint takes from a checkpoint that this
# project's model has.
SETTINGS: Tuple[Setting, ...] = (
    Setting("num_layers", "num_layers"),
    Setting("hidden_size", "hidden_size"),
    Setting("ffn_hidden_size", "ffn_hidden_size"),
    Setting("num_attention_heads", "num_attention_heads"),
    Setting("group_query_attention", "group_query_attention"),
    Setting("num_query_groups", "num_query_groups"),
    Setting("kv_channels", "kv_channels"),
    Setting("max_position_embeddings", "max_position_embeddings"),
    Setting("position_embedding_type", "position_embedding_type"),
    Setting("rotary_base", "rotary_base"),
    Setting("rotary_percent", "rotary_percent"),
    Setting("add_qkv_bias", "add_qkv_bias"),
    Setting("apply_layernorm_1p", "apply_layernorm_1p"),
    Setting("qk_layernorm", "qk_layernorm"),
    Setting("swiglu", "swiglu"),
    Setting("untie_embeddings_and_output_weights", "untie_embeddings_and_output_weights"),
    Setting("normalization", "normalization"),
    Setting("disable_bias_linear", "add_bias_linear", lambda v: not v),
    Setting("seq_length", "seq_length", shape=False),
    Setting("hidden_dropout", "hidden_dropout", shape=False),
    Setting("attention_dropout", "attention_dropout", shape=False),
)


def saved_settings(common: dict) -> Optional[Dict[str, Any]]:
    """{ModelConfig field: value} the checkpoint's common state records; None if nothing.

    Also ``padded_vocab_size`` when recorded.
    """
    values: Dict[str, Any] = {}
    args = common.get("args")
    if args is not None:
        get = (args.get if isinstance(args, dict)
               else lambda name, default=None: getattr(args, name, default))
        for s in SETTINGS:
            value = get(s.megatron, None)
            if value is None and s.megatron == "add_bias_linear" and \
                    get("disable_bias_linear", None) is not None:
                value = not get("disable_bias_linear")
            if value is not None:
                values[s.field] = s.from_megatron(value)
        if get("padded_vocab_size", None) is not None:
            values["padded_vocab_size"] = get("padded_vocab_size")
    config = common.get("config")
    if isinstance(config, dict) and isinstance(config.get("model"), dict):
        model = config["model"]
        for s in SETTINGS:
            if s.field not in values and model.get(s.field) is not None:
                values[s.field] = model[s.field]
    if common.get("padded_vocab_size") is not None:
        values.setdefault("padded_vocab_size", common["padded_vocab_size"])
    return values or None


def shown(value) -> str:
    """A setting's value as a message shows it: "not given" for None, on/off for a switch."""
    if value is None:
        return "not given"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def differences(saved: Dict[str, Any], model_cfg, padded_vocab: Optional[int],
                shape_only: bool = True) -> List[str]:
    """'--flag SAVED (this run: NOW)' for each setting that differs. Pure."""
    out = []
    for s in SETTINGS:
        if shape_only and not s.shape:
            continue
        if s.field in saved and saved[s.field] != getattr(model_cfg, s.field):
            if s.field == "num_query_groups" and not (saved.get("group_query_attention")
                                                     or model_cfg.group_query_attention):
                continue  # without GQA the group count is unused
            out.append(f"{s.flag} {shown(saved[s.field])} (this run: "
                       f"{shown(getattr(model_cfg, s.field))})")
    if padded_vocab is not None and saved.get("padded_vocab_size") not in (None, padded_vocab):
        out.append(f"padded vocabulary {saved['padded_vocab_size']} (this run: {padded_vocab}; "
                   "--vocab-size / --tokenizer-model, --make-vocab-size-divisible-by)")
    return out


def check_settings(common: dict, model_cfg, padded_vocab: int, path: str) -> None:
    """Refuses, in one line, a checkpoint whose architecture differs from the run's.

    Raises:
        UsageError: naming every differing setting.
    """
    saved = saved_settings(common)
    if not saved:
        return
    diff = differences(saved, model_cfg, padded_vocab)
    if diff:
        raise UsageError(f"--load {path}: the checkpoint's model differs from this run's: "
                         f"{'; '.join(diff)}; give the checkpoint's settings, or "
                         "--use-checkpoint-args to take them from it")


def apply_settings(common: dict, model_cfg, path: str):
    """A ModelConfig with the checkpoint's settings (--use-checkpoint-args).

    Returns:
        (the new ModelConfig, the settings taken as 'field=value' strings)

    Raises:
        UsageError: the checkpoint records no model settings.
    """
    saved = saved_settings(common)
    if not saved:
        raise UsageError(f"--use-checkpoint-args: {path} records no model settings (neither "
                         "Megatron-LM's args nor this project's config); give them as flags")
    changes = {s.field: saved[s.field] for s in SETTINGS
               if s.field in saved and saved[s.field] != getattr(model_cfg, s.field)}
    for field, value in changes.items():
        log.info("Setting %s to %s from checkpoint", field, value)
    return dataclasses.replace(model_cfg, **changes), [f"{k}={v}" for k, v in changes.items()]


# The distributed optimizer's sharding types that load at another TP/PP (megatron-core's
# DistributedOptimizer.checkpoint_fully_reshardable_formats at core_v0.16.1); the others
# (dp_reshardable, which this project and Megatron-LM write by default, and
# dp_zero_gather_scatter) follow the optimizer's buffers, which depend on TP and PP.
FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")


def saved_layout(common: dict) -> Optional[Tuple[int, int]]:
    """(TP, PP) the checkpoint was saved at (None when it does not record it).

    From Megatron-LM's ``args``, else this project's saved config (format 1).
    """
    args = common.get("args")
    if args is not None:
        return (getattr(args, "tensor_model_parallel_size", 1),
                getattr(args, "pipeline_model_parallel_size", 1))
    parallel = (common.get("config") or {}).get("parallel") or {}
    if "tensor_model_parallel_size" in parallel:
        return (parallel["tensor_model_parallel_size"],
                parallel.get("pipeline_model_parallel_size", 1))
    return None


def optimizer_sharding(common: dict, metadata: Optional[dict]) -> Optional[str]:
    """The sharding type of the checkpoint's distributed-optimizer state (None: not one).

    From the content metadata; for a checkpoint without it (Megatron-LM before mcore 0.13),
    Megatron-LM's own rule from its ``args``.
    """
    if metadata and metadata.get("distrib_optim_sharding_type"):
        return metadata["distrib_optim_sharding_type"]
    args = common.get("args")
    if metadata is None and getattr(args, "use_distributed_optimizer", False):
        return ("fully_sharded_model_space" if getattr(args, "ckpt_fully_parallel_save", False)
                else "dp_zero_gather_scatter")
    return None


def check_optimizer_layout(common: dict, metadata: Optional[dict], tp: int, pp: int,
                           path: str) -> None:
    """Refuses an optimizer state that does not load at this run's TP and PP. Pure.

    A distributed-optimizer state of a sharding type outside :data:`FULLY_RESHARDABLE`
    loads only at the TP and PP it was saved at (Megatron-LM refuses it too); megatron-core
    would fail deep in the load with a CheckpointingException. The model weights load at
    any layout (dist_checkpointing reshards them).

    Raises:
        UsageError: the layouts differ and the state cannot be resharded.
    """
    saved = saved_layout(common)
    sharding = optimizer_sharding(common, metadata)
    if saved is None or tuple(saved) == (tp, pp) or sharding is None \
            or sharding in FULLY_RESHARDABLE:
        return
    raise UsageError(
        f"--load {path}: its optimizer state was saved at TP={saved[0]} PP={saved[1]} by the "
        f"distributed optimizer ({sharding} sharding), which loads only at the same tensor "
        f"and pipeline parallel sizes; this run has TP={tp} PP={pp}: resume with "
        f"--tensor-model-parallel-size {saved[0]} --pipeline-model-parallel-size {saved[1]}, "
        "or add --no-load-optim (the model weights and the iteration load at any layout; "
        "the optimizer starts fresh)")

