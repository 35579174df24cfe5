"""Prints the memory plan of a pretrain_gpt.py run on a stated machine, without a GPU.

Takes pretrain_gpt.py's flags (parsed by the same parser) plus the target machine's
capacities, and prints the plan the run would make at start-up: per tier (the GPU, the
host, each path) the bytes and subgroups, the activation peak, the predicted step time.
Exit 0 when the run fits; otherwise the table on stdout, the refusal as one ``error:``
line on stderr, exit 2. Nothing is built and no data file is opened (fast, no torch)::

    python tools/plan_memory.py --num-layers 36 --hidden-size 6144 ... --offload-optimizer \\
        --target-gpu-gb 150.1 --target-host-gb 134.2 --target-path 60@1.37,1.80 \\
        --target-tflops 590

``--offload-paths`` may name directories that do not exist here: the target's
``--target-path`` entries give their free space and bandwidths (one per directory, in
order); without ``--offload-paths`` the ``--target-path`` entries are the run's paths.
Output directories (``--save``, ``--tensorboard-dir``, ...) are the target's too and are
ignored; ``--tokenizer-vocab-size N`` stands for a tokenizer whose files are elsewhere.
The CUDA allocator's slack is counted as this shell's ``PYTORCH_CUDA_ALLOC_CONF`` says
(unset: expandable segments, what a run sets when the job gives no settings).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence, Tuple

from _common import EXIT_USAGE, ToolArgumentParser, positive_int

from megatron_ext.errors import UsageError  # noqa: E402


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def tool_parser() -> argparse.ArgumentParser:
    """The tool's own flags (the rest are pretrain_gpt.py's)."""
    parser = ToolArgumentParser(
        prog="tools/plan_memory.py", add_help=False,
        description="The memory plan of pretrain_gpt.py's flags on a stated machine "
                    "(capacities per node; every other flag is pretrain_gpt.py's). The CUDA "
                    "allocator's slack follows this shell's PYTORCH_CUDA_ALLOC_CONF (unset: "
                    "expandable segments, as a run sets them).")
    parser.add_argument("--help", "-h", action="store_true", help="show this help and exit")
    parser.add_argument("--target-gpu-gb", type=_positive_float, required=False,
                        help="free memory of one GPU, in GB (10^9 bytes; an H200 shows about "
                             "150.1 GB, 139.8 GiB, to a process)")
    parser.add_argument("--target-host-gb", type=_positive_float,
                        help="the node's MemAvailable, in GB")
    parser.add_argument("--target-path", action="append", default=[],
                        metavar="GB[@READ_GBPS,WRITE_GBPS]",
                        help="one offload path's free space on the node and its bandwidths "
                             "(tools/probe_tiers.py measures them); repeat per path")
    parser.add_argument("--target-tflops", type=_positive_float,
                        help="achieved TFLOP/s per GPU of forward+backward (default: none, "
                             "no step time; 590 was measured on an H200)")
    parser.add_argument("--target-gpus-per-node", type=positive_int, default=1,
                        help="GPUs (training processes) per node; they share the host and "
                             "the paths")
    parser.add_argument("--target-nodes", type=positive_int, default=1,
                        help="nodes of the job (the world size is nodes x GPUs per node)")
    parser.add_argument("--tokenizer-vocab-size", type=positive_int,
                        help="the tokenizer's vocabulary (before padding), when its files are "
                             "not on this machine: the tokenizer flags are then not read "
                             "(default: from the tokenizer the flags name)")
    return parser


# Flags whose files or directories live on the target machine and do not change the plan:
# dropped (with their values) before the config checks them here.
TARGET_FILE_FLAGS = ("--save", "--save-interval", "--tensorboard-dir", "--metrics-path",
                     "--wandb-save-dir", "--profile-dir", "--data-cache-path")
# The tokenizer's flags, replaced by --tokenizer-vocab-size when it is given.
TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file",
                   "--vocab-size", "--tiktoken-pattern", "--tiktoken-num-special-tokens",
                   "--tokenizer-special-tokens", "--tiktoken-special-tokens",
                   "--vocab-extra-ids")


def _take(argv: Sequence[str], flags: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(argv without ``flags`` and their values, the values they had)."""
    rest, values = [], []
    taking = False
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in flags:
            taking = not eq
            if eq:
                values.append(value)
            continue
        if taking and not arg.startswith("--"):
            values.append(arg)
            continue
        taking = False
        rest.append(arg)
    return rest, values


def _vocab_size(cfg, given: Optional[int]) -> int:
    if given is not None:
        return given
    from megatron_ext.data.tokenizer import build_tokenizer

    try:
        return build_tokenizer(cfg.data).vocab_size
    except (OSError, ValueError, UsageError) as err:
        raise UsageError(f"the tokenizer cannot be read here ({err}): give "
                         "--tokenizer-vocab-size N") from None


def plan_from_argv(argv: Sequence[str]):
    """(the plan, the mode's re-settled choice or None) of the tool's command line.

    The plan is a :class:`~megatron_ext.memory.plan.MemoryPlan`; the note is the line the
    run would log where the mode re-settled one of its ``auto`` choices to fit.

    Raises:
        UsageError: a flag is wrong (pretrain_gpt.py's or the tool's).
    """
    from megatron_ext.config import parse_config
    from megatron_ext.memory.machine import split_path_spec, target_machine
    from megatron_ext.memory.startup import settle_plan

    args, rest = tool_parser().parse_known_args(argv)
    if args.target_gpu_gb is None or args.target_host_gb is None:
        raise UsageError("give the target machine: --target-gpu-gb G --target-host-gb H "
                         "(and --target-path GB@READ,WRITE per offload path)")
    # The directories and files are the target's: not looked for here.
    rest, offload_paths = _take(rest, ("--offload-paths",))
    rest, _ = _take(rest, TARGET_FILE_FLAGS)
    if args.tokenizer_vocab_size is not None:
        rest, _ = _take(rest, TOKENIZER_FLAGS)
        rest += ["--tokenizer-type", "NullTokenizer", "--vocab-size",
                 str(args.tokenizer_vocab_size)]
    cfg = parse_config(rest)
    targets = list(args.target_path)
    if offload_paths:
        if not cfg.offload.offload_optimizer:
            raise UsageError("--offload-paths needs --offload-optimizer")
        if len(targets) != len(offload_paths):
            raise UsageError(f"--offload-paths names {len(offload_paths)} directories and "
                             f"--target-path gives {len(targets)}: give one --target-path "
                             "GB[@READ,WRITE] per directory, in order")
        for i, text in enumerate(offload_paths):
            _, read, write = split_path_spec(text)
            if read is not None and "@" not in targets[i]:
                targets[i] = f"{targets[i]}@{read},{write}"
    elif targets and cfg.offload.offload_optimizer:
        offload_paths = [f"path{i}" for i in range(len(targets))]
    cfg.offload.offload_paths = offload_paths
    world = args.target_gpus_per_node * args.target_nodes
    cfg.check_world(world)
    try:
        machine = target_machine(args.target_gpu_gb, args.target_host_gb, targets,
                                 args.target_tflops, args.target_gpus_per_node)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return settle_plan(cfg, _vocab_size(cfg, args.tokenizer_vocab_size), world, machine)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Prints the plan; returns 0 when the run fits, 2 otherwise (or for bad flags)."""
    from megatron_ext.memory.report import plan_table

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        tool_parser().print_help()
        print("\nEvery other flag is pretrain_gpt.py's (python pretrain_gpt.py --help).")
        return 0
    try:
        plan, note = plan_from_argv(argv)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if note:
        print(note, flush=True)
    print(plan_table(plan, tflops_flag="--target-tflops"), flush=True)
    if plan.refusals:
        print(f"error: memory plan: {plan.refusals[0]}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
