"""A tiny GPT trains on the CPU in one process; resume is exact."""

from __future__ import annotations

import signal
import time

import pytest

from mext_testing import (
    TINY,
    assert_loss_falls,
    launch,
    losses_of,
    precision_flags,
    read_metrics,
    run_pretrain,
    straight_and_resumed,
    train_losses,
)


def test_trains_and_loss_falls(run_cache):
    # The plain run of the golden curve and of the offload and ZenFlow comparisons.
    run = run_cache.run([*TINY, "--train-iters", "20", "--use-distributed-optimizer"])
    losses = run.losses
    assert len(losses) == 20
    assert_loss_falls(losses)
    record = run.records[-1]
    for key in ("lr", "grad_norm", "loss_scale", "time/forward_s", "time/backward_s",
                "time/grad_sync_s", "time/optimizer_s", "throughput/tokens_per_s",
                "throughput/tflops_per_gpu", "memory/host_rss_gib"):
        assert key in record, key
    assert record["time/forward_s"] > 0 and record["time/optimizer_s"] > 0


def test_full_recompute_gives_the_same_losses(tmp_path):
    """--recompute-granularity full recomputes each layer in the backward with the dropout
    masks of its forward (megatron-core restores the generator it saved): the same losses and
    gradient norms, bit for bit, as without recomputation (it failed on the CPU before)."""
    records = {}
    for name, flags in (("plain", []), ("full", ["--recompute-granularity", "full",
                                                 "--recompute-method", "uniform",
                                                 "--recompute-num-layers", "1"])):
        metrics = tmp_path / f"{name}.jsonl"
        run_pretrain([*TINY, "--train-iters", "4", "--metrics-path", str(metrics), *flags])
        records[name] = [(r["lm_loss"], r["grad_norm"]) for r in read_metrics(metrics)
                         if "lm_loss" in r]
    assert len(records["plain"]) == 4 and records["full"] == records["plain"], records


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bitwise_exact(tmp_path, run_cache, precision):
    flags = [*TINY, "--train-iters", "20", "--use-distributed-optimizer",
             *precision_flags(precision)]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=10,
                                             load_flags=["--save", str(tmp_path / "ckpt")],
                                             runs=run_cache)
    assert losses_of(resumed) == losses_of(straight)


SIGNAL_FLAGS = [*TINY, "--train-iters", "30", "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def signal_straight(tmp_path_factory):
    """Losses of SIGNAL_FLAGS run straight through (once for both signals)."""
    straight = tmp_path_factory.mktemp("signal") / "straight.jsonl"
    run_pretrain([*SIGNAL_FLAGS, "--metrics-path", str(straight)])
    return train_losses(straight)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_exit_signal_saves_and_resume_is_exact(tmp_path, signal_straight, signum):
    flags = SIGNAL_FLAGS
    ckpt = tmp_path / "ckpt"
    first = tmp_path / "first.jsonl"
    proc = launch([*flags, "--save", str(ckpt), "--metrics-path", str(first)])
    deadline = time.time() + 120
    while time.time() < deadline:
        if first.exists() and len(train_losses(first)) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    stopped = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 5 <= stopped < 30, out
    assert "exit signal received" in out
    assert len(train_losses(first)) == stopped
    second = tmp_path / "second.jsonl"
    run_pretrain([*flags, "--load", str(ckpt), "--save", str(ckpt), "--metrics-path", str(second)])
    assert train_losses(first) + train_losses(second) == signal_straight


def test_fp16_resume_restores_loss_scale(tmp_path):
    flags = [*TINY, "--train-iters", "12", "--use-distributed-optimizer", "--fp16",
             "--initial-loss-scale", "1048576"]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=4)
    keys = ("lm_loss", "loss_scale", "skipped_iterations", "lr")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in straight]
    # The scaler moved during the run, so restoring it is actually tested.
    assert len({r["loss_scale"] for r in straight}) > 1


@pytest.mark.parametrize("mode", ["--finetune", "--no-load-optim"])
def test_weights_only_loads(tmp_path, mode):
    flags = [*TINY, "--use-distributed-optimizer", "--hidden-dropout", "0",
             "--attention-dropout", "0"]
    ckpt = tmp_path / "ckpt"
    pre = tmp_path / "pre.jsonl"
    run_pretrain([*flags, "--train-iters", "10", "--save", str(ckpt), "--metrics-path", str(pre)])
    scratch = tmp_path / "scratch.jsonl"
    run_pretrain([*flags, "--train-iters", "3", "--metrics-path", str(scratch)])
    tuned = tmp_path / "tuned.jsonl"
    iters = "3" if mode == "--finetune" else "13"
    run_pretrain([*flags, "--train-iters", iters, "--load", str(ckpt), mode,
                  "--metrics-path", str(tuned)])
    records = read_metrics(tuned)
    if mode == "--finetune":
        assert [r["iteration"] for r in records] == [1, 2, 3]
        assert records[0]["consumed_samples"] == 4
    else:
        assert [r["iteration"] for r in records] == [11, 12, 13]
    # The loaded weights are the trained ones: the first loss is far below a fresh model's.
    assert records[0]["lm_loss"] < train_losses(scratch)[0] - 0.3
    assert records[0]["lm_loss"] == pytest.approx(train_losses(pre)[-1], abs=0.5)
