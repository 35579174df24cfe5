#!/usr/bin/env python3
"""The memory plan against the measured peaks, GPU and host, over several shapes and modes.

Each case is a fresh ``pretrain_gpt.py`` process of ``--iters`` iterations with
``--metrics-path``; the plan's numbers are its first record's ``memory/plan_*``, the GPU
peaks the largest ``memory/gpu_max_allocated_gib`` / ``memory/gpu_max_reserved_gib`` of
its records (PyTorch's allocator: the CUDA context is outside both), the host peak the
largest resident set of the process and its children, sampled every 0.2 s here. A case
the plan refuses is recorded as refused (its one line), with no peaks. Writes one JSON
line per case to ``--output`` as it ends (a cut-off call keeps the cases done) and prints
the table at the end.

Usage (on the GPU machine, after ``bench/gpu/gpu_setup.sh``):
    python3 bench/gpu/plan_vs_peak.py --output $OUT/plan_vs_peak.jsonl [--cases a,b] [--iters 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from pretrain_bench import REFERENCE  # noqa: E402

GIB = 1 << 30


def _shape(layers: int, hidden: int, heads: int, *more: str) -> list:
    """The reference flags with another transformer shape (and ``more`` appended)."""
    args = list(REFERENCE)
    for flag, value in (("--num-layers", layers), ("--hidden-size", hidden),
                        ("--num-attention-heads", heads)):
        args[args.index(flag) + 1] = str(value)
    return [*args, *more]


FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]
MB1 = ["--micro-batch-size", "1", "--global-batch-size", "8"]
CASES = {
    # The 1.34B reference GPT (micro-batch 4, no recomputation) in each mode.
    "1.3b-plain": _shape(24, 2048, 16),
    "1.3b-offload": _shape(24, 2048, 16, "--offload-optimizer"),
    "1.3b-zenflow": _shape(24, 2048, 16, "--zenflow"),
    # fp32 gradient reduction (Megatron-LM's default with --bf16).
    "1.3b-plain-fp32-grads": [a for a in _shape(24, 2048, 16) if a != "--grad-reduce-in-bf16"],
    # Activations heavy: 2.7B, micro-batch 2, no recomputation.
    "2.7b-plain-mbs2": _shape(32, 2560, 32, "--micro-batch-size", "2"),
    # Weights and states heavy: 4.1B with full recomputation, plain and offload.
    "4.1b-plain-recompute": _shape(32, 3200, 32, *FULL, *MB1),
    "6.7b-offload-recompute": _shape(32, 4096, 32, *FULL, *MB1, "--offload-optimizer"),
}
# On the CPU (``--cases cpu-...``): the host holds everything; 8 layers, sequence 256.
_CPU = ["--num-layers", "8", "--num-attention-heads", "8", "--seq-length", "256",
        "--max-position-embeddings", "256", "--mock-data", "--vocab-size", "8192", "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--device", "cpu",
        "--wandb-mode", "disabled", "--bf16", "--use-distributed-optimizer"]
for _hidden in (512, 768):
    for _mbs in (1, 4):
        CASES[f"cpu-h{_hidden}-mbs{_mbs}-plain"] = [
            *_CPU, "--hidden-size", str(_hidden), "--micro-batch-size", str(_mbs)]
        CASES[f"cpu-h{_hidden}-mbs{_mbs}-offload"] = [
            *CASES[f"cpu-h{_hidden}-mbs{_mbs}-plain"], "--offload-optimizer",
            "--offload-subgroup-size", "1000000"]
GPU_CASES = [name for name in CASES if not name.startswith("cpu-")]


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_case(name: str, args: list, iters: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *args, "--train-iters",
               str(iters), "--metrics-path", str(metrics)]
        start = time.time()
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        peak = [0]
        proc = psutil.Process(child.pid)

        def watch():
            while child.poll() is None:
                peak[0] = max(peak[0], _tree_rss(proc))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        lines, at_plan = [], [None]
        killer = threading.Timer(timeout, child.kill)
        killer.start()
        for line in child.stdout:  # the resident set when the plan is printed: its baseline
            if at_plan[0] is None and line.startswith("memory plan ("):
                at_plan[0] = _tree_rss(proc)
            lines.append(line)
        child.wait()
        killer.cancel()
        out = "".join(lines)
        if time.time() - start >= timeout:
            return {"case": name, "status": f"timed out after {timeout:.0f} s",
                    "tail": out[-1500:]}
        watcher.join(1)
        records = ([json.loads(line) for line in metrics.read_text().splitlines()]
                   if metrics.exists() else [])
    row = {"case": name, "seconds": round(time.time() - start, 1), "rc": child.returncode}
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    text = out.splitlines()
    first = next((i for i, line in enumerate(text) if line.startswith("memory plan (")), None)
    if first is not None:
        last = next((i for i in range(first, len(text)) if "fits" in text[i]), first)
        row["plan_table"] = text[first:last + 1]
    plan = next((r for r in records if "memory/plan_gpu_bytes" in r), {})
    row.update({k.split("/", 1)[1]: v for k, v in plan.items() if k.startswith("memory/plan_")})
    steps = [r for r in records if "lm_loss" in r]
    if child.returncode != 0 or not steps:
        row["status"] = errors[-1] if errors else "failed"
        row["tail"] = out[-1500:]
        return row
    row["status"] = "ran"
    row["gpu_max_allocated_bytes"] = max(r.get("memory/gpu_max_allocated_gib", 0) for r in steps) * GIB
    row["gpu_max_reserved_bytes"] = max(r.get("memory/gpu_max_reserved_gib", 0) for r in steps) * GIB
    row["host_rss_peak_bytes"] = peak[0]
    row["host_rss_at_plan_bytes"] = at_plan[0] or 0
    row["step_s"] = [round(r["time/iteration_s"], 3) for r in steps]
    return row


def table(rows: list) -> str:
    lines = ["| case | status | planned GPU GB | max allocated GB | max reserved GB | "
             "planned / reserved | planned host GB | host RSS peak GB | host RSS growth after the plan GB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = lambda key: f"{r[key] / 1e9:.2f}" if key in r else "-"  # noqa: E731
        if r.get("status") == "ran" and not r.get("gpu_max_reserved_bytes"):
            # A CPU run: the device's items are in host memory too (MemoryPlan.host_view).
            r = {**r, "plan_host_bytes": r["plan_gpu_bytes"] + r["plan_host_bytes"]}
        ratio = (f"{r['plan_gpu_bytes'] / r['gpu_max_reserved_bytes']:.3f}"
                 if r.get("gpu_max_reserved_bytes") else "-")
        growth = (f"{(r['host_rss_peak_bytes'] - r['host_rss_at_plan_bytes']) / 1e9:.2f}"
                  if r.get("host_rss_at_plan_bytes") else "-")
        lines.append(f"| {r['case']} | {r['status'][:80]} | {g('plan_gpu_bytes')} | "
                     f"{g('gpu_max_allocated_bytes')} | {g('gpu_max_reserved_bytes')} | "
                     f"{ratio} | {g('plan_host_bytes')} | {g('host_rss_peak_bytes')} | "
                     f"{growth} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSON lines, one per case")
    parser.add_argument("--cases", default=",".join(GPU_CASES),
                        help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--iters", type=int, default=3, help="iterations per case")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per case")
    a = parser.parse_args()
    rows = []
    for name in a.cases.split(","):
        if name not in CASES:
            sys.exit(f"error: unknown case {name!r}; the cases: {', '.join(CASES)}")
        row = run_case(name, CASES[name], a.iters, a.timeout)
        rows.append(row)
        with open(a.output, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{name}: {row['status']}", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
