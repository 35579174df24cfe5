"""The loss curve of one tiny fixed config matches the committed golden curve.

A change in numerics (initialization, data order, loss, optimizer, schedule, precision
handling) shows up here. To accept an intended change, regenerate the curves with
``MEGATRON_EXT_UPDATE_GOLDEN=1 python -m pytest tests/functional/test_golden.py`` and
commit them with a note of why they changed.
"""

from __future__ import annotations

import json
import os
import platform

import pytest

from mext_testing import ROOT, TINY, precision_flags

GOLDEN_DIR = ROOT / "tests" / "functional" / "golden"
# Different CPUs (vector widths) reorder float sums; bf16 amplifies that over 20 steps.
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loss_curve_matches_golden(run_cache, precision):
    flags = [*TINY, "--train-iters", "20", "--use-distributed-optimizer",
             *precision_flags(precision)]
    # The plain run other modules compare against (the session's run cache shares it).
    losses = run_cache.run(flags).losses
    path = GOLDEN_DIR / f"tiny_gpt_{precision}.json"
    if os.environ.get("MEGATRON_EXT_UPDATE_GOLDEN"):
        import megatron.core
        import torch

        path.write_text(json.dumps({
            "args": flags, "lm_loss": losses, "torch": torch.__version__,
            "megatron_core": megatron.core.__version__, "machine": platform.machine(),
        }, indent=1) + "\n")
    golden = json.loads(path.read_text())
    assert golden["args"] == flags, "the golden config changed: regenerate the curve"
    assert len(losses) == len(golden["lm_loss"])
    for it, (got, want) in enumerate(zip(losses, golden["lm_loss"]), start=1):
        assert got == pytest.approx(want, rel=TOLERANCE[precision]), (
            f"iteration {it}: lm loss {got} vs golden {want}")
