"""--use-checkpoint-args, the learning-rate schedule check on resume, and re-running a
finished run (no duplicate records, the same wandb run).

One tiny run saves a checkpoint (with evaluation and an offline wandb run); the cases
reuse it, each a real pretrain_gpt.py process.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from mext_testing import PRETRAIN, ROOT, TINY, read_metrics, run_pretrain, test_env

FLAGS = [*TINY, "--train-iters", "4", "--use-distributed-optimizer", "--lr-decay-style",
         "linear", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "2"]
UNREACHABLE = "http://127.0.0.1:9"


def wandb_env(tmp):
    return {"WANDB_MODE": "offline", "WANDB_BASE_URL": UNREACHABLE, "HTTP_PROXY": UNREACHABLE,
            "HTTPS_PROXY": UNREACHABLE, "WANDB_CONFIG_DIR": str(tmp / "config"),
            "WANDB_CACHE_DIR": str(tmp / "cache"), "WANDB_DATA_DIR": str(tmp / "data"),
            "WANDB_API_KEY": ""}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """(tmp dir, checkpoint dir, metrics file, command) of a finished run."""
    tmp = tmp_path_factory.mktemp("ckargs")
    ckpt, metrics = tmp / "ckpt", tmp / "m.jsonl"
    args = [*FLAGS, "--save", str(ckpt), "--load", str(ckpt), "--metrics-path", str(metrics),
            "--wandb-project", "p", "--wandb-mode", "offline", "--wandb-save-dir",
            str(tmp / "wb")]
    run_pretrain(args, env=wandb_env(tmp))
    return tmp, ckpt, metrics, args


def test_rerun_of_a_finished_run_adds_no_records_and_resumes_its_wandb_run(finished):
    tmp, ckpt, metrics, args = finished
    before = metrics.read_text()
    assert sum('"eval/lm_loss"' in line for line in before.splitlines()) == 2
    result = run_pretrain(args, env=wandb_env(tmp))
    assert "already reached: nothing to train" in result.stdout
    assert metrics.read_text() == before
    run_id = (ckpt / "wandb_run_id.txt").read_text().strip()
    runs = glob.glob(str(tmp / "wb" / "wandb" / "offline-run-*"))
    assert len(runs) == 2 and all(r.endswith("-" + run_id) for r in runs), runs


def _run(args):
    return subprocess.run([sys.executable, PRETRAIN, *args], cwd=ROOT, env=test_env(),
                          capture_output=True, text=True, timeout=300)


def test_longer_schedule_on_resume_needs_a_choice(finished):
    _, ckpt, _, _ = finished
    proc = _run([*FLAGS, "--train-iters", "6", "--load", str(ckpt)])
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    # In samples, as Megatron-LM's scheduler counts: iterations x the global batch of 4.
    assert "lr_decay_steps (--lr-decay-iters/samples or the training length, in samples) 16 " \
           "in the checkpoint, 24 from the flags" in lines[0] \
        and "--override-opt_param-scheduler" in lines[0]


@pytest.mark.parametrize("choice", ["--override-opt_param-scheduler",
                                    "--use-checkpoint-opt_param-scheduler"])
def test_schedule_choice_on_resume(finished, tmp_path, choice):
    """With the model's settings from the checkpoint (the flags say another shape)."""
    _, ckpt, metrics, _ = finished
    out = tmp_path / "m.jsonl"
    wrong_shape = [a for a in FLAGS]
    wrong_shape[wrong_shape.index("--hidden-size") + 1] = "128"
    wrong_shape[wrong_shape.index("--num-layers") + 1] = "3"
    result = run_pretrain([*wrong_shape, "--train-iters", "6", "--load", str(ckpt),
                           "--use-checkpoint-args", choice, "--metrics-path", str(out)])
    assert "Setting hidden_size to 64 from checkpoint" in result.stdout
    assert "Setting num_layers to 2 from checkpoint" in result.stdout
    records = [r for r in read_metrics(out) if "lm_loss" in r]
    assert [r["iteration"] for r in records] == [5, 6]
    saved_lr = [r["lr"] for r in read_metrics(metrics) if "lm_loss" in r]
    if choice == "--use-checkpoint-opt_param-scheduler":
        # The checkpoint's schedule ended at iteration 4 (min lr from there on).
        assert records[0]["lr"] == pytest.approx(saved_lr[-1])
    else:
        # Decay over 6 iterations now: above the min lr at iteration 5.
        assert records[0]["lr"] > saved_lr[-1] * 1.5
    assert os.path.isfile(ckpt / "iter_0000004" / "integrity.json")
