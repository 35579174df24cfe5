"""tools/build_corpus.py: valid jsonl, deterministic, no empty document, clean errors."""

from __future__ import annotations

import json
import os
import sysconfig
from pydoc_data.topics import topics as PYDOC_TOPICS

import pytest
from build_corpus import order_files, split_text, to_jsonl_line
from tools_testlib import assert_ok, assert_usage_error, run_tool


def _read_jsonl(path):
    with open(path, encoding="utf-8") as stream:
        return [json.loads(line) for line in stream]


def test_small_corpus_is_valid_jsonl(tmp_path):
    out = tmp_path / "c.jsonl"
    run = run_tool("build_corpus.py", "--output", out, "--max-docs", 20)
    assert_ok(run)
    records = _read_jsonl(out)
    assert len(records) == 20
    stdlib = sysconfig.get_paths()["stdlib"]
    for record in records:
        assert set(record) == {"text", "source", "chunk"}
        assert isinstance(record["text"], str) and record["text"].strip()
        assert record["source"].endswith(".py")
        assert os.path.isfile(os.path.join(stdlib, record["source"]))
    # Without --seed the files come in sorted order.
    sources = [r["source"] for r in records]
    assert sources == sorted(sources)
    assert "wrote 20 documents" in run.stderr
    assert not list(tmp_path.glob("*.tmp-*"))


def test_build_is_deterministic(tmp_path):
    args = ["--max-docs", 40, "--max-chars", 2000, "--seed", 7]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert_ok(run_tool("build_corpus.py", "--output", first, *args))
    assert_ok(run_tool("build_corpus.py", "--output", second, *args))
    assert first.read_bytes() == second.read_bytes()
    records = _read_jsonl(first)
    assert all(0 < len(r["text"]) <= 2000 for r in records)
    # A chunked file's chunks are consecutive and numbered from 0.
    for previous, record in zip(records, records[1:], strict=False):
        if record["chunk"]:
            assert record["source"] == previous["source"]
            assert record["chunk"] == previous["chunk"] + 1


def test_chunks_concatenate_to_the_file(tmp_path):
    out = tmp_path / "c.jsonl"
    assert_ok(run_tool("build_corpus.py", "--output", out, "--max-docs", 30, "--max-chars", 500))
    records = _read_jsonl(out)
    first_source = records[0]["source"]
    chunks = [r["text"] for r in records if r["source"] == first_source]
    with open(os.path.join(sysconfig.get_paths()["stdlib"], first_source), "rb") as stream:
        whole = stream.read().decode("utf-8")
    if len(chunks) == 30:  # the file did not fit in --max-docs: compare the prefix only
        whole = whole[:len("".join(chunks))]
    assert "".join(chunks) == whole


def test_pydoc_topics_one_document_per_topic_in_name_order(tmp_path):
    out = tmp_path / "t.jsonl"
    run = run_tool("build_corpus.py", "--kind", "pydoc-topics", "--output", out)
    assert_ok(run)
    records = _read_jsonl(out)
    # Every topic is one whole document (no --max-chars), sources are the topic names, sorted.
    assert [r["source"] for r in records] == sorted(PYDOC_TOPICS)
    for record in records:
        assert set(record) == {"text", "source", "chunk"}
        assert record["chunk"] == 0
        assert record["text"] == PYDOC_TOPICS[record["source"]]
    assert f"wrote {len(PYDOC_TOPICS)} documents" in run.stderr
    assert f"from {len(PYDOC_TOPICS)} topics" in run.stderr
    assert not list(tmp_path.glob("*.tmp-*"))


def test_pydoc_topics_chunks_are_deterministic_and_rebuild_each_topic(tmp_path):
    args = ["--kind", "pydoc-topics", "--max-chars", 3000]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert_ok(run_tool("build_corpus.py", "--output", first, *args))
    assert_ok(run_tool("build_corpus.py", "--output", second, *args))
    assert first.read_bytes() == second.read_bytes()
    records = _read_jsonl(first)
    assert len(records) > len(PYDOC_TOPICS)  # some topics are longer than 3000 characters
    assert all(0 < len(r["text"]) <= 3000 for r in records)
    rebuilt = {}
    for record in records:
        assert record["chunk"] == len(rebuilt.get(record["source"], []))
        rebuilt.setdefault(record["source"], []).append(record["text"])
    assert list(rebuilt) == sorted(PYDOC_TOPICS)
    assert {name: "".join(chunks) for name, chunks in rebuilt.items()} == PYDOC_TOPICS


def test_pydoc_topics_seed_and_max_docs(tmp_path):
    out = tmp_path / "t.jsonl"
    assert_ok(run_tool("build_corpus.py", "--kind", "pydoc-topics", "--output", out,
                       "--max-docs", 10, "--seed", 5))
    sources = [r["source"] for r in _read_jsonl(out)]
    assert len(sources) == 10
    assert sources == order_files(sorted(PYDOC_TOPICS), 5)[:10]


@pytest.mark.parametrize("text, max_chars, expected", [
    ("", 10, []),
    ("abc", None, ["abc"]),
    ("abc\n", 10, ["abc\n"]),
    ("a\nb\nc\n", 4, ["a\nb\n", "c\n"]),
    ("aaaaaaaaaa\nb\n", 4, ["aaaa", "aaaa", "aa\n", "b\n"]),
    ("ab\r\ncd\r\n", 4, ["ab\r\n", "cd\r\n"]),
    ("x" * 9, 3, ["xxx"] * 3),
])
def test_split_text(text, max_chars, expected):
    assert split_text(text, max_chars) == expected
    assert "".join(split_text(text, max_chars)) == text


def test_order_files_is_sorted_without_seed_and_reproducible_with_one():
    paths = [f"m{i:03d}.py" for i in range(50)]
    assert order_files(paths, None) == paths
    assert order_files(paths, 3) == order_files(paths, 3)
    assert order_files(paths, 3) != paths
    assert sorted(order_files(paths, 3)) == paths


def test_jsonl_line_escapes_unicode_line_breaks():
    record = {"text": "a\u2028b\x85c\nd", "source": "x.py", "chunk": 0}
    line = to_jsonl_line(record)
    assert line.endswith("\n") and len(line.splitlines()) == 1
    assert json.loads(line) == record


@pytest.mark.parametrize("args, expected", [
    (["--max-docs", "0"], "--max-docs: must be >= 1"),
    (["--max-chars", "x"], "--max-chars: expected an integer"),
    (["--kind", "nope"], "argument --kind: invalid choice"),
])
def test_bad_flags(tmp_path, args, expected):
    run = run_tool("build_corpus.py", "--output", tmp_path / "c.jsonl", *args)
    assert_usage_error(run, expected)
    assert not list(tmp_path.iterdir())


def test_output_that_is_a_directory_is_rejected(tmp_path):
    assert_usage_error(run_tool("build_corpus.py", "--output", tmp_path), "is a directory")


def test_files_mode_round_trips_each_file(tmp_path):
    """--files: one document per text file, its text byte for byte (CRLF and non-ASCII
    kept), sorted by path; blank and non-UTF-8 files are skipped and counted."""
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    texts = {
        docs / "a.txt": "First document.\nSecond line.\n",
        docs / "sub" / "b.txt": "Windows line ends\r\nand ümlauts, “quotes”\r\n",
        docs / "sub" / "c.txt": "no newline at the end",
    }
    for path, text in texts.items():
        path.write_bytes(text.encode("utf-8"))
    (docs / "blank.txt").write_text("  \n\n")
    (docs / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (docs / "skip.md").write_text("not matched")
    out = tmp_path / "files.jsonl"
    run = run_tool("build_corpus.py", "--files", f"{docs}/**/*.txt", "--output", out)
    assert_ok(run)
    records = _read_jsonl(out)
    assert [r["source"] for r in records] == sorted(str(p) for p in texts)
    assert {r["source"]: r["text"] for r in records} == {str(p): t for p, t in texts.items()}
    assert all(r["chunk"] == 0 for r in records)
    assert "skipped 1 non-UTF-8 and 1 blank files" in run.stderr


def test_files_mode_chunks_rebuild_the_file(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("".join(f"line {i} of a long text file\n" for i in range(200)))
    out = tmp_path / "c.jsonl"
    assert_ok(run_tool("build_corpus.py", "--files", path, "--max-chars", 500, "--output", out))
    records = _read_jsonl(out)
    assert len(records) > 1 and all(len(r["text"]) <= 500 for r in records)
    assert "".join(r["text"] for r in records) == path.read_text()


@pytest.mark.parametrize("args, expected", [
    (["--files", "/no/such/dir/*.txt"], "--files /no/such/dir/*.txt: no file matches"),
    (["--files", "/no/such/dir/a.txt", "/also/missing"], "no file matches"),
])
def test_files_mode_bad_input(tmp_path, args, expected):
    assert_usage_error(run_tool("build_corpus.py", "--output", tmp_path / "c.jsonl", *args),
                       expected)


def test_files_and_kind_are_exclusive(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    run = run_tool("build_corpus.py", "--output", tmp_path / "c.jsonl", "--files",
                   tmp_path / "a.txt", "--kind", "pydoc-topics")
    assert_usage_error(run, "--files and --kind are exclusive")
