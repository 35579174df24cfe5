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
--workers 2``. The tokenizer is GPTSentencePieceTokenizer with ``--tokenizer-model``, or
the flags of ``--tokenizer-args`` (paths in it absolute), or, with ``--all-types``, every
``--tokenizer-type`` with and without ``--legacy-tokenizer`` (one report each).

Usage (Megatron-LM's tree at core_v0.16.1; its tools import ``six`` and, through
megatron.training, ``triton``: give a folder holding them with ``--extra-path``)::

    python bench/peers/megatron_lm_preprocess.py --mlm-dir /tmp/mlm --extra-path /tmp/mlmdeps \
        --input runs/quickstart/corpus.jsonl --tokenizer-model runs/quickstart/tokenizer.model \
        --work-dir /tmp/preprocess-cmp --output bench/results/.../compare.json --all-types
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
    p.add_argument("--tokenizer-model", help="a SentencePiece .model (the default tokenizer)")
    p.add_argument("--tokenizer-args", help="instead: the tokenizer flags, as one string "
                   "(e.g. '--tokenizer-type GPT2BPETokenizer --vocab-file v --merge-file m')")
    p.add_argument("--all-types", action="store_true",
                   help="every --tokenizer-type, megatron-core's and --legacy-tokenizer: the "
                        "SentencePiece types with --tokenizer-model, the others with files "
                        "made here (tests/tokenizer_files.py's HF and tiktoken files, a "
                        "byte-level BPE vocab.json/merges.txt trained on the corpus); one "
                        "report per tokenizer setting, named after it, beside --output")
    p.add_argument("--work-dir", required=True)
    p.add_argument("--output", required=True, help="the JSON report")
    a = p.parse_args()

    work = Path(a.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = work / "corpus.jsonl"
    kinds = build_corpus(Path(a.input), a.docs, corpus)
    if a.all_types:
        if not a.tokenizer_model:
            p.error("--all-types needs --tokenizer-model (the SentencePiece types)")
        settings = tokenizer_settings(a, work)
        ok = True
        for name, flags in settings.items():
            print(f"== {name}: {' '.join(flags)}", flush=True)
            out = Path(a.output).with_name(f"{Path(a.output).stem}-{name}.json")
            ok &= compare(a, work / name, corpus, kinds, flags, out)
        return 0 if ok else 1
    if a.tokenizer_args:
        tokenizer = shlex.split(a.tokenizer_args)
    elif a.tokenizer_model:
        tokenizer = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                     os.path.abspath(a.tokenizer_model)]
    else:
        p.error("give --tokenizer-model, --tokenizer-args or --all-types")
    return 0 if compare(a, work, corpus, kinds, tokenizer, Path(a.output)) else 1


def tokenizer_settings(a, work: Path) -> dict:
    """--all-types: name -> tokenizer flags, the files they need made under ``work``."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tokenizer_files
    from tokenizers import ByteLevelBPETokenizer

    texts = [json.loads(line)["text"] for line in open(a.input, encoding="utf-8")][:a.docs]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=3000, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    vocab, merges = bpe.save_model(str(work))
    hf = tokenizer_files.make_hf_dir(str(work / "hf"))
    tik = tokenizer_files.make_tiktoken_json(str(work / "tik.json"))
    spm = os.path.abspath(a.tokenizer_model)
    base = {
        "GPTSentencePieceTokenizer": ["--tokenizer-model", spm],
        "SentencePieceTokenizer": ["--tokenizer-model", spm],
        "Llama2Tokenizer": ["--tokenizer-model", spm],
        "HuggingFaceTokenizer": ["--tokenizer-model", hf],
        "TikTokenizer": ["--tokenizer-model", tik, "--tiktoken-pattern", "v2", "--vocab-size",
                         str(tokenizer_files.TIKTOKEN_VOCAB + 1000)],
    }
    settings = {}
    for kind, flags in base.items():
        settings[kind] = ["--tokenizer-type", kind, *flags]
        settings[f"{kind}-legacy"] = ["--legacy-tokenizer", "--tokenizer-type", kind, *flags]
    settings["HuggingFaceTokenizer-specials"] = [*settings["HuggingFaceTokenizer"],
                                                 "--tokenizer-hf-include-special-tokens"]
    # Megatron-LM's megatron-core GPT2BPETokenizer loads 'gpt2' from the Hugging Face hub,
    # which cannot be reached here: only its training (legacy) tokenizer is compared.
    settings["GPT2BPETokenizer-legacy"] = ["--legacy-tokenizer", "--tokenizer-type",
                                           "GPT2BPETokenizer", "--vocab-file", vocab,
                                           "--merge-file", merges]
    return settings


def compare(a, work: Path, corpus: Path, kinds: dict, tokenizer: list, output: Path) -> bool:
    """Both tools on ``corpus`` with every flag set; writes ``output``; True if identical."""
    work.mkdir(parents=True, exist_ok=True)
    mlm_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.abspath(a.mlm_dir), *map(os.path.abspath, a.extra_path)]))
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "corpus": {"source": a.input, "documents": sum(kinds.values()), "kinds": kinds},
              "megatron_lm": os.path.abspath(a.mlm_dir), "tokenizer": " ".join(tokenizer),
              "runs": {}}
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
                               if "sequences" in line or line.startswith("note:")]
        if mlm.returncode or ours.returncode:
            run["stderr_tail"] = {"megatron_lm": mlm.stderr[-600:], "ours": ours.stderr[-600:]}
        report["runs"][name] = run
        print(f"{name}: {' '.join(flags)}: "
              + ", ".join(f"{s} {'identical' if e['identical'] else 'DIFFERENT'}"
                          for s, e in run["files"].items()), flush=True)
    report["identical"] = same_everywhere
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    return same_everywhere


if __name__ == "__main__":
    sys.exit(main())
