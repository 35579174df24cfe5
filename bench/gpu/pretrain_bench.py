#!/usr/bin/env python3
"""Step time, tokens/s and TFLOP/s of pretrain_gpt.py on the reference GPT.

The reference model (issue 2): 24 layers, hidden 2048, 16 heads, sequence 2048, vocab 32000,
micro-batch 4 (1.34B parameters), local layer spec with SDPA core attention, bf16, the
distributed optimizer, one GPU. Each repetition is a fresh process of ``--iters``
iterations; the first ``--warmup`` iterations are dropped (compilation, allocator warm-up).
Reported: per repetition the mean and median step time; over all measured steps the
min / median / mean / max. Optionally runs DeepSpeed's GPT benchmark (the peer bundle) in
the same command for a side-by-side row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from megatron_ext.runtime.mcore_compat import null_vocab_includes_eod  # noqa: E402


def vocab_size_flag(ids: int) -> str:
    """--vocab-size for ``ids`` token ids plus the end-of-document id on the installed version.

    NullTokenizer's --vocab-size follows Megatron-LM at the installed megatron-core's tag
    (from 0.18 it counts the EOD): the rows stay one model on 0.16.1 and 0.19.2 (32000 ids +
    EOD, padded to 32128, as every row measured before).
    """
    return str(ids + 1 if null_vocab_includes_eod() else ids)


REFERENCE = [
    "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "4",
    "--mock-data", "--vocab-size", vocab_size_flag(32000), "--bf16",
    "--use-distributed-optimizer",
    "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "2", "--log-interval", "1",
    "--eval-iters", "0", "--wandb-mode", "disabled", "--hidden-dropout", "0",
    "--attention-dropout", "0",
    # As the recorded results ran (bf16 gradients, cosine decay, loading in the main
    # process); Megatron-LM's defaults would reduce bf16 gradients in fp32.
    "--grad-reduce-in-bf16", "--lr-decay-style", "cosine", "--num-workers", "0",
]


def run_once(args, iters: int, extra) -> list:
    """Runs pretrain_gpt.py once; returns its training records."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *args, "--train-iters", str(iters),
               "--metrics-path", str(metrics), *extra]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"pretrain_gpt.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return [json.loads(line) for line in metrics.read_text().splitlines()
                if "lm_loss" in line]


def summarize(values):
    """Min / median / mean / max / n of a list of numbers."""
    return {"min": min(values), "median": statistics.median(values),
            "mean": statistics.fmean(values), "max": max(values), "n": len(values)}


def main() -> int:
    """Runs the repetitions and writes the results JSON."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=25, help="iterations per repetition")
    p.add_argument("--warmup", type=int, default=5, help="iterations dropped from each repetition")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes")
    p.add_argument("--tiny", action="store_true", help="a small model (for a CPU smoke run)")
    p.add_argument("--label", default="no-offload", help="name of this configuration")
    p.add_argument("--output", help="JSON results path "
                   "(default bench/results/pretrain_<label>_<date>.json)")
    p.add_argument("--deepspeed-bundle", help="also run the DeepSpeed peer bundle's GPT benchmark "
                   "(folder holding zero_infinity_bench.py, set up with setup_on_gpu.sh)")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    a = p.parse_args()
    args = list(REFERENCE)
    if a.tiny:
        args = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
                "--seq-length", "128", "--max-position-embeddings", "128",
                "--micro-batch-size", "4", "--mock-data", "--vocab-size",
                vocab_size_flag(1000), "--log-interval", "1", "--eval-iters", "0",
                "--wandb-mode", "disabled",
                "--use-distributed-optimizer", "--lr", "1e-3", "--lr-decay-style", "cosine",
                "--num-workers", "0"]
    reps = []
    steps, fwd, bwd, opt, tflops, tps, mem = [], [], [], [], [], [], []
    for r in range(a.repeats):
        records = run_once(args, a.iters, a.extra)[a.warmup:]
        times = [x["time/iteration_s"] for x in records]
        reps.append({"mean_s": statistics.fmean(times), "median_s": statistics.median(times)})
        steps += times
        fwd += [x["time/forward_s"] for x in records]
        bwd += [x["time/backward_s"] for x in records]
        opt += [x["time/optimizer_s"] for x in records]
        tflops += [x["throughput/tflops_per_gpu"] for x in records]
        tps += [x["throughput/tokens_per_s"] for x in records]
        mem += [x.get("memory/gpu_max_allocated_gib", 0.0) for x in records]
        print(f"repeat {r + 1}: mean {reps[-1]['mean_s']:.4f} s/step, median "
              f"{reps[-1]['median_s']:.4f}", flush=True)
    result = {
        "label": a.label,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(x) for x in sys.argv),
        "pretrain_args": args + a.extra,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "repeats": reps,
        "step_s": summarize(steps),
        "forward_s": summarize(fwd), "backward_s": summarize(bwd), "optimizer_s": summarize(opt),
        "tflops_per_gpu_6n": summarize(tflops), "tokens_per_s": summarize(tps),
        "gpu_max_allocated_gib": max(mem) if mem else None,
    }
    try:
        import torch

        result["machine"]["torch"] = torch.__version__
        if torch.cuda.is_available():
            result["machine"]["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    if a.deepspeed_bundle:
        result["deepspeed"] = run_deepspeed(a.deepspeed_bundle)
    out = Path(a.output) if a.output else ROOT / "bench" / "results" / (
        f"pretrain_{a.label}_{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    s = result["step_s"]
    print("| config | step s (min/median/mean/max) | fwd s | bwd s | opt s | TFLOP/s (6N) "
          "| GPU GiB |")
    print("|---|---|---|---|---|---|---|")
    print(f"| megatron_ext {a.label} | {s['min']:.4f} / {s['median']:.4f} / {s['mean']:.4f} / "
          f"{s['max']:.4f} | {result['forward_s']['median']:.4f} | "
          f"{result['backward_s']['median']:.4f} | {result['optimizer_s']['median']:.4f} | "
          f"{result['tflops_per_gpu_6n']['median']:.1f} | {result['gpu_max_allocated_gib']:.1f} |")
    if "deepspeed" in result:
        print(f"| DeepSpeed (same run) | {result['deepspeed'].get('summary', 'see JSON')} |")
    print(f"results: {out}")
    return 0


def run_deepspeed(bundle: str) -> dict:
    """Runs the peer bundle's GPT benchmark (torch AdamW, no offload) and keeps its output."""
    cmd = [sys.executable, os.path.join(bundle, "zero_infinity_bench.py"), "--offload", "none",
           "--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "32000",
           "--seq", "2048", "--micro-batch", "4", "--warmup", "5", "--steps", "20"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    result = {"command": " ".join(cmd), "returncode": proc.returncode, "tail": lines[-30:]}
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                result["json"] = json.loads(line)
                result["summary"] = json.dumps(result["json"])[:300]
            except json.JSONDecodeError:
                pass
            break
    return result


if __name__ == "__main__":
    sys.exit(main())
