#!/usr/bin/env python3
r"""ZenFlow's accuracy in a fine-tune, against Adam and against DeepSpeed's ZenFlow (issue 29).

One command per part (each fits one call of the lent H200 machine, <= 9 min; every part
builds its data and pretrains again, since a call starts on a fresh machine):

* ``ours``: corpora, pretraining of the reference GPT with Adam (``pretrain_gpt.py``,
  ``--save``), then fine-tunes from it (``--finetune --load``) on a corpus of another domain:
  ``adam`` and ``zenflow`` (the defaults), each with every ``--seeds`` value.
* ``ours-extra``: the same data and pretraining; ``adam`` (first seed: the link to ``ours``),
  ``zenflow-auto`` (``--zenflow-update-interval auto``) and ``zenflow-paper`` (DeepSpeed's
  tutorial settings: k = 0.05, S = 4, columns selected once).
* ``deepspeed``: the same data; ``bench/peers/ds_finetune.py`` under the DeepSpeed bundle pretrains
  a GPT of the same shape with DeepSpeed's Adam and fine-tunes it with DeepSpeed's Adam
  (``ds-adam``) and DeepSpeed's ZenFlow (``ds-zenflow``: k = 0.1, S = 4, re-selection every
  100 steps, ``overlap_step``), each with every seed: each ZenFlow is compared with its own
  framework's Adam.

Data (all offline, on any machine with Python): corpus A is the Python standard library's
source (``tools/build_corpus.py --kind stdlib-python``), corpus B the English prose of
Python's documentation topics (``--kind pydoc-topics``). Both are byte-level: each
document's UTF-8 bytes are its token ids (``NullTokenizer``, ids 0-255, EOD after them;
``--vocab-size`` keeps the reference's embedding size), tokenized by
``tools/preprocess_data.py``; the fine-tune's validation split is a set of held-out topics.

Output (in ``--output-dir``, few files, as the GPU call brings back at most 8):
``runs.json`` (per run: command, exit status, validation loss against step and training
wall time, training loss, step times, rho(t), retention and S for ZenFlow; the summary),
``summary.md`` (the table), ``summary.csv``, ``val_loss.png`` (validation loss against
training wall time and against step; needs matplotlib: without it, ``--plot-only`` redraws
it from runs.json on another machine).

Examples::

    OUT=/tmp/o PART=ours bash bench/gpu/gpu_zenflow_finetune.sh      # on the GPU machine
    python bench/gpu/zenflow_finetune.py --tiny --part ours --output-dir /tmp/zf-tiny   # CPU smoke
    python bench/gpu/zenflow_finetune.py --plot-only --output-dir DIR_WITH_RUNS_JSON
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("ours", "ours-extra", "deepspeed")
# Each row: its framework, the flags beyond the fine-tune's, and the Adam row it is read against.
ROWS = {
    "adam": ("megatron_ext", []),
    "zenflow": ("megatron_ext", ["--zenflow"]),
    "zenflow-auto": ("megatron_ext", ["--zenflow", "--zenflow-update-interval", "auto"]),
    "zenflow-paper": ("megatron_ext", ["--zenflow", "--zenflow-topk-ratio", "0.05",
                                       "--zenflow-update-interval", "4"]),
    "ds-adam": ("deepspeed", []),
    "ds-zenflow": ("deepspeed", []),
}
ADAM_OF = {"megatron_ext": "adam", "deepspeed": "ds-adam"}
# The reference GPT (bench/gpu/pretrain_bench.py's REFERENCE: 24 x 2048, 16 heads, vocabulary
# 32000: 1.34B) at sequence 1024; byte ids (0-255, EOD 256) use 257 of its embedding rows
# (at least 257: the tiny shape has no more).
SHAPE = {"layers": 24, "hidden": 2048, "heads": 16, "seq": 1024, "vocab": 32000,
         "micro_batch": 8}
TINY_SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "seq": 64, "vocab": 257, "micro_batch": 4}


def log(message: str) -> None:
    """A timestamped line on stdout."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------- metrics -> summary (pure)


def curves(records: Sequence[dict]) -> dict:
    """The compact curves of one run from its metrics JSONL records.

    Validation losses are placed on the training wall time: the sum of the iteration times
    up to their iteration (process start-up and the evaluations left out).
    """
    train = [r for r in records if "lm_loss" in r and "iteration" in r]
    wall, elapsed = {}, 0.0
    for r in train:
        elapsed += float(r.get("time/iteration_s", 0.0))
        wall[r["iteration"]] = elapsed
    evals = [r for r in records if "eval/lm_loss" in r]
    out = {
        "iteration": [r["iteration"] for r in train],
        "train_loss": [r["lm_loss"] for r in train],
        "step_s": [r.get("time/iteration_s") for r in train],
        "eval_iteration": [r["iteration"] for r in evals],
        "eval_loss": [r["eval/lm_loss"] for r in evals],
        "eval_wall_s": [round(wall.get(r["iteration"], elapsed), 3) for r in evals],
    }
    for key in ("rho", "retention", "update_interval", "selected_ratio", "stall_s"):
        name = f"zenflow/{key}"
        if any(name in r for r in train):
            out[key] = [r.get(name) for r in train]
    return out


def final_loss(run: dict) -> Optional[float]:
    """The run's last validation loss (None when it has none or it is not finite)."""
    losses = run.get("curves", {}).get("eval_loss") or []
    if not losses or losses[-1] is None or not math.isfinite(losses[-1]):
        return None
    return float(losses[-1])


def median_step(run: dict, skip: int = 3) -> Optional[float]:
    """Median step time, the first ``skip`` steps (compilation, selection) left out."""
    times = [t for t in run.get("curves", {}).get("step_s", [])[skip:] if t is not None]
    return statistics.median(times) if times else None


def mean_step(run: dict, skip: int = 3) -> Optional[float]:
    """Mean step time (ZenFlow's window boundaries count), the first ``skip`` left out."""
    times = [t for t in run.get("curves", {}).get("step_s", [])[skip:] if t is not None]
    return statistics.fmean(times) if times else None


def _stats(values: List[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean": statistics.fmean(values), "min": min(values),
            "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarize(runs: Sequence[dict]) -> List[dict]:
    """One row per method: final validation loss over seeds, its gap to its framework's Adam.

    The gap is paired by seed (ZenFlow seed s - Adam seed s) where both ran; ``adam_spread``
    is the Adam row's max - min over its seeds. Step times are over the seeds' runs: median
    step and mean step (the mean counts the window boundaries), and their ratio to the
    framework's Adam (mean over mean).
    """
    by_row: Dict[str, List[dict]] = {}
    for run in runs:
        by_row.setdefault(run["row"], []).append(run)
    table = []
    for row in sorted(by_row, key=lambda r: (list(ROWS).index(r) if r in ROWS else 99, r)):
        mine = by_row[row]
        finals = {r["seed"]: final_loss(r) for r in mine if not r.get("skipped")}
        ok = {s: v for s, v in finals.items() if v is not None}
        adam_row = ADAM_OF.get(ROWS.get(row, ("", []))[0], "")
        adam = {r["seed"]: final_loss(r) for r in by_row.get(adam_row, [])}
        adam = {s: v for s, v in adam.items() if v is not None}
        paired = [ok[s] - adam[s] for s in sorted(ok) if s in adam]
        means = [m for m in (mean_step(r) for r in mine) if m is not None]
        medians = [m for m in (median_step(r) for r in mine) if m is not None]
        adam_means = [m for m in (mean_step(r) for r in by_row.get(adam_row, []))
                      if m is not None]
        rhos = [x for r in mine for x in r.get("curves", {}).get("rho", []) if x is not None]
        kept = [x for r in mine for x in r.get("curves", {}).get("retention", [])
                if x is not None and math.isfinite(x)]
        # DeepSpeed's rows evaluate at step 0 too: every row starts from the same weights.
        start = [r["curves"]["eval_loss"][0] for r in mine
                 if (r.get("curves") or {}).get("eval_iteration", [None])[:1] == [0]]
        entry = {"row": row, "framework": ROWS.get(row, ("?", []))[0],
                 "step0_val_loss": statistics.fmean(start) if start else None,
                 "seeds": sorted(finals), "failed": sorted(s for s, v in finals.items()
                                                           if v is None),
                 "skipped": sorted(r["seed"] for r in mine if r.get("skipped")),
                 "final_val_loss": _stats(list(ok.values())),
                 "gap_to_adam": _stats(paired) if row != adam_row else None,
                 "adam_spread": (max(adam.values()) - min(adam.values())) if adam else None,
                 "step_mean_s": statistics.fmean(means) if means else None,
                 "step_median_s": statistics.fmean(medians) if medians else None,
                 "step_vs_adam": (statistics.fmean(means) / statistics.fmean(adam_means)
                                  if means and adam_means else None),
                 "rho_mean": statistics.fmean(rhos) if rhos else None,
                 "retention_mean": statistics.fmean(kept) if kept else None}
        table.append(entry)
    return table


def _num(value, spec=".4f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(table: Sequence[dict]) -> str:
    """The summary as a markdown table."""
    lines = ["| row | seeds | final val loss mean | min | max | std | gap to its Adam "
             "(paired mean, min, max) | Adam's spread | step mean s | x its Adam | "
             "rho mean | retention | val loss at step 0 |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for e in table:
        f, g = e["final_val_loss"], e["gap_to_adam"]
        gap = "-" if not g or not g.get("n") else \
            f"{g['mean']:+.4f} ({g['min']:+.4f}, {g['max']:+.4f})"
        seeds = f"{f.get('n', 0)}" + (f" ({len(e['failed'])} failed)" if e["failed"] else "") \
            + (f" ({len(e['skipped'])} skipped)" if e.get("skipped") else "")
        lines.append(f"| {e['row']} | {seeds} | {_num(f.get('mean'))} | {_num(f.get('min'))} | "
                     f"{_num(f.get('max'))} | {_num(f.get('std'))} | {gap} | "
                     f"{_num(e['adam_spread'])} | {_num(e['step_mean_s'], '.3f')} | "
                     f"{_num(e['step_vs_adam'], '.2f')} | {_num(e['rho_mean'], '.3f')} | "
                     f"{_num(e['retention_mean'], '.3f')} | {_num(e.get('step0_val_loss'))} |")
    return "\n".join(lines) + "\n"


def write_csv(table: Sequence[dict], path: Path) -> None:
    """The summary, one line per row."""
    keys = ["row", "framework", "n", "mean", "min", "max", "std", "gap_mean", "gap_min",
            "gap_max", "adam_spread", "step_mean_s", "step_median_s", "step_vs_adam",
            "rho_mean", "retention_mean"]
    with open(path, "w", newline="", encoding="utf-8") as stream:
        writer = csv.writer(stream)
        writer.writerow(keys)
        for e in table:
            f, g = e["final_val_loss"], e["gap_to_adam"] or {}
            writer.writerow([e["row"], e["framework"], f.get("n"), f.get("mean"), f.get("min"),
                             f.get("max"), f.get("std"), g.get("mean"), g.get("min"),
                             g.get("max"), e["adam_spread"], e["step_mean_s"],
                             e["step_median_s"], e["step_vs_adam"], e["rho_mean"],
                             e["retention_mean"]])


def plot(runs: Sequence[dict], path: Path) -> Optional[str]:
    """Validation loss against training wall time and against step; None when drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    fig, (ax_t, ax_s, ax_r) = plt.subplots(1, 3, figsize=(18, 5))
    colors = {}
    for run in runs:
        c = run.get("curves") or {}
        if not c.get("eval_loss"):
            continue
        color = colors.setdefault(run["row"], f"C{len(colors)}")
        label = f"{run['row']} s{run['seed']}"
        ax_t.plot(c["eval_wall_s"], c["eval_loss"], marker=".", color=color, label=label)
        ax_s.plot(c["eval_iteration"], c["eval_loss"], marker=".", color=color, label=label)
        if c.get("rho"):
            ax_r.plot(c["iteration"], c["rho"], color=color, label=label, lw=0.8)
    ax_t.set(xlabel="training wall time (s, start-up and evaluations left out)",
             ylabel="validation loss", title="validation loss vs wall time")
    ax_s.set(xlabel="step", ylabel="validation loss", title="validation loss vs step")
    ax_r.set(xlabel="step", ylabel="rho", title="rho: delayed share of gradient energy")
    for ax in (ax_t, ax_s, ax_r):
        ax.grid(alpha=0.3)
    ax_s.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---------------------------------------------------------------- data


def _run(cmd: Sequence[str], log_path: Path, env: Optional[dict] = None,
         timeout: Optional[float] = None) -> int:
    """Runs ``cmd`` from the repository root, its output appended to ``log_path``."""
    with open(log_path, "a", encoding="utf-8") as stream:
        stream.write(f"\n$ {' '.join(shlex.quote(str(c)) for c in cmd)}\n")
        stream.flush()
        try:
            return subprocess.run([str(c) for c in cmd], cwd=ROOT, stdout=stream,
                                  stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            stream.write(f"timed out after {timeout} s\n")
            return 124


def to_byte_ids(src: Path, dst: Path) -> int:
    """JSONL ``text`` -> JSONL of its UTF-8 bytes as whitespace-separated ids; documents."""
    count = 0
    with open(src, encoding="utf-8") as fin, open(dst, "w", encoding="utf-8") as fout:
        for line in fin:
            text = json.loads(line).get("text", "")
            if text:
                fout.write(json.dumps({"text": " ".join(map(str, text.encode("utf-8")))})
                           + "\n")
                count += 1
    return count


def build_data(a, work: Path, log_path: Path) -> Dict[str, str]:
    """Corpus A (stdlib source) and B (documentation prose) as byte-level .bin/.idx."""
    py = sys.executable
    corpora = {"stdlib": ["--kind", "stdlib-python", "--max-docs", str(a.stdlib_docs),
                          "--max-chars", str(a.stdlib_chars), "--seed", "1"],
               "topics": ["--kind", "pydoc-topics", "--max-chars", "4000", "--seed", "1"]}
    prefixes = {}
    for name, flags in corpora.items():
        prefix = work / f"{name}_bytes"
        prefixes[name] = str(prefix) + "_text_document"
        if Path(prefixes[name] + ".idx").exists():
            continue
        raw, ids = work / f"{name}.jsonl", work / f"{name}_bytes.jsonl"
        if _run([py, "tools/build_corpus.py", *flags, "--output", raw], log_path):
            sys.exit(f"error: build_corpus {name} failed (see {log_path})")
        docs = to_byte_ids(raw, ids)
        if _run([py, "tools/preprocess_data.py", "--input", ids, "--output-prefix", prefix,
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--append-eod",
                 "--workers", str(a.workers)], log_path):
            sys.exit(f"error: preprocess_data {name} failed (see {log_path})")
        log(f"data: {name}: {docs} documents -> {prefixes[name]}")
    return prefixes


# ---------------------------------------------------------------- megatron_ext runs


def model_args(a) -> List[str]:
    """pretrain_gpt.py's model, optimizer and output flags shared by every run."""
    s = a.shape
    args = ["--num-layers", s["layers"], "--hidden-size", s["hidden"],
            "--num-attention-heads", s["heads"], "--seq-length", s["seq"],
            "--max-position-embeddings", s["seq"], "--micro-batch-size", s["micro_batch"],
            "--global-batch-size", s["micro_batch"],
            "--tokenizer-type", "NullTokenizer", "--vocab-size", s["vocab"],
            "--use-distributed-optimizer", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--lr-decay-style", "cosine", "--log-interval", "1",
            "--num-workers", "0", "--wandb-mode", "disabled", "--device", a.device]
    if a.device != "cpu":
        args += ["--bf16", "--grad-reduce-in-bf16"]
    return [str(x) for x in args]


def pretrain(a, data: Dict[str, str], work: Path, log_path: Path) -> Optional[str]:
    """Pretrains on corpus A with Adam; the checkpoint directory (None on failure)."""
    ckpt = work / "pretrain"
    if (ckpt / "latest_checkpointed_iteration.txt").exists():
        return str(ckpt)
    iters = a.pretrain_iters
    cmd = [sys.executable, "pretrain_gpt.py", *model_args(a), "--train-iters", str(iters),
           "--lr", str(a.pretrain_lr), "--min-lr", str(a.pretrain_lr / 10),
           "--lr-warmup-iters", str(max(1, iters // 10)), "--seed", "1234",
           "--data-path", data["stdlib"], "--split", "98,2,0", "--eval-iters", "0",
           "--save", str(ckpt), "--save-interval", str(iters),
           "--metrics-path", str(work / "pretrain.jsonl")]
    start = time.time()
    status = _run(cmd, log_path, timeout=a.timeout)
    log(f"pretrain: exit {status}, {time.time() - start:.0f} s")
    return str(ckpt) if status == 0 else None


def finetune_args(a, row: str, seed: int) -> List[str]:
    """The fine-tune's flags of one row (beyond the model's)."""
    iters = a.finetune_iters
    flags = list(ROWS[row][1])
    if row == "zenflow-paper":  # selected once (DeepSpeed's select_strategy auto, no epochs)
        flags += ["--zenflow-select-interval", str(iters)]
    return ["--train-iters", str(iters), "--lr", str(a.finetune_lr),
            "--min-lr", str(a.finetune_lr / 10), "--lr-warmup-iters", str(max(1, iters // 10)),
            "--seed", str(seed), "--split", "85,15,0", "--eval-interval", str(a.eval_interval),
            "--eval-iters", str(a.eval_iters), *flags]


def finetune(a, row: str, seed: int, data: Dict[str, str], ckpt: str, work: Path,
             log_path: Path) -> dict:
    """One fine-tune of ours from the pretrained checkpoint (no --save: nothing to keep)."""
    metrics = work / f"{row}-seed{seed}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "pretrain_gpt.py", *model_args(a), "--finetune", "--load", ckpt,
           "--data-path", data["topics"], *finetune_args(a, row, seed),
           "--metrics-path", str(metrics)]
    start = time.time()
    status = _run(cmd, log_path, timeout=a.timeout)
    records = []
    if metrics.exists():
        records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    run = {"row": row, "seed": seed, "framework": "megatron_ext", "returncode": status,
           "process_s": round(time.time() - start, 1),
           "command": " ".join(shlex.quote(c) for c in cmd), "curves": curves(records)}
    log(f"{row} seed {seed}: exit {status}, {run['process_s']} s, final val loss "
        f"{final_loss(run)}, mean step {_num(mean_step(run), '.3f')} s")
    return run


def deepspeed_runs(a, data: Dict[str, str], work: Path, log_path: Path) -> List[dict]:
    """bench/peers/ds_finetune.py (under the bundle's environment): its runs."""
    out = work / "ds_runs.json"
    out.unlink(missing_ok=True)
    s = a.shape
    cmd = [sys.executable, "bench/peers/ds_finetune.py", "--pretrain-data", data["stdlib"],
           "--finetune-data", data["topics"], "--output", str(out),
           "--layers", s["layers"], "--hidden", s["hidden"], "--heads", s["heads"],
           "--seq", s["seq"], "--vocab", s["vocab"], "--micro-batch", s["micro_batch"],
           "--pretrain-iters", a.pretrain_iters, "--pretrain-lr", a.pretrain_lr,
           "--finetune-iters", a.finetune_iters, "--finetune-lr", a.finetune_lr,
           "--eval-interval", a.eval_interval, "--eval-iters", a.eval_iters,
           "--seeds", *a.seeds, "--engine", a.ds_engine, "--work-dir", work / "ds",
           "--zenflow-topk", "0.1", "--zenflow-update-interval", "4",
           "--zenflow-select-interval", "100"]
    if a.deadline:
        cmd += ["--deadline-at", str(a.started + a.deadline)]
    if a.ds_bundle:
        cmd = ["bash", "-c", 'source "$0" && exec "$@"', f"{a.ds_bundle}/env.sh", *cmd]
    status = _run(cmd, log_path, timeout=a.timeout * (2 + 2 * len(a.seeds)))
    runs = json.loads(out.read_text())["runs"] if out.exists() else []
    log(f"deepspeed: exit {status}, {len(runs)} runs")
    for run in runs:
        log(f"{run['row']} seed {run['seed']}: final val loss {final_loss(run)}, mean step "
            f"{_num(mean_step(run), '.3f')} s")
    if status and not runs:
        runs = [{"row": "ds-adam", "seed": 0, "framework": "deepspeed", "returncode": status,
                 "curves": {}}]
    return runs


# ---------------------------------------------------------------- main


def report(runs: List[dict], a, out: Path, final: bool = True) -> None:
    """Writes runs.json, the tables and the plot; prints the table when ``final``."""
    table = summarize(runs)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "part": a.part,
            "shape": a.shape, "pretrain_iters": a.pretrain_iters,
            "finetune_iters": a.finetune_iters, "pretrain_lr": a.pretrain_lr,
            "finetune_lr": a.finetune_lr, "seeds": a.seeds, "device": a.device}
    (out / "runs.json").write_text(json.dumps({"meta": meta, "summary": table, "runs": runs}))
    (out / "summary.md").write_text(markdown(table))
    write_csv(table, out / "summary.csv")
    if not final:
        return
    note = plot(runs, out / "val_loss.png")
    print(markdown(table), flush=True)
    if note:
        log(note)


def parse(argv=None):
    """The flags, with the tiny or full defaults filled in."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=PARTS, default="ours")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--work-dir", default="/tmp/zenflow-finetune",
                   help="data, checkpoints and metrics (default %(default)s)")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny model on small corpora, few steps, on the CPU: the pipeline's "
                        "smoke test")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    p.add_argument("--shape", dest="shape_overrides", default="",
                   help="model shape overrides, e.g. layers=4,hidden=256,heads=4,seq=256,"
                        "micro_batch=8 (keys: " + ", ".join(SHAPE) + ")")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="fine-tune seeds (data order; default 1 2 3, tiny: 1 2)")
    p.add_argument("--pretrain-iters", type=int, default=None, help="default 150 (tiny 16)")
    p.add_argument("--finetune-iters", type=int, default=None, help="default 100 (tiny 12)")
    p.add_argument("--pretrain-lr", type=float, default=None, help="default 3e-4 (tiny 3e-3)")
    p.add_argument("--finetune-lr", type=float, default=None, help="default 1e-4 (tiny 1e-3)")
    p.add_argument("--eval-interval", type=int, default=None, help="default 20 (tiny 4)")
    p.add_argument("--eval-iters", type=int, default=None,
                   help="batches per evaluation (default 4, tiny 2)")
    p.add_argument("--stdlib-docs", type=int, default=None, help="default 600 (tiny 40)")
    p.add_argument("--stdlib-chars", type=int, default=8000)
    p.add_argument("--workers", type=int, default=4, help="preprocess_data.py --workers")
    p.add_argument("--timeout", type=float, default=300, help="seconds per process")
    p.add_argument("--ds-bundle", default=None,
                   help="the DeepSpeed bundle whose env.sh the DeepSpeed part runs under")
    p.add_argument("--ds-engine", default="deepspeed", choices=("deepspeed", "torch"),
                   help="torch: bench/peers/ds_finetune.py's plain-PyTorch stand-in "
                        "(CPU smoke test)")
    p.add_argument("--deadline", type=float, default=0,
                   help="seconds from the start: a run that would end after it (by the last "
                        "run's time) is skipped and recorded as such, so that a call with a "
                        "time limit ends with whole runs (0: none)")
    p.add_argument("--plot-only", action="store_true",
                   help="redraw val_loss.png and the tables from --output-dir/runs.json")
    a = p.parse_args(argv)
    tiny = a.tiny
    a.device = a.device or ("cpu" if tiny else "cuda")
    a.shape = dict(TINY_SHAPE if tiny else SHAPE)
    for item in filter(None, a.shape_overrides.split(",")):
        key, _, value = item.partition("=")
        if key not in SHAPE or not value.isdigit():
            p.error(f"--shape {item}: give KEY=N with KEY one of {', '.join(SHAPE)}")
        a.shape[key] = int(value)
    a.seeds = a.seeds or ([1, 2] if tiny else [1, 2, 3])
    a.pretrain_iters = a.pretrain_iters or (16 if tiny else 150)
    a.finetune_iters = a.finetune_iters or (12 if tiny else 100)
    a.eval_interval = a.eval_interval or (4 if tiny else 20)
    a.stdlib_docs = a.stdlib_docs or (40 if tiny else 600)
    a.eval_iters = a.eval_iters or (2 if tiny else 4)
    a.pretrain_lr = a.pretrain_lr or (3e-3 if tiny else 3e-4)
    a.finetune_lr = a.finetune_lr or (1e-3 if tiny else 1e-4)
    if tiny:
        a.stdlib_chars = min(a.stdlib_chars, 4000)
    return a


def main(argv=None) -> int:
    """Runs the part; 0 when every run finished."""
    a = parse(argv)
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if a.plot_only:
        saved = json.loads((out / "runs.json").read_text())
        a.part = saved["meta"]["part"]
        report(saved["runs"], a, out)
        return 0
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    log_path = out / "finetune.log"
    start = a.started = time.time()
    data = build_data(a, work, log_path)
    log(f"data ready ({time.time() - start:.0f} s)")
    runs: List[dict] = []
    if a.part == "deepspeed":
        runs = deepspeed_runs(a, data, work, log_path)
    else:
        ckpt = pretrain(a, data, work, log_path)
        if ckpt is None:
            sys.exit(f"error: the pretraining failed (see {log_path})")
        if a.part == "ours":
            plan = [(row, seed) for seed in a.seeds for row in ("adam", "zenflow")]
        else:
            plan = [("adam", a.seeds[0]), ("zenflow-auto", a.seeds[0]),
                    ("zenflow-paper", a.seeds[0])]
        last = 0.0
        for row, seed in plan:
            if a.deadline and time.time() - start + last > a.deadline:
                log(f"{row} seed {seed}: skipped, it would end after --deadline {a.deadline} s")
                runs.append({"row": row, "seed": seed, "framework": "megatron_ext",
                             "returncode": None, "skipped": True, "curves": {}})
                continue
            began = time.time()
            runs.append(finetune(a, row, seed, data, ckpt, work, log_path))
            last = time.time() - began
            # After every run: a call killed at its time limit keeps the finished ones.
            report(runs, a, out, final=False)
    report(runs, a, out)
    log(f"done ({time.time() - start:.0f} s)")
    return 0 if runs and all(r.get("returncode") == 0 or r.get("skipped") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
