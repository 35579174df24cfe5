"""tools/preprocess_data.py: jsonl -> .bin/.idx -> IndexedDataset gives back the input ids.

Also: the output does not depend on --workers, malformed lines are reported with file:line
(and skipped with --on-error skip), and no failed or interrupted run leaves a file under
the output prefix.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import time
import warnings

import numpy as np
import psutil
import pytest
import sentencepiece
from _indexed_writer import DatasetWriter
from _tokenize_chunks import Chunk, ChunkResult, encode_chunk, iter_chunks
from preprocess_data import expand_inputs
from tools_testlib import REPO_ROOT, assert_ok, assert_usage_error, run_tool, tool_command

from megatron_ext.data.tokenizer import GPTSentencePieceTokenizer

EOD = 2  # </s> of the models tools/train_tokenizer.py writes


def _indexed_dataset(prefix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns about missing GPU packages
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(prefix)


def _write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(record if isinstance(record, str) else json.dumps(record))
            out.write("\n")
    return str(path)


def _outputs(prefix):
    return sorted(glob.glob(f"{prefix}*"))


def _expected_docs(model_path, values, append_eod):
    """Megatron-LM's rule (its Encoder.encode): a string is one sentence, an array its
    sentences; each non-empty sentence is a sequence; the EOD goes after the last one of a
    document that has any; a document without token has no sequence."""
    sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
    docs = []
    for value in values:
        sentences = [value] if isinstance(value, str) else value
        doc = [ids for ids in (sp.encode(text) for text in sentences) if ids]
        if doc and append_eod:
            doc[-1] = doc[-1] + [EOD]
        docs.append(doc)
    return docs


def _assert_dataset_equals(prefix, expected_docs):
    dataset = _indexed_dataset(prefix)
    sequences = [ids for doc in expected_docs for ids in doc]
    assert len(dataset) == len(sequences)
    assert dataset[0].dtype == np.uint16  # DType.optimal_dtype for a vocabulary < 65500
    for index, ids in enumerate(sequences):
        assert dataset[index].tolist() == ids, f"sequence {index}"
    np.testing.assert_array_equal(dataset.document_indices,
                                  np.cumsum([0] + [len(doc) for doc in expected_docs]))


# Malformed lines mixed into the round-trip input (run with --on-error skip): more than
# the tool prints warnings for, so the cap shows too.
NUM_MALFORMED = 23


@pytest.fixture(scope="module")
def roundtrip_input(small_corpus, tmp_path_factory):
    """The small corpus with empty documents and malformed lines mixed in.

    Returns:
        ``(path, records)``: the jsonl file and the well-formed records, in order; each has
        a second key, ``source``, to tokenize as a second dataset.
    """
    with open(small_corpus, encoding="utf-8") as stream:
        records = [json.loads(line) for line in stream]
    records.insert(3, {"text": "", "source": "empty.py"})
    records.append({"text": "", "source": "last-empty.py"})
    lines = [json.dumps(r) for r in records]
    for i in range(NUM_MALFORMED):
        # Inserted back to front, so that the first bad line ends up at line 6.
        position = 5 + (NUM_MALFORMED - 1 - i) * 5
        lines.insert(position, '{"text": 7}' if i % 2 else '{"source": "x"}')
    path = tmp_path_factory.mktemp("roundtrip") / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path), records


@pytest.fixture(scope="module")
def preprocessed(roundtrip_input, tiny_tokenizer, tmp_path_factory):
    """The round-trip input preprocessed with 1 and 2 workers: {workers: (prefix, stderr)}."""
    path, _ = roundtrip_input
    out = tmp_path_factory.mktemp("preprocessed")
    procs = {}
    # Both runs at once: each spends seconds importing megatron-core.
    for workers in (1, 2):
        command = tool_command("preprocess_data.py", [
            "--input", path, "--output-prefix", out / f"w{workers}", "--json-keys", "text",
            "source", "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
            tiny_tokenizer, "--append-eod", "--workers", workers, "--on-error", "skip",
            # Small chunks: many chunks in flight, so a reordering bug would show.
            "--chunk-lines", 7, "--log-interval", 50])
        procs[workers] = subprocess.Popen(command, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    results = {}
    for workers, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        results[workers] = (str(out / f"w{workers}"), stderr)
    return results


@pytest.mark.parametrize("workers", [1, 2])
def test_roundtrip_gives_back_the_tokenizer_ids(preprocessed, roundtrip_input, tiny_tokenizer,
                                                workers):
    _, records = roundtrip_input
    output_prefix, _ = preprocessed[workers]
    for key in ("text", "source"):
        prefix = f"{output_prefix}_{key}_document"
        assert _outputs(f"{output_prefix}_{key}") == [prefix + ".bin", prefix + ".idx"]
        expected = _expected_docs(tiny_tokenizer, [r[key] for r in records], append_eod=True)
        if key == "text":
            # An empty text is a document of no sequence, even with --append-eod.
            assert expected.count([]) == 2
        _assert_dataset_equals(prefix, expected)


@pytest.mark.parametrize("workers", [1, 2])
def test_on_error_skip_warns_counts_and_continues(preprocessed, workers):
    _, stderr = preprocessed[workers]
    warned = [line for line in stderr.splitlines() if line.startswith("warning: ")]
    assert warned[0].endswith('data.jsonl:6: missing key "text" (keys present: "source"); '
                              "skipping the line")
    assert warned[1].endswith('data.jsonl:12: value of key "text" is a number, expected a '
                              "string or an array of strings; skipping the line")
    assert len(warned) == 21  # 20 shown, then one line saying the rest are only counted
    assert f"skipped {NUM_MALFORMED} malformed line(s)" in stderr
    # Progress is reported per chunk: the first line after 50 documents.
    assert re.search(r"^processed 5\d documents \(\d+\.\d docs/s, \d+\.\d\d MB/s\)$", stderr,
                     re.MULTILINE)


def test_output_does_not_depend_on_workers(preprocessed):
    for key in ("text", "source"):
        for suffix in (".bin", ".idx"):
            one, two = (f"{preprocessed[w][0]}_{key}_document{suffix}" for w in (1, 2))
            with open(one, "rb") as a, open(two, "rb") as b:
                assert a.read() == b.read(), f"{key}{suffix} differs between 1 and 2 workers"


def test_encode_chunk_reports_lines_and_keeps_empty_documents_without_sequences(
        tiny_tokenizer):
    sp = sentencepiece.SentencePieceProcessor(model_file=tiny_tokenizer)
    lines = [b'{"text": "a b"}\n', b'{"text": ""}\n', b'not json\n', b'{"text": "c"}\n',
             b'{"text": ["d e", "", "f"]}\n', b'{"text": []}']
    tokenizer = GPTSentencePieceTokenizer(tiny_tokenizer)
    result = encode_chunk(tokenizer, Chunk(0, 11, lines), ["text"], eod_id=None)
    assert result.errors == [(13, "invalid JSON (Expecting value: line 1 column 1 (char 0))")]
    assert result.empty_documents == {"text": 2}
    assert result.sequences["text"].tolist() == [1, 0, 1, 2, 0]
    pieces = [sp.encode(t) for t in ("a b", "c", "d e", "f")]
    assert result.lengths["text"].tolist() == [len(p) for p in pieces]
    assert result.tokens["text"].tolist() == sum(pieces, [])
    assert result.num_lines == 6 and result.num_bytes == sum(map(len, lines))
    # The EOD ends each document that has a token (after its last sentence), as in
    # Megatron-LM; an empty document stays a document of no sequence.
    with_eod = encode_chunk(tokenizer, Chunk(0, 11, lines), ["text"], eod_id=EOD)
    assert with_eod.empty_documents == {"text": 2}
    assert with_eod.sequences["text"].tolist() == [1, 0, 1, 2, 0]
    assert with_eod.lengths["text"].tolist() == [len(pieces[0]) + 1, len(pieces[1]) + 1,
                                                 len(pieces[2]), len(pieces[3]) + 1]


def test_array_values_and_empty_documents_end_to_end(tmp_path, tiny_tokenizer):
    values = ["x = 1", "", ["def f():", "", "    return 2"], [], ["", ""], "y"]
    data = _write_jsonl(tmp_path / "data.jsonl", [{"text": v} for v in values])
    for eod in (True, False):
        prefix = tmp_path / f"eod{eod}"
        run = run_tool("preprocess_data.py", "--input", data, "--output-prefix", prefix,
                       "--tokenizer-model", tiny_tokenizer, *(["--append-eod"] if eod else []))
        assert_ok(run)
        assert "6 documents, 4 sequences" in run.stderr
        assert "3 empty documents (no sequence" in run.stderr
        _assert_dataset_equals(f"{prefix}_text_document",
                               _expected_docs(tiny_tokenizer, values, append_eod=eod))


def _texts(tmp_path, name, count):
    return _write_jsonl(tmp_path / name, [{"text": f"{name} line {i}"} for i in range(count)])


@pytest.mark.parametrize("partitions, sequential", [(3, False), (2, False), (3, True)])
def test_partitions_order_the_documents_as_megatron_lm_merges_them(tmp_path, tiny_tokenizer,
                                                                    partitions, sequential):
    """Megatron-LM's --partitions N puts line i of all the inputs (counted on across files)
    in partition i mod N, or in contiguous blocks with --keep-sequential-samples, and merges
    the partitions in order."""
    paths = [_texts(tmp_path, "a.jsonl", 7), _texts(tmp_path, "b.jsonl", 4)]
    values = [json.loads(line)["text"] for p in paths for line in open(p, encoding="utf-8")]
    if sequential:
        order = values
    else:
        order = [v for p in range(partitions) for i, v in enumerate(values)
                 if i % partitions == p]
    prefix = tmp_path / "ds"
    run = run_tool("preprocess_data.py", "--input", str(tmp_path / "*.jsonl"),
                   "--output-prefix", prefix, "--tokenizer-model", tiny_tokenizer,
                   "--append-eod", "--partitions", partitions, "--workers", 2,
                   "--chunk-lines", 2, *(["--keep-sequential-samples"] if sequential else []))
    assert_ok(run)
    assert order != values or sequential
    _assert_dataset_equals(f"{prefix}_text_document",
                           _expected_docs(tiny_tokenizer, order, append_eod=True))


def test_partition_chunks_keep_their_line_numbers(tmp_path):
    paths = [_texts(tmp_path, "a.jsonl", 5), _texts(tmp_path, "b.jsonl", 4)]
    for partition, expected in ((0, [(0, 1, [1, 4]), (1, 2, [2])]),
                                (1, [(0, 2, [2, 5]), (1, 3, [3])]),
                                (2, [(0, 3, [3]), (1, 1, [1, 4])])):
        chunks = list(iter_chunks(paths, 2, partitions=3, partition=partition))
        got = [(c.file_index, c.first_line, [c.line_number(k) for k in range(len(c.lines))])
               for c in chunks]
        # a.jsonl's lines are 0-4 of all the inputs, b.jsonl's 5-8; b.jsonl's line 1 is
        # input line 5 (5 mod 3 = 2), so partition 2 holds it.
        assert [(f, first, nums) for f, first, nums in got] == [
            (f, nums[0], nums) for f, _, nums in expected], partition
        for c in chunks:
            for k, raw in enumerate(c.lines):
                assert json.loads(raw)["text"].endswith(f" line {c.line_number(k) - 1}")


def test_gzip_input_is_read_as_the_plain_file(tmp_path, tiny_tokenizer):
    import gzip

    plain = _texts(tmp_path, "data.jsonl", 9)
    with open(plain, "rb") as src, gzip.open(tmp_path / "data.jsonl.gz", "wb") as dst:
        dst.write(src.read())
    for name, path in (("plain", plain), ("gz", tmp_path / "data.jsonl.gz")):
        assert_ok(run_tool("preprocess_data.py", "--input", path, "--output-prefix",
                           tmp_path / name, "--tokenizer-model", tiny_tokenizer,
                           "--append-eod"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"plain_text_document{suffix}").read_bytes() == \
            (tmp_path / f"gz_text_document{suffix}").read_bytes()


@pytest.mark.parametrize("legacy", [False, True])
def test_sentencepiece_tokenizer_ids_are_megatron_core_s_unless_legacy(tmp_path, tiny_tokenizer,
                                                                      legacy):
    """Megatron-LM's preprocess_data.py ends SentencePieceTokenizer documents with the
    model's </s> (megatron-core's tokenizer); its training tokenizer (and pretrain_gpt.py's)
    with <EOD>, past the pieces: the tool says so, and --legacy-tokenizer writes that."""
    data = _write_jsonl(tmp_path / "data.jsonl", [{"text": "a b"}])
    prefix = tmp_path / "ds"
    run = run_tool("preprocess_data.py", "--input", data, "--output-prefix", prefix,
                   "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                   tiny_tokenizer, "--append-eod", *(["--legacy-tokenizer"] if legacy else []))
    assert_ok(run)
    sp = sentencepiece.SentencePieceProcessor(model_file=tiny_tokenizer)
    dataset = _indexed_dataset(f"{prefix}_text_document")  # kept: [0] views its mmap
    ids = dataset[0].tolist()
    assert ids[:-1] == sp.encode("a b")
    note = "note: as Megatron-LM's preprocess_data.py, SentencePieceTokenizer's ids are"
    if legacy:
        assert ids[-1] >= sp.get_piece_size()  # <EOD>, appended past the model's pieces
        assert note not in run.stderr
    else:
        assert ids[-1] == EOD
        assert note in run.stderr and "--legacy-tokenizer writes the training ids" in run.stderr


def test_text_the_tokenizer_cannot_encode_is_a_line_error(tmp_path):
    """NullTokenizer reads space-separated ids; other text is that line's error."""
    data = _write_jsonl(tmp_path / "data.jsonl", [{"text": "1 2 3"}, {"text": "4 x"},
                                                  {"text": "5"}])
    common = ["--input", data, "--tokenizer-type", "NullTokenizer", "--vocab-size", 100]
    run = run_tool("preprocess_data.py", *common, "--output-prefix", tmp_path / "fail")
    assert_usage_error(run, "data.jsonl:2: the tokenizer cannot encode this text "
                            "(ValueError: 'x' is not a token id: NullTokenizer reads text as "
                            "space-separated token ids)")
    assert "Traceback" not in run.stderr
    assert _outputs(tmp_path / "fail") == []
    run = run_tool("preprocess_data.py", *common, "--output-prefix", tmp_path / "skip",
                   "--on-error", "skip")
    assert_ok(run)
    assert "warning: " in run.stderr and "data.jsonl:2: the tokenizer" in run.stderr
    dataset = _indexed_dataset(f"{tmp_path / 'skip'}_text_document")
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3], [5]]


def test_inputs_expand_in_order_and_chunks_keep_file_line_numbers(tmp_path):
    for name, count in (("b.jsonl", 5), ("a.jsonl", 3), ("c.txt", 1)):
        (tmp_path / name).write_text("".join(f'{{"text": "{name} {i}"}}\n'
                                             for i in range(count)))
    paths = expand_inputs([str(tmp_path / "*.jsonl"), str(tmp_path / "c.txt")])
    assert paths == [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "c.txt")]
    chunks = list(iter_chunks(paths, chunk_lines=2))
    assert [(c.file_index, c.first_line, len(c.lines)) for c in chunks] == [
        (0, 1, 2), (0, 3, 1), (1, 1, 2), (1, 3, 2), (1, 5, 1), (2, 1, 1)]
    # The byte limit ends a chunk too.
    assert [len(c.lines) for c in iter_chunks(paths[:1], 100, chunk_bytes=30)] == [2, 1]


@pytest.mark.parametrize("vocab_size, dtype", [(65499, np.uint16), (65500, np.int32),
                                                (200_000, np.int32)])
def test_writer_picks_the_smallest_dtype_that_holds_the_vocabulary(tmp_path, vocab_size,
                                                                   dtype):
    prefix = str(tmp_path / "ds_text_document")
    writer = DatasetWriter({"text": prefix}, vocab_size)
    docs = [[0, 1, vocab_size - 1], [vocab_size - 2]]
    writer.add(ChunkResult(0, 1, 2, 10, tokens={"text": np.array(sum(docs, []), np.int32)},
                           lengths={"text": np.array([3, 1])},
                           sequences={"text": np.array([1, 1])}, empty_documents={"text": 0}))
    assert writer.commit() == [prefix + ".bin", prefix + ".idx"]
    dataset = _indexed_dataset(prefix)
    assert dataset[0].dtype == dtype
    assert [dataset[i].tolist() for i in range(len(dataset))] == docs
    assert _outputs(tmp_path / "ds") == [prefix + ".bin", prefix + ".idx"]


GOOD = '{"text": "print(1)"}'


@pytest.mark.parametrize("lines, expected", [
    ([GOOD, GOOD, '{"text": "unterminated}'], "data.jsonl:3: invalid JSON"),
    ([GOOD, '{"body": "x"}'], 'data.jsonl:2: missing key "text"'),
    ([GOOD, GOOD, GOOD, '{"text": 42}'],
     'data.jsonl:4: value of key "text" is a number, expected a string'),
    (['{"text": null}'], 'data.jsonl:1: value of key "text" is null, expected a string'),
    ([GOOD, '{"text": ["a", 3]}'],
     'data.jsonl:2: element 1 of key "text" is a number, expected a string'),
    (['["text"]'], "data.jsonl:1: expected a JSON object, got list"),
    ([GOOD, ""], "data.jsonl:2: empty line"),
    ([GOOD, b'{"text": "\xff"}'], "data.jsonl:2: not valid UTF-8"),
], ids=["bad-json", "missing-key", "number", "null", "array-element", "not-object",
        "empty-line", "not-utf8"])
def test_malformed_line_fails_with_file_and_line(tmp_path, tiny_tokenizer, lines, expected):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n"
                              for ln in lines))
    prefix = tmp_path / "out" / "ds"
    run = run_tool("preprocess_data.py", "--input", data, "--output-prefix", prefix,
                   "--tokenizer-model", tiny_tokenizer)
    assert_usage_error(run, expected)
    assert "--on-error skip" in run.stderr  # says how to get past it
    assert _outputs(prefix) == []


@pytest.mark.parametrize("args, expected", [
    (["--input", "{tmp}/missing.jsonl"], "--input {tmp}/missing.jsonl: file not found"),
    (["--input", "{tmp}/*.nomatch"], "--input {tmp}/*.nomatch: no file matches"),
    (["--tokenizer-model", "{tmp}/missing.model"],
     "--tokenizer-model {tmp}/missing.model: file not found"),
    (["--tokenizer-model", "{tmp}/data.jsonl"], "not a SentencePiece model"),
    (["--workers", "0"], "--workers: must be >= 1"),
    (["--json-keys", "text", "text"], "--json-keys text text: a key is repeated"),
    (["--output-prefix", "{tmp}"], "is a directory"),
    (["--split-sentences"], "--split-sentences is not supported: Megatron-LM splits with "
                            "NLTK's punkt model"),
    (["--partitions", "0"], "--partitions: must be >= 1"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--vocab-extra-ids", "2"],
     "--vocab-extra-ids needs --legacy-tokenizer"),
    # Megatron-LM's GPT-2 BPE tokenizer reads it (through transformers), this project's not.
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{tmp}/data.jsonl",
      "--merge-file", "{tmp}/data.jsonl", "--tokenizer-hf-include-special-tokens"],
     "--tokenizer-hf-include-special-tokens with --tokenizer-type GPT2BPETokenizer: "
     "Megatron-LM's tokenizer reads it, this project's does not"),
], ids=["missing-input", "glob-no-match", "missing-model", "not-a-model", "workers-0",
        "repeated-key", "prefix-is-dir", "split-sentences", "partitions-0", "extra-ids",
        "hf-specials"])
def test_bad_arguments(tmp_path, tiny_tokenizer, args, expected):
    data = _write_jsonl(tmp_path / "data.jsonl", [{"text": "x"}])
    defaults = {"--input": data, "--tokenizer-model": tiny_tokenizer,
                "--output-prefix": str(tmp_path / "ds")}
    given = [a.format(tmp=tmp_path) for a in args]
    for flag, value in defaults.items():
        if flag not in given:
            given += [flag, value]
    run = run_tool("preprocess_data.py", *given)
    assert_usage_error(run, expected.format(tmp=tmp_path))
    assert _outputs(tmp_path / "ds") == []


def test_all_lines_malformed_writes_nothing(tmp_path, tiny_tokenizer):
    data = _write_jsonl(tmp_path / "data.jsonl", ['{"a": 1}', {"text": ""}])
    run = run_tool("preprocess_data.py", "--input", data, "--output-prefix", tmp_path / "ds",
                   "--tokenizer-model", tiny_tokenizer, "--on-error", "skip")
    assert_usage_error(run, "no document to write")
    assert _outputs(tmp_path / "ds") == []


def test_failure_after_writing_began_leaves_nothing(tmp_path, small_corpus, tiny_tokenizer):
    # One line per chunk: the writer opens and writes its temporary files long before the
    # bad last line comes back from the workers.
    with open(small_corpus, encoding="utf-8") as stream:
        lines = stream.read().splitlines()
    data = _write_jsonl(tmp_path / "data.jsonl", lines + ['{"text": 1}'])
    prefix = tmp_path / "ds"
    run = run_tool("preprocess_data.py", "--input", data, "--output-prefix", prefix,
                   "--tokenizer-model", tiny_tokenizer, "--chunk-lines", 1, "--workers", 2,
                   "--log-interval", 10)
    assert_usage_error(run, f"data.jsonl:{len(lines) + 1}: value of key")
    assert f"processed {len(lines) // 10 * 10} documents" in run.stderr  # writing did begin
    assert _outputs(prefix) == []


def _kill_workers(pid):
    for child in psutil.Process(pid).children():
        child.send_signal(signal.SIGKILL)


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupted_or_broken_run_leaves_nothing(tmp_path, small_corpus, tiny_tokenizer):
    # A run's temporary files appear once it has imported megatron-core (seconds), while
    # its worker has tokenized only the chunks queued ahead (64 of 16 lines); the input is
    # large enough that much is left to tokenize at that point.
    with open(small_corpus, encoding="utf-8") as stream:
        corpus = stream.read()
    data = tmp_path / "big.jsonl"
    data.write_text(corpus * 30, encoding="utf-8")
    cases = {  # output prefix: (what hits the run, its exit status, its last message)
        "term": (lambda pid: os.kill(pid, signal.SIGTERM), 143, "terminated (SIGTERM)"),
        "int": (lambda pid: os.kill(pid, signal.SIGINT), 130, "interrupted (Ctrl-C)"),
        # A worker killed (as the kernel's OOM killer would) must not hang the run.
        "oom": (_kill_workers, 2, "error: a worker process died"),
    }
    # The runs at once: each waits seconds for its megatron-core import. Each gets Ctrl-C's
    # default action, as a command in a terminal has: a suite started in the background
    # (`cmd &`, nohup, setsid) runs with SIGINT ignored, which its children inherit and
    # Python keeps (the run then ignored the Ctrl-C and exited 0, 2026-12-02).
    procs = {name: subprocess.Popen(
        tool_command("preprocess_data.py", ["--input", data, "--output-prefix", tmp_path / name,
                                            "--tokenizer-model", tiny_tokenizer,
                                            "--workers", 1, "--chunk-lines", 16]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        preexec_fn=_default_sigint)
        for name in cases}
    try:
        # Generous: other processes on a shared machine can slow the import many times.
        deadline = time.monotonic() + 300
        waiting = set(cases)
        while waiting:
            for name in sorted(waiting):
                if glob.glob(f"{tmp_path / name}*.tmp-*.bin"):
                    assert procs[name].poll() is None, f"{name}: finished before the signal"
                    cases[name][0](procs[name].pid)
                    waiting.remove(name)
                else:
                    assert procs[name].poll() is None, f"{name}: no temporary file appeared"
            assert time.monotonic() < deadline, "no temporary file appeared"
            time.sleep(0.01)
        for name, (_, exit_code, message) in cases.items():
            _, stderr = procs[name].communicate(timeout=60)
            assert procs[name].returncode == exit_code, stderr
            assert stderr.splitlines()[-1].startswith(message), stderr
            assert "Traceback" not in stderr, stderr
            assert _outputs(tmp_path / name) == []
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert os.listdir(tmp_path) == ["big.jsonl"]


def test_help_explains_every_flag():
    run = run_tool("preprocess_data.py", "--help")
    assert_ok(run)
    for flag in ("--input", "--json-keys", "--output-prefix", "--tokenizer-type",
                 "--tokenizer-model", "--append-eod", "--workers", "--log-interval",
                 "--on-error", "--chunk-lines", "--partitions", "--keep-sequential-samples",
                 "--split-sentences", "--keep-newlines", "--lang", "--legacy-tokenizer",
                 "--tokenizer-hf-include-special-tokens"):
        assert flag in run.stdout
