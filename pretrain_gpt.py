#!/usr/bin/env python3
"""Pretrain a GPT on megatron-core, optionally with optimizer-state offload.

Launch with torchrun (``torchrun --nproc-per-node N pretrain_gpt.py ...``), with Slurm's
plain ``srun`` (one task per GPU), or as a single process. ``--help`` lists every flag.
"""

import os
import sys


def _reports_errors() -> bool:
    """Rank 0 prints the error; so does a process whose rank is malformed or out of range."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")).strip()
    world = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")).strip()
    if not (rank.isdigit() and world.isdigit()):
        return True
    return int(rank) == 0 or int(rank) >= int(world)


def main(argv=None) -> int:
    """Parses the flags and trains; returns the exit status (2 for bad input)."""
    from megatron_ext.config import parse_config
    from megatron_ext.errors import UsageError

    try:
        cfg = parse_config(argv)
        from megatron_ext.training.loop import pretrain

        return pretrain(cfg)
    except UsageError as err:
        if _reports_errors():
            print(f"error: {err}", file=sys.stderr, flush=True)
        return UsageError.exit_code


if __name__ == "__main__":
    # dist_checkpointing starts a multiprocessing Manager: the entry point must be
    # importable without side effects, hence the guard.
    sys.exit(main())
