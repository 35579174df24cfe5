"""Sample-based training on the CPU: Megatron-LM's lr per step, --train-samples, the ramp."""

from __future__ import annotations

import pytest

from mext_testing import TINY, ramp_batches, read_metrics, run_pretrain, straight_and_resumed

# TINY without its iteration-based warm-up (each test gives its own), micro batch 4, GBS 8.
_i = TINY.index("--lr-warmup-iters")
BASE = [*TINY[:_i], *TINY[_i + 2:], "--global-batch-size", "8"]
GBS = 8


def _train_records(path):
    return [r for r in read_metrics(path) if "lm_loss" in r]


def _megatron_lrs(iterations, increments, **lengths):
    """lr after each iteration of megatron-core's scheduler with Megatron-LM's values."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Holder:
        param_groups = [{"lr": 0.0}]

    holder = Holder()
    scheduler = OptimizerParamScheduler(
        holder, init_lr=0.0, max_lr=1e-2, min_lr=1e-4, lr_decay_style="cosine", start_wd=0.01,
        end_wd=0.01, wd_incr_style="constant", **lengths)
    out = []
    for inc in increments[:iterations]:
        scheduler.step(increment=inc)
        out.append(holder.param_groups[0]["lr"])
    return out


def test_train_iters_and_train_samples_are_the_same_run(tmp_path):
    by_iters, by_samples = tmp_path / "iters.jsonl", tmp_path / "samples.jsonl"
    run_pretrain([*BASE, "--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-iters",
                  "5", "--metrics-path", str(by_iters)])
    run_pretrain([*BASE, "--train-samples", str(6 * GBS), "--lr-warmup-samples", str(2 * GBS),
                  "--lr-decay-samples", str(5 * GBS), "--metrics-path", str(by_samples)])
    iters, samples = _train_records(by_iters), _train_records(by_samples)
    assert len(iters) == 6
    assert [r["lm_loss"] for r in iters] == [r["lm_loss"] for r in samples]
    assert [r["lr"] for r in iters] == [r["lr"] for r in samples]
    assert [r["consumed_samples"] for r in samples] == [GBS * i for i in range(1, 7)]
    # Megatron-LM's scheduler in samples: warm-up 2 x 8, decay 5 x 8, wd 6 x 8, stepped by 8.
    want = _megatron_lrs(6, [GBS] * 6, lr_warmup_steps=16, lr_decay_steps=40, wd_incr_steps=48)
    assert [r["lr"] for r in iters] == want
    # min lr past the decay: the schedule really ran in samples (iterations would not reach it).
    assert want[-1] == 1e-4


def test_warmup_fraction_matches_megatron_lm(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run_pretrain([*BASE, "--train-samples", "64", "--lr-warmup-fraction", "0.3",
                  "--metrics-path", str(metrics)])
    want = _megatron_lrs(8, [GBS] * 8, lr_warmup_steps=0.3 * 64, lr_decay_steps=64,
                         wd_incr_steps=64)
    assert [r["lr"] for r in _train_records(metrics)] == want


RAMP = ["--train-samples", "64", "--rampup-batch-size", "2", "2", "20", "--micro-batch-size",
        "2", "--lr-warmup-samples", "6", "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def ramp_run(run_cache):
    """The training records of the ramp run (once a session: also the straight run of
    test_resume_mid_ramp_is_exact)."""
    return [r for r in run_cache.run([*BASE, *RAMP]).records if "lm_loss" in r]


def test_global_batch_follows_megatron_lms_ramp(ramp_run):
    want = ramp_batches(64, 2, 2, 20, GBS)
    assert [r["global_batch_size"] for r in ramp_run] == want
    consumed = [sum(want[:i + 1]) for i in range(len(want))]
    assert [r["consumed_samples"] for r in ramp_run] == consumed
    # The scheduler steps by each iteration's batch, as Megatron-LM's.
    assert [r["lr"] for r in ramp_run] == _megatron_lrs(
        len(want), want, lr_warmup_steps=6, lr_decay_steps=64, wd_incr_steps=64)


def test_resume_mid_ramp_is_exact(tmp_path, run_cache, ramp_run):
    want = ramp_batches(64, 2, 2, 20, GBS)
    stop_at = 6
    assert want[stop_at - 1] < want[stop_at] < GBS  # stops inside the ramp
    straight, resumed = straight_and_resumed(tmp_path, [*BASE, *RAMP], stop_at=stop_at,
                                             runs=run_cache)
    assert [r["lm_loss"] for r in resumed if "lm_loss" in r] == \
        [r["lm_loss"] for r in straight if "lm_loss" in r] == [r["lm_loss"] for r in ramp_run]
    assert [r["lr"] for r in resumed if "lm_loss" in r] == [r["lr"] for r in ramp_run]
    # As Megatron-LM, the run saved where the batch grew (with --save).
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("iter_"))
    grows = [i for i in range(1, stop_at) if want[i] != want[i - 1]]
    assert saved == [f"iter_{i:07d}" for i in sorted({*grows, stop_at})]


def test_ramp_with_the_offload_engine_is_the_plain_run(tmp_path, ramp_run):
    paths = tmp_path / "nvme"
    paths.mkdir()
    metrics = tmp_path / "m.jsonl"
    run_pretrain([*BASE, *RAMP, "--offload-optimizer", "--offload-paths", str(paths),
                  "--metrics-path", str(metrics)])
    assert [r["lm_loss"] for r in _train_records(metrics)] == [r["lm_loss"] for r in ramp_run]


def test_ramp_with_pipeline_parallel_resumes_exactly(tmp_path):
    """PP=2 takes each iteration's micro-batches from the ramp, and resumes mid-ramp."""
    flags = [*BASE, *RAMP, "--pipeline-model-parallel-size", "2"]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=5, nproc=2)
    straight = [r for r in straight if "lm_loss" in r]
    assert [r["global_batch_size"] for r in straight] == ramp_batches(64, 2, 2, 20, GBS)
    assert [r["lm_loss"] for r in resumed if "lm_loss" in r] == [r["lm_loss"] for r in straight]


def test_ramp_with_zenflow_is_the_plain_run(tmp_path, ramp_run):
    """ZenFlow with every column on the GPU side and one-step windows is plain Adam: the
    ramp's growing batches reach it as they reach the plain optimizer."""
    metrics = tmp_path / "m.jsonl"
    run_pretrain([*BASE, *RAMP, "--zenflow", "--zenflow-topk-ratio", "1.0",
                  "--zenflow-update-interval", "1", "--metrics-path", str(metrics)])
    assert [r["lm_loss"] for r in _train_records(metrics)] == [r["lm_loss"] for r in ramp_run]
