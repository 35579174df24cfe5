"""tools/preprocess_data.py on plain text, the files tools/train_tokenizer.py takes.

The tools run in this process (their main, as their __main__ calls it): a process each
would spend most of its time importing megatron-core.

Plain UTF-8 text -> .bin/.idx -> IndexedDataset gives back the documents of
--text-documents lines | blocks | file; a file that is not UTF-8, flags that do not apply
to the inputs, and a plain-text file read as jsonl say how to fix them in one line.
"""

from __future__ import annotations

import gzip
import io
import warnings

import preprocess_data
import pytest
import sentencepiece
import train_tokenizer
from _documents import decode_text, input_format, iter_text_documents, malformed_hint
from _tokenize_chunks import iter_chunks
from model_testlib import assert_ok, assert_usage_error, call_tool

EOD = 2  # </s> of the models tools/train_tokenizer.py writes

TEXT = ("def main():\n    return 1\n\n\nclass A:\n    pass\n  \nx = 'caf\u00e9'\n")
DOCUMENTS = {
    "lines": ["def main():", "    return 1", "class A:", "    pass", "  ", "x = 'caf\u00e9'"],
    "blocks": ["def main():\n    return 1", "class A:\n    pass", "x = 'caf\u00e9'"],
    "file": [TEXT],
}


def _dataset_docs(prefix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns about missing GPU packages
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    dataset = IndexedDataset(str(prefix))
    bounds = dataset.document_indices.tolist()
    return [[dataset[i].tolist() for i in range(a, b)] for a, b in zip(bounds, bounds[1:])]


def _expected(model, documents):
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    return [[sp.encode(text) + [EOD]] for text in documents]


@pytest.mark.parametrize("cut, expected", [
    ("lines", [(1, "def main():"), (2, "    return 1"), (5, "class A:"), (6, "    pass"),
               (7, "  "), (8, "x = 'caf\u00e9'")]),
    ("blocks", [(1, "def main():\n    return 1"), (5, "class A:\n    pass"),
                (8, "x = 'caf\u00e9'")]),
    ("file", [(1, TEXT)]),
])
def test_text_documents_and_their_first_lines(cut, expected):
    got = list(iter_text_documents(io.BytesIO(TEXT.encode()), cut))
    assert [(n, raw.decode()) for n, raw in got] == expected
    assert [raw.decode() for _, raw in got] == DOCUMENTS[cut]


@pytest.mark.parametrize("data, cut, expected", [
    (b"", "lines", []), (b"", "blocks", []), (b"", "file", []),
    (b"\n\n", "lines", []), (b"\n \n", "blocks", []),
    (b"no newline at the end", "lines", [(1, b"no newline at the end")]),
    (b"a\r\nb\r\n", "lines", [(1, b"a\r"), (2, b"b\r")]),  # as train_tokenizer.py's lines
    (b"\n\na\n\n\n\nb", "blocks", [(3, b"a"), (7, b"b")]),
])
def test_text_documents_edges(data, cut, expected):
    assert list(iter_text_documents(io.BytesIO(data), cut)) == expected


def test_input_format_and_decoding():
    assert [input_format(p, "auto") for p in ("a.jsonl", "a.json", "a.ndjson", "a.jsonl.gz",
                                                "a.txt", "a.txt.gz", "a", "a.py")] == \
        ["jsonl"] * 4 + ["text"] * 4
    assert input_format("a.jsonl", "text") == "text"
    assert decode_text("caf\u00e9".encode()) == "caf\u00e9"
    (message,) = decode_text("caf\u00e9".encode("latin-1"))
    assert message.startswith("not valid UTF-8 text (unexpected end of data at byte 3")


def test_chunks_of_text_keep_each_document_line_number(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(TEXT)
    chunks = list(iter_chunks([str(path)], chunk_lines=2, formats=["text"],
                              text_documents="lines"))
    assert all(c.text for c in chunks)
    assert [[c.line_number(k) for k in range(len(c.lines))] for c in chunks] == \
        [[1, 2], [5, 6], [7, 8]]


@pytest.mark.parametrize("cut", ["lines", "blocks", "file"])
def test_round_trip(tmp_path, tiny_tokenizer, cut):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    prefix = tmp_path / "ds"
    run = call_tool(preprocess_data, "--input", path, "--output-prefix", prefix,
                   "--tokenizer-model", tiny_tokenizer, "--append-eod", "--text-documents", cut)
    assert_ok(run)
    assert f"--text-documents {cut}" in run.stderr
    assert _dataset_docs(f"{prefix}_text_document") == _expected(tiny_tokenizer, DOCUMENTS[cut])


def test_the_files_train_tokenizer_takes(tmp_path):
    """The first hour: a tokenizer trained on plain text, then that text preprocessed
    (default: a document per line), gzipped or not, with any number of workers."""
    lines = [f"line {i}: the quick brown fox jumps over {i % 7} lazy dogs" for i in range(300)]
    text = "\n".join(lines) + "\n"
    (tmp_path / "corpus.txt").write_text(text)
    with gzip.open(tmp_path / "corpus.txt.gz", "wt") as out:
        out.write(text)
    assert_ok(call_tool(train_tokenizer, "--input", tmp_path / "corpus.txt",
                       "--output-prefix", tmp_path / "tok", "--vocab-size", 300,
                       "--num-threads", 1))
    model = str(tmp_path / "tok.model")
    for name, workers in (("corpus.txt", 1), ("corpus.txt.gz", 2)):
        prefix = tmp_path / f"ds-{workers}"
        assert_ok(call_tool(preprocess_data, "--input", tmp_path / name, "--output-prefix",
                           prefix, "--tokenizer-model", model, "--append-eod", "--workers",
                           workers))
        assert _dataset_docs(f"{prefix}_text_document") == _expected(model, lines)


def test_text_that_is_not_utf8(tmp_path, tiny_tokenizer):
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"fine\n" + "caf\u00e9\n".encode("latin-1") + b"also fine\n")
    flags = ["--input", path, "--output-prefix", tmp_path / "ds", "--tokenizer-model",
             tiny_tokenizer, "--append-eod"]
    assert_usage_error(call_tool(preprocess_data, *flags),
                       f"{path}:2: not valid UTF-8 text (unexpected end of data at byte 3 "
                       "of the document); convert the file to UTF-8; fix the file, or pass "
                       "--on-error skip to leave such documents out")
    assert not list(tmp_path.glob("ds*"))
    run = call_tool(preprocess_data, *flags, "--on-error", "skip")
    assert_ok(run)
    assert f"warning: {path}:2: not valid UTF-8 text" in run.stderr
    assert _dataset_docs(tmp_path / "ds_text_document") == _expected(
        tiny_tokenizer, ["fine", "also fine"])


@pytest.mark.parametrize("name, flags, expected", [
    ("plain.txt", ["--json-keys", "body"],
     "--json-keys body: {t}/plain.txt is plain text, which has no keys"),
    ("texts.jsonl", ["--text-documents", "blocks"],
     "--text-documents blocks cuts plain text, and every --input is jsonl by its name"),
    # Plain text read as jsonl: the hint is the format, not --on-error skip (which would
    # leave out every line).
    ("plain.txt", ["--input-format", "jsonl"],
     "{t}/plain.txt:1: invalid JSON (Expecting value: line 1 column 1 (char 0)); if the file "
     "is plain text, not jsonl, pass --input-format text"),
])
def test_flags_that_do_not_fit_the_input(tmp_path, tiny_tokenizer, name, flags, expected):
    (tmp_path / "plain.txt").write_text("plain text, one line of it\n")
    (tmp_path / "texts.jsonl").write_text('{"text": "a b"}\n')
    assert_usage_error(call_tool(preprocess_data, "--input", tmp_path / name,
                                "--output-prefix", tmp_path / "ds", "--tokenizer-model",
                                tiny_tokenizer, *flags),
                       expected.replace("{t}", str(tmp_path)))


@pytest.mark.parametrize("line, message, formats, hint", [
    (1, "invalid JSON (x)", ["jsonl"], "pass --input-format text"),
    (2, "invalid JSON (x)", ["jsonl"], "--on-error skip to leave malformed lines out"),
    (1, 'missing key "text"', ["jsonl"], "--on-error skip to leave malformed lines out"),
    (1, "not valid UTF-8 text", ["text"], "--on-error skip to leave such documents out"),
])
def testmalformed_hint(line, message, formats, hint):
    assert hint in malformed_hint(line, message, formats, 0)
