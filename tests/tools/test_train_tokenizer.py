"""tools/train_tokenizer.py: special ids, lossless round trip, determinism, clean errors."""

from __future__ import annotations

import json

import pytest
import sentencepiece
from tools_testlib import TINY_VOCAB, assert_ok, assert_usage_error, run_tool
from train_tokenizer import reservoir_sample

# Code with what a lossy tokenizer gets wrong: tabs, runs of spaces, trailing spaces,
# blank lines, CRLF, digits, non-ASCII text and an emoji that no tiny vocabulary holds.
CODE_SNIPPET = (
    "def f(x):\n"
    "\tif x  >  12345:  \n"
    "        return 'h\u00e9llo \u4e16\u754c \U0001F600' + \"\\n\"\n"
    "\n\n"
    "    y = [1,2 ,3]\r\n"
    "  \n"
)


def _load(model_path):
    return sentencepiece.SentencePieceProcessor(model_file=model_path)


def test_special_ids_and_vocab_size(tiny_tokenizer):
    sp = _load(tiny_tokenizer)
    assert sp.vocab_size() == TINY_VOCAB
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, 3)
    assert [sp.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    # The newline is one piece of its own, whatever text surrounds it.
    assert sp.piece_to_id("\n") not in (sp.unk_id(), -1)
    assert sp.encode("\n") == [sp.piece_to_id("\n")]
    # Byte fallback: all 256 byte pieces exist.
    assert all(sp.piece_to_id(f"<0x{b:02X}>") != sp.unk_id() for b in range(256))


def test_decode_encode_is_lossless_on_code(tiny_tokenizer):
    sp = _load(tiny_tokenizer)
    ids = sp.encode(CODE_SNIPPET)
    assert sp.unk_id() not in ids
    assert sp.decode(ids) == CODE_SNIPPET


def test_decode_encode_is_lossless_on_the_corpus(tiny_tokenizer, small_corpus):
    sp = _load(tiny_tokenizer)
    with open(small_corpus, encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    assert all(sp.decode(ids) == text for ids, text in zip(sp.encode(texts), texts, strict=True))


def test_vocab_file_lists_every_piece(tiny_tokenizer):
    vocab_path = tiny_tokenizer[:-len(".model")] + ".vocab"
    with open(vocab_path, encoding="utf-8") as stream:
        lines = stream.read().split("\n")[:-1]
    assert len(lines) == TINY_VOCAB
    assert lines[2] == "</s>\t0"
    assert "\\n\t0" in lines  # the newline piece, escaped to keep one piece per line


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_training_is_deterministic(tmp_path, small_corpus, model_type):
    args = ["--input", small_corpus, "--vocab-size", 400, "--model-type", model_type,
            "--num-threads", 2, "--input-sentence-size", 3000, "--seed", 5, "--quiet"]
    assert_ok(run_tool("train_tokenizer.py", *args, "--output-prefix", tmp_path / "a"))
    assert_ok(run_tool("train_tokenizer.py", *args, "--output-prefix", tmp_path / "b"))
    model_a = (tmp_path / "a.model").read_bytes()
    assert model_a == (tmp_path / "b.model").read_bytes()
    assert (tmp_path / "a.vocab").read_bytes() == (tmp_path / "b.vocab").read_bytes()
    sp = sentencepiece.SentencePieceProcessor(model_proto=model_a)
    assert sp.vocab_size() == 400
    assert sp.decode(sp.encode(CODE_SNIPPET)) == CODE_SNIPPET
    assert not list(tmp_path.glob("*.tmp-*"))


def test_array_values_train_as_their_lines_joined(tmp_path, small_corpus):
    """An array of sentences (what preprocess_data.py takes, as Megatron-LM) is one text of
    those lines: the same model as the joined text."""
    with open(small_corpus, encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    arrays = tmp_path / "arrays.jsonl"
    joined = tmp_path / "joined.jsonl"
    arrays.write_text("".join(json.dumps({"text": t.split("\n")}) + "\n" for t in texts))
    joined.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = ["--vocab-size", 400, "--num-threads", 1, "--seed", 5, "--quiet"]
    for name in ("arrays", "joined"):
        assert_ok(run_tool("train_tokenizer.py", "--input", tmp_path / f"{name}.jsonl", *args,
                           "--output-prefix", tmp_path / name))
    assert (tmp_path / "arrays.model").read_bytes() == (tmp_path / "joined.model").read_bytes()


def test_plain_text_input_and_no_byte_fallback(tmp_path, small_corpus):
    with open(small_corpus, encoding="utf-8") as stream:
        text = "".join(json.loads(line)["text"] for line in stream)
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    run = run_tool("train_tokenizer.py", "--input", tmp_path / "corpus.txt", "--vocab-size", 300,
                   "--no-byte-fallback", "--output-prefix", tmp_path / "nb", "--quiet")
    assert_ok(run)
    assert "read 1 documents" in run.stderr
    sp = _load(str(tmp_path / "nb.model"))
    assert sp.vocab_size() == 300
    assert sp.piece_to_id("<0x41>") == sp.unk_id()  # no byte pieces
    assert sp.encode("\U0001F600") == [sp.unk_id()]


def test_reservoir_sample_is_seeded_uniform_and_in_order():
    items = [f"line {i}" for i in range(1000)]
    sample, total = reservoir_sample(iter(items), 100, seed=3)
    assert total == 1000 and len(sample) == 100
    assert sample == sorted(sample, key=items.index)  # corpus order kept
    assert reservoir_sample(iter(items), 100, seed=3)[0] == sample
    assert reservoir_sample(iter(items), 100, seed=4)[0] != sample
    assert reservoir_sample(iter(items), 0, seed=3) == (items, 1000)
    assert reservoir_sample(iter(items[:10]), 100, seed=3) == (items[:10], 10)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n{"text": 5}\n', encoding="utf-8")
    run = run_tool("train_tokenizer.py", "--input", data, "--output-prefix", tmp_path / "m")
    assert_usage_error(run, 'data.jsonl:2: value of key "text" is a number, expected a string')
    assert not list(tmp_path.glob("m*"))


@pytest.mark.parametrize("args, expected", [
    (["--vocab-size", "100000"], "SentencePiece training failed: "),
    (["--vocab-size", "0"], "--vocab-size: must be >= 1"),
    (["--model-type", "word"], "argument --model-type: invalid choice"),
    (["--character-coverage", "1.5"], "--character-coverage 1.5: must be in (0, 1]"),
])
def test_bad_flags(tmp_path, small_corpus, args, expected):
    run = run_tool("train_tokenizer.py", "--input", small_corpus, "--output-prefix",
                   tmp_path / "m", "--quiet", *args)
    assert_usage_error(run, expected)
    assert not list(tmp_path.glob("m*"))


def test_missing_input(tmp_path):
    run = run_tool("train_tokenizer.py", "--input", tmp_path / "nope.jsonl", "--output-prefix",
                   tmp_path / "m")
    assert_usage_error(run, "nope.jsonl: file not found")


def test_quiet_by_default_with_progress_lines_and_verbose_brings_the_log_back(tmp_path,
                                                                               small_corpus):
    base = ["--input", small_corpus, "--vocab-size", TINY_VOCAB, "--num-threads", 1]
    quiet = run_tool("train_tokenizer.py", *base, "--output-prefix", tmp_path / "q")
    assert_ok(quiet)
    lines = (quiet.stdout + quiet.stderr).strip().splitlines()
    assert len(lines) <= 4, lines
    assert any("train_tokenizer: training a bpe model" in line for line in lines), lines
    assert any("trained in" in line for line in lines), lines
    verbose = run_tool("train_tokenizer.py", *base, "--output-prefix", tmp_path / "v",
                       "--verbose")
    assert_ok(verbose)
    assert len((verbose.stdout + verbose.stderr).splitlines()) > 50
    assert (tmp_path / "q.model").read_bytes() == (tmp_path / "v.model").read_bytes()


def test_quiet_and_verbose_are_exclusive(tmp_path, small_corpus):
    run = run_tool("train_tokenizer.py", "--input", small_corpus, "--output-prefix",
                   tmp_path / "m", "--quiet", "--verbose")
    assert_usage_error(run, "--quiet and --verbose are exclusive")
