"""The tools' bad input: one ``error:`` line each, exit status 2, no traceback.

The check is mext_testing.assert_one_error_line: stderr is the one ``error: `` line, with
the expected fragment, also where the bad input is found once the tool has begun its work
(tools/_common.py holds its start lines back until the work is under way). The cases run
in this process through each tool's own entry point (``run_tool(main, argv)``, as its
``__main__`` does); some run as processes, so the real process path is proven. The tools'
own suites (tests/tools) cover more of their errors; this table adds the rest.
"""
from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys

import pytest

from mext_testing import ROOT, TINY, assert_one_error_line, write_indexed_dataset

TOOLS = os.path.join(str(ROOT), "tools")
if TOOLS not in sys.path:
    # The tools import their helpers as the top-level module _common, as scripts do.
    sys.path.insert(0, TOOLS)

# (tool, argv with {t} for a directory holding the inputs below, expected fragment)
CASES = {
    "build_corpus without --output": (
        "build_corpus", ["--max-docs", "3"], "the following arguments are required: --output"),
    "build_corpus negative seed": (
        "build_corpus", ["--output", "{t}/c.jsonl", "--seed", "-1"],
        "argument --seed: must be >= 0, got -1"),
    "build_corpus of files with no text": (
        "build_corpus", ["--output", "{t}/c.jsonl", "--files", "{t}/blank.py"],
        "no documents found for --kind files in {t}/blank.py"),
    "build_corpus output under a file": (
        "build_corpus", ["--output", "{t}/afile/c.jsonl", "--max-docs", "1"],
        "cannot create output directory {t}/afile: {t}/afile is a file, not a directory"),
    "convert_checkpoint without a direction": (
        "convert_checkpoint", [], "give --to hf (with --load, --output) or --from hf"),
    "convert_checkpoint both directions": (
        "convert_checkpoint", ["--to", "hf", "--from", "hf"],
        "--to and --from are exclusive; give one direction"),
    "convert_checkpoint to hf without output": (
        "convert_checkpoint", ["--to", "hf", "--load", "{t}"],
        "--to hf needs --load CKPT_DIR and --output HF_DIR"),
    "convert_checkpoint input without config.json": (
        "convert_checkpoint", ["--from", "hf", "--input", "{t}/weights_only", "--save", "{t}/ck"],
        "no config.json (not a transformers model directory)"),
    "convert_checkpoint config.json without a model type": (
        "convert_checkpoint", ["--from", "hf", "--input", "{t}/bare_config", "--save", "{t}/ck"],
        "--input {t}/bare_config: unsupported config.json"),
    "convert_checkpoint save under a file": (
        "convert_checkpoint", ["--from", "hf", "--input", "{t}/bare_config", "--save",
                               "{t}/afile/ck"],
        "--save {t}/afile/ck: {t}/afile is a file, so the directory cannot be created there; "
        "give another path"),
    "convert_checkpoint save that is a file": (
        "convert_checkpoint", ["--from", "hf", "--input", "{t}/bare_config", "--save", "{t}/afile"],
        "--save {t}/afile: is a file; give a directory"),
    "convert_checkpoint output under a file": (
        "convert_checkpoint", ["--to", "hf", "--load", "{t}", "--output", "{t}/afile/hf"],
        "--output {t}/afile/hf: {t}/afile is a file, so the directory cannot be created"),
    "convert_checkpoint vocabulary padding zero": (
        "convert_checkpoint", ["--from", "hf", "--input", "{t}/bare_config", "--save", "{t}/ck",
                               "--make-vocab-size-divisible-by", "0"],
        "--make-vocab-size-divisible-by must be >= 1"),
    "generate without a prompt": (
        "generate", ["--load", "{t}"], "the following arguments are required: --prompt"),
    "generate zero new tokens": (
        "generate", ["--load", "{t}", "--prompt", "x", "--max-new-tokens", "0"],
        "argument --max-new-tokens: must be >= 1, got 0"),
    "generate temperature zero": (
        "generate", ["--load", "{t}", "--prompt", "x", "--temperature", "0"],
        "argument --temperature: must be > 0, got 0.0"),
    "generate negative top-k": (
        "generate", ["--load", "{t}", "--prompt", "x", "--top-k", "-1"],
        "argument --top-k: must be >= 0, got -1"),
    "generate greedy with a temperature": (
        "generate", ["--load", "{t}", "--prompt", "x", "--greedy", "--temperature", "0.5"],
        "--greedy takes the most likely token: drop --temperature"),
    "generate from a directory that is not a checkpoint": (
        "generate", ["--load", "{t}/empty", "--prompt", "x"],
        "--load {t}/empty: not a checkpoint (no latest_checkpointed_iteration.txt"),
    "evaluate without a data path": (
        "evaluate", ["--load", "{t}"], "the following arguments are required: --data-path"),
    "evaluate a directory that is not a checkpoint": (
        "evaluate", ["--load", "{t}/empty", "--data-path", "corpus"],
        "--load {t}/empty: not a checkpoint"),
    "evaluate on an unknown device": (
        "evaluate", ["--load", "{t}", "--data-path", "corpus", "--device", "tpu"],
        "argument --device: invalid choice: 'tpu'"),
    "plot_breakdown of a directory": (
        "plot_breakdown", ["{t}/empty", "--output", "{t}/b.png"],
        "metrics file {t}/empty: not a regular file"),
    "plot_breakdown without output": (
        "plot_breakdown", ["{t}/metrics.jsonl"],
        "the following arguments are required: --output"),
    "probe_tiers without a directory": (
        "probe_tiers", [], "the following arguments are required: DIR"),
    "probe_tiers zero threads": (
        "probe_tiers", ["{t}", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
    "probe_tiers json under a file": (
        "probe_tiers", ["{t}", "--size-mb", "1", "--repeat", "1", "--json", "{t}/afile/p.json"],
        "cannot create output directory {t}/afile: {t}/afile is a file, not a directory"),
    "train_tokenizer coverage zero": (
        "train_tokenizer", ["--input", "{t}/plain.txt", "--output-prefix", "{t}/tok",
                            "--character-coverage", "0"],
        "--character-coverage 0.0: must be in (0, 1]"),
    "train_tokenizer unknown model type": (
        "train_tokenizer", ["--input", "{t}/plain.txt", "--output-prefix", "{t}/tok",
                            "--model-type", "word"],
        "argument --model-type: invalid choice: 'word'"),
    "train_tokenizer vocabulary zero": (
        "train_tokenizer", ["--input", "{t}/plain.txt", "--output-prefix", "{t}/tok",
                            "--vocab-size", "0"],
        "argument --vocab-size: must be >= 1, got 0"),
    "train_tokenizer on empty documents": (
        "train_tokenizer", ["--input", "{t}/empty_docs.jsonl", "--output-prefix", "{t}/tok"],
        "the input has no text to train on"),
    "train_tokenizer on text that is not utf-8": (
        "train_tokenizer", ["--input", "{t}/latin1.txt", "--output-prefix", "{t}/tok"],
        "{t}/latin1.txt: not valid UTF-8 text"),
    "train_tokenizer vocabulary larger than the text allows": (
        "train_tokenizer", ["--input", "{t}/plain.txt", "--output-prefix", "{t}/tok",
                            "--vocab-size", "100000"],
        "Vocabulary size too high (100000)"),
    "preprocess_data of empty documents": (
        "preprocess_data", ["--input", "{t}/empty_docs.jsonl", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
        "no document to write: the 2 input lines were all malformed or empty"),
    # Plain text is read as such (tests/tools/test_preprocess_text.py); read as jsonl, the
    # hint is the format, not --on-error skip, which would leave out every line.
    "preprocess_data of plain text read as jsonl": (
        "preprocess_data", ["--input", "{t}/plain.txt", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                            "--input-format", "jsonl"],
        "{t}/plain.txt:1: invalid JSON (Expecting value: line 1 column 1 (char 0)); if the "
        "file is plain text, not jsonl, pass --input-format text"),
    "preprocess_data of text that is not utf-8": (
        "preprocess_data", ["--input", "{t}/latin1.txt", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
        "{t}/latin1.txt:1: not valid UTF-8 text"),
    "preprocess_data text documents of jsonl": (
        "preprocess_data", ["--input", "{t}/texts.jsonl", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                            "--text-documents", "lines"],
        "--text-documents lines cuts plain text, and every --input is jsonl by its name"),
    "preprocess_data json keys of plain text": (
        "preprocess_data", ["--input", "{t}/plain.txt", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                            "--json-keys", "text", "body"],
        "--json-keys text body: {t}/plain.txt is plain text, which has no keys"),
    "train_tokenizer of plain text read as jsonl": (
        "train_tokenizer", ["--input", "{t}/plain.txt", "--output-prefix", "{t}/tok",
                            "--input-format", "jsonl"],
        "{t}/plain.txt:1: invalid JSON (Expecting value: line 1 column 1 (char 0)); if the "
        "file is plain text, not jsonl, pass --input-format text"),
    "preprocess_data gpt2 without its files": (
        "preprocess_data", ["--input", "{t}/metrics.jsonl", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "GPT2BPETokenizer"],
        "--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    "preprocess_data null tokenizer without vocabulary": (
        "preprocess_data", ["--input", "{t}/metrics.jsonl", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "NullTokenizer"],
        "no vocabulary: give --tokenizer-type and its files, or --vocab-size N"),
    "preprocess_data hugging face directory without a tokenizer": (
        "preprocess_data", ["--input", "{t}/metrics.jsonl", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                            "{t}/empty"],
        "--tokenizer-model {t}/empty: not a Hugging Face tokenizer"),
    "preprocess_data gpt2 files that are not gpt2's": (
        "preprocess_data", ["--input", "{t}/texts.jsonl", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                            "{t}/plain.txt", "--merge-file", "{t}/plain.txt"],
        "not a GPT-2 BPE vocabulary and merges file"),
    "preprocess_data tiktoken vocabulary not json": (
        "preprocess_data", ["--input", "{t}/texts.jsonl", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "TikTokenizer", "--tiktoken-pattern", "v2",
                            "--tokenizer-model", "{t}/broken.json"],
        "--tokenizer-model {t}/broken.json: not a JSON file"),
    "preprocess_data sentencepiece model that is a directory": (
        "preprocess_data", ["--input", "{t}/texts.jsonl", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                            "{t}/empty"],
        "--tokenizer-model {t}/empty: a directory, not a SentencePiece .model file"),
    # --vocab-extra-ids with NullTokenizer is ignored (as Megatron-LM): special tokens are
    # read by Megatron-LM's GPT-2 BPE tokenizer and not by this project's.
    "preprocess_data special tokens for gpt2": (
        "preprocess_data", ["--input", "{t}/metrics.jsonl", "--output-prefix", "{t}/ds",
                            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                            "{t}/texts.jsonl", "--merge-file", "{t}/texts.jsonl",
                            "--tokenizer-special-tokens", "<x>"],
        "--tokenizer-special-tokens with --tokenizer-type GPT2BPETokenizer"),
    "preprocess_data output under a file": (
        "preprocess_data", ["--input", "{t}/texts.jsonl", "--output-prefix", "{t}/afile/ds",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
        "{t}/afile is a file, not a directory"),
}

# Bad input a tool finds once it has said what it starts to do (the first input line, the
# output path, the checkpoint's files), run as processes: its error line must be all it
# prints on stderr, without that start line (or the trainer's start-up log). {ckpt}: a
# tiny run's checkpoint (NullTokenizer); {damaged}: a copy with a file cut short.
PROCESS_ONLY = {
    "evaluate a damaged checkpoint": (
        "evaluate", ["--load", "{damaged}", "--data-path", "{t}/tokens", "--eval-iters", "1",
                     "--split", "0,100,0"],
        "__0_0.distcp: 100 bytes"),
    "generate a damaged checkpoint": (
        "generate", ["--load", "{damaged}", "--prompt", "1 2"], "__0_0.distcp: 100 bytes"),
    "convert_checkpoint a damaged checkpoint": (
        "convert_checkpoint", ["--to", "hf", "--load", "{damaged}", "--output", "{t}/hf"],
        "__0_0.distcp: 100 bytes"),
    "generate a null tokenizer prompt of words": (
        "generate", ["--load", "{ckpt}", "--prompt", "hello world"],
        "--prompt 'hello world': 'hello' is not a token id: NullTokenizer reads text as "
        "space-separated token ids (e.g. --prompt '1 2 3')"),
    "generate a token id outside the vocabulary": (
        "generate", ["--load", "{ckpt}", "--prompt", "1 99999"],
        "--prompt: token id 99999 is outside the vocabulary of "),
}
# Run as processes too: tools without torch and with it, and those above.
PROCESS_CASES = ["build_corpus output under a file", "build_corpus of files with no text",
                 "preprocess_data of plain text read as jsonl",
                 "train_tokenizer on empty documents", "probe_tiers json under a file",
                 *PROCESS_ONLY]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    t = tmp_path_factory.mktemp("bad-tool-input")
    (t / "afile").write_text("x")
    (t / "empty").mkdir()
    (t / "weights_only").mkdir()
    (t / "weights_only" / "model.safetensors").write_bytes(b"")
    (t / "bare_config").mkdir()
    (t / "bare_config" / "config.json").write_text("{}")
    (t / "plain.txt").write_text("plain text, one line of it\n")
    (t / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (t / "empty_docs.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (t / "texts.jsonl").write_text('{"text": "1 2 3"}\n')
    (t / "broken.json").write_text("{not json")
    (t / "metrics.jsonl").write_text('{"iteration": 1, "lm_loss": 5.0}\n')
    (t / "blank.py").write_text("\n")
    write_indexed_dataset(t / "tokens", [list(range(1, 100))] * 20)
    return t


def _check(status, stdout: str, stderr: str, expected: str) -> None:
    assert_one_error_line(status, stdout, stderr, expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_tool_input_gives_one_line(inputs, capsys, case):
    import _common

    tool, argv, expected = CASES[case]
    module = importlib.import_module(tool)
    handler = signal.getsignal(signal.SIGTERM)  # run_tool installs its own
    try:
        status = _common.run_tool(module.main, [a.replace("{t}", str(inputs)) for a in argv])
    except SystemExit as exc:  # argparse's exits, as the process would end
        status = exc.code
    finally:
        signal.signal(signal.SIGTERM, handler)
    out, err = capsys.readouterr()
    _check(status, out, err, expected.replace("{t}", str(inputs)))


@pytest.fixture(scope="module")
def checkpoint(run_cache):
    """A tiny run's checkpoint (once a session; the tests only read it)."""
    return run_cache.run([*TINY, "--train-iters", "2", "--save", "{run}/ckpt"]).directory / "ckpt"


@pytest.fixture(scope="module")
def damaged(checkpoint, tmp_path_factory):
    """A copy of :func:`checkpoint` with a file cut short: found when the trainer, built,
    loads it."""
    copy = tmp_path_factory.mktemp("damaged") / "ckpt"
    shutil.copytree(checkpoint, copy)
    os.truncate(copy / "iter_0000002" / "__0_0.distcp", 100)
    return copy


@pytest.mark.parametrize("case", PROCESS_CASES)
def test_bad_tool_input_in_a_process(inputs, request, case):
    tool, argv, expected = {**CASES, **PROCESS_ONLY}[case]

    def fill(text: str) -> str:
        for name in ("ckpt", "damaged"):
            if f"{{{name}}}" in text:
                fixture = "checkpoint" if name == "ckpt" else name
                text = text.replace(f"{{{name}}}", str(request.getfixturevalue(fixture)))
        return text.replace("{t}", str(inputs))
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, f"{tool}.py"),
                           *[fill(a) for a in argv]], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    _check(proc.returncode, proc.stdout, proc.stderr, fill(expected))

