"""Which checkpoint ``--load`` means, and whether this run can take it.

Before the model and the optimizer are built (:func:`prepare_load`, called by the loop):
the 'latest' pointer (Megatron-LM's ``latest_checkpointed_iteration.txt``) of the --load
root, the checkpoint's files verified (:mod:`.integrity`), its common state read, its
format version, and whether its optimizer state fits this run's mode and TP/PP layout
(:func:`loads_optimizer`); after the model is built, that the checkpoint's model is this
run's (:func:`check_model`). Each refusal is one line naming the fix. The save and the
load themselves are :mod:`.checkpointing`'s.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from megatron_ext.checkpoint import checkpoint_args, integrity
from megatron_ext.errors import UsageError
from megatron_ext.optim.modes import mode_of

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
# Megatron-LM's checkpoint_version (its generate_state_dict writes 3.0).
FORMAT_VERSION = 3.0
# This project's earlier format: rng/ files, the scheduler counted in iterations.
LEGACY_FORMAT = 1


def checkpoint_name(root: str, iteration: int) -> str:
    """The folder of the checkpoint of ``iteration`` under ``root``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """The iteration named by the 'latest' pointer of ``root``, or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(256)
    text = raw.decode("ascii", errors="replace").strip()
    # isdigit() alone accepts non-ASCII digits; the pointer is written in ASCII.
    if not (raw.strip().isascii() and text.isdigit()):
        raise UsageError(f"--load {root}: {TRACKER} holds {text[:40]!r}, not an iteration "
                         "number; write the iteration to resume from into it (e.g. 'echo 100 "
                         f"> {path}')")
    return int(text)


def resolve_load_dir(cfg) -> Optional[str]:
    """The checkpoint directory --load points at; None to start from scratch.

    ``--load`` equal to ``--save`` with no checkpoint yet starts from scratch (the
    resume-or-start pattern of requeued Slurm jobs); any other --load without a checkpoint
    is an error.
    """
    root = cfg.checkpoint.load
    if not root:
        return None
    path = latest_checkpoint(root) if os.path.isdir(root) else None
    if path is None:
        same = cfg.checkpoint.save and os.path.abspath(cfg.checkpoint.save) == os.path.abspath(root)
        if same and not cfg.checkpoint.finetune:
            return None
        raise UsageError(f"--load {root}: no checkpoint there (no {TRACKER}); check the path, "
                         "or drop --load to start from scratch")
    return path


def latest_checkpoint(root: str) -> Optional[str]:
    """The iteration folder the tracker of the --save root ``root`` names (None: no tracker).

    Raises:
        UsageError: the tracker names an iteration whose folder does not exist.
    """
    iteration = read_tracker(root)
    if iteration is None:
        return None
    path = checkpoint_name(root, iteration)
    if not os.path.isdir(path):
        found = integrity.newest_good(root)
        advice = (integrity.resume_advice(*found, what="newest complete") if found else
                  "no complete checkpoint is there: restore that folder, or drop --load to "
                  "start from scratch")
        raise UsageError(f"--load {root}: {TRACKER} names iteration {iteration} but "
                         f"{path} does not exist; {advice}")
    return path


def read_common(path: str) -> dict:
    """The checkpoint's common state (weights_only: torch's default load)."""
    try:
        return integrity.read_common_state(path)
    except Exception as err:  # noqa: BLE001 - an unverified checkpoint's damage, in one line
        if isinstance(err, UsageError):
            raise
        text = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise UsageError(f"--load {path}: its common state (common.pt / metadata.json) cannot "
                         f"be read ({type(err).__name__}: {text}); the checkpoint is damaged or "
                         "not a torch_dist checkpoint") from None


def prepare_load(path: str, cfg, runtime) -> dict:
    """Verifies the checkpoint and reads its common state, before the model is built.

    With --use-checkpoint-args, takes the model settings from it (into ``cfg.model``).

    Returns:
        the common state (for :func:`check_model` and :func:`.checkpointing.load_checkpoint`).

    Raises:
        UsageError: a damaged file, named with the previous checkpoint that verifies.
    """
    integrity.verify(path, runtime.host_group)
    common = read_common(path)
    # Before the model and optimizer are built: what of the checkpoint loads, and whether
    # its optimizer state fits this run's layout.
    format_of(common, path)
    loads_optimizer(common, cfg, runtime, path)
    if cfg.checkpoint.use_checkpoint_args:
        cfg.model, taken = checkpoint_args.apply_settings(common, cfg.model, path)
        cfg.check_world(runtime.world_size)
        if runtime.rank == 0:
            log.info("--use-checkpoint-args: model settings from %s: %s", path,
                     ", ".join(taken) or "all equal to the flags")
    return common


def check_model(common: dict, cfg, padded_vocab: int, path: str) -> None:
    """Refuses a checkpoint of another architecture, naming what differs, before loading."""
    checkpoint_args.check_settings(common, cfg.model, padded_vocab, path)


def optimizer_kind(config) -> str:
    """Which optimizer mode a run config (or a saved one) uses, in words.

    Their checkpoint states differ.
    """
    return mode_of(config).words


def format_of(common: dict, path: str) -> float:
    """The checkpoint's format version, refused when this version does not read it."""
    version = common.get("checkpoint_version")
    if version not in (FORMAT_VERSION, LEGACY_FORMAT):
        raise UsageError(f"--load {path}: checkpoint_version {version!r} is not one this version "
                         f"reads ({FORMAT_VERSION}: Megatron-LM's and this project's torch_dist "
                         f"checkpoints; {LEGACY_FORMAT}: this project's earlier format)")
    return version


def loads_optimizer(common: dict, cfg, runtime, path: str) -> bool:
    """Whether the load takes the checkpoint's optimizer state; refuses one that cannot be.

    Raises:
        UsageError: the flags ask for what the checkpoint does not hold (a weights-only
            checkpoint without --finetune, an optimizer state saved with --no-save-optim),
            or its optimizer state is another mode's or of another TP/PP layout.
    """
    from megatron.core import dist_checkpointing

    ck = cfg.checkpoint
    # A weights-only checkpoint (tools/convert_checkpoint.py --from hf) has no optimizer,
    # scheduler or data position to resume.
    weights_only = bool(common.get("weights_only"))
    if weights_only and not ck.finetune and not cfg.training.skip_train:
        raise UsageError(f"--load {path}: this checkpoint holds model weights only (converted "
                         "from Hugging Face); add --finetune to train from it")
    saved_optim = not getattr(common.get("args"), "no_save_optim", False)
    with_optimizer = ck.load_optim and not ck.finetune and not weights_only and saved_optim
    if ck.load_optim and not ck.finetune and not weights_only and not saved_optim:
        raise UsageError(f"--load {path}: the checkpoint holds no optimizer state (saved with "
                         "--no-save-optim); add --no-load-optim or --finetune")
    if with_optimizer:
        saved, now = optimizer_kind(common.get("config", {})), optimizer_kind(cfg)
        if saved != now:
            raise UsageError(f"--load {path}: its optimizer state was saved by {saved} and this "
                             f"run uses {now}; add --finetune (model weights only) or "
                             "--no-load-optim (weights and iteration) to start a fresh optimizer")
        checkpoint_args.check_optimizer_layout(
            common, dist_checkpointing.load_content_metadata(preloaded_state_dict=common),
            runtime.tp, runtime.pp, path)
    return with_optimizer
