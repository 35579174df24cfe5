"""The megatron-core versions this project runs on, and every difference between them.

Supported: megatron-core 0.16.1 up to (not including) 0.20; tested on 0.16.1 (Python 3.11, the
pin of requirements.txt there) and 0.19.2 (Python >= 3.12: megatron-core 0.17 and newer need
it). :func:`check_version` refuses any other in one line, at start-up.

What differs between 0.16.1 and 0.19.x for this project, and where it is met (each one here,
so that no engine compares versions; the callers use these functions on every version):

======================================  =============================================
difference (0.16.1 -> 0.19.x)           handled by
======================================  =============================================
DDP takes the distributed optimizer's   :func:`ddp_layout_kwargs`: computes it as
parameter layout (``full_param_layout``  Megatron-LM's ``wrap_model_chunks_with_ddp``
from ``DistributedOptimizer.compute_     does and passes it (0.16.1: nothing to pass)
full_param_layout``); without it DDP
computes it itself and warns
the common state of a checkpoint moved   :func:`save_checkpoint`: writes ``common.pt``
from ``common.pt`` into the ``.distcp``  as well when megatron-core did not, so that
files (a ShardedObject ``common_state``; megatron-core 0.16.1 and Megatron-LM at both
``common.pt`` is still read)             tags read the checkpoint
reading that in-file common state        ``checkpoint/integrity.py``'s weights-only
unpickles it with torch's default load   reader (``read_common_state``), the same for
planner (``weights_only=False``)         both layouts
the ramp of --rampup-batch-size (the     ``runtime/batch_schedule.py``: the ramp is
``RampupBatchsizeNumMicroBatches         this project's own pure rule (0.16.1's), so
Calculator`` class) is gone; 0.19        it means the same on both
ignores ``rampup_batch_size``
NullTokenizer's ``--vocab-size`` (from    :func:`null_vocab_includes_eod`: this
0.18): V ids with EOD V-1 (0.16.1/0.17:  project's NullTokenizer means what the
V ids plus EOD V, V+1 in all)            installed version's Megatron-LM means;
                                         :func:`null_vocab_size_flag`: the flag of one
                                         model on every version (tests, bench rows)
new deprecation notices (GPTModel,       :func:`quiet`: dropped by message, the other
``load_common``, mcore async save,       lines of those loggers kept
MimoModelConfig, torch DCP's no-dist
load)
======================================  =============================================

Unchanged and relied on (the test suite runs on both versions): the factory's lookup of
``DistributedOptimizer`` by name in ``megatron.core.optimizer``, the optimizer's shard maps
(``gbuf_ranges``, ``model_param_gbuf_map``, ``_get_model_param_range_map``'s
``gbuf_world_in_bucket``, the buffers' ``param_data``/``grad_data``), its param groups, and
the checkpoint keys of the model, optimizer and ``rng_state``. megatron-core registers
``argparse.Namespace`` (Megatron-LM's ``args``) for ``weights_only`` loading in both; the
common state holds nothing else beyond tensors, containers and numbers.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Optional, Tuple

from megatron_ext.errors import UsageError

MINIMUM = (0, 16, 1)
BELOW = (0, 20, 0)
TESTED = {"0.16.1": "Python 3.11 (and 3.12)", "0.19.2": "Python >= 3.12"}
COMMON_FILE = "common.pt"


def _parse(text: str) -> Tuple[int, int, int]:
    numbers = [int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple((numbers + [0, 0, 0])[:3])


def installed_version() -> Optional[str]:
    """megatron-core's version as its package metadata says, or None when not installed."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def supported(version: str) -> bool:
    """Whether ``version`` is in the supported range (0.16.1 <= version < 0.20)."""
    return MINIMUM <= _parse(version) < BELOW


def check_version(version: Optional[str] = None) -> str:
    """Refuses, in one line, a megatron-core outside the supported range.

    Args:
        version: the version to check; the installed one by default.

    Returns:
        the version.

    Raises:
        UsageError: not installed, or outside 0.16.1 <= version < 0.20.
    """
    version = installed_version() if version is None else version
    how = ("pip install megatron-core==0.16.1 (Python 3.11) or megatron-core==0.19.2 "
           "(Python >= 3.12), or pip install -r requirements.txt, which picks the one for "
           "this Python")
    if version is None:
        raise UsageError(f"megatron-core is not installed: {how}")
    if not supported(version):
        tested = ", ".join(TESTED)
        raise UsageError(f"megatron-core {version} is installed; this project runs on 0.16.1 "
                         f"up to 0.20 (tested: {tested}): {how}")
    return version


def null_vocab_includes_eod(version: Optional[str] = None) -> bool:
    """Whether NullTokenizer's ``--vocab-size`` V counts the end-of-document id.

    Megatron-LM's NullTokenizer changed at core_v0.18.0: V ids, EOD V-1. Up to 0.17 it
    was V ids plus EOD V (V+1 in all). This project follows the installed version, so a
    Megatron-LM script's ``--vocab-size`` builds the same embedding and the same mock data
    as Megatron-LM at the tag of that megatron-core (and their checkpoints interchange).

    Args:
        version: megatron-core's version; the installed one by default.
    """
    version = installed_version() if version is None else version
    return version is not None and _parse(version) >= (0, 18, 0)


def null_vocab_size_flag(ids: int, version: Optional[str] = None) -> str:
    """NullTokenizer's ``--vocab-size`` for ``ids`` token ids plus the end-of-document id.

    The same model on every version: ``ids`` on 0.16.1/0.17 (the EOD comes on top), one
    more from 0.18 (the EOD counts inside). A fixed ``--vocab-size`` builds a model one id
    smaller from 0.18: another model, with another training trajectory.
    """
    return str(ids + 1 if null_vocab_includes_eod(version) else ids)


# ------------------------------------------------------------------ DDP


def _ddp_bucket_size(ddp_config, dp_size: int, disable_bucketing: bool) -> Optional[int]:
    """The bucket size DistributedDataParallel gives its buffers (megatron-core's rule)."""
    from megatron.core import parallel_state

    if disable_bucketing or not ddp_config.overlap_grad_reduce:
        return None
    if parallel_state.get_pipeline_model_parallel_rank() > 0:
        return None
    if ddp_config.bucket_size is None:
        return max(40000000, 1000000 * dp_size)
    return ddp_config.bucket_size


def ddp_layout_kwargs(module, ddp_config, disable_bucketing: bool = False) -> dict:
    """Extra keyword arguments of ``DistributedDataParallel(...)`` for ``module``.

    megatron-core 0.19 shards the distributed optimizer along a layout computed before DDP
    (``DistributedOptimizer.compute_full_param_layout``), as Megatron-LM's
    ``wrap_model_chunks_with_ddp`` computes it: the data-parallel size of the layout is
    the group the optimizer shards over, the bucket size the one DDP would use. 0.16.1
    has no such argument: nothing to pass.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    compute = getattr(DistributedOptimizer, "compute_full_param_layout", None)
    if compute is None or not ddp_config.use_distributed_optimizer:
        return {}
    from megatron.core import parallel_state

    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True,
                                                          partial_data_parallel=True)
    expert_dp = parallel_state.get_expert_data_parallel_world_size(
        partial_expert_data_parallel=True)
    params = [p for p in module.parameters() if p.requires_grad]
    layout = compute(params, _ddp_bucket_size(ddp_config, dp_size, disable_bucketing), dp_size,
                     ddp_config, expert_data_parallel_world_size=expert_dp)
    return {"full_param_layout": layout}


# ------------------------------------------------------------------ checkpoints


def common_part(state: dict, content_metadata: Optional[dict] = None) -> dict:
    """The common (not sharded) part of a state dict, as dist_checkpointing saves it."""
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

    _, persistent = extract_nonpersistent(state)
    _, common = extract_sharded_base(persistent)
    if content_metadata is not None:
        metadata = dict(content_metadata)
        # Process groups do not pickle (megatron-core drops this one too).
        metadata.pop("dp_cp_group", None)
        common["content_metadata"] = metadata
    return common


def save_checkpoint(state: dict, directory: str, content_metadata: Optional[dict] = None) -> None:
    """``dist_checkpointing.save``, with the common state in ``common.pt`` on every version.

    megatron-core 0.16.1 writes the common state to ``common.pt``; 0.17 and newer keep it
    inside the ``.distcp`` files only, which megatron-core 0.16.1 (and Megatron-LM at
    core_v0.16.1) cannot read, while every version reads ``common.pt``. So where
    megatron-core did not write it, rank 0 writes it (the same dict, computed before the
    save adds its own keys).
    """
    import torch
    from megatron.core import dist_checkpointing

    common = common_part(state, content_metadata)
    dist_checkpointing.save(state, directory, content_metadata=content_metadata)
    path = os.path.join(directory, COMMON_FILE)
    if torch.distributed.get_rank() == 0 and not os.path.exists(path):
        torch.save(common, path)


# ------------------------------------------------------------------ log noise

# (logger, start of the message) of notices about megatron-core's own deprecations: nothing a
# user of this project can act on. Other lines of these loggers still show.
_NOTICES = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    ("megatron.core.dist_checkpointing.strategies.common", "load_common is deprecated"),
    ("megatron.core.dist_checkpointing.strategies.common", "save_common is deprecated"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
    ("megatron.core.num_microbatches_calculator", "rampup_batch_size is deprecated"),
)
_WARNINGS = (".*MimoModelConfig is experimental.*",
             ".*The argument order of load has been changed.*",
             ".*torch.distributed is disabled, unavailable or uninitialized.*")


class _DropNotices(logging.Filter):
    def __init__(self, starts):
        super().__init__()
        self.starts = tuple(starts)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet() -> None:
    """Drops megatron-core's deprecation notices that do not apply to this project's runs."""
    by_logger = {}
    for name, start in _NOTICES:
        by_logger.setdefault(name, []).append(start)
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotices) for f in logger.filters):
            logger.addFilter(_DropNotices(starts))
    for pattern in _WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
