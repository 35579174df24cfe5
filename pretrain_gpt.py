#!/usr/bin/env python3
"""Pretrain a GPT on megatron-core, optionally with optimizer-state offload.

Launch with torchrun (``torchrun --nproc-per-node N pretrain_gpt.py ...``), with Slurm's
plain ``srun`` (one task per GPU), or as a single process. ``--help`` lists every flag.
"""

import sys


def _run(argv) -> int:
    from megatron_ext.config import parse_config

    cfg = parse_config(argv)
    from megatron_ext.training.loop import pretrain

    return pretrain(cfg)


def main(argv=None) -> int:
    """Parses the flags and trains; returns the exit status (2 for bad input).

    Every failure is one ``error:`` line for the whole job (a bug's traceback above it), and
    the process ends promptly (:mod:`megatron_ext.runtime.fatal`).
    """
    try:
        from megatron_ext.runtime import fatal
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C) while starting up", file=sys.stderr, flush=True)
        return 130
    return fatal.run_main(lambda: _run(argv))


if __name__ == "__main__":
    # dist_checkpointing starts a multiprocessing Manager: the entry point must be
    # importable without side effects, hence the guard.
    sys.exit(main())
