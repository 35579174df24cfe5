"""A CPU run's log holds what the run says, not the libraries' noise that does not apply.

One pretrain_gpt.py run of 2 processes (TP=2, which makes megatron-core advise
CUDA_DEVICE_MAX_CONNECTIONS) with the PyTorch profiler (whose start and stop print "USDT:"
lines from native code): none of that, nor absl's warnings, reaches stdout or stderr.
"""

from __future__ import annotations

import re

from mext_testing import TINY, run_pretrain

NOISE = ("CUDA_DEVICE_MAX_CONNECTIONS", "USDT", "absl", "UserWarning", "warnings.warn")


def test_a_cpu_run_has_no_library_noise(tmp_path):
    prof = tmp_path / "prof"
    out = run_pretrain([*TINY, "--train-iters", "3", "--tensor-model-parallel-size", "2",
                        "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                        "--profile-step-end", "2", "--profile-dir", str(prof)], nproc=2).stdout
    # The run itself still speaks: its iterations, and the profile it wrote.
    assert len(re.findall(r"^ iteration +\d+/ +3 \|", out, re.M)) == 3, out
    assert f"profile of iterations 2-2 written to {prof}/rank0-iter2-2.txt" in out, out
    assert (prof / "rank0-iter2-2.txt").is_file()
    noisy = [line for line in out.splitlines() if any(word in line for word in NOISE)]
    assert not noisy, "\n".join(noisy)


def test_a_cpu_runs_plan_and_start_up_say_nothing_of_gpus():
    # Megatron-LM's defaults (--transformer-impl transformer_engine, --attention-backend auto)
    # fall back on a GPU run without Transformer Engine, in one line each; on the CPU
    # Transformer Engine never applies, and the plan has no GPU to fill nor a step to predict.
    out = run_pretrain([*TINY, "--train-iters", "1"]).stdout
    plan = out[out.index("memory plan"):out.index("start-up:")]
    assert [line.split("|")[0].strip() for line in plan.splitlines()[1:3]] == ["tier", "host"]
    for word in ("GPU", "TFLOP", "step:", "device budget"):
        assert word not in plan, plan
    assert "Transformer Engine" not in out and "--attention-backend" not in out, out
