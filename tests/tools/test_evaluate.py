"""tools/evaluate.py and pretrain_gpt.py --skip-train reproduce the run's validation loss."""

from __future__ import annotations

import math

import evaluate
import model_testlib as lib
import pytest
from model_testlib import assert_ok, assert_usage_error, call_tool

from mext_testing import TINY, read_metrics, run_pretrain


def _last_eval(path) -> dict:
    return [r for r in read_metrics(path) if "eval/lm_loss" in r][-1]


def test_evaluate_reproduces_the_runs_validation_loss(finetuned_run, tmp_path):
    logged = _last_eval(finetuned_run.metrics)
    assert logged["iteration"] == 40
    out = tmp_path / "eval.jsonl"
    run = call_tool(evaluate, "--load", finetuned_run.ckpt_out, "--data-path",
                    finetuned_run.prefix, "--device", "cpu", "--metrics-path", out)
    assert_ok(run)
    (record,) = read_metrics(out)
    assert record["iteration"] == 40 and record["eval_iters"] == 2
    assert math.isclose(record["eval/lm_loss"], logged["eval/lm_loss"], rel_tol=1e-6), \
        (record, logged)
    assert math.isclose(record["eval/lm_ppl"], math.exp(logged["eval/lm_loss"]), rel_tol=1e-6)
    assert run.stdout.startswith("validation loss at iteration 40 | lm loss value: ")
    # A different number of batches is a different (finite) evaluation.
    one = call_tool(evaluate, "--load", finetuned_run.ckpt_out, "--data-path",
                    finetuned_run.prefix, "--device", "cpu", "--eval-iters", "1")
    assert_ok(one)
    assert f"{logged['eval/lm_loss']:.6E}" not in one.stdout


def test_skip_train_evaluates_the_loaded_model_and_exits(finetuned_run, tmp_path):
    """Megatron-LM's --skip-train: load, evaluate at the loaded iteration, no training, no save."""
    logged = _last_eval(finetuned_run.metrics)
    metrics = tmp_path / "m.jsonl"
    before = sorted(p.name for p in finetuned_run.ckpt_out.iterdir())
    run_pretrain([*lib.flags_file(finetuned_run.ckpt_in), "--seq-length", "32", *lib.TRAIN,
                  *lib.data_flags(finetuned_run.tokenizer, finetuned_run.prefix),
                  "--load", str(finetuned_run.ckpt_out), "--save", str(finetuned_run.ckpt_out),
                  "--skip-train", "--train-iters", "80", "--log-interval", "10",
                  "--eval-interval", "20", "--eval-iters", "2", "--metrics-path", str(metrics)])
    records = read_metrics(metrics)
    assert [r["iteration"] for r in records] == [40]
    assert math.isclose(records[0]["eval/lm_loss"], logged["eval/lm_loss"], rel_tol=1e-6)
    assert sorted(p.name for p in finetuned_run.ckpt_out.iterdir()) == before


def test_train_iters_zero_evaluates_at_iteration_zero(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*TINY, "--train-iters", "0", "--eval-iters", "2", "--eval-interval", "5",
                        "--lr-decay-style", "cosine", "--save", str(tmp_path / "ck"),
                        "--metrics-path", str(metrics)]).stdout
    records = read_metrics(metrics)
    assert [sorted(r) for r in records] == [["eval/lm_loss", "eval/lm_ppl", "iteration"]]
    assert records[0]["iteration"] == 0 and math.isfinite(records[0]["eval/lm_loss"])
    assert "validation loss at iteration 0" in out
    assert not (tmp_path / "ck").exists()  # as Megatron-LM: nothing trained, nothing saved


@pytest.mark.parametrize("argv, expected", [
    (["--load", "/nonexistent/ckpt", "--data-path", "x"], "--load /nonexistent/ckpt"),
    (["--load", ".", "--data-path", "x", "--eval-iters", "0"], "--eval-iters"),
])
def test_bad_input_is_one_line(argv, expected):
    assert_usage_error(call_tool(evaluate, *argv), expected)


def test_missing_data_prefix_is_one_line(finetuned_run, tmp_path):
    assert_usage_error(call_tool(evaluate, "--load", finetuned_run.ckpt_out, "--data-path",
                                 tmp_path / "nothing", "--device", "cpu"), "--data-path")


def test_help_of_every_tool():
    import convert_checkpoint
    import generate

    for module, flag in ((evaluate, "--eval-iters"), (generate, "--top-p"),
                         (convert_checkpoint, "--finetune")):
        run = call_tool(module, "--help")
        assert run.returncode == 0 and flag in run.stdout, run.stdout
