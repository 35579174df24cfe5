#!/usr/bin/env python3
r"""ZenFlow benchmark: step time of --zenflow against the other ways to hold the optimizer.

What runs: pretrain_gpt.py once per configuration, each a fresh process, on the reference
GPT of issue 2 (``REFERENCE`` of bench/gpu/pretrain_bench.py: 24 layers, hidden 2048, 16 heads,
seq 2048, vocab 32000, micro-batch 4, bf16, distributed optimizer, mock data, tied
embeddings: ~1.28B parameters), with ``--log-interval 1`` so that the metrics JSONL holds one
record per iteration; and DeepSpeed's peer bundle (zero_infinity_bench.py, from
``--deepspeed-bundle``) as a subprocess on the same shape (its GPT has an untied head:
1.34B parameters). Configurations (``--configs``, comma-separated, run in that order):

  no-offload              megatron-core's DistributedOptimizer, states on the GPU
  mcore-offload           megatron-core's host offload: --optimizer-cpu-offload
                          --optimizer-offload-fraction 1.0 --overlap-cpu-optimizer-d2h-h2d
  host-only               this project's offload engine, every state in host memory
                          (--offload-optimizer --offload-io-threads IO_THREADS)
  zenflow                 --zenflow --zenflow-topk-ratio K --zenflow-update-interval S
                          --zenflow-select-interval N (--topk, --interval, --select-interval)
  deepspeed-zero-offload  the bundle with --offload cpu (ZeRO-3, optimizer states and
                          DeepSpeedCPUAdam on the host)
  deepspeed-zenflow       the bundle with --offload cpu --zenflow --zenflow-topk K
                          --zenflow-update-interval S (ZeRO-2, overlap_step; the bundle
                          fixes DeepSpeed's select_interval at 16 steps)

``zenflow@N`` is zenflow with N staging slots (MEGATRON_EXT_ZENFLOW_STAGING_SLOTS=N: the
host adds up to N-1 steps' gradients in one pass); ``:VAR=VALUE`` after a megatron_ext
configuration's name sets an environment variable of its run (``zenflow:OMP_NUM_THREADS=8``);
a configuration may be listed more than once. Modifiers ``+MOD`` after the name (before any
``:VAR=VALUE``): ``+device``, ``+host``, ``+auto`` on zenflow: ``--zenflow-accumulate``
(where the delayed gradients are summed over a window; default auto); on any megatron_ext
configuration ``+fp32grads``: gradients accumulated and reduced in fp32
(``--accumulate-allreduce-grads-in-fp32``, Megatron-LM's flag), ``+bf16grads``: in bf16
(``--grad-reduce-in-bf16`` where pretrain_gpt.py has it, else the bf16 default of
``--bf16``). A run's "x no-off" is over the no-offload run with the same grads modifier.
E.g. ``no-offload+bf16grads,zenflow+device+bf16grads,zenflow+host+bf16grads,
no-offload+fp32grads,zenflow+device+fp32grads,zenflow+host+fp32grads``.

Measurement rules. ZenFlow's CPU update runs in the background over a window of S steps
and its result is waited for at the window's boundary, so the median step hides the stall
at the boundary: the step time reported is the MEAN over whole windows (median, min, max
and n next to it). Windows start at iteration 1 (the first selection), so: the first
``--warmup-windows`` windows (default 1, i.e. S iterations: the first selection, allocator
and kernel warm-up) are dropped and the next ``--windows`` whole windows (default 3: 12
iterations at S=4) are measured. Every configuration, the DeepSpeed ones (``--warmup`` and
``--steps`` of the bundle) and the non-ZenFlow ones included, drops and measures the same
numbers of steps, so that the rows are comparable. The per-iteration time is
``time/iteration_s`` of the JSONL (the bundle: its fwd+bwd+step per step).

``--window-records``: pretrain_gpt.py logs once per window (``--log-interval S``) instead
of every iteration, so no metric is read from the GPU between a window's steps (such a
read may wait for the copies in flight, e.g. the delayed gradients' 2.3 GB D2H on the
reference GPT: the hypothesis of bench/results/2026-12-01c-h200, not yet measured); each
record is then its window's mean step, and min/max/median are over windows. This is
how a run that logs every S or more steps sees its steps; the per-position profile of the
window is not available then.

Reported per configuration (in the JSON, and in the table on stdout): mean / median / min /
max (n) of the step time, its ratio to no-offload's mean (when no-offload ran), the peak
resident set size of the process (wait4's ru_maxrss: the host memory it really used,
pinned buffers included), the GPU's max allocated memory, the losses of every iteration and
the final one. For zenflow also: the GPU stall share (sum of ``zenflow/stall_s`` / sum of
the step times over the measured steps: the time the GPU waited for the CPU side), the mean
CPU update time per step (``zenflow/cpu_update_bg_s``, in the background), the mean bytes
over PCIe per step (``zenflow/d2h_bytes`` + ``zenflow/h2d_bytes``) next to the paper's
expectation (S+1)(1-K)*M*b/S (M: the model's parameters, derived from the JSONL's
throughput fields, checked against pretrain_gpt.py's "...M parameters" line; b = 2 bytes,
bf16),
the mean step time by position in the window, and its mean step time over mcore-offload's,
host-only's and deepspeed-zenflow's.

How to read the table: "mean" is the number to compare (the cost of a step averaged over
the window, boundary stall included); a median well below the mean means a boundary
stall. "x no-off" is the slowdown against the states on the GPU. Losses: the megatron_ext
rows share data (mock), seed (``--seed``) and steps, so no-offload, mcore-offload and
host-only should agree to rounding and zenflow's final loss differs by what its delayed
updates cost (at equal loss only where they agree); the DeepSpeed rows train another model
on other data (the bundle's own random tokens): their losses are not comparable to ours.
The JSON also records the exact command of every run, the date and the machine (GPU name
from nvidia-smi, torch and megatron-core versions).

``--tiny --device cpu`` swaps in a tiny model (2 layers, hidden 64, seq 32) on the CPU for
a smoke test; megatron-core's host offload and DeepSpeed need a GPU and are skipped there
with a note. Examples (GPU: bench/gpu/gpu_zenflow_run.sh runs it; then the CPU smoke test)::

    python bench/gpu/zenflow_bench.py --output zf.json --deepspeed-bundle .peers/deepspeed
    python bench/gpu/zenflow_bench.py --tiny --device cpu --output zf.json \
        --configs no-offload,host-only,zenflow
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # pretrain_bench beside it

from offload_bench import last_json, run_measured  # noqa: E402
from pretrain_bench import REFERENCE, summarize  # noqa: E402

CONFIGS = ("no-offload", "mcore-offload", "host-only", "zenflow", "deepspeed-zero-offload",
           "deepspeed-zenflow")
GPU_ONLY = ("mcore-offload", "deepspeed-zero-offload", "deepspeed-zenflow")
SHAPE_FLAGS = {"layers": ("--num-layers",), "hidden": ("--hidden-size",),
               "heads": ("--num-attention-heads",),
               "seq": ("--seq-length", "--max-position-embeddings"),
               "vocab": ("--vocab-size",), "micro_batch": ("--micro-batch-size",)}
TINY = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 256, "micro_batch": 4}
BYTES_PER_PARAM = 2  # b of the paper's traffic formula: bf16
PARAMS_LINE = re.compile(r"([0-9.]+)M parameters")
DS_STEP = re.compile(r"\[bench\] step (\d+) \((?:warmup|timed)\):.*total ([0-9.]+) ms"
                     r"\s+loss (\S+)")


def reference_shape() -> dict:
    """The model shape of ``REFERENCE`` (so that the DeepSpeed runs use the same one)."""
    return {key: int(REFERENCE[REFERENCE.index(flags[0]) + 1])
            for key, flags in SHAPE_FLAGS.items()}


def pretrain_args(shape: dict, a) -> list:
    """``REFERENCE`` with the model shape replaced, plus the device and the seed."""
    args = list(REFERENCE)
    for key, flags in SHAPE_FLAGS.items():
        for flag in flags:
            args[args.index(flag) + 1] = str(shape[key])
    return args + ["--device", a.device, "--seed", str(a.seed)]


PLACES = ("device", "host", "auto")
GRADS = ("fp32grads", "bf16grads")


def config_parts(name: str) -> tuple:
    """A configuration's base, staging slots, modifiers and environment assignments.

    ``zenflow@5+device+fp32grads:OMP_NUM_THREADS=8`` ->
    ``("zenflow", "5", ["device", "fp32grads"], ["OMP_NUM_THREADS=8"])``.
    """
    head, *assignments = name.split(":")
    head, *mods = head.split("+")
    base, _, slots = head.partition("@")
    return base, slots, mods, assignments


def base_config(name: str) -> str:
    """``zenflow@5+device:OMP_NUM_THREADS=8`` -> ``zenflow``."""
    return config_parts(name)[0]


def grads_of(name: str) -> str:
    """The grads modifier of a configuration ("" when none)."""
    return next((m for m in config_parts(name)[2] if m in GRADS), "")


def has_flag(flag: str) -> bool:
    """pretrain_gpt.py has ``flag``: a config dataclass of megatron_ext has its field."""
    field = flag.lstrip("-").replace("-", "_")
    pattern = re.compile(rf"^\s+{field}\s*:", re.M)
    return any(pattern.search(p.read_text()) for p in (ROOT / "megatron_ext").rglob("*.py"))


def config_env(name: str) -> dict:
    """The environment of one configuration's run (``@N``: N staging slots; ``:VAR=VALUE``)."""
    env = dict(os.environ)
    _, slots, _, assignments = config_parts(name)
    if slots:
        env["MEGATRON_EXT_ZENFLOW_STAGING_SLOTS"] = slots
    for assignment in assignments:
        key, _, value = assignment.partition("=")
        env[key] = value
    return env


def bad_config(name: str) -> bool:
    """Not a configuration: an unknown base, ``@`` not on zenflow, a malformed suffix."""
    head, *assignments = name.split(":")
    base, slots, mods, _ = config_parts(name)
    at = "@" in head
    return (base not in CONFIGS or (at and (base != "zenflow" or not slots.isdigit()))
            or ((assignments or mods) and base.startswith("deepspeed-"))
            or any(m not in PLACES + GRADS or (m in PLACES and base != "zenflow")
                   for m in mods)
            or sum(m in PLACES for m in mods) > 1 or sum(m in GRADS for m in mods) > 1
            or any(not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", x) for x in assignments))


def config_args(name: str, a) -> list:
    """pretrain_gpt.py flags of one megatron_ext configuration (modifiers' flags last)."""
    _, _, mods, _ = config_parts(name)
    extra = []
    for mod in mods:
        if mod in PLACES:
            extra += ["--zenflow-accumulate", mod]
        elif mod == "fp32grads":
            extra += ["--accumulate-allreduce-grads-in-fp32"]
        elif mod == "bf16grads" and has_flag("--grad-reduce-in-bf16"):
            extra += ["--grad-reduce-in-bf16"]
    return _base_args(base_config(name), a) + extra


def _base_args(name: str, a) -> list:
    if name == "no-offload":
        return []
    if name == "mcore-offload":
        return ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0",
                "--overlap-cpu-optimizer-d2h-h2d"]
    if name == "host-only":
        return ["--offload-optimizer", "--offload-io-threads", str(a.io_threads)]
    if name == "zenflow":
        return ["--zenflow", "--zenflow-topk-ratio", str(a.topk), "--zenflow-update-interval",
                str(a.interval), "--zenflow-select-interval", str(a.select_interval)]
    raise ValueError(name)


def _mean(records: list, key: str):
    """The mean of ``key`` over the records that have it (None when none do)."""
    values = [r[key] for r in records if key in r]
    return statistics.fmean(values) if values else None


def window_profile(times: list, interval: int) -> list:
    """Mean step time by position in the window (1..S) over whole windows."""
    return [statistics.fmean(times[i::interval]) for i in range(interval)]


def model_params(output: str, records: list, shape: dict) -> dict:
    """M, the model's parameters, from the JSONL and the "...M parameters" line.

    The JSONL's throughput fields hold it (tflops_per_gpu = 6 M tokens / time / 1e12, one
    process); pretrain_gpt.py's line (to 0.01M) is kept next to it as a check.
    """
    r = records[-1]
    tokens = r["global_batch_size"] * shape["seq"]
    found = {"params": round(r["throughput/tflops_per_gpu"] * 1e12 * r["time/iteration_s"]
                             / (6 * tokens)),
             "params_source": "jsonl: throughput/tflops_per_gpu * time/iteration_s / (6 tokens)"}
    match = PARAMS_LINE.search(output)
    if match:
        found["params_stdout"] = round(float(match.group(1)) * 1e6)
    return found


def run_config(name: str, a, shape: dict, base: list) -> dict:
    """Runs one megatron_ext configuration; returns its summary."""
    extra = config_args(name, a)
    if grads_of(name) == "fp32grads":  # REFERENCE reduces in bf16 as its recorded rows ran
        base = [x for x in base if x != "--grad-reduce-in-bf16"]
    per_record = a.interval if a.window_records else 1
    dropped, measured_n = a.warmup_windows * a.interval, a.windows * a.interval
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *base, *extra,
               "--train-iters", str(dropped + measured_n), "--metrics-path", str(metrics)]
        print(f"== {name}: {' '.join(shlex.quote(x) for x in extra)}", flush=True)
        returncode, output, peak_rss = run_measured(cmd, a, cwd=ROOT, env=config_env(name))
        records = ([json.loads(line) for line in metrics.read_text().splitlines()
                    if "lm_loss" in line] if metrics.exists() else [])
    result = {"config": name, "args": extra,
              "command": " ".join(shlex.quote(x) for x in cmd).replace(tmp, "$TMP"),
              "returncode": returncode, "peak_rss_gib": peak_rss,
              "iterations": len(records), "dropped_steps": dropped}
    if records:
        result["losses"] = [r["lm_loss"] for r in records]
        result["final_loss"] = records[-1]["lm_loss"]
        result["step_times_s"] = [r["time/iteration_s"] for r in records]
    if returncode != 0 or len(records) != (dropped + measured_n) // per_record:
        result["tail"] = output.strip().splitlines()[-25:]
        print("\n".join(result["tail"][-8:]), flush=True)
        return result
    measured = records[dropped // per_record:]
    times = [r["time/iteration_s"] for r in measured]
    result["step_s"] = summarize(times)
    result["optimizer_s"] = summarize([r["time/optimizer_s"] for r in measured])
    result["forward_backward_s"] = summarize([r["time/forward_backward_s"] for r in measured])
    gpu = [r["memory/gpu_max_allocated_gib"] for r in measured
           if "memory/gpu_max_allocated_gib" in r]
    result["gpu_max_allocated_gib"] = max(gpu) if gpu else None
    result.update(model_params(output, records, shape))
    if base_config(name) == "zenflow":
        pcie = [r["zenflow/d2h_bytes"] + r["zenflow/h2d_bytes"] for r in measured]
        k, s, m = a.topk, a.interval, result["params"]
        on_device = measured[-1].get("zenflow/accumulate_on_device")
        # The traffic this run should have: H2D of the new weights (bf16) once per window;
        # D2H of the delayed grads every step (grads' bytes g) on the host, of the
        # window's fp32 mean once per window on the device.
        g = measured[-1].get("zenflow/grad_bytes") or (4 if grads_of(name) == "fp32grads"
                                                        else 2)
        expected = (1 - k) * m * ((4 / s if on_device else g) + BYTES_PER_PARAM / s)
        result["zenflow"] = {
            "accumulate_on_device": on_device,
            "grad_bytes": measured[-1].get("zenflow/grad_bytes"),
            "host_thread_s_mean": _mean(measured, "zenflow/host_thread_s"),
            "d2h_copies_per_step": _mean(measured, "zenflow/d2h_copies"),
            "device_acc_gib": measured[-1].get("zenflow/device_acc_gib"),
            "stall_share_metric_mean": _mean(measured, "zenflow/stall_share"),
            "pcie_bytes_per_step_expected": expected,
            "pcie_expected_formula": "(1-K)*M*((4/S on the device, else g) + 2/S), g: grad "
                                     f"bytes = {g}",
            "stall_share": sum(r["zenflow/stall_s"] for r in measured) / sum(times),
            "stall_s_mean": statistics.fmean(r["zenflow/stall_s"] for r in measured),
            "cpu_update_bg_s_mean": statistics.fmean(r["zenflow/cpu_update_bg_s"]
                                                     for r in measured),
            "cpu_accumulate_bg_s_mean": statistics.fmean(r["zenflow/cpu_accumulate_bg_s"]
                                                         for r in measured),
            "gpu_update_s_mean": statistics.fmean(r["zenflow/gpu_update_s"] for r in measured),
            "d2h_bytes_mean": statistics.fmean(r["zenflow/d2h_bytes"] for r in measured),
            "h2d_bytes_mean": statistics.fmean(r["zenflow/h2d_bytes"] for r in measured),
            "pcie_bytes_per_step_mean": statistics.fmean(pcie),
            "pcie_bytes_per_step_paper": (s + 1) * (1 - k) * m * BYTES_PER_PARAM / s,
            "paper_formula": f"(S+1)(1-K)*M*b/S, S={s}, K={k}, M={m}, b={BYTES_PER_PARAM}",
            "selected_ratio": measured[-1]["zenflow/selected_ratio"],
            "rho_mean": statistics.fmean(r["zenflow/rho"] for r in measured),
            "device_state_gib": measured[-1]["zenflow/device_state_gib"],
            "host_state_gib": measured[-1]["zenflow/host_state_gib"],
            "window_profile_s": None if a.window_records else window_profile(times, s),
            "first_step_s": records[0]["time/iteration_s"],
        }
    st = result["step_s"]
    print(f"   step s mean/median/min/max {st['mean']:.3f}/{st['median']:.3f}/{st['min']:.3f}/"
          f"{st['max']:.3f} (n={st['n']}), final loss {result['final_loss']:.4f}", flush=True)
    return result


def run_deepspeed(name: str, a, shape: dict) -> dict:
    """DeepSpeed's peer bundle on the same shape: ZeRO-Offload, or ZenFlow on top of it."""
    cmd = [sys.executable, os.path.join(a.deepspeed_bundle, "zero_infinity_bench.py"),
           "--offload", "cpu", "--layers", str(shape["layers"]), "--hidden", str(shape["hidden"]),
           "--heads", str(shape["heads"]), "--vocab", str(shape["vocab"]),
           "--seq", str(shape["seq"]), "--micro-batch", str(shape["micro_batch"]),
           "--warmup", str(a.warmup_windows * a.interval),
           "--steps", str(a.windows * a.interval)]
    if name == "deepspeed-zenflow":
        cmd += ["--zenflow", "--zenflow-topk", str(a.topk),
                "--zenflow-update-interval", str(a.interval)]
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    returncode, output, peak_rss = run_measured(cmd, a)
    lines = output.strip().splitlines()
    result = {"config": name, "command": " ".join(shlex.quote(x) for x in cmd),
              "returncode": returncode, "peak_rss_gib": peak_rss,
              "dropped_steps": a.warmup_windows * a.interval, "tail": lines[-30:]}
    steps = [m.groups() for m in map(DS_STEP.search, lines) if m]
    if steps:
        result["losses"] = [float(loss) for _, _, loss in steps]
        result["final_loss"] = result["losses"][-1]
        result["step_times_s"] = [float(ms) / 1e3 for _, ms, _ in steps]
    summary = last_json(lines)
    if summary is not None:
        result["json"] = summary
    ds = result.get("json")
    if returncode == 0 and ds and len(ds.get("step_times_s", [])) == a.windows * a.interval:
        times = ds["step_times_s"]
        result["step_s"] = summarize(times)
        result["gpu_max_allocated_gib"] = ds.get("peak_gpu_mem_gib")
        result["params"], result["params_source"] = ds.get("params"), "bundle JSON"
        if name == "deepspeed-zenflow":
            result["window_profile_s"] = window_profile(times, a.interval)
        st = result["step_s"]
        print(f"   step s mean/median/min/max {st['mean']:.3f}/{st['median']:.3f}/"
              f"{st['min']:.3f}/{st['max']:.3f} (n={st['n']})", flush=True)
    else:
        print("\n".join(lines[-8:]), flush=True)
    return result


def machine_facts() -> dict:
    """Platform, CPUs, host memory, torch / megatron-core versions, GPU (nvidia-smi)."""
    facts = {"platform": platform.platform(), "python": platform.python_version(),
             "cpus": os.cpu_count(), "hostname": platform.node()}
    try:
        with open("/proc/meminfo") as f:
            facts["mem_total_gib"] = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:  # the installed distribution's version (importing megatron.core only warns here)
        facts["megatron_core"] = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        facts["megatron_core"] = None
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=60)
        facts["nvidia_smi"] = proc.stdout.strip().splitlines() if proc.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        facts["nvidia_smi"] = None
    return facts


def add_ratios(results: dict) -> None:
    """Each run's mean step over no-offload's; zenflow's over the other offloads'."""
    means = {r["config"]: r["step_s"]["mean"] for r in results["runs"] if "step_s" in r}
    plain = {}  # grads modifier -> the first no-offload run with it
    for run in results["runs"]:
        if base_config(run["config"]) == "no-offload" and "step_s" in run:
            plain.setdefault(grads_of(run["config"]), run)
    for run in results["runs"]:
        if "step_s" not in run:
            continue
        base = plain.get(grads_of(run["config"]))
        if base is not None:
            run["mean_over_no_offload"] = run["step_s"]["mean"] / base["step_s"]["mean"]
            run["no_offload_config"] = base["config"]
        if base_config(run["config"]) == "zenflow":
            for other in ("mcore-offload", "host-only", "deepspeed-zenflow",
                          "deepspeed-zero-offload"):
                if other in means:
                    run[f"mean_over_{other.replace('-', '_')}"] = (run["step_s"]["mean"]
                                                                   / means[other])
            if base is not None and "final_loss" in run:
                run["final_loss_minus_no_offload"] = run["final_loss"] - base["final_loss"]


def gbytes(value: float) -> str:
    """Bytes in GB (MB below 0.1 GB)."""
    return f"{value / 1e9:.3f} GB" if value >= 1e8 else f"{value / 1e6:.3f} MB"


def fmt(value, spec: str = ".3f") -> str:
    """``value`` formatted, or empty for None."""
    return "" if value is None else format(value, spec)


def print_table(results: dict) -> None:
    """The markdown table of the runs (and the ZenFlow ratios under it)."""
    print("| config | step s mean / median / min / max (n) | x no-off | GPU GiB "
          "| host RSS GiB | final loss | stall share | CPU update s/step "
          "| host threads s/step | acc. on | PCIe bytes/step (paper; expected) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in results["runs"]:
        if "skipped" in run:
            print(f"| {run['config']} | skipped: {run['skipped']} | | | | | | | | | |")
            continue
        if "step_s" not in run:
            print(f"| {run['config']} | failed (rc {run['returncode']}, "
                  f"{len(run.get('step_times_s', []))} steps): see JSON | | | "
                  f"{run['peak_rss_gib']:.1f} | | | | | | |")
            continue
        s, z = run["step_s"], run.get("zenflow", {})
        pcie = (f"{gbytes(z['pcie_bytes_per_step_mean'])} "
                f"({gbytes(z['pcie_bytes_per_step_paper'])}; "
                f"{gbytes(z['pcie_bytes_per_step_expected'])})" if z else "")
        place = ("" if not z or z.get("accumulate_on_device") is None
                 else "device" if z["accumulate_on_device"] else "host")
        if z.get("grad_bytes"):
            place += f", {8 * int(z['grad_bytes'])}-bit grads"
        print(f"| {run['config']} | {s['mean']:.3f} / {s['median']:.3f} / {s['min']:.3f} / "
              f"{s['max']:.3f} ({s['n']}) | {fmt(run.get('mean_over_no_offload'), '.2f')} | "
              f"{fmt(run.get('gpu_max_allocated_gib'), '.1f')} | {run['peak_rss_gib']:.1f} | "
              f"{fmt(run.get('final_loss'), '.4f')} | {fmt(z.get('stall_share'), '.1%')} | "
              f"{fmt(z.get('cpu_update_bg_s_mean'))} | {fmt(z.get('host_thread_s_mean'))} | "
              f"{place} | {pcie} |")
    for run in results["runs"]:
        if base_config(run["config"]) != "zenflow" or "step_s" not in run:
            continue
        ratios = [f"{key[len('mean_over_'):]} x{value:.2f}" for key, value in run.items()
                  if key.startswith("mean_over_")]
        z = run["zenflow"]
        profile = (" / ".join(f"{t:.3f}" for t in z["window_profile_s"])
                   if z["window_profile_s"] else "- (one record per window)")
        print(f"{run['config']} mean step over: {', '.join(ratios) or '-'}; mean step by "
              f"position in the window (s): {profile}; "
              f"M = {run['params']} ({run['params_source']})")
    for run in results["runs"]:
        if "window_profile_s" in run:
            print(f"{run['config']} mean step by position in the window (s): "
                  f"{' / '.join(f'{t:.3f}' for t in run['window_profile_s'])}")


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written; each option's default after its help."""


def main() -> int:
    """Runs the configurations, writes one results JSON, prints the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated configurations, run in that order")
    p.add_argument("--topk", type=float, default=0.1,
                   help="K: --zenflow-topk-ratio (and DeepSpeed's --zenflow-topk)")
    p.add_argument("--interval", type=int, default=4,
                   help="S: --zenflow-update-interval (and DeepSpeed's); the window length "
                        "that every configuration's step counts are made of")
    p.add_argument("--select-interval", type=int, default=100,
                   help="N: --zenflow-select-interval (DeepSpeed's bundle fixes 16)")
    p.add_argument("--warmup-windows", type=int, default=1,
                   help="windows of S iterations dropped at the start of every configuration")
    p.add_argument("--windows", type=int, default=3,
                   help="whole windows of S iterations measured in every configuration")
    p.add_argument("--io-threads", type=int, default=8, help="host-only's --offload-io-threads")
    p.add_argument("--seed", type=int, default=1234, help="pretrain_gpt.py --seed (all runs)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="pretrain_gpt.py --device; on cpu, mcore-offload and the DeepSpeed "
                        "configurations are skipped")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny model (2 layers, hidden 64, 4 heads, seq 32, vocab 256) instead "
                        "of the reference one, for a smoke test")
    p.add_argument("--timeout", type=int, default=240,
                   help="seconds per configuration before its process is killed")
    p.add_argument("--deepspeed-bundle", default=str(ROOT / ".peers" / "deepspeed"),
                   help="folder of the DeepSpeed peer bundle (zero_infinity_bench.py, set up "
                        "with its setup_on_gpu.sh)")
    p.add_argument("--extra-args", default="",
                   help="more pretrain_gpt.py flags for every megatron_ext configuration, one "
                        "string (e.g. \"--profile --profile-dir prof\")")
    p.add_argument("--window-records", action="store_true",
                   help="log once per window (--log-interval S): each record is a window's "
                        "mean step, and no metric is read between a window's steps")
    p.add_argument("--output", required=True, help="results JSON (rewritten after each run)")
    a = p.parse_args()
    configs = [c for c in a.configs.split(",") if c]
    unknown = [c for c in configs if bad_config(c)]
    if unknown:
        p.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}, zenflow@N, "
                f"zenflow+{{device,host,auto}}, NAME+{{fp32grads,bf16grads}}, NAME:VAR=VALUE")
    if a.interval < 1 or a.windows < 1 or a.warmup_windows < 0:
        p.error("--interval and --windows must be >= 1, --warmup-windows >= 0")
    shape = TINY if a.tiny else reference_shape()
    base = pretrain_args(shape, a) + shlex.split(a.extra_args)
    if a.window_records:
        base[base.index("--log-interval") + 1] = str(a.interval)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(shlex.quote(x) for x in sys.argv),
               "machine": machine_facts(), "shape": shape, "pretrain_args": base,
               "rules": {"interval_S": a.interval, "topk_K": a.topk,
                         "select_interval_N": a.select_interval,
                         "dropped_steps": a.warmup_windows * a.interval,
                         "measured_steps": a.windows * a.interval,
                         "step_time": "mean over whole windows of time/iteration_s",
                         "records": "one per window" if a.window_records else "one per step"},
               "runs": []}
    print(f"machine: {json.dumps(results['machine'])}", flush=True)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in configs:
        if a.device == "cpu" and base_config(name) in GPU_ONLY:
            run = {"config": name, "skipped": "needs a GPU (--device cpu)"}
            print(f"== {name}: skipped, needs a GPU", flush=True)
        elif name.startswith("deepspeed-"):
            run = run_deepspeed(name, a, shape)
        else:
            run = run_config(name, a, shape, base)
        results["runs"].append(run)
        add_ratios(results)
        out.write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)
    print(f"results: {out}")
    return 0 if all("step_s" in r or "skipped" in r for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
