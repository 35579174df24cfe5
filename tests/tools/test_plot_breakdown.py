"""tools/plot_breakdown.py: metrics JSONL -> PNG, with a panel per kind of field present.

On synthetic records (with and without offload / ZenFlow fields, log interval 10, a
resumed run's repeated iterations), on the JSONL of a real tiny pretrain_gpt.py run
(log interval 3, with evaluations), and on bad input.
"""

from __future__ import annotations

import json
import math
import os

import _breakdown_panels as panels_of
import matplotlib.image
import plot_breakdown
import pytest
from _breakdown_panels import (
    bar_spans,
    classify_field,
    plan_panels,
    split_records,
    stacked_values,
)
from plot_breakdown import plot
from tools_testlib import assert_ok, assert_usage_error, run_tool

import mext_testing

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CORE_PANELS = ["time", "loss", "throughput", "memory"]
OFFLOAD_PANELS = ["offload/time", "offload/background", "offload/ratio", "offload/bandwidth"]
ZENFLOW_PANELS = ["zenflow/time", "zenflow/ratio"]


def synthetic_records(iterations=range(10, 101, 10), offload=False, zenflow=False,
                      eval_every=50):
    """Records shaped like pretrain_gpt.py's (log interval 10), plus feature fields."""
    records = []
    for it in iterations:
        record = {"iteration": it, "lm_loss": 8.0 - it / 50, "lr": 1e-3, "grad_norm": None,
                  "time/iteration_s": 0.2, "time/forward_s": 0.05, "time/backward_s": 0.09,
                  "time/grad_sync_s": 0.01, "time/optimizer_s": 0.03,
                  "throughput/tokens_per_s": 40000.0, "memory/host_rss_gib": 12.0,
                  "memory/gpu_max_allocated_gib": 30.5}
        if offload:
            record.update({"offload/fetch_bg_s": 0.02, "offload/convert_s": 0.005,
                           "offload/update_s": 0.03, "offload/flush_bg_s": 0.01,
                           "offload/stall_s": 0.004, "offload/cache_hit_rate": 0.6,
                           "offload/path/nvme/read_gbps": 6.5,
                           "offload/path/pfs/read_gbps": 2.1})
        if zenflow:
            record.update({"zenflow/rho": 0.1, "zenflow/selected_ratio": 0.12,
                           "zenflow/retention": 0.8, "zenflow/cpu_update_s": 0.05,
                           "zenflow/gpu_stall_s": 0.002})
        records.append(record)
        if eval_every and it % eval_every == 0:
            records.append({"iteration": it, "eval/lm_loss": 7.0, "eval/lm_ppl": 1096.6})
    return records


def write_jsonl(path, records):
    with open(path, "w") as out:
        for record in records:
            out.write(record if isinstance(record, str) else json.dumps(record, sort_keys=True))
            out.write("\n")
    return str(path)


def assert_png(path, num_panels):
    """A real PNG: magic bytes, a plausible size, and the figure's pixel dimensions."""
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert 20_000 < os.path.getsize(path) < 5_000_000, os.path.getsize(path)
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width == 1210  # 11 in x 110 dpi
    assert height == round((0.8 + 2.4 * num_panels) * 110)
    assert image.std() > 0.05  # something was drawn, not a blank canvas


@pytest.mark.parametrize("offload,zenflow", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_feature_panels_only_when_their_fields_exist(tmp_path, offload, zenflow):
    output = tmp_path / "breakdown.png"
    panels = plot(synthetic_records(offload=offload, zenflow=zenflow), str(output),
                  detail="all")
    expected = CORE_PANELS + (OFFLOAD_PANELS if offload else []) + \
        (ZENFLOW_PANELS if zenflow else [])
    assert panels == expected
    assert_png(output, len(expected))
    assert os.listdir(tmp_path) == ["breakdown.png"]  # no temporary file left


def test_many_records_draw_as_stacked_areas(tmp_path):
    # Beyond plot_breakdown._MAX_BARS records the stacks are areas instead of bars.
    records = synthetic_records(range(1, 2 * plot_breakdown._MAX_BARS), offload=True)
    output = tmp_path / "many.png"
    assert plot(records, str(output), detail="all") == CORE_PANELS + OFFLOAD_PANELS
    assert_png(output, len(CORE_PANELS + OFFLOAD_PANELS))


def test_feature_fields_are_grouped_by_unit():
    train, evals = split_records(synthetic_records(offload=True, zenflow=True))
    panels = {p.name: p for p in plan_panels(train, evals, "all")}
    keys = lambda name: sorted(s.key for s in panels[name].series)  # noqa: E731
    assert panels["offload/time"].kind == "stacked"
    assert keys("offload/time") == ["offload/convert_s", "offload/stall_s", "offload/update_s"]
    # I/O threads run alongside the phases: their busy time is drawn apart, as lines.
    assert panels["offload/background"].kind == "lines"
    assert keys("offload/background") == ["offload/fetch_bg_s", "offload/flush_bg_s"]
    assert keys("offload/ratio") == ["offload/cache_hit_rate"]
    assert panels["offload/ratio"].ylim == (0.0, 1.05)
    assert keys("offload/bandwidth") == ["offload/path/nvme/read_gbps",
                                         "offload/path/pfs/read_gbps"]
    assert keys("zenflow/time") == ["zenflow/cpu_update_s", "zenflow/gpu_stall_s"]
    # rho and retention carry no unit in their names: ratios because they lie in [0, 1].
    assert keys("zenflow/ratio") == ["zenflow/retention", "zenflow/rho",
                                     "zenflow/selected_ratio"]
    assert [s.label for s in panels["time"].series] == [
        "forward", "backward", "grad sync", "optimizer", "other"]
    assert [s.key for s in panels["loss"].series] == ["lm_loss", "eval/lm_loss"]


@pytest.mark.parametrize("key,values,kind", [
    ("offload/fetch_s", [3.0], "time"),
    ("offload/fetch_bg_s", [3.0], "background"),
    ("offload/path/nvme/write_gbps", [0.5], "bandwidth"),
    ("offload/pinned_gib", [0.5], "memory"),
    ("offload/params_per_s", [0.5], "rate"),
    ("offload/cache_hit_rate", [0.0, 1.0], "ratio"),
    ("zenflow/rho", [0.0, 0.25], "ratio"),
    ("offload/bytes_moved", [0.5, 3e9], "values"),
    ("offload/cache_hits", [math.nan], "values"),
    ("offload/io_bytes", [0.5, 3e9], "bytes"),
    ("zenflow/d2h_bytes", [2.3e9], "bytes"),
    # Counts that happen to be 0 or 1 are not ratios.
    ("offload/device_subgroups_n", [0.0, 1.0], "values"),
    ("offload/streamed_subgroups", [0.0], "values"),
    ("zenflow/d2h_copies", [1.0], "values"),
    # The I/O floor is a bound, not a phase; the roofline ratio is >= 1, not in 0-1.
    ("offload/io_floor_s", [0.3], "floor"),
    ("offload/roofline_ratio", [1.4], "roofline"),
    ("offload/host_only_subgroups", [1.0], "values"),
])
def test_classify_field(key, values, kind):
    assert classify_field(key, values) == kind


def test_other_is_the_unaccounted_time_clipped_at_zero():
    train = [{"iteration": 1, "time/iteration_s": 1.0, "time/forward_s": 0.2,
              "time/backward_s": 0.3, "time/grad_sync_s": 0.1, "time/optimizer_s": 0.1},
             {"iteration": 2, "time/iteration_s": 0.5, "time/forward_s": 0.4,
              "time/backward_s": 0.3},  # the timed parts exceed the iteration
             {"iteration": 3, "time/iteration_s": 0.5}]
    panel = plan_panels(train, [])[0]
    assert panel.name == "time"
    rows = dict(zip([s.key for s in panel.series], stacked_values(train, panel)))
    assert rows["other"] == pytest.approx([0.3, 0.0, 0.5])
    assert rows["time/grad_sync_s"] == [0.1, 0.0, 0.0]


@pytest.mark.parametrize("iterations,spans", [
    ([10, 20, 30], [(0, 10), (10, 10), (20, 10)]),  # log interval 10
    ([10, 20, 25], [(0, 10), (10, 10), (20, 5)]),   # train_iters not a multiple of it
    ([10, 12], [(0, 10), (10, 2)]),                 # the quickstart test's 12 iterations
    ([3, 6, 9, 10], [(0, 3), (3, 3), (6, 3), (9, 1)]),
    ([31, 32, 33], [(30, 1), (31, 1), (32, 1)]),    # a resumed run's file
    ([40, 50, 60], [(30, 10), (40, 10), (50, 10)]),  # resumed at 30, log interval 10
    ([10, 20, 60, 70], [(0, 10), (10, 10), (50, 10), (60, 10)]),  # records missing
    ([7], [(0, 7)]),
])
def test_bar_spans_cover_the_logging_interval(iterations, spans):
    assert bar_spans(iterations) == spans


def test_resumed_run_later_record_of_an_iteration_wins():
    records = synthetic_records(range(1, 6), eval_every=0)
    records += [dict(r, lm_loss=1.0) for r in synthetic_records(range(4, 8), eval_every=0)]
    train, evals = split_records(records)
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["lm_loss"] for r in train][3:] == [1.0] * 4
    assert evals == []


def test_command_line_prints_the_output_and_the_panels(tmp_path):
    metrics = write_jsonl(tmp_path / "m.jsonl", synthetic_records(offload=True) + [""])
    output = tmp_path / "plots" / "b.png"  # the folder does not exist yet
    run = run_tool("plot_breakdown.py", metrics, "--output", output, "--title", "a title",
                   "--panels", "all")
    assert_ok(run)
    assert run.stdout == f"{output}\n"
    assert f"panels {', '.join(CORE_PANELS + OFFLOAD_PANELS)}" in run.stderr
    assert_png(output, len(CORE_PANELS + OFFLOAD_PANELS))


def test_the_default_is_the_four_core_panels_and_names_the_others(tmp_path):
    # An offload and ZenFlow run's file: a reader gets the time breakdown, the loss, the
    # throughput and the memory, and one line naming what --panels all adds.
    metrics = write_jsonl(tmp_path / "m.jsonl", synthetic_records(offload=True, zenflow=True))
    output = tmp_path / "b.png"
    run = run_tool("plot_breakdown.py", metrics, "--output", output)
    assert_ok(run)
    assert f"panels {', '.join(CORE_PANELS)}\n" in run.stderr
    more = len(OFFLOAD_PANELS + ZENFLOW_PANELS)
    assert f"offload and zenflow fields: {more} more panels with --panels all" in run.stderr
    assert_png(output, len(CORE_PANELS))


def test_every_legend_label_is_a_name():
    # A field that is its unit's whole name (offload/roofline_ratio) kept no label, which
    # matplotlib's legend shows as "_child0".
    train, evals = split_records(synthetic_records(offload=True))
    for record in train:
        record.update({"offload/roofline_ratio": 1.4, "offload/io_floor_s": 0.1})
    panels = {p.name: p for p in panels_of.feature_panels(train, "offload/")}
    assert [s.label for s in panels["offload/roofline"].series] == ["roofline ratio"]
    assert all(s.label and not s.label.startswith("_")
               for p in panels.values() for s in p.series)


def test_real_tiny_run_with_log_interval_3_and_evaluations(tmp_path):
    metrics = tmp_path / "m.jsonl"
    mext_testing.run_pretrain([*mext_testing.TINY, "--train-iters", "10", "--log-interval", "3",
                           "--eval-iters", "2", "--eval-interval", "5",
                           "--metrics-path", str(metrics)])
    records = mext_testing.read_metrics(metrics)
    assert [r["iteration"] for r in records if "lm_loss" in r] == [3, 6, 9, 10]
    assert [r["iteration"] for r in records if "eval/lm_loss" in r] == [5, 10]
    output = tmp_path / "breakdown.png"
    run = run_tool("plot_breakdown.py", metrics, "--output", output)
    assert_ok(run)
    assert run.stdout.strip() == str(output)
    assert f"panels {', '.join(CORE_PANELS)}" in run.stderr  # no offload, no ZenFlow
    assert_png(output, len(CORE_PANELS))
    assert plot(records, str(tmp_path / "again.png")) == CORE_PANELS


@pytest.mark.parametrize("content,expected", [
    (None, "m.jsonl: file not found"),
    ("", "m.jsonl: empty file"),
    ("\n  \n", "m.jsonl: empty file"),
    ('{"iteration": 10, "eval/lm_loss": 5.0}\n', "m.jsonl: no training records"),
    ('{"iteration": 1, "lm_loss": 5.0}\n{"iteration": 2, "lm_loss": 4.\n',
     "m.jsonl:2: invalid JSON"),
    ('{"iteration": 1, "lm_loss": 5.0}\n\n[1, 2]\n', "m.jsonl:3: expected a JSON object"),
    ('{"lm_loss": 5.0}\n', 'm.jsonl:1: record has no integer "iteration"'),
    (b'{"iteration": 1, "lm_loss": 5.0, "x": "\xff"}\n', "m.jsonl:1: not valid UTF-8"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, content, expected):
    metrics = tmp_path / "m.jsonl"
    if isinstance(content, bytes):
        metrics.write_bytes(content)
    elif content is not None:
        metrics.write_text(content)
    output = tmp_path / "b.png"
    assert_usage_error(run_tool("plot_breakdown.py", metrics, "--output", output), expected)
    assert not output.exists()
    assert sorted(os.listdir(tmp_path)) == ([] if content is None else ["m.jsonl"])


def test_unsupported_output_format_is_a_usage_error(tmp_path):
    metrics = write_jsonl(tmp_path / "m.jsonl", synthetic_records())
    assert_usage_error(run_tool("plot_breakdown.py", metrics, "--output", tmp_path / "b.xyz"),
                       "unsupported image format .xyz")


def test_plot_without_training_records_raises():
    with pytest.raises(plot_breakdown.ToolError, match="no training records"):
        plot([{"iteration": 5, "eval/lm_loss": 3.0}], "unused.png")


def test_counts_and_bytes_get_axes_of_their_own():
    """What the engines report per iteration: bytes moved (GB-sized) and counts
    (subgroups per path, ZenFlow's S) never share an axis."""
    records = synthetic_records(offload=True, zenflow=True)
    for record in records:
        record.update({"offload/io_bytes": 3.1e9, "offload/path0_subgroups": 6.0,
                       "zenflow/d2h_bytes": 2.3e9, "zenflow/h2d_bytes": 4.0e8,
                       "zenflow/update_interval": 4.0})
    train, evals = split_records(records)
    panels = {p.name: p for p in plan_panels(train, evals, "all")}
    keys = lambda name: sorted(s.key for s in panels[name].series)  # noqa: E731
    assert keys("offload/bytes") == ["offload/io_bytes"]
    assert keys("offload/values") == ["offload/path0_subgroups"]
    assert keys("zenflow/bytes") == ["zenflow/d2h_bytes", "zenflow/h2d_bytes"]
    assert keys("zenflow/values") == ["zenflow/update_interval"]
    assert panels["offload/bytes"].ylabel.format(unit="GB") == "bytes per iteration (GB)"
    assert "bytes" not in panels["offload/values"].ylabel


@pytest.mark.parametrize("values,expected", [
    ([3.1e9, 1.0], (1e9, "GB")), ([4.0e8], (1e6, "MB")), ([2048.0], (1e3, "KB")),
    ([12.0, math.nan], (1.0, "B")), ([], (1.0, "B")),
])
def test_bytes_unit(values, expected):
    assert plot_breakdown.bytes_unit(values) == expected


def cpu_records(**kwargs):
    """synthetic_records of a run without GPU: no memory/gpu_* field, the offload engine's
    device-tier fields at 0 (what a CPU run records)."""
    records = synthetic_records(**kwargs)
    for record in records:
        record.pop("memory/gpu_max_allocated_gib", None)
        if "offload/update_s" in record:
            record.update({"offload/device_update_s": 0.0, "offload/device_tier_gib": 0.0,
                           "offload/device_subgroups_n": 0, "offload/streamed_subgroups": 0.0})
    return records


def test_a_cpu_run_draws_no_flat_zeros_and_says_so(tmp_path):
    train, evals = split_records(cpu_records(offload=True))
    assert panels_of.ran_on_cpu(train)
    left_out = panels_of.left_out_fields(train)
    assert left_out == ["offload/device_subgroups_n", "offload/device_tier_gib",
                        "offload/device_update_s", "offload/streamed_subgroups"]
    panels = {p.name: p for p in plan_panels(train, evals, "all")}
    drawn = {s.key for p in panels.values() for s in p.series}
    assert not drawn & set(left_out)
    # The offload memory and values panels had only device-tier fields: not drawn at all.
    assert list(panels) == CORE_PANELS + OFFLOAD_PANELS
    assert [s.key for s in panels["offload/time"].series] == [
        "offload/convert_s", "offload/stall_s", "offload/update_s"]
    assert [s.key for s in panels["memory"].series] == ["memory/host_rss_gib"]
    output = tmp_path / "cpu.png"
    run = run_tool("plot_breakdown.py", write_jsonl(tmp_path / "m.jsonl", cpu_records(
        offload=True)), "--output", output, "--panels", "all")
    assert_ok(run)
    assert ("no GPU in this run: not drawn, 0 in every record: offload: device_subgroups_n, "
            "device_tier_gib, device_update_s, streamed_subgroups") in run.stderr
    assert_png(output, len(CORE_PANELS + OFFLOAD_PANELS))


def test_a_gpu_run_keeps_its_zero_fields():
    records = synthetic_records(offload=True)
    for record in records:
        record["offload/device_update_s"] = 0.0
    train, evals = split_records(records)
    assert not panels_of.ran_on_cpu(train) and panels_of.left_out_fields(train) == []
    panels = {p.name: p for p in plan_panels(train, evals, "all")}
    assert "offload/device_update_s" in {s.key for s in panels["offload/time"].series}


def test_a_cpu_run_keeps_a_field_that_is_not_always_zero():
    records = cpu_records(offload=True)
    records[3]["offload/device_update_s"] = 0.01
    train, _ = split_records(records)
    assert "offload/device_update_s" not in panels_of.left_out_fields(train)


def test_feature_prefixes_come_from_the_records(tmp_path):
    """A feature this tool has never heard of gets its panels from its fields' units."""
    records = synthetic_records(eval_every=0)
    for record in records:
        record.update({"prefetch/wait_s": 0.01, "prefetch/hit_rate": 0.9,
                       "prefetch/read_gbps": 3.0})
    train, evals = split_records(records)
    assert panels_of.feature_prefixes(train) == ["prefetch/"]
    assert [p.name for p in plan_panels(train, evals, "all")] == CORE_PANELS + [
        "prefetch/time", "prefetch/ratio", "prefetch/bandwidth"]
    assert plot(records, str(tmp_path / "p.png"), detail="all")[-1] == "prefetch/bandwidth"
