"""preprocess_data.py's unit of work: chunks of input lines and their tokenization.

The main process cuts the inputs into :class:`Chunk` s of whole lines (:func:`iter_chunks`,
bytes only: it does no per-line work); a pool of worker processes, each set up once by
:func:`init_worker` with its own tokenizer, parses and tokenizes a whole chunk
(:func:`encode_chunk_in_worker`) and returns a :class:`ChunkResult` of numpy arrays, which
pickle fast. A worker ignores Ctrl-C and SIGTERM (the main process shuts it down) and exits
on its own when the main process is gone.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from _common import ToolError, parse_json_line
from _documents import decode_text, iter_text_documents, open_input

from megatron_ext.data.tokenizer import build_preprocessing_tokenizer  # noqa: E402
from megatron_ext.errors import UsageError  # noqa: E402

# A chunk also ends once its lines reach this many bytes, so that a file of very long
# documents does not put hundreds of MB in one task, and the last tasks stay small
# enough for the workers to finish together.
CHUNK_MAX_BYTES = 1 << 20
# How often a worker checks that the main process is still alive.
ORPHAN_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Chunk:
    """Consecutive lines (or plain-text documents) of one input file: the unit of work sent
    to a worker."""

    file_index: int
    first_line: int  # 1-based line number of lines[0]
    lines: List[bytes]
    stride: int = 1  # lines[k] is line first_line + k * stride (--partitions)
    # Plain text: each of ``lines`` is a document's UTF-8 text, not a JSON object, and
    # ``numbers[k]`` is the line where document k starts.
    text: bool = False
    numbers: Optional[Tuple[int, ...]] = None

    def line_number(self, offset: int) -> int:
        if self.numbers is not None:
            return self.numbers[offset]
        return self.first_line + offset * self.stride


@dataclass
class ChunkResult:
    """A tokenized chunk; arrays rather than lists of lists, because they pickle fast.

    For each json key: ``tokens[key]`` is the ids of the chunk's documents one after the
    other, ``lengths[key]`` the number of ids of each sequence, and ``sequences[key]`` the
    number of sequences of each document (0 for a document with no token).
    """

    file_index: int
    first_line: int
    num_lines: int
    num_bytes: int
    tokens: Dict[str, np.ndarray] = field(default_factory=dict)
    lengths: Dict[str, np.ndarray] = field(default_factory=dict)
    sequences: Dict[str, np.ndarray] = field(default_factory=dict)
    empty_documents: Dict[str, int] = field(default_factory=dict)
    errors: List[Tuple[int, str]] = field(default_factory=list)  # (line number, message)


def encode_chunk(tokenizer, chunk: Chunk, keys: Sequence[str],
                 eod_id: Optional[int]) -> ChunkResult:
    """Parses and tokenizes every line of ``chunk``, as Megatron-LM's ``Encoder.encode``.

    Args:
        tokenizer: a :mod:`megatron_ext.data.tokenizer` tokenizer (``tokenize_batch``).
        chunk: the lines to process (or plain-text documents: each is the value of every
            key, which is ``text`` then).
        keys: the json keys to tokenize, each one a separate output dataset.
        eod_id: appended to every document that has a token when not ``None``
            (``--append-eod``).

    Returns:
        The ids, the sequence lengths, the sequences per document and the malformed lines
        of the chunk. A value that is an array of strings is the document's sentences: one
        sequence each, empty ones left out, the EOD after the last. A document with no token
        is kept as a document of no sequence (what Megatron-LM writes) and counted.
    """
    result = ChunkResult(chunk.file_index, chunk.first_line, len(chunk.lines),
                         sum(len(line) for line in chunk.lines))
    records: List[Tuple[int, dict]] = []
    for offset, raw in enumerate(chunk.lines):
        if chunk.text:
            text = decode_text(raw)
            parsed = text[0] if isinstance(text, tuple) else {key: text for key in keys}
        else:
            parsed = parse_json_line(raw, keys, allow_lists=True)
        if isinstance(parsed, str):
            result.errors.append((chunk.line_number(offset), parsed))
        else:
            records.append((chunk.line_number(offset), parsed))
    encoded = _tokenize_records(tokenizer, records, keys, result.errors)
    for key in keys:
        docs = [doc[key] for doc in encoded]
        if eod_id is not None:
            for sentences in docs:
                if sentences:
                    sentences[-1].append(eod_id)
        sequences = np.fromiter((len(doc) for doc in docs), dtype=np.int64, count=len(docs))
        seq_ids = [ids for doc in docs for ids in doc]
        lengths = np.fromiter((len(ids) for ids in seq_ids), dtype=np.int64,
                              count=len(seq_ids))
        result.tokens[key] = np.fromiter(itertools.chain.from_iterable(seq_ids),
                                         dtype=np.int32, count=int(lengths.sum()))
        result.lengths[key] = lengths
        result.sequences[key] = sequences
        result.empty_documents[key] = int((sequences == 0).sum())
    return result


def _tokenize_records(tokenizer, records: List[Tuple[int, dict]], keys: Sequence[str],
                      errors: List[Tuple[int, str]]) -> List[Dict[str, List[List[int]]]]:
    """Each record's non-empty sentences' ids per key; a text the tokenizer refuses is an
    error of its line (the record is left out)."""
    def sentences(value) -> List[str]:
        return [value] if isinstance(value, str) else value

    texts = [text for _, record in records for key in keys for text in sentences(record[key])]
    try:
        # One batch call: the per-call overhead of the C++ side is paid once per chunk.
        ids = tokenizer.tokenize_batch(texts) if texts else []
    except Exception:  # noqa: BLE001 - find the line, report the tokenizer's own message
        ids = None
    out: List[Dict[str, List[List[int]]]] = []
    position = 0
    bad = []
    for line_number, record in records:
        doc: Dict[str, List[List[int]]] = {}
        try:
            for key in keys:
                parts = sentences(record[key])
                if ids is None:
                    encoded = tokenizer.tokenize_batch(parts) if parts else []
                else:
                    encoded = ids[position:position + len(parts)]
                    position += len(parts)
                doc[key] = [piece if isinstance(piece, list) else list(piece)
                            for piece in encoded if len(piece) > 0]
        except Exception as err:  # noqa: BLE001
            message = " ".join(str(err).split())[:160] or "no message"
            bad.append((line_number, f"the tokenizer cannot encode this text "
                                     f"({type(err).__name__}: {message})"))
            continue
        out.append(doc)
    if bad:
        errors.extend(bad)
        errors.sort()
    return out


def iter_chunks(paths: Sequence[str], chunk_lines: int,
                chunk_bytes: int = CHUNK_MAX_BYTES, partitions: int = 1,
                partition: int = 0, formats: Optional[Sequence[str]] = None,
                text_documents: str = "lines") -> Iterator[Chunk]:
    """Reads ``paths`` in order and cuts them into chunks of whole lines.

    Lines are kept as bytes: workers decode them, so the main process does no per-line
    work besides splitting at b"\\n". A chunk never spans two files, so its line numbers
    are that file's. With ``partitions`` > 1 only the lines of Megatron-LM's partition
    ``partition`` are read: line i of all the inputs together (from 0) when i mod
    ``partitions`` is ``partition``. A file whose entry of ``formats`` is ``text`` is read
    as plain-text documents cut by ``text_documents`` (see
    :func:`_documents.iter_text_documents`), each taking the place of a line, for the
    partitions too.
    """
    index = 0  # the line's (or document's) position in all the inputs together
    for file_index, path in enumerate(paths):
        text = formats is not None and formats[file_index] == "text"
        lines: List[bytes] = []
        numbers: List[int] = []
        size = 0
        with open_input(path) as stream:
            units = (iter_text_documents(stream, text_documents) if text
                     else enumerate(stream, start=1))
            for line_number, raw in units:
                mine = index % partitions == partition
                index += 1
                if not mine:
                    continue
                lines.append(raw)
                numbers.append(line_number)
                size += len(raw)
                if len(lines) >= chunk_lines or size >= chunk_bytes:
                    yield _chunk(file_index, lines, numbers, partitions, text)
                    lines, numbers, size = [], [], 0
        if lines:
            yield _chunk(file_index, lines, numbers, partitions, text)


def _chunk(file_index: int, lines: List[bytes], numbers: List[int], stride: int,
           text: bool) -> Chunk:
    if text:  # documents start at irregular lines: their numbers are kept
        return Chunk(file_index, numbers[0], lines, text=True, numbers=tuple(numbers))
    return Chunk(file_index, numbers[0], lines, stride)


# Worker-process state, set once per worker by init_worker: loading the model per chunk
# would cost more than tokenizing a small chunk.
_worker_state: dict = {}


def _exit_when_orphaned(parent_pid: int) -> None:
    # A worker waits for tasks on a pipe whose write end it holds too, so it would never
    # see the main process die (SIGKILL, OOM kill) and would wait forever.
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_CHECK_INTERVAL_S)
    os._exit(1)


def init_worker(tokenizer_args: dict, keys: Sequence[str], eod_id: Optional[int]) -> None:
    """A worker process's initializer: loads its tokenizer once, for every chunk it encodes.

    Args:
        tokenizer_args: the tokenizer flags (see :func:`load_tokenizer`).
        keys: the json keys to tokenize.
        eod_id: the end-of-document id to append, or None (see :func:`encode_chunk`).
    """
    # The main process handles Ctrl-C and SIGTERM and then shuts the workers down; workers
    # that also reacted would each print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    try:
        _worker_state["tokenizer"] = load_tokenizer(tokenizer_args)
    except ToolError as err:
        # Raised from the first task instead: an initializer that raises only kills the
        # worker, and the main process would learn nothing about why.
        _worker_state["error"] = err
    _worker_state["keys"] = tuple(keys)
    _worker_state["eod_id"] = eod_id


def encode_chunk_in_worker(chunk: Chunk) -> ChunkResult:
    """:func:`encode_chunk` with the worker's tokenizer, keys and EOD (the pool's task).

    Raises:
        ToolError: the worker could not load its tokenizer.
    """
    if "error" in _worker_state:
        raise _worker_state["error"]
    return encode_chunk(_worker_state["tokenizer"], chunk, _worker_state["keys"],
                        _worker_state["eod_id"])


def load_tokenizer(tokenizer_args: dict):
    """The tokenizer of the tokenizer flags (a dict of preprocess_data.py's
    ``TOKENIZER_FLAGS``).

    Raises:
        ToolError: the flags or the tokenizer's files are wrong.
    """
    try:
        return build_preprocessing_tokenizer(argparse.Namespace(**tokenizer_args))
    except UsageError as err:
        raise ToolError(str(err)) from None

