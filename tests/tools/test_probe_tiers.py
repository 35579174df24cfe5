"""tools/probe_tiers.py: probes directories; its last line goes back through parse_tier_spec."""

from __future__ import annotations

import json
import os
import shlex

from tools_testlib import assert_ok, assert_usage_error, run_tool

from megatron_ext.offload.paths import parse_tier_spec

TINY = ("--size-mb", 2, "--block-mb", 1, "--threads", 2)


def test_two_dirs_give_a_line_for_the_job_script(tmp_path):
    dirs = [tmp_path / "nvme", tmp_path / "pfs"]
    for path in dirs:
        path.mkdir()
    out = tmp_path / "report" / "tiers.json"
    run = run_tool("probe_tiers.py", *dirs, *TINY, "--repeat", 2, "--json", out)
    assert_ok(run)

    words = shlex.split(run.stdout.strip().splitlines()[-1])
    assert words[0] == "--offload-paths"
    specs = [parse_tier_spec(word) for word in words[1:]]
    assert [spec.path for spec in specs] == [str(path) for path in dirs]
    assert all(spec.read_gbps > 0 and spec.write_gbps > 0 for spec in specs)

    assert len([line for line in run.stderr.splitlines() if "round" in line]) == 4
    report = json.loads(out.read_text())
    assert [entry["path"] for entry in report["paths"]] == [str(path) for path in dirs]
    assert all(len(entry["read_gbps"]["samples"]) == 2 for entry in report["paths"])
    assert report["offload_paths"] == run.stdout.strip().splitlines()[-1]
    assert all(os.listdir(path) == [] for path in dirs)


def test_direct_io_flag(tmp_path):
    run = run_tool("probe_tiers.py", tmp_path, *TINY, "--repeat", 1, "--direct-io")
    assert_ok(run)
    assert "O_DIRECT" in run.stderr
    assert os.listdir(tmp_path) == []


def test_missing_dir(tmp_path):
    run = run_tool("probe_tiers.py", tmp_path, tmp_path / "missing", *TINY)
    assert_usage_error(run, "missing: directory not found")
    assert run.stdout == ""


def test_not_a_directory(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    assert_usage_error(run_tool("probe_tiers.py", path, *TINY), "not a directory")


def test_same_dir_twice(tmp_path):
    assert_usage_error(run_tool("probe_tiers.py", tmp_path, f"{tmp_path}/", *TINY),
                       "listed twice")


def test_bad_flag_value(tmp_path):
    assert_usage_error(run_tool("probe_tiers.py", tmp_path, "--size-mb", 0), "--size-mb")


def test_help():
    run = run_tool("probe_tiers.py", "--help")
    assert_ok(run)
    assert "--offload-paths" in run.stdout
