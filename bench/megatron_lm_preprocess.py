#!/usr/bin/env python3
r"""tools/preprocess_data.py against Megatron-LM's own, byte for byte, on one corpus.

Builds a jsonl corpus from ``--input`` (the first ``--docs`` documents) in which, by
position, every seventh document is empty, one holds its paragraphs as an array of
strings, one an empty array and one an array with empty strings around a sentence (the
cases where the two tools once differed); the rest are kept as they are. Then runs
Megatron-LM's ``tools/preprocess_data.py`` (from ``--mlm-dir``, its own process, its own
megatron package first on the path) and this project's on that corpus, for each flag set
below, and compares the ``.bin`` and ``.idx`` files byte for byte.

Flag sets: ``--append-eod --workers 2``; ``--workers 1`` (no EOD); ``--append-eod
--partitions 3 --workers 3``; ``--append-eod --partitions 2 --keep-sequential-samples
--workers 2``. The tokenizer is GPTSentencePieceTokenizer with ``--tokenizer-model``.

Usage (Megatron-LM's tree at core_v0.16.1; its tools import ``six`` and, through
megatron.training, ``triton``: give a folder holding them with ``--extra-path``)::

    python bench/megatron_lm_preprocess.py --mlm-dir /tmp/mlm --extra-path /tmp/mlmdeps \
        --input runs/quickstart/corpus.jsonl --tokenizer-model runs/quickstart/tokenizer.model \
        --work-dir /tmp/preprocess-cmp --output bench/results/.../compare.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAG_SETS = {
    "eod": ["--append-eod", "--workers", "2"],
    "no-eod": ["--workers", "1"],
    "partitions-3": ["--append-eod", "--partitions", "3", "--workers", "3"],
    "sequential-2": ["--append-eod", "--partitions", "2", "--keep-sequential-samples",
                     "--workers", "2"],
}


def build_corpus(source: Path, docs: int, out: Path) -> dict:
    """The mixed corpus; returns how many documents of each kind it holds."""
    kinds = {"empty": 0, "paragraph array": 0, "empty array": 0, "array with empties": 0,
             "text": 0}
    with open(source, encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        for index, line in enumerate(src):
            if index >= docs:
                break
            text = json.loads(line)["text"]
            slot = index % 7
            if slot == 0:
                value, kind = "", "empty"
            elif slot == 1:
                value, kind = text.split("\n\n")[:20], "paragraph array"
            elif slot == 2:
                value, kind = [], "empty array"
            elif slot == 3:
                value, kind = ["", text[:200], ""], "array with empties"
            else:
                value, kind = text, "text"
            kinds[kind] += 1
            dst.write(json.dumps({"text": value}) + "\n")
    return kinds


def sha256(path: Path) -> str:
    """The file's SHA-256, hex."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    """Runs every flag set with both tools; 0 when every file is identical."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mlm-dir", required=True, help="Megatron-LM's tree (core_v0.16.1)")
    p.add_argument("--extra-path", action="append", default=[],
                   help="a folder to put on Megatron-LM's PYTHONPATH (six, triton)")
    p.add_argument("--input", required=True, help="a jsonl corpus with a text key")
    p.add_argument("--docs", type=int, default=600, help="documents taken from --input")
    p.add_argument("--tokenizer-model", required=True, help="a SentencePiece .model")
    p.add_argument("--work-dir", required=True)
    p.add_argument("--output", required=True, help="the JSON report")
    a = p.parse_args()

    work = Path(a.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = work / "corpus.jsonl"
    kinds = build_corpus(Path(a.input), a.docs, corpus)
    tokenizer = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                 os.path.abspath(a.tokenizer_model)]
    mlm_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.abspath(a.mlm_dir), *map(os.path.abspath, a.extra_path)]))
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "corpus": {"source": a.input, "documents": sum(kinds.values()), "kinds": kinds},
              "megatron_lm": os.path.abspath(a.mlm_dir), "runs": {}}
    same_everywhere = True
    for name, flags in FLAG_SETS.items():
        mlm_dir = work / f"megatron-lm-{name}"
        mlm_dir.mkdir()
        mlm_input = mlm_dir / "corpus.jsonl"  # Megatron-LM writes its partitions beside it
        shutil.copy(corpus, mlm_input)
        mlm_cmd = [sys.executable, "tools/preprocess_data.py", "--input", str(mlm_input),
                   "--output-prefix", str(mlm_dir / "out"), *tokenizer, *flags]
        ours_prefix = work / f"ours-{name}"
        ours_cmd = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
                    str(corpus), "--output-prefix", str(ours_prefix), *tokenizer, *flags]
        mlm = subprocess.run(mlm_cmd, cwd=a.mlm_dir, env=mlm_env, capture_output=True, text=True)
        ours = subprocess.run(ours_cmd, cwd=ROOT, capture_output=True, text=True)
        run = {"flags": " ".join(flags), "megatron_lm_rc": mlm.returncode,
               "ours_rc": ours.returncode, "files": {}}
        for suffix in (".bin", ".idx"):
            theirs = mlm_dir / f"out_text_document{suffix}"
            mine = Path(f"{ours_prefix}_text_document{suffix}")
            entry = {"megatron_lm": sha256(theirs) if theirs.exists() else None,
                     "ours": sha256(mine) if mine.exists() else None,
                     "bytes": mine.stat().st_size if mine.exists() else None}
            entry["identical"] = entry["ours"] is not None and entry["ours"] == entry["megatron_lm"]
            same_everywhere &= entry["identical"]
            run["files"][suffix] = entry
        run["ours_summary"] = [line for line in ours.stderr.splitlines()
                               if "sequences" in line]
        if mlm.returncode or ours.returncode:
            run["stderr_tail"] = {"megatron_lm": mlm.stderr[-600:], "ours": ours.stderr[-600:]}
        report["runs"][name] = run
        print(f"{name}: {' '.join(flags)}: "
              + ", ".join(f"{s} {'identical' if e['identical'] else 'DIFFERENT'}"
                          for s, e in run["files"].items()), flush=True)
    report["identical"] = same_everywhere
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
