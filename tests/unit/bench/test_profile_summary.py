"""bench/gpu/profile_summary.py: device work is charged to the range that launched it."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "gpu"))

import profile_summary  # noqa: E402


def _trace():
    def x(name, cat, ts, dur, tid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid,
                "args": args}

    return [
        x("optimizer/update", "user_annotation", 0, 1000),
        x("cudaLaunchKernel", "cuda_runtime", 10, 5, correlation=1),
        x("cudaMemcpyAsync", "cuda_runtime", 20, 5, correlation=2),
        x("cudaLaunchKernel", "cuda_runtime", 30, 5, tid=2, correlation=3),  # other thread
        x("cudaLaunchKernel", "cuda_runtime", 2000, 5, correlation=4),  # after the range
        x("adam_kernel", "kernel", 1500, 300, tid=7, correlation=1),  # runs after the range
        x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 100, 200, tid=8, correlation=2),
        x("other_thread_kernel", "kernel", 50, 1000, tid=7, correlation=3),
        x("later_kernel", "kernel", 2010, 1000, tid=7, correlation=4),
    ]


def test_device_time_follows_the_launch(tmp_path):
    summary = profile_summary.summarize(_trace(), ["optimizer/update", "zenflow/gpu_update"], 5)
    update = summary["optimizer/update"]
    assert update["count"] == 1 and update["host_ms"] == 1.0
    assert update["launches"] == 2 and update["device_ms"] == 0.5
    assert list(update["by_name"]) == ["adam_kernel", "Memcpy DtoH (Device -> Pinned)"]
    assert summary["zenflow/gpu_update"] == {"host_ms": 0.0, "count": 0, "device_ms": 0.0,
                                             "launches": 0, "by_name": {}}


def test_reads_gzip_and_reports_bad_files(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert profile_summary.main([str(path), "--labels", "optimizer/update"]) == 0
    assert "device 0.5 ms in 2 launches" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert profile_summary.main([str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}: not a readable Chrome trace")
