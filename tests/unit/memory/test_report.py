"""The plan's table and its ``memory/plan_*`` metrics."""

from __future__ import annotations

from megatron_ext.config import parse_config
from megatron_ext.memory.machine import target_machine
from megatron_ext.memory.plan import gb, plan_run
from megatron_ext.memory.report import plan_metrics, plan_table

FLAGS = ["--num-layers", "36", "--hidden-size", "6144", "--num-attention-heads", "48",
         "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
         "--global-batch-size", "64", "--lr", "1e-4", "--train-iters", "10", "--mock-data",
         "--vocab-size", "32000", "--bf16", "--grad-reduce-in-bf16",
         "--use-distributed-optimizer", "--recompute-granularity", "full", "--recompute-method",
         "uniform", "--recompute-num-layers", "1", "--offload-optimizer",
         "--offload-device-cache-gb", "auto"]


def the_plan():
    cfg = parse_config(FLAGS)
    cfg.check_world(1)
    cfg.offload.offload_paths = ["/nvme"]
    return plan_run(cfg, 32001, 1, target_machine(150.1, 80, ["60@1.37,1.80"], 590.0))


def test_table_has_a_row_per_tier_the_step_and_the_verdict():
    text = plan_table(the_plan())
    lines = text.splitlines()
    assert lines[0].startswith("memory plan (offload mode, per rank of 1 on target; 16.52B "
                               "parameters, 16.52B on the rank, TP=1 PP=1 DP=1; 10 B/element "
                               "states in subgroups of 1 GB)")
    assert [line.split("|")[0].strip() for line in lines[1:5]] == ["tier", "GPU", "host",
                                                                    "path0"]
    assert "device tier" in lines[2] and "at 1.37/1.80 GB/s" in lines[4]
    assert lines[5].startswith("  step: forward+backward 30.1 s (1.77e+16 FLOPs at 590 "
                               "TFLOP/s per GPU)")
    assert lines[-1] == "  fits"


def test_the_tflops_hint_names_the_flag_of_the_program_that_prints_it():
    cfg = parse_config(FLAGS)
    cfg.check_world(1)
    cfg.offload.offload_paths = ["/nvme"]
    plan = plan_run(cfg, 32001, 1, target_machine(150.1, 80, ["60@1.37,1.80"], None))
    assert "(no TFLOP/s known: give --plan-tflops)" in plan_table(plan)
    text = plan_table(plan, tflops_flag="--target-tflops")
    assert "(no TFLOP/s known: give --target-tflops)" in text
    assert "--plan-tflops" not in text


def test_a_refusal_is_not_repeated_by_the_verdict():
    """The program prints the first refusal as its error line after the table: the table's
    verdict names only the others."""
    plan = the_plan()
    plan.refusals = ["first reason", "second reason"]
    assert plan_table(plan).splitlines()[-1] == ("  does not fit (why: the line below; also: "
                                                 "second reason)")
    plan.refusals = ["first reason"]
    assert plan_table(plan).splitlines()[-1] == "  does not fit (why: the line below)"


def test_metrics_give_bytes_and_subgroups_per_tier():
    plan = the_plan()
    record = plan_metrics(plan)
    assert record["memory/plan_gpu_bytes"] == plan.gpu.used
    assert record["memory/plan_device_subgroups"] == plan.device_subgroups > 0
    assert record["memory/plan_device_tier_bytes"] == plan.gpu.items["device tier"]
    assert record["memory/plan_path0_subgroups"] == plan.paths[0].subgroups
    assert record["memory/plan_state_bytes_per_element"] == 10
    assert record["memory/plan_fits"] == 1.0
    assert record["memory/plan_step_s"] == plan.step_s
    assert all(isinstance(v, float) for v in record.values())


def test_a_cpu_run_has_no_gpu_row_and_no_step_prediction():
    from megatron_ext.memory.machine import Machine

    cfg = parse_config(FLAGS)
    cfg.check_world(1)
    cpu = Machine(name="cpu", gpu_total_bytes=None, gpu_free_bytes=None,
                  host_available_bytes=300 * 10**9)
    plan = plan_run(cfg, 32001, 1, cpu)
    lines = plan_table(plan).splitlines()
    assert [line.split("|")[0].strip() for line in lines[1:3]] == ["tier", "host"]
    # What the plan counts for the device lives in host memory on the CPU: one row holds it.
    assert "weights" in lines[2] and "optimizer states" in lines[2]
    assert lines[2].split("|")[1].strip() == gb(plan.gpu.used + plan.host.used)
    text = "\n".join(lines)
    assert "GPU" not in text and "TFLOP" not in text and "step:" not in text
    assert "device budget" not in text
