"""--zenflow with two processes (torchrun, gloo): DP=2 and TP=2 equal plain Adam where
ZenFlow must (all columns selected; synchronous steps), and resume is exact at DP=2.
(TP=2 resume goes through the same per-rank file; the engine's state round trip is
tests/unit/zenflow/test_engine.py's.)"""

from __future__ import annotations

import pytest

from mext_testing import (
    BF16,
    TINY,
    losses_of,
    read_metrics,
    run_pretrain,
    straight_and_resumed,
    train_losses,
)

BASE = [*TINY, "--train-iters", "12", "--use-distributed-optimizer"]
LAYOUTS = {"dp2-bf16": [*BF16], "tp2-bf16": [*BF16, "--tensor-model-parallel-size", "2"],
           "dp2-fp32": []}
MODES = {
    "all-selected": ["--zenflow", "--zenflow-topk-ratio", "1.0", "--zenflow-update-interval",
                     "1"],
    "synchronous": ["--zenflow", "--zenflow-topk-ratio", "0.3", "--zenflow-full-warmup-steps",
                    "12", "--zenflow-select-interval", "4"],
}


# Synchronous steps (both sides updated in the step, the selection all-reduced over DP or
# TP and re-selected every 4 steps) in every layout; all columns selected (the GPU side
# alone) where the selection is split the most, TP=2.
CASES = [("dp2-bf16", "synchronous"), ("tp2-bf16", "synchronous"), ("dp2-fp32", "synchronous"),
         ("tp2-bf16", "all-selected")]
# The same with the delayed grads summed on the device (--zenflow-accumulate device; the
# cases above take auto, which is host on a CPU run).
DEVICE_CASES = [("dp2-bf16", "synchronous"), ("tp2-bf16", "synchronous")]


@pytest.fixture(scope="module")
def plain_losses(run_cache):
    """Losses of the plain distributed optimizer per layout at two ranks (once a session)."""
    def get(layout: str):
        return run_cache.run([*BASE, *LAYOUTS[layout]], nproc=2).losses
    return get


@pytest.mark.parametrize("layout,mode,place",
                         [(*c, "auto") for c in CASES] + [(*c, "device") for c in DEVICE_CASES],
                         ids=[f"{a}-{b}" for a, b in CASES]
                         + [f"{a}-{b}-device" for a, b in DEVICE_CASES])
def test_two_ranks_zenflow_equals_plain(tmp_path, plain_losses, layout, mode, place):
    zenflow = tmp_path / "zenflow.jsonl"
    run_pretrain([*BASE, *LAYOUTS[layout], *MODES[mode], "--zenflow-accumulate", place,
                  "--metrics-path", str(zenflow)], nproc=2)
    assert train_losses(zenflow) == plain_losses(layout)
    if place == "device":
        records = read_metrics(zenflow)
        assert records[-1]["zenflow/accumulate_on_device"] == 1.0


def test_two_ranks_zenflow_resume_is_exact_and_needs_the_same_layout(tmp_path, run_cache):
    flags = [*BASE, *LAYOUTS["dp2-bf16"], "--zenflow", "--zenflow-update-interval", "3",
             "--zenflow-select-interval", "6"]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=7, nproc=2,
                                             runs=run_cache)
    assert losses_of(resumed) == losses_of(straight)
    # The same checkpoint at one rank: the ZenFlow state is per rank and layout.
    result = run_pretrain([*flags, "--load", str(tmp_path / "ckpt")], nproc=1, check=False)
    assert result.returncode != 0
    assert "another parallel layout" in result.stdout, result.stdout[-3000:]
