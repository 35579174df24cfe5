"""How the corpus tools read their input files: jsonl, or plain text cut into documents.

``tools/train_tokenizer.py`` and ``tools/preprocess_data.py`` take the same files: jsonl
(one JSON object per line) or plain UTF-8 text, told apart by the name (:func:`input_format`).
Plain text becomes documents in one of three ways (:data:`TEXT_DOCUMENTS`): one per
non-empty line, one per block of lines between blank lines, or the whole file. The
tokenizer's model does not depend on the cut (it trains on the non-empty lines either way);
the datasets do: each document ends with the end-of-document token.

Files are read as bytes and a document is decoded where it is tokenized (a worker process of
preprocess_data.py), so the reading process does no per-character work. Also here:
preprocess_data.py's checks of its input flags against the inputs, and its hint for a
malformed line.
"""

from __future__ import annotations

import gzip
from typing import BinaryIO, Iterator, List, Optional, Sequence, Tuple, Union

from _common import ToolError, log_start

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# How plain text is cut into documents (preprocess_data.py --text-documents).
TEXT_DOCUMENTS = ("lines", "blocks", "file")


def input_format(path: str, requested: str) -> str:
    """``jsonl`` or ``text`` for ``path``: ``requested`` unless it is ``auto``.

    ``auto``: jsonl for names ending in .jsonl, .json or .ndjson (before a .gz), plain text
    otherwise.

    >>> input_format("data/a.jsonl.gz", "auto"), input_format("book.txt", "auto")
    ('jsonl', 'text')
    """
    if requested != "auto":
        return requested
    name = path[:-3] if path.endswith(".gz") else path
    return "jsonl" if name.endswith(JSONL_SUFFIXES) else "text"


def open_input(path: str) -> BinaryIO:
    """The input as a binary stream; ``.gz`` files are read through gzip."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def iter_text_documents(stream: BinaryIO, cut: str) -> Iterator[Tuple[int, bytes]]:
    """The documents of a plain-text stream as ``(first line number, UTF-8 bytes)``.

    Args:
        stream: the file, binary.
        cut: ``lines``: each non-empty line, without its "\\n" (the lines
            train_tokenizer.py trains on); ``blocks``: each run of lines between blank
            lines (empty or whitespace only), joined by "\\n", without the last "\\n";
            ``file``: the whole file as it is, unless it is empty.

    >>> import io
    >>> list(iter_text_documents(io.BytesIO(b"a b\\n\\nc\\n  \\nd\\ne"), "blocks"))
    [(1, b'a b'), (3, b'c'), (5, b'd\\ne')]
    """
    if cut == "file":
        data = stream.read()
        if data:
            yield 1, data
        return
    if cut == "lines":
        for number, raw in enumerate(stream, start=1):
            line = raw[:-1] if raw.endswith(b"\n") else raw
            if line:
                yield number, line
        return
    if cut != "blocks":
        raise ValueError(f"unknown cut {cut!r}; one of {TEXT_DOCUMENTS}")
    block: List[bytes] = []
    first = 0
    for number, raw in enumerate(stream, start=1):
        if not raw.strip():
            if block:
                yield first, b"\n".join(block)
                block = []
            continue
        if not block:
            first = number
        block.append(raw[:-1] if raw.endswith(b"\n") else raw)
    if block:
        yield first, b"\n".join(block)


def decode_text(raw: bytes) -> Union[str, Tuple[str]]:
    """A document's text, or ``(message,)`` saying why it is not UTF-8 text. Pure."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return (f"not valid UTF-8 text ({err.reason} at byte {err.start} of the document); "
                "convert the file to UTF-8",)


def malformed_hint(line_number: int, message: str, formats: Optional[Sequence[str]],
                   file_index: int) -> str:
    """How to fix a malformed line of preprocess_data.py's input ``file_index``. Pure.

    A jsonl file whose first line is not JSON at all is most likely plain text, where
    ``--on-error skip`` would leave out every line: the hint then names --input-format text.
    """
    if formats is not None and formats[file_index] == "text":
        return "fix the file, or pass --on-error skip to leave such documents out"
    if line_number == 1 and message.startswith("invalid JSON"):
        return ("if the file is plain text, not jsonl, pass --input-format text (one "
                "document per line; see --text-documents)")
    return "fix the line, or pass --on-error skip to leave malformed lines out"


def resolve_inputs(args, paths: Sequence[str]) -> List[str]:
    """Each input's format (``jsonl`` or ``text``) under preprocess_data.py's flags; settles
    ``args.json_keys`` and ``args.text_documents`` for them.

    Raises:
        ToolError: --json-keys with plain text, or --text-documents without it.
    """
    formats = [input_format(path, args.input_format) for path in paths]
    text = [path for path, fmt in zip(paths, formats) if fmt == "text"]
    if text and args.json_keys not in (None, ["text"]):
        raise ToolError(f"--json-keys {' '.join(args.json_keys)}: {text[0]} is plain text, "
                        "which has no keys (its documents are written as key text); drop "
                        "--json-keys, or give --input-format jsonl if it is jsonl")
    if not text and args.text_documents is not None:
        raise ToolError(f"--text-documents {args.text_documents} cuts plain text, and every "
                        "--input is jsonl by its name; drop the flag, or give "
                        "--input-format text")
    args.json_keys = args.json_keys or ["text"]
    args.text_documents = args.text_documents or "lines"
    if text:
        what = {"lines": "one document per non-empty line",
                "blocks": "one document per block of lines between blank lines",
                "file": "one document per file"}[args.text_documents]
        log_start(f"reading {len(text)} plain-text file(s), {what} (--text-documents "
            f"{args.text_documents})")
    return formats
