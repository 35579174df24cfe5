"""Checkpoints travel between this project and Megatron-LM (torch_dist, same layout).

``megatron_lm_side.py`` does Megatron-LM's part with megatron-core: it loads this
project's checkpoint with Megatron-LM's keys and trains on; and it writes a checkpoint the
way Megatron-LM's save_checkpoint does, which this project's --load resumes. Either way
the losses continue exactly as one uninterrupted run of this project (CPU, bitwise; at 1
rank, DP=2, TP=2 and PP=2). Also this project's format-1 checkpoints (rng/ files, the
scheduler in iterations) still load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mext_testing import TINY, read_metrics, run_pretrain

SIDE = str(Path(__file__).with_name("megatron_lm_side.py"))
ITERS, STOP = 6, 3
FLAGS = [*TINY, "--train-iters", str(ITERS), "--use-distributed-optimizer",
         "--global-batch-size", "8"]
LAYOUTS = {
    "1rank": (1, []),
    "DP=2": (2, []),
    "TP=2": (2, ["--tensor-model-parallel-size", "2"]),
    "PP=2": (2, ["--pipeline-model-parallel-size", "2"]),
}


def _train(records):
    return [(r["iteration"], r["lm_loss"], r["lr"]) for r in records if "lm_loss" in r]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def straight(request, run_cache):
    """(layout, records of the uninterrupted run of this project; once a session)."""
    nproc, extra = LAYOUTS[request.param]
    return request.param, _train(run_cache.run([*FLAGS, *extra], nproc=nproc).records)


def test_megatron_lm_loads_this_projects_checkpoint_and_trains_on(straight, tmp_path):
    layout, want = straight
    nproc, extra = LAYOUTS[layout]
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    run_pretrain([*FLAGS, *extra, "--save", str(ckpt), "--exit-interval", str(STOP),
                  "--metrics-path", str(first)], nproc=nproc)
    report = tmp_path / "report.json"
    run_pretrain(["load", str(ckpt), str(report), "--", *FLAGS, *extra, "--metrics-path",
                  str(second)], nproc=nproc, script=SIDE)
    assert _train(read_metrics(first)) + _train(read_metrics(second)) == want
    seen = json.loads(report.read_text())
    assert seen["checkpoint_version"] == 3.0 and seen["iteration"] == STOP
    assert seen["content_metadata"] == {"distrib_optim_sharding_type": "dp_reshardable",
                                        "singleton_local_shards": False,
                                        "chained_optim_avoid_prefix": True}
    args = seen["args"]
    tp, pp = (2 if layout == "TP=2" else 1), (2 if layout == "PP=2" else 1)
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"],
            args["world_size"], args["data_parallel_size"]) == (tp, pp, nproc, nproc // tp // pp)
    assert args["consumed_train_samples"] == STOP * 8
    assert (args["num_layers"], args["hidden_size"], args["num_attention_heads"],
            args["seq_length"], args["padded_vocab_size"]) == (2, 64, 4, 32, 256)
    assert args["ckpt_format"] == "torch_dist" and args["use_dist_ckpt"] is True
    assert args["train_iters"] == ITERS and args["global_batch_size"] == 8
    assert seen["params_dtype"] == "torch.float32"
    # Megatron-LM's scheduler units: samples.
    sched = seen["opt_param_scheduler"]
    assert (sched["num_steps"], sched["lr_warmup_steps"], sched["lr_decay_steps"]) == \
        (STOP * 8, 2 * 8, ITERS * 8)
    assert seen["rng_keys"] == ["np_rng_state", "random_rng_state", "torch_rng_state"]
    assert seen["num_floating_point_operations_so_far"] > 0


def test_this_project_resumes_a_megatron_lm_checkpoint(straight, tmp_path):
    layout, want = straight
    nproc, extra = LAYOUTS[layout]
    ckpt, second = tmp_path / "ckpt", tmp_path / "second.jsonl"
    run_pretrain(["save", str(ckpt), str(STOP), "--", *FLAGS, *extra], nproc=nproc, script=SIDE)
    assert not (ckpt / f"iter_{STOP:07d}" / "integrity.json").exists()
    out = run_pretrain([*FLAGS, *extra, "--load", str(ckpt), "--metrics-path", str(second)],
                       nproc=nproc).stdout
    assert f"iteration {STOP}, {STOP * 8} samples consumed" in out, out[-3000:]
    assert _train(read_metrics(second)) == want[STOP:]


def test_format_1_checkpoint_still_loads(tmp_path, run_cache):
    want = _train(run_cache.run(FLAGS).records)  # the 1rank layout's straight run
    ckpt, second = tmp_path / "ckpt", tmp_path / "second.jsonl"
    run_pretrain(["save-legacy", str(ckpt), str(STOP), "--", *FLAGS], script=SIDE)
    assert (ckpt / f"iter_{STOP:07d}" / "rng" / "rank_00000.pt").is_file()
    run_pretrain([*FLAGS, "--load", str(ckpt), "--metrics-path", str(second)])
    assert _train(read_metrics(second)) == want[STOP:]
