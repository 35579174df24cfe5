"""Trains a SentencePiece tokenizer (BPE or unigram) on jsonl or plain-text files.

The model is made for GPT pretraining on code and prose:

* ids 0-3 are ``<unk>``, ``<s>``, ``</s>``, ``<pad>``; ``</s>`` (id 2) is the
  end-of-document (EOD) id that ``tools/preprocess_data.py --append-eod`` appends;
* ``decode(encode(text)) == text`` for any text when byte fallback is on (the default):
  normalization is the identity, whitespace is kept as it is (no collapsing, no dummy
  prefix), and characters outside the vocabulary become byte pieces ``<0x..>``;
* the newline is a piece of its own (``"\\n"``), since training sees one line at a time;
* digits are split one per piece, and pieces made only of whitespace (indentation) are
  allowed.

Determinism: the same inputs and flags, including ``--num-threads``, give a byte-identical
``.model``. SentencePiece's own sentence sampling is not reproducible from one process to
the next even with a fixed seed, so ``--input-sentence-size`` is applied here, by a seeded
reservoir sample, and SentencePiece always gets every sentence it is given. The unigram
trainer splits its sums over threads, so its model depends on ``--num-threads``; BPE's
does not.

Example::

    python tools/train_tokenizer.py --input data/stdlib.jsonl --output-prefix data/spm32k \\
        --vocab-size 32000 --model-type bpe
"""

from __future__ import annotations

import io
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

from _common import (
    ToolArgumentParser,
    ToolError,
    check_input_file,
    ensure_parent_dir,
    human_mb,
    log,
    log_start,
    non_negative_int,
    parse_json_line,
    positive_int,
    remove_quietly,
    run_tool,
    temporary_path,
)
from _documents import input_format, open_input

# The special pieces and their ids; tools/preprocess_data.py and the trainer rely on
# </s> being the EOD id.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# Training sees lines without their "\n" (see iter_training_lines), so the newline could
# never be learned; as a user-defined symbol it is always exactly one piece, with or
# without byte fallback.
NEWLINE_SYMBOLS = ["\n"]
_PROGRESS_EVERY_LINES = 100_000


@dataclass
class ReadStats:
    """What was read, for the ``read N documents, M MB`` line."""

    documents: int = 0
    text_bytes: int = 0


def iter_documents(paths: Sequence[str], fmt: str, json_keys: Sequence[str],
                   stats: ReadStats) -> Iterator[str]:
    """Yields the documents of ``paths``: jsonl values of ``json_keys``, or whole text files.

    Raises:
        ToolError: a jsonl line is malformed (with file name and 1-based line number).
    """
    for path in paths:
        if input_format(path, fmt) == "jsonl":
            with open_input(path) as stream:
                for line_number, raw in enumerate(stream, start=1):
                    parsed = parse_json_line(raw, json_keys, allow_lists=True)
                    if isinstance(parsed, str):
                        hint = ("if the file is plain text, not jsonl, pass --input-format "
                                "text" if line_number == 1 and parsed.startswith("invalid JSON")
                                else "fix or remove the line")
                        raise ToolError(f"{path}:{line_number}: {parsed}; {hint}")
                    stats.text_bytes += len(raw)
                    for key in json_keys:
                        stats.documents += 1
                        value = parsed[key]
                        # An array is the document's sentences (preprocess_data.py's input
                        # too): trained on as the lines of one text.
                        yield value if isinstance(value, str) else "\n".join(value)
                    if line_number % _PROGRESS_EVERY_LINES == 0:
                        log(f"train_tokenizer: read {stats.documents} documents, "
                            f"{human_mb(stats.text_bytes)}")
        else:
            try:
                with open_input(path) as stream:
                    text = stream.read().decode("utf-8")
            except UnicodeDecodeError as err:
                raise ToolError(f"{path}: not valid UTF-8 text ({err.reason} at byte "
                                f"{err.start}); convert it or pass a jsonl file") from None
            stats.text_bytes += len(text.encode("utf-8"))
            stats.documents += 1
            yield text


def iter_training_lines(documents: Iterable[str]) -> Iterator[str]:
    """The non-empty lines of ``documents``, without their "\\n".

    SentencePiece treats each input as a sentence and has a length limit per sentence
    (``max_sentence_length``, 4192 bytes by default), so whole files would mostly be
    dropped; lines are the natural unit for code and prose.
    """
    for document in documents:
        for line in document.split("\n"):
            if line:
                yield line


def reservoir_sample(items: Iterable[str], size: int, seed: int) -> Tuple[List[str], int]:
    """A uniform random sample of ``size`` items, in their original order.

    Deterministic for a given ``seed`` (Algorithm R with Python's ``random.Random``), and
    it holds only ``size`` items in memory however long ``items`` is.

    Args:
        items: the population, read once.
        size: how many to keep; 0 keeps everything.
        seed: the sampling seed.

    Returns:
        ``(sample, population_size)``.
    """
    if size == 0:
        everything = list(items)
        return everything, len(everything)
    rng = random.Random(seed)
    reservoir: List[Tuple[int, str]] = []
    count = 0
    for index, item in enumerate(items):
        count = index + 1
        if index < size:
            reservoir.append((index, item))
        else:
            slot = rng.randrange(index + 1)
            if slot < size:
                reservoir[slot] = (index, item)
    # Back in corpus order, so the sample reads like the corpus does.
    reservoir.sort(key=lambda pair: pair[0])
    return [item for _, item in reservoir], count


def trainer_options(args) -> dict:
    """The SentencePiece trainer options for the parsed command line."""
    return dict(
        model_type=args.model_type,
        vocab_size=args.vocab_size,
        character_coverage=args.character_coverage,
        byte_fallback=args.byte_fallback,
        # Identity normalization and kept whitespace: decode(encode(x)) == x for code.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        # No "▁" before each sentence: training sentences are lines, and a line inside a
        # document is encoded without a dummy prefix too, so train and use agree.
        add_dummy_prefix=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=NEWLINE_SYMBOLS,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
        unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>", pad_piece="<pad>",
        num_threads=args.num_threads,
        # Sampling is done by reservoir_sample (reproducible); hand SentencePiece all of it.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=args.max_sentence_length,
        # SentencePiece logs ~400 lines of INFO per model: only with --verbose.
        minloglevel=0 if args.verbose else 1,
    )


def write_vocab(model_proto: bytes, vocab_path: str) -> None:
    """Writes the ``piece<TAB>score`` listing SentencePiece writes as PREFIX.vocab.

    SentencePiece only writes it when it writes the model itself (``model_prefix``), but
    then the model records that prefix and its bytes depend on the output path. Unlike
    SentencePiece's file, control characters in a piece (the newline piece) are written
    as escapes such as ``\\n``, so that the file has exactly one piece per line. The file
    is for people to read; tools load the ``.model``.
    """
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(model_proto)
    with open(vocab_path, "w", encoding="utf-8", newline="\n") as out:
        for piece in model.pieces:
            # "%g" is C++'s default float formatting, which SentencePiece's own file uses.
            out.write(f"{_escape_controls(piece.piece)}\t{piece.score:g}\n")


def _escape_controls(piece: str) -> str:
    """``piece`` with ASCII control characters as Python-style escapes."""
    if piece.isprintable():
        return piece
    return "".join(ch.encode("unicode_escape").decode("ascii") if ord(ch) < 0x20 or
                   ord(ch) == 0x7F else ch for ch in piece)


def build_parser() -> ToolArgumentParser:
    """The command-line parser; --help describes every flag."""
    parser = ToolArgumentParser(
        prog="tools/train_tokenizer.py",
        description="Train a SentencePiece model (PREFIX.model, PREFIX.vocab) whose ids "
                    "0-3 are <unk> <s> </s> <pad>; </s> is the end-of-document id.",
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="training text: jsonl files (one JSON object per line) or plain "
                             "UTF-8 text files (each file one document; training reads its "
                             "non-empty lines, however tools/preprocess_data.py "
                             "--text-documents cuts it), optionally .gz")
    parser.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto",
                        help="how to read --input; auto: jsonl for names ending in .jsonl, "
                             ".json or .ndjson (before a .gz), plain text otherwise (default: "
                             "%(default)s)")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="jsonl keys whose string values are documents "
                             "(default: %(default)s)")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="writes PREFIX.model and PREFIX.vocab; the directory is created "
                             "if missing")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                        help="SentencePiece algorithm (default: %(default)s)")
    parser.add_argument("--vocab-size", type=positive_int, default=32000, metavar="N",
                        help="number of pieces, including the 4 special pieces, the newline "
                             "and, with byte fallback, 256 byte pieces (default: %(default)s)")
    parser.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false",
                        help="turn byte fallback off: characters outside the vocabulary "
                             "then become <unk> and decode(encode(x)) == x no longer holds")
    parser.add_argument("--character-coverage", type=float, default=0.9995, metavar="F",
                        help="fraction of characters the vocabulary must cover; the rarest "
                             "others are left to byte fallback (default: %(default)s)")
    parser.add_argument("--input-sentence-size", type=non_negative_int, default=1_000_000,
                        metavar="N",
                        help="train on a seeded random sample of N lines; 0 uses every "
                             "line (default: %(default)s)")
    parser.add_argument("--max-sentence-length", type=positive_int, default=4192,
                        metavar="BYTES",
                        help="SentencePiece skips training lines longer than this "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=non_negative_int, default=1234,
                        help="seed of the line sample (default: %(default)s)")
    parser.add_argument("--num-threads", type=positive_int, default=min(os.cpu_count() or 1, 16),
                        metavar="N",
                        help="trainer threads; a unigram model depends on it, so pass the "
                             "same value to reproduce one (default: the CPU count, at most "
                             "16: %(default)s)")
    parser.add_argument("--verbose", action="store_true",
                        help="show SentencePiece's own progress log (hundreds of lines); "
                             "without it, this tool's progress lines and SentencePiece's "
                             "warnings only")
    parser.add_argument("--quiet", action="store_true",
                        help="the default now (SentencePiece's log hidden); kept for scripts "
                             "that pass it; exclusive with --verbose")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Trains and writes the tokenizer named by the command line.

    Raises:
        ToolError: bad input; ``run_tool`` prints it and exits with status 2.
    """
    args = build_parser().parse_args(argv)
    import sentencepiece

    for path in args.input:
        check_input_file(path, "--input")
    if not 0.0 < args.character_coverage <= 1.0:
        raise ToolError(f"--character-coverage {args.character_coverage}: must be in (0, 1]")
    if args.quiet and args.verbose:
        raise ToolError("--quiet and --verbose are exclusive")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise ToolError(f"--json-keys {' '.join(args.json_keys)}: a key is repeated")
    model_path = args.output_prefix + ".model"
    vocab_path = args.output_prefix + ".vocab"
    for path in (model_path, vocab_path):
        if os.path.isdir(path):
            raise ToolError(f"--output-prefix {args.output_prefix}: {path} is a directory")
    ensure_parent_dir(model_path)

    stats = ReadStats()
    documents = iter_documents(args.input, args.input_format, args.json_keys, stats)
    lines, total_lines = reservoir_sample(iter_training_lines(documents),
                                          args.input_sentence_size, args.seed)
    if not lines:
        raise ToolError("the input has no text to train on; check --input and --json-keys")
    log_start(f"train_tokenizer: read {stats.documents} documents, "
              f"{human_mb(stats.text_bytes)}, {total_lines} non-empty lines; training on "
              f"{len(lines)} of them")
    log_start(f"train_tokenizer: training a {args.model_type} model of {args.vocab_size} pieces on "
        f"{len(lines)} lines with {args.num_threads} threads"
        f"{'' if args.verbose else ' (SentencePiece log: --verbose)'}")
    started = time.perf_counter()
    buffer = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines),
                                                 model_writer=buffer, **trainer_options(args))
    except RuntimeError as err:
        # SentencePiece's messages say how to fix the flag (e.g. the largest vocab size).
        message = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
        raise ToolError(f"SentencePiece training failed: {message}") from None
    proto = buffer.getvalue()

    tmp_model, tmp_vocab = temporary_path(model_path), temporary_path(vocab_path)
    done = False
    try:
        with open(tmp_model, "wb") as out:
            out.write(proto)
        write_vocab(proto, tmp_vocab)
        os.replace(tmp_model, model_path)
        os.replace(tmp_vocab, vocab_path)
        done = True
    finally:
        if not done:
            remove_quietly([tmp_model, tmp_vocab])

    model = sentencepiece.SentencePieceProcessor(model_proto=proto)
    log(f"train_tokenizer: trained in {time.perf_counter() - started:.1f} s; wrote {model_path} "
        f"and {vocab_path}: {model.vocab_size()} pieces ({args.model_type}), "
        f"unk={model.unk_id()} bos={model.bos_id()} eos/EOD={model.eos_id()} "
        f"pad={model.pad_id()}")


if __name__ == "__main__":
    sys.exit(run_tool(main))
