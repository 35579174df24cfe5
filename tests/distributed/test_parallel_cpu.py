"""Two processes (torchrun, gloo) on the CPU: DP=2, TP=2, PP=2 train; resume is exact."""

from __future__ import annotations

import pytest

from mext_testing import (
    TINY,
    assert_loss_falls,
    losses_of,
    precision_flags,
    straight_and_resumed,
)

LAYOUTS = {
    "dp2": ["--use-distributed-optimizer"],
    "dp2-overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                    "--overlap-param-gather", "--global-batch-size", "16"],
    "tp2": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
    "tp2-llama": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                  "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                  "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                  "--group-query-attention", "--num-query-groups", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
            "--use-distributed-optimizer"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_ranks_train_and_loss_falls(run_cache, layout):
    # dp2 is also tests/distributed/test_offload_parallel_cpu.py's plain fp32 run (the
    # session's run cache shares it).
    run = run_cache.run([*TINY, "--train-iters", "20", *LAYOUTS[layout]], nproc=2)
    assert "cpu x2" in run.stdout
    losses = run.losses
    assert len(losses) == 20
    assert_loss_falls(losses)


# bf16 only: its fp32 main params are the larger state; fp32 resume is exact at world size 1
# (tests/functional/test_train_cpu.py) and the two-rank fp32 run ~95 s on 2 cores.
@pytest.mark.parametrize("precision", ["bf16"])
def test_resume_is_bitwise_exact_at_world_size_2(tmp_path, run_cache, precision):
    flags = [*TINY, "--train-iters", "20", "--use-distributed-optimizer",
             *precision_flags(precision)]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=10, nproc=2,
                                             runs=run_cache)
    assert losses_of(resumed) == losses_of(straight)
