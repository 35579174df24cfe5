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
import os
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
# Megatron-LM's Llama-3-8B flag set (examples/llama/train_llama3_8b_h100_fp8.sh at
# core_v0.16.1, its bf16 branch, mock data) on one GPU with global batch 8 and full
# recomputation (as issue 37's rows ran it); iteration-based schedule flags instead of the
# script's sample-based ones (this driver passes --train-iters).
LLAMA3_8B = [
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--kv-channels", "128", "--seq-length", "8192", "--max-position-embeddings", "8192",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu",
    "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "0.00015",
    "--min-lr", "0.00001", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
    "--log-interval", "1", "--eval-iters", "0", "--wandb-mode", "disabled", *FULL]
CASES["llama3-8b-plain"] = LLAMA3_8B
CASES["llama3-8b-offload"] = [*LLAMA3_8B, "--offload-optimizer"]
CASES["llama3-8b-zenflow"] = [*LLAMA3_8B, "--zenflow"]
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


def _children(proc: psutil.Process) -> tuple:
    """(the child processes, their resident set in bytes)."""
    kids = proc.children(recursive=True)
    total = 0
    for p in kids:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return kids, total


def _tree_rss(proc: psutil.Process) -> int:
    """The resident set of ``proc`` and its children, in bytes."""
    try:
        own = proc.memory_info().rss
    except psutil.Error:
        own = 0
    return own + _children(proc)[1]


def _kb_fields(path: str) -> dict:
    """The ``Key: N kB`` lines of a /proc file (/proc/meminfo, /proc/PID/status) in bytes;
    {} when it is gone."""
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _kinds(proc: psutil.Process, kids: list) -> str:
    """The main process's and its children's resident set by kind: anonymous, file-backed
    (shared libraries, reclaimable), shared memory (what pinned CUDA host memory shows as)."""
    kinds = ("RssAnon", "RssFile", "RssShmem")
    own = _kb_fields(f"/proc/{proc.pid}/status")
    theirs = [_kb_fields(f"/proc/{p.pid}/status") for p in kids]

    def gib(values) -> str:
        return "/".join(f"{value / GIB:.2f}" for value in values)

    return (f"main anon/file/shmem {gib(own.get(k, 0) for k in kinds)}, children "
            f"{gib(sum(d.get(k, 0) for d in theirs) for k in kinds)}")


def _largest_mappings(pid: int, count: int = 12) -> list:
    """The ``count`` largest mappings of ``pid`` by resident set: (GiB, name)."""
    sizes, name = {}, None
    try:
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else "[anonymous]"
            elif head and head[0] == "Rss:" and name is not None:
                sizes[name] = sizes.get(name, 0) + int(head[1]) * 1024
    except (OSError, ValueError, IndexError):
        return []
    return sorted(((v / GIB, k) for k, v in sizes.items()), reverse=True)[:count]


def _gpu_used() -> int:
    """The device's used memory in bytes, as the driver counts it (nvidia-smi; every
    process, the CUDA context and libraries included); 0 without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=5).stdout
        return int(float(out.split()[0]) * 2**20)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 0


def run_case(name: str, args: list, iters: int, timeout: float, env: dict = None,
             timeline: Path = None, trace_pinned: Path = None) -> dict:
    """One fresh run of case ``name``; ``env`` added to its environment; ``timeline``: a
    file for its host resident set every 0.5 s and its output lines, each with the seconds
    since the start (where the host grows, phase by phase); ``trace_pinned``: a file for
    its pinned host allocations by stack (the run goes through ``pinned_trace.py``)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *args, "--train-iters",
               str(iters), "--metrics-path", str(metrics)]
        if trace_pinned is not None:
            cmd.insert(1, str(HERE / "pinned_trace.py"))
            env = {**(env or {}), "PINNED_TRACE_OUT": str(trace_pinned)}
        start = time.time()
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True,
                                 env={**os.environ, **(env or {})})
        peak = [0]
        proc = psutil.Process(child.pid)
        events = []  # (seconds, text) for the timeline

        gpu_peak = [0]
        # The node's MemAvailable before the run and its lowest during it: what the run
        # took from the node (anonymous, pinned and shared memory; not the libraries' pages
        # the kernel can drop), whatever process of the tree holds it.
        before = _kb_fields("/proc/meminfo").get("MemAvailable", 0)
        low = [before]

        def watch():
            last = 0.0
            while child.poll() is None:
                rss = _tree_rss(proc)
                peak[0] = max(peak[0], rss)
                now = time.time() - start
                if now - last >= 0.5:
                    # The children apart (data workers, torch.compile's compile workers).
                    kids, kids_rss = _children(proc)
                    used = _gpu_used()
                    gpu_peak[0] = max(gpu_peak[0], used)
                    info = _kb_fields("/proc/meminfo")
                    if info.get("MemAvailable"):
                        low[0] = min(low[0], info["MemAvailable"])
                    events.append((now, f"rss {rss / GIB:.2f} GiB, {len(kids)} children "
                                        f"{kids_rss / GIB:.2f} GiB, GPU used {used / GIB:.2f} GiB; "
                                        f"{_kinds(proc, kids)}; node MemAvailable "
                                        f"{info.get('MemAvailable', 0) / GIB:.2f} Shmem "
                                        f"{info.get('Shmem', 0) / GIB:.2f} GiB"))
                    last = now
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        lines, at_plan, gpu_at_plan = [], [None], [0]
        killer = threading.Timer(timeout, child.kill)
        killer.start()
        for line in child.stdout:  # the resident set when the plan is printed: its baseline
            if at_plan[0] is None and line.startswith("memory plan ("):
                at_plan[0] = _tree_rss(proc)
                gpu_at_plan[0] = _gpu_used()
            lines.append(line)
            events.append((time.time() - start, line.rstrip()[:300]))
            if " iteration        1/" in line:  # the log line's %8d
                # Where the main process's memory is, once the first iteration is done.
                for size, where in _largest_mappings(child.pid):
                    events.append((time.time() - start, f"  mapping {size:7.2f} GiB {where}"))
        child.wait()
        killer.cancel()
        out = "".join(lines)
        if timeline is not None:
            with open(timeline, "a") as f:
                f.write(f"## {name} {json.dumps(env or {})}\n")
                f.writelines(f"{t:8.1f} {text}\n" for t, text in sorted(events))
        if time.time() - start >= timeout:
            return {"case": name, "status": f"timed out after {timeout:.0f} s",
                    "tail": out[-1500:]}
        watcher.join(1)
        records = ([json.loads(line) for line in metrics.read_text().splitlines()]
                   if metrics.exists() else [])
    row = {"case": name, "seconds": round(time.time() - start, 1), "rc": child.returncode,
           "env": env or {}}
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
    # The driver's view (sampled every 0.5 s): the allocator's peaks leave out what CUDA's
    # libraries load after the plan (the engine's first-step line saw ~2.1-2.5 GB less room
    # than the plan on an H100, bench/results/2026-12-07b-h100-plan-vs-peak).
    row["node_available_drop_bytes"] = before - low[0]
    row["gpu_device_used_peak_bytes"] = gpu_peak[0]
    row["gpu_device_used_at_plan_bytes"] = gpu_at_plan[0]
    row["step_s"] = [round(r["time/iteration_s"], 3) for r in steps]
    # Each iteration's timers and the engine's counters (the first step's state build).
    row["iterations"] = [{k: v for k, v in r.items()
                          if k.startswith(("time/", "offload/", "zenflow/", "throughput/"))}
                         for r in steps]
    return row


def table(rows: list) -> str:
    lines = ["| case | status | planned GPU GB | max allocated GB | max reserved GB | "
             "planned / reserved | GPU used by the driver's count, peak GB | planned host GB | "
             "host RSS peak GB | host RSS growth after the plan GB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = lambda key: f"{r[key] / 1e9:.2f}" if key in r else "-"  # noqa: E731
        if r.get("status") == "ran" and not r.get("gpu_max_reserved_bytes"):
            # A CPU run: the device's items are in host memory too (MemoryPlan.host_view).
            r = {**r, "plan_host_bytes": r["plan_gpu_bytes"] + r["plan_host_bytes"]}
        ratio = (f"{r['plan_gpu_bytes'] / r['gpu_max_reserved_bytes']:.3f}"
                 if r.get("gpu_max_reserved_bytes") else "-")
        growth = (f"{(r['host_rss_peak_bytes'] - r['host_rss_at_plan_bytes']) / 1e9:.2f}"
                  if r.get("host_rss_at_plan_bytes") else "-")
        name = r["case"] + (" " + " ".join(f"{k}={v}" for k, v in r["env"].items()) if r.get("env") else "")
        lines.append(f"| {name} | {r['status'][:80]} | {g('plan_gpu_bytes')} | "
                     f"{g('gpu_max_allocated_bytes')} | {g('gpu_max_reserved_bytes')} | "
                     f"{ratio} | {g('gpu_device_used_peak_bytes')} | {g('plan_host_bytes')} | "
                     f"{g('host_rss_peak_bytes')} | "
                     f"{growth} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSON lines, one per case")
    parser.add_argument("--cases", default=",".join(GPU_CASES),
                        help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--iters", type=int, default=3, help="iterations per case")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per case")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="added to every case's environment (repeatable)")
    parser.add_argument("--timeline", type=Path, default=None,
                        help="a file for each case's host timeline and output lines")
    parser.add_argument("--trace-pinned", type=Path, default=None, metavar="DIR",
                        help="each case's pinned host allocations by stack, to "
                             "DIR/pinned-CASE.txt (bench/gpu/pinned_trace.py)")
    a = parser.parse_args()
    env = dict(item.split("=", 1) for item in a.env)
    rows = []
    for name in a.cases.split(","):
        if name not in CASES:
            sys.exit(f"error: unknown case {name!r}; the cases: {', '.join(CASES)}")
        trace = None if a.trace_pinned is None else a.trace_pinned / f"pinned-{name}.txt"
        row = run_case(name, CASES[name], a.iters, a.timeout, env, a.timeline, trace)
        rows.append(row)
        with open(a.output, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{name}: {row['status']}", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
