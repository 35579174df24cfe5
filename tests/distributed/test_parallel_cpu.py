"""Two processes (torchrun, gloo) on the CPU: DP=2, TP=2, PP=2 train; resume is exact."""

from __future__ import annotations

import pytest

from conftest import TINY, run_pretrain, train_losses

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
def test_two_ranks_train_and_loss_falls(tmp_path, layout):
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*TINY, *LAYOUTS[layout], "--train-iters", "20",
                        "--metrics-path", str(metrics)], nproc=2).stdout
    assert "cpu x2" in out
    losses = train_losses(metrics)
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bitwise_exact_at_world_size_2(tmp_path, precision):
    flags = [*TINY, "--train-iters", "20", "--use-distributed-optimizer"]
    if precision == "bf16":
        flags.append("--bf16")
    straight = tmp_path / "straight.jsonl"
    run_pretrain([*flags, "--metrics-path", str(straight)], nproc=2)
    ckpt = tmp_path / "ckpt"
    first = tmp_path / "first.jsonl"
    run_pretrain([*flags, "--save", str(ckpt), "--exit-interval", "10",
                  "--metrics-path", str(first)], nproc=2)
    second = tmp_path / "second.jsonl"
    run_pretrain([*flags, "--load", str(ckpt), "--metrics-path", str(second)], nproc=2)
    assert train_losses(first) + train_losses(second) == train_losses(straight)
