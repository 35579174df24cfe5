"""Benchmarks tools/preprocess_data.py at several worker counts on a real corpus.

Steps: build the standard-library corpus with ``tools/build_corpus.py``, train a BPE
tokenizer on it with ``tools/train_tokenizer.py``, then run ``tools/preprocess_data.py``
``--repetitions`` times per worker count (worker counts interleaved, so that a burst of
load from other processes hits all of them alike) and time each run from start to exit.

What it reports, per worker count: documents/s and MB/s (input jsonl bytes) as min /
median / max over the repetitions, and the median's speedup over the first worker count.
Rates are end to end, as a user sees them: they include the fixed cost of every run
(starting Python, importing megatron-core and torch: seconds of CPU, measured separately
as ``fixed_cost_s`` on a one-document input). ``--copies`` repeats the corpus so that the
fixed cost does not hide the tokenizing throughput.

Every run's .bin/.idx are compared with the first run's: the output must not depend on the
worker count. Results go to ``bench/results/preprocess_<date>.json`` with the command
line, the machine, the load average around each run (other processes on the machine skew
the numbers, and the load says by how much) and the raw timings; a markdown table goes to
stdout.

Example::

    python bench/cpu/preprocess_bench.py                      # 1 and 2 workers, 3 repetitions
    python bench/cpu/preprocess_bench.py --workers 1 2 4 8 --copies 1
"""

from __future__ import annotations

import argparse
import datetime
import filecmp
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS_DIR = os.path.join(REPO_ROOT, "tools")
RESULTS_DIR = os.path.join(REPO_ROOT, "bench", "results")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run(tool: str, args: Sequence) -> subprocess.CompletedProcess:
    """Runs ``python tools/{tool}``; exits with its output if it fails."""
    command = [sys.executable, os.path.join(TOOLS_DIR, tool), *[str(a) for a in args]]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        _log(proc.stderr)
        sys.exit(f"error: {' '.join(command)} exited with {proc.returncode}")
    return proc


def _load_average() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def summarize(values: Sequence[float]) -> Dict[str, float]:
    """The min, median and max of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def markdown_table(summary: Dict[int, dict], baseline: int) -> str:
    """The per-worker-count summary as a markdown table."""
    rows = ["| workers | docs/s min | docs/s median | docs/s max | MB/s min | MB/s median "
            "| MB/s max | speedup (median) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = summary[baseline]["docs_per_s"]["median"]
    for workers, stats in summary.items():
        docs, mbs = stats["docs_per_s"], stats["mb_per_s"]
        rows.append(f"| {workers} | {docs['min']:.0f} | {docs['median']:.0f} | "
                    f"{docs['max']:.0f} | {mbs['min']:.2f} | {mbs['median']:.2f} | "
                    f"{mbs['max']:.2f} | {docs['median'] / base:.2f}x |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; --help describes every flag."""
    parser = argparse.ArgumentParser(
        prog="bench/cpu/preprocess_bench.py",
        description="Time tools/preprocess_data.py at several --workers on the standard-"
                    "library corpus; write bench/results/preprocess_<date>.json.")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], metavar="N",
                        help="worker counts to time; speedups are relative to the first "
                             "(default: %(default)s)")
    parser.add_argument("--repetitions", type=int, default=3, metavar="R",
                        help="timed runs per worker count (default: %(default)s)")
    parser.add_argument("--max-docs", type=int, default=None, metavar="N",
                        help="corpus size in documents, before --copies (default: the whole "
                             "standard library, about 5000 documents of up to --max-chars)")
    parser.add_argument("--max-chars", type=int, default=8000, metavar="N",
                        help="build_corpus.py --max-chars (default: %(default)s)")
    parser.add_argument("--copies", type=int, default=3, metavar="K",
                        help="repeat the corpus K times in the input, so that each run's fixed "
                             "cost (seconds) is small beside its tokenizing (default: "
                             "%(default)s)")
    parser.add_argument("--vocab-size", type=int, default=8000, metavar="N",
                        help="vocabulary of the BPE tokenizer trained for the benchmark "
                             "(default: %(default)s)")
    parser.add_argument("--tokenizer-model", default=None, metavar="PATH.model",
                        help="use this SentencePiece model instead of training one")
    parser.add_argument("--chunk-lines", type=int, default=None, metavar="N",
                        help="preprocess_data.py --chunk-lines (default: the tool's default)")
    parser.add_argument("--output", default=None, metavar="PATH.json",
                        help="where to write the results (default: "
                             "bench/results/preprocess_<date>.json)")
    parser.add_argument("--work-dir", default=None, metavar="DIR",
                        help="keep the corpus, tokenizer and outputs here (default: a "
                             "temporary directory, removed at the end)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs the benchmark, writes the JSON results and prints the markdown table."""
    args = build_parser().parse_args(argv)
    if min(args.workers) < 1 or args.repetitions < 1 or args.copies < 1:
        sys.exit("error: --workers, --repetitions and --copies must be >= 1")
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="preprocess_bench_")
    os.makedirs(work_dir, exist_ok=True)
    try:
        report = _benchmark(args, work_dir)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)

    date = datetime.date.today().isoformat()
    output = args.output or os.path.join(RESULTS_DIR, f"preprocess_{date}.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w", encoding="utf-8") as out:
        json.dump(report, out, indent=2)
        out.write("\n")
    summary = {int(k): v for k, v in report["summary"].items()}
    print(f"preprocess_data.py on {report['input']['documents']} documents "
          f"({report['input']['bytes'] / 1e6:.1f} MB), {args.repetitions} runs per worker "
          f"count, {report['machine']['cpu_count']} CPUs; fixed cost per run "
          f"{report['fixed_cost_s']['median']:.2f} s\n")
    print(markdown_table(summary, args.workers[0]))
    _log(f"wrote {output}")


def _benchmark(args, work_dir: str) -> dict:
    corpus = os.path.join(work_dir, "corpus.jsonl")
    corpus_args = ["--output", corpus, "--max-chars", args.max_chars]
    if args.max_docs:
        corpus_args += ["--max-docs", args.max_docs]
    _log("building the corpus ...")
    _run("build_corpus.py", corpus_args)

    tokenizer = args.tokenizer_model
    if tokenizer is None:
        _log("training the tokenizer ...")
        prefix = os.path.join(work_dir, "spm")
        _run("train_tokenizer.py", ["--input", corpus, "--output-prefix", prefix,
                                    "--vocab-size", args.vocab_size, "--quiet",
                                    "--input-sentence-size", 300_000])
        tokenizer = prefix + ".model"

    data = os.path.join(work_dir, "input.jsonl")
    with open(corpus, "rb") as src:
        text = src.read()
    with open(data, "wb") as dst:
        for _ in range(args.copies):
            dst.write(text)
    documents = text.count(b"\n") * args.copies
    num_bytes = len(text) * args.copies

    common = ["--tokenizer-model", tokenizer, "--append-eod", "--log-interval", 10 ** 9]
    if args.chunk_lines:
        common += ["--chunk-lines", args.chunk_lines]

    # The fixed cost: a run on a one-document input is all start-up and shut-down.
    tiny = os.path.join(work_dir, "tiny.jsonl")
    with open(tiny, "wb") as dst:
        dst.write(text.split(b"\n", 1)[0] + b"\n")
    fixed = []
    for _ in range(args.repetitions):
        start = time.perf_counter()
        _run("preprocess_data.py", ["--input", tiny, "--output-prefix",
                                    os.path.join(work_dir, "tiny"), "--workers", 1, *common])
        fixed.append(time.perf_counter() - start)

    runs = []
    for repetition in range(args.repetitions):
        for workers in args.workers:
            out_prefix = os.path.join(work_dir, f"out_w{workers}")
            load_before = _load_average()
            start = time.perf_counter()
            _run("preprocess_data.py", ["--input", data, "--output-prefix", out_prefix,
                                        "--workers", workers, *common])
            wall = time.perf_counter() - start
            run = {"workers": workers, "repetition": repetition, "wall_s": round(wall, 3),
                   "docs_per_s": round(documents / wall, 1),
                   "mb_per_s": round(num_bytes / wall / 1e6, 3),
                   "load_average_before": load_before, "load_average_after": _load_average()}
            runs.append(run)
            _log(f"workers {workers} run {repetition + 1}/{args.repetitions}: {wall:.2f} s, "
                 f"{run['docs_per_s']:.0f} docs/s, {run['mb_per_s']:.2f} MB/s "
                 f"(load {load_before})")
            for suffix in (".bin", ".idx"):
                path = f"{out_prefix}_text_document{suffix}"
                kept = os.path.join(work_dir, f"reference{suffix}")
                if not os.path.exists(kept):
                    shutil.copy(path, kept)
                elif not filecmp.cmp(path, kept, shallow=False):
                    sys.exit(f"error: {path} differs from the first run's output "
                             f"(--workers {args.workers[0]})")

    summary = {}
    for workers in args.workers:
        mine = [r for r in runs if r["workers"] == workers]
        summary[workers] = {
            "docs_per_s": summarize([r["docs_per_s"] for r in mine]),
            "mb_per_s": summarize([r["mb_per_s"] for r in mine]),
            "wall_s": summarize([r["wall_s"] for r in mine]),
        }
    base = summary[args.workers[0]]["docs_per_s"]["median"]
    for stats in summary.values():
        stats["speedup_median"] = round(stats["docs_per_s"]["median"] / base, 3)
    return {
        "command": [sys.executable, *sys.argv],
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(),
                    "cpus_usable": len(os.sched_getaffinity(0))
                    if hasattr(os, "sched_getaffinity") else None,
                    "platform": platform.platform(), "processor": platform.processor(),
                    "python": platform.python_version()},
        "versions": _versions(),
        "input": {"kind": "stdlib-python", "documents": documents, "bytes": num_bytes,
                  "copies": args.copies, "max_chars": args.max_chars},
        "tokenizer": {"vocab_size": _vocab_size(tokenizer), "trained_here":
                      args.tokenizer_model is None},
        "preprocess_args": [str(a) if a != tokenizer else "<tokenizer>.model" for a in common],
        "fixed_cost_s": summarize([round(x, 3) for x in fixed]),
        "runs": runs,
        "summary": summary,
        "outputs_identical_across_workers": True,
    }


def _vocab_size(model_path: str) -> int:
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=model_path).vocab_size()


def _versions() -> Dict[str, str]:
    from importlib import metadata

    versions = {}
    for package in ("sentencepiece", "megatron-core", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


if __name__ == "__main__":
    main()
