"""Megatron-LM flags this project refuses, and why: one table, kept by a test.

A flag of Megatron-LM's ``megatron/training/arguments.py`` (tag core_v0.16.1) is either
accepted by the generated parser with Megatron-LM's name, meaning and default, or it is
in this table and refused in one line that names it and says why. A flag that is in
neither is unknown: argparse's error, shortened to one line with a "did you mean" hint.

The table is data: each helper or lane that implements a flag removes its row (or adds
its own refusals) without touching the code below.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Optional, Sequence

_MOE = ("mixture-of-experts (MoE) is not supported here: megatron-core's MoE layers need "
        "Transformer Engine / grouped-GEMM kernels this project does not wire; train a dense "
        "GPT (drop the MoE flags)")
_FP8 = ("FP8 is not supported here: it needs Transformer Engine's FP8 recipes, which this "
        "project does not wire; train with --bf16")
_FP4 = "FP4 is not supported here: it needs Transformer Engine; train with --bf16"

# Exact flag -> why it is refused.
REFUSED = {
    "--num-experts": _MOE,
    "--expert-model-parallel-size": _MOE,
    "--expert-tensor-parallel-size": _MOE,
    "--fp8-param-gather": _FP8,
    "--no-fp8-wgrad": _FP8,
    "--first-last-layers-bf16": _FP8,
    "--num-layers-at-start-in-bf16": _FP8,
    "--num-layers-at-end-in-bf16": _FP8,
}

# Flag prefix -> why every flag starting with it is refused.
REFUSED_PREFIXES = {
    "--moe-": _MOE,
    "--fp8-": _FP8,
    "--fp4-": _FP4,
}


def refusal(flag: str) -> Optional[str]:
    """Why ``flag`` (``--name`` or ``--name=value``) is refused, or None if it is not."""
    name = flag.split("=", 1)[0]
    if name in REFUSED:
        return REFUSED[name]
    for prefix, reason in REFUSED_PREFIXES.items():
        if name.startswith(prefix):
            return reason
    return None


def first_refused(argv: Sequence[str]) -> Optional[str]:
    """The one-line message for the first refused flag of ``argv``, or None."""
    for arg in argv:
        if arg == "--":
            break
        if arg.startswith("--"):
            reason = refusal(arg)
            if reason:
                return f"{arg.split('=', 1)[0]}: {reason}"
    return None


def did_you_mean(flag: str, known: Iterable[str]) -> str:
    """`` (did you mean --X?)`` for the closest known flag, or an empty string."""
    name = flag.split("=", 1)[0]
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""
