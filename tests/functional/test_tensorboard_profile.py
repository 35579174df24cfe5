"""--tensorboard-dir writes Megatron-LM's tags with the values of the metrics JSONL, and
--profile behaves as Megatron-LM's (nsys range alone, torch.profiler with
--use-pytorch-profiler).

One pretrain_gpt.py process: 3 iterations with TensorBoard, an evaluation and the
PyTorch profiler together. The nsys bracket is checked in-process (no CUDA here).
"""

from __future__ import annotations

import glob
import json

import pytest

from megatron_ext.config import parse_config
from megatron_ext.errors import UsageError
from megatron_ext.training import profiling
from mext_testing import TINY, read_metrics, run_pretrain

BASE = [*TINY, "--train-iters", "3", "--log-interval", "1", "--lr-decay-style", "linear"]

# The flags Megatron-LM requires (model shape, batch, lr, length) for in-process parses.
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "4",
         "--lr", "1e-2", "--train-iters", "4"]


def _scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_tags_equal_the_metrics_and_the_pytorch_profiler_writes(tmp_path):
    tb, prof, metrics = tmp_path / "tb", tmp_path / "prof", tmp_path / "m.jsonl"
    run_pretrain([*BASE, "--eval-iters", "1", "--eval-interval", "2",
                  "--tensorboard-dir", str(tb), "--metrics-path", str(metrics),
                  "--log-timers-to-tensorboard", "--timing-log-level", "2",
                  "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard",
                  "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                  "--profile-step-end", "2", "--profile-dir", str(prof)])
    records = read_metrics(metrics)
    train = {r["iteration"]: r for r in records if "lm_loss" in r}
    evals = {r["iteration"]: r for r in records if "eval/lm_loss" in r}
    assert sorted(train) == [1, 2, 3] and sorted(evals) == [2, 3]
    scalars = _scalars(str(tb))
    expected = {"lm loss": "lm_loss", "learning-rate": "lr", "batch-size": "global_batch_size",
                "grad-norm": "grad_norm", "loss-scale": "loss_scale",
                "iteration-time": "time/iteration_s",
                "forward-backward-time": "time/forward_backward_s",
                "forward-compute-time": "time/forward_s",
                "backward-compute-time": "time/backward_s",
                "all-grads-sync-time": "time/grad_sync_s", "optimizer-time": "time/optimizer_s"}
    for tag, key in expected.items():
        assert scalars[tag] == {i: pytest.approx(r[key], rel=1e-6) for i, r in train.items()}, tag
    samples = {r["consumed_samples"]: r["lm_loss"] for r in train.values()}
    assert scalars["lm loss vs samples"] == pytest.approx(samples, rel=1e-6)
    assert scalars["world-size"] == {1: 1.0, 2: 1.0, 3: 1.0}
    assert scalars["lm loss validation"] == pytest.approx(
        {i: r["eval/lm_loss"] for i, r in evals.items()}, rel=1e-6)
    assert scalars["lm loss validation ppl"] == pytest.approx(
        {i: r["eval/lm_ppl"] for i, r in evals.items()}, rel=1e-6)
    # --use-pytorch-profiler: Megatron-LM's range (after 1 iteration, to 2): iteration 2 only.
    assert (prof / "rank0-iter2-2.txt").read_text().startswith("iterations 2-2, rank 0")
    assert json.loads((prof / "rank0-iter2-2.json").read_text())["traceEvents"]
    assert glob.glob(str(tb / "rank0*.pt.trace.json")), "trace for TensorBoard's profiler"


def test_nsys_range_brackets_the_profiled_steps(monkeypatch):
    calls = []
    monkeypatch.setattr(profiling.torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(profiling.torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(profiling.torch.cuda, "synchronize", lambda: None)

    class Nvtx:
        def __init__(self, record_shapes):
            assert record_shapes

        def __enter__(self):
            calls.append("nvtx on")

        def __exit__(self, *exc):
            calls.append("nvtx off")

    monkeypatch.setattr(profiling.torch.autograd.profiler, "emit_nvtx", Nvtx)
    cfg = parse_config([*SHAPE, "--mock-data", "--vocab-size", "100", "--profile",
                        "--profile-step-start", "2", "--profile-step-end", "4"]).logging
    with profiling.Profiler(cfg, rank=0, is_cpu=False) as prof:
        for it in range(1, 7):
            calls.append(f"before {it}")
            prof.before(it)
            prof.after(it)
    # Megatron-LM: cudaProfilerStart once 2 iterations are done, stop after iteration 4.
    assert calls == ["before 1", "before 2", "before 3", "start", "nvtx on", "before 4",
                     "nvtx off", "stop", "before 5", "before 6"]
    assert list(profiling.profiled_steps(cfg)) == [3, 4]
    other_rank = profiling.Profiler(cfg, rank=1, is_cpu=False)
    other_rank.before(3)
    assert other_rank._nvtx is None


def test_nsys_profile_without_cuda_is_refused():
    cfg = parse_config([*SHAPE, "--mock-data", "--vocab-size", "100", "--profile"]).logging
    with pytest.raises(UsageError, match="add --use-pytorch-profiler"):
        profiling.Profiler(cfg, rank=0, is_cpu=True)
    with pytest.raises(UsageError, match="add --profile"):
        parse_config([*SHAPE, "--mock-data", "--vocab-size", "100", "--use-pytorch-profiler"])
    with pytest.raises(UsageError, match="add --tensorboard-dir"):
        parse_config([*SHAPE, "--mock-data", "--vocab-size", "100", "--log-timers-to-tensorboard"])
