#!/usr/bin/env python3
"""Offload benchmark: the reference GPT with its optimizer states on host memory and disk.

Runs pretrain_gpt.py once per configuration (a fresh process each, ``--iters`` iterations,
the first ``--warmup`` dropped) on the reference GPT of issue 2 (24 layers, hidden 2048,
seq 2048, micro-batch 4, 1.34B parameters, bf16, distributed optimizer), and reports per
configuration the step time (min/median/mean/max over the measured steps), the optimizer
(update) phase, the offload breakdown (fetch, convert, update, write-back, flush, stall,
cache hit rate, bytes and GB/s per path) and the update phase against the I/O floor: the
bytes the step moved over each path divided by that path's bandwidth, measured by an
O_DIRECT probe (tools/probe_tiers.py's) in the same command.

Configurations (``--configs``, comma-separated):
  no-offload            states on the GPU (megatron-core's DistributedOptimizer)
  mcore-offload         megatron-core's --optimizer-cpu-offload, fraction 1.0, D2H/H2D overlap
  host-only             this engine, every state in host memory (no paths)
  all-off               this engine, disk path, all four techniques switched off
  alt                   + alternating order (with cache reuse)
  alt-delayed           + delayed FP16->FP32 gradient conversion
  all-on                + concurrency control and rebalancing (all techniques)
  all-on-2paths         + a second path given by --second-path (name it a stand-in)
  all-on-nocc           all-on without concurrency control (for runs on several GPUs)
  deepspeed-nvme        DeepSpeed ZeRO-Infinity (the peer bundle), same model, same disk

A configuration name may end in ``@GB`` (``all-on@9.6``): that run's host cache budget
instead of ``--cache-gb``, and in ``xN`` (``all-on@2.4x2``): that run on N GPUs of the
machine (torchrun, data parallel, each rank its own shard, all ranks on the same paths:
the setting that concurrency control is for; ``all-on-nocc`` is all-on without it). Every
run also reports its peak resident set size (``peak_rss_gib``, from wait4's rusage; with N
GPUs, that of the largest process): the host memory it really used, pinned buffers, CUDA
context and all, so that budgets can be compared across engines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # pretrain_bench beside it

from pretrain_bench import REFERENCE, summarize  # noqa: E402

OFF_SWITCHES = {
    "alternate": "--no-offload-alternate-order",
    "delayed": "--no-offload-delayed-grad-conversion",
    "concurrency": "--no-offload-concurrency-control",
    "rebalance": "--no-offload-rebalance",
}
ENABLED = {"all-off": (), "alt": ("alternate",), "alt-delayed": ("alternate", "delayed"),
           "all-on": tuple(OFF_SWITCHES), "all-on-2paths": tuple(OFF_SWITCHES),
           "all-on-nocc": ("alternate", "delayed", "rebalance")}


def probe(path: str, size_mb: int) -> dict:
    """O_DIRECT read/write bandwidth of ``path`` (tools/probe_tiers.py's probe)."""
    from megatron_ext.offload.probe import probe_bandwidth

    result = probe_bandwidth(path, size_mb=size_mb, threads=4, direct_io=True)
    return {"read_gbps": result.read_gbps, "write_gbps": result.write_gbps,
            "direct_io": result.direct_io_used, "size_mb": size_mb}


def split_name(name: str):
    """``all-on@9.6x2`` -> (``all-on``, 9.6, 2); ``all-on`` -> (``all-on``, None, 1)."""
    match = re.fullmatch(r"([a-z0-9-]+?)(?:@([0-9.]+))?(?:x([0-9]+))?", name)
    if match is None:
        raise SystemExit(f"bad configuration name {name!r}: NAME[@CACHE_GB][xGPUS]")
    base, cache, nproc = match.groups()
    return base, float(cache) if cache else None, int(nproc) if nproc else 1


def run_measured(cmd, a, **kwargs):
    """Runs ``cmd``; returns (returncode, stdout+stderr, peak RSS of the process in GiB).

    The peak comes from wait4's rusage of that one child (ru_maxrss, KiB on Linux).
    """
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, **kwargs)
        timer = threading.Timer(a.timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    return proc.returncode, output, usage.ru_maxrss / 2**20


def config_args(name: str, a, bandwidth: dict) -> list:
    """pretrain_gpt.py flags of one configuration."""
    name, cache_gb, _ = split_name(name)
    if name == "no-offload":
        return []
    if name == "mcore-offload":
        return ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0",
                "--overlap-cpu-optimizer-d2h-h2d"]
    args = ["--offload-optimizer", "--offload-io-threads", str(a.io_threads)]
    if name == "host-only":
        return args
    disk = bandwidth[a.disk]
    paths = [f"{a.disk}@{disk['read_gbps']:.2f},{disk['write_gbps']:.2f}"]
    if name == "all-on-2paths":
        second = bandwidth[a.second_path]
        paths.append(f"{a.second_path}@{second['read_gbps']:.2f},{second['write_gbps']:.2f}")
    args += ["--offload-paths", *paths, "--offload-host-cache-gb", str(cache_gb or a.cache_gb),
             "--offload-direct-io"]
    args += [flag for key, flag in OFF_SWITCHES.items() if key not in ENABLED[name]]
    return args


def run_config(name: str, a, bandwidth: dict) -> dict:
    """Runs one configuration; returns its summary (step times, breakdown, I/O floor)."""
    extra = config_args(name, a, bandwidth)
    nproc = split_name(name)[2]
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [*launch, str(ROOT / "pretrain_gpt.py"), *REFERENCE, *shlex.split(a.extra_args),
               *extra, "--train-iters", str(a.iters), "--metrics-path", str(metrics)]
        print(f"== {name}: {' '.join(shlex.quote(x) for x in extra)}", flush=True)
        returncode, output, peak_rss = run_measured(cmd, a, cwd=ROOT)
        records = ([json.loads(line) for line in metrics.read_text().splitlines()
                    if "lm_loss" in line] if metrics.exists() else [])
    result = {"config": name, "args": extra, "nproc": nproc, "returncode": returncode,
              "peak_rss_gib": peak_rss}
    if returncode != 0 or len(records) <= a.warmup:
        lines = output.strip().splitlines()
        result["tail"] = lines[-25:]
        # torchrun's own report ends the output; the rank's one-line error comes before it.
        result["errors"] = [x for x in lines if x.lower().startswith("error:")][:4]
        print("\n".join(result["errors"] + result["tail"][-8:]), flush=True)
        return result
    measured = records[a.warmup:]
    result["step_s"] = summarize([r["time/iteration_s"] for r in measured])
    result["optimizer_s"] = summarize([r["time/optimizer_s"] for r in measured])
    result["forward_backward_s"] = summarize([r["time/forward_backward_s"] for r in measured])
    result["gpu_max_allocated_gib"] = max(r.get("memory/gpu_max_allocated_gib", 0)
                                          for r in measured)
    result["losses"] = [r["lm_loss"] for r in records]
    offload = {k: statistics.fmean(r[k] for r in measured) for k in measured[0]
               if k.startswith("offload/")}
    if offload:
        result["offload"] = offload
        floor = 0.0
        paths = [a.disk] + ([a.second_path] if split_name(name)[0] == "all-on-2paths" else [])
        # Rank 0's bytes; the other ranks move as many over the same paths.
        for i, path in enumerate(paths):
            bw = bandwidth[path]
            floor += (offload.get(f"offload/path{i}_read_bytes", 0.0) / (bw["read_gbps"] * 1e9)
                      + offload.get(f"offload/path{i}_write_bytes", 0.0)
                      / (bw["write_gbps"] * 1e9))
        if floor:
            result["io_floor_s"] = floor * nproc
            result["update_over_floor"] = result["optimizer_s"]["median"] / (floor * nproc)
    s = result["step_s"]
    print(f"   step s min/median/mean/max {s['min']:.3f}/{s['median']:.3f}/{s['mean']:.3f}/"
          f"{s['max']:.3f} (n={s['n']}), optimizer median {result['optimizer_s']['median']:.3f}"
          + (f", I/O floor {result['io_floor_s']:.3f} s (x{result['update_over_floor']:.2f})"
             if "io_floor_s" in result else ""), flush=True)
    return result


def last_json(lines) -> "dict | None":
    """The JSON object on the last line that starts with ``{`` (the DeepSpeed bundle's summary)."""
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def run_deepspeed(a) -> dict:
    """DeepSpeed ZeRO-Infinity (peer bundle) on the same model and disk."""
    nvme = os.path.join(a.disk, "deepspeed-swap")
    os.makedirs(nvme, exist_ok=True)
    cmd = [sys.executable, os.path.join(a.deepspeed_bundle, "zero_infinity_bench.py"),
           "--offload", "nvme", "--nvme-path", nvme, "--layers", "24", "--hidden", "2048",
           "--heads", "16", "--vocab", "32000", "--seq", "2048", "--micro-batch", "4",
           "--warmup", str(a.warmup), "--steps", str(a.iters - a.warmup)]
    print(f"== deepspeed-nvme: {' '.join(cmd)}", flush=True)
    returncode, output, peak_rss = run_measured(cmd, a)
    shutil.rmtree(nvme, ignore_errors=True)
    lines = output.strip().splitlines()
    result = {"config": "deepspeed-nvme", "command": " ".join(cmd), "returncode": returncode,
              "peak_rss_gib": peak_rss, "tail": lines[-30:]}
    summary = last_json(lines)
    if summary is not None:
        result["json"] = summary
    print("\n".join(lines[-6:]), flush=True)
    return result


def main() -> int:
    """Runs the configurations and writes one results JSON."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="no-offload,all-off,all-on",
                   help="comma-separated configurations (see above)")
    p.add_argument("--disk", default="/var/tmp/mext-offload",
                   help="directory on the disk tier (created)")
    p.add_argument("--second-path", help="second tier directory for all-on-2paths (created)")
    p.add_argument("--cache-gb", type=float, default=4.8,
                   help="--offload-host-cache-gb (DeepSpeed's pinned swap buffers: ~4.8 GB)")
    p.add_argument("--io-threads", type=int, default=8, help="--offload-io-threads")
    p.add_argument("--iters", type=int, default=6, help="iterations per configuration")
    p.add_argument("--warmup", type=int, default=2, help="iterations dropped")
    p.add_argument("--probe-mb", type=int, default=2048, help="size of the bandwidth probe")
    p.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    p.add_argument("--extra-args", default="",
                   help="pretrain_gpt.py flags added to every configuration of this engine "
                        "and megatron-core (e.g. '--global-batch-size 64'); not to DeepSpeed")
    p.add_argument("--deepspeed-bundle", help="the DeepSpeed peer bundle (for deepspeed-nvme)")
    p.add_argument("--output", required=True, help="results JSON")
    a = p.parse_args()
    configs = [c for c in a.configs.split(",") if c]
    os.makedirs(a.disk, exist_ok=True)
    bandwidth = {a.disk: probe(a.disk, a.probe_mb)}
    if a.second_path:
        os.makedirs(a.second_path, exist_ok=True)
        bandwidth[a.second_path] = probe(a.second_path, a.probe_mb)
    print(f"probe (O_DIRECT, {a.probe_mb} MiB): {json.dumps(bandwidth)}", flush=True)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(shlex.quote(x) for x in sys.argv),
               "reference_args": REFERENCE + shlex.split(a.extra_args), "bandwidth": bandwidth,
               "runs": []}
    out = Path(a.output)
    for name in configs:
        run = run_deepspeed(a) if name == "deepspeed-nvme" else run_config(name, a, bandwidth)
        results["runs"].append(run)
        out.write_text(json.dumps(results, indent=1) + "\n")
    print("| config | step s min / median / mean / max (n) | optimizer s (median) | I/O floor s "
          "| GPU GiB | peak host RSS GiB |")
    print("|---|---|---|---|---|---|")
    for run in results["runs"]:
        if "json" in run:  # DeepSpeed's own summary line
            ds = run["json"]
            times = ds.get("step_times_s", [])
            print(f"| {run['config']} | {min(times):.3f} / {ds['median_step_s']:.3f} / "
                  f"{statistics.fmean(times):.3f} / {max(times):.3f} ({len(times)}) | "
                  f"{ds['median_opt_step_s']:.3f} | | {ds['peak_gpu_mem_gib']:.1f} | "
                  f"{run['peak_rss_gib']:.1f} |")
            continue
        if "step_s" not in run:
            print(f"| {run['config']} | failed or see JSON (rc {run['returncode']}) | | | | |")
            continue
        s = run["step_s"]
        print(f"| {run['config']} | {s['min']:.3f} / {s['median']:.3f} / {s['mean']:.3f} / "
              f"{s['max']:.3f} ({s['n']}) | {run['optimizer_s']['median']:.3f} | "
              f"{run.get('io_floor_s', float('nan')):.3f} | {run['gpu_max_allocated_gib']:.1f} | "
              f"{run['peak_rss_gib']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
