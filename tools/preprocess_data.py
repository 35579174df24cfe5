"""Tokenizes jsonl or plain-text documents into megatron-core's indexed dataset format (.bin/.idx).

Flags and output names follow Megatron-LM's ``tools/preprocess_data.py``: for each json
key K the output is ``{output_prefix}_{K}_document.bin`` and ``.idx``, which
``megatron.core.datasets.indexed_dataset.IndexedDataset("{output_prefix}_{K}_document")``
reads back, one document per input line, with the tokenizer's ids (and the end-of-document
id when ``--append-eod`` is given). The documents are Megatron-LM's, byte for byte: a text
is one sequence; an array of strings is the document's sentences, one sequence each (empty
ones left out), the EOD after the last; a document with no token (an empty text or array)
is a document of no sequence, without EOD. ``--partitions N`` orders the documents as
Megatron-LM's N partitions merged (line i of the inputs in partition i mod N).

Plain UTF-8 text (names other than .jsonl/.json/.ndjson, or ``--input-format text``), the
files ``tools/train_tokenizer.py`` also takes, is cut into documents by
``--text-documents``: one per non-empty line (the default), one per block of lines between
blank lines, or one per file; the documents go to ``{output_prefix}_text_document``, as the
jsonl key ``text`` would.

How the work is split: the main process reads the input in chunks of lines and hands them
to a pool of worker processes; each worker parses JSON and tokenizes a whole chunk and
returns numpy arrays, and the main process writes the chunks in input order, so the output
is byte-identical for any ``--workers``. Tokenizing is about 90% of the CPU time (the main
process's reading and writing the rest), so the run scales with the workers.

Failure handling: output goes to temporary files next to the final ones
(``{output_prefix}_{K}_document.tmp-PID.bin/.idx``) that are renamed only once every line
is written. On a malformed line (``--on-error fail``, the default), an exception, Ctrl-C
or SIGTERM, or a full disk (one ``error:`` line), the temporary files are removed, so
nothing is left under the output prefix.
A worker that dies (e.g. killed for lack of memory) stops the run the same way. Only
SIGKILL of the main process leaves its ``.tmp-PID`` files behind (nothing can catch it);
they are safe to delete, and its workers exit within a second.

Example::

    python tools/preprocess_data.py --input data/stdlib.jsonl --output-prefix data/stdlib \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/spm32k.model \\
        --append-eod --workers 8
    # -> data/stdlib_text_document.bin, data/stdlib_text_document.idx
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Deque, List, Optional, Sequence

import numpy as np
from _common import (
    ToolArgumentParser,
    ToolError,
    check_input_file,
    ensure_parent_dir,
    log,
    log_start,
    positive_int,
    run_tool,
)
from _documents import TEXT_DOCUMENTS, malformed_hint, resolve_inputs
from _indexed_writer import WRITE_ERRNOS, DatasetWriter, output_prefixes
from _tokenize_chunks import (
    CHUNK_MAX_BYTES,
    ChunkResult,
    encode_chunk_in_worker,
    init_worker,
    iter_chunks,
    load_tokenizer,
)

from megatron_ext.data.tokenizer import (  # noqa: E402
    TOKENIZER_TYPES,
    build_tokenizer,
    preprocesses_with_core_tokenizer,
)

# The tokenizer flags, with pretrain_gpt.py's (and Megatron-LM's) names and meanings.
TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file",
                   "vocab_size", "vocab_extra_ids", "tiktoken_pattern",
                   "tiktoken_num_special_tokens", "tokenizer_special_tokens",
                   "tiktoken_special_tokens", "legacy_tokenizer",
                   "tokenizer_hf_include_special_tokens")
# Printed warnings for skipped lines (--on-error skip); the rest are only counted.
MAX_PRINTED_WARNINGS = 20
# Chunks submitted ahead of the one being written, per worker: enough that no worker waits
# for the main process, few enough that memory stays bounded whatever the input size.
CHUNKS_AHEAD_PER_WORKER = 4
# Until the first chunk is written, megatron-core is still being imported (seconds); this
# many chunks are submitted ahead meanwhile, so that the workers are busy during it.
CHUNKS_AHEAD_AT_START = 64


def training_difference(tokenizer, tokenizer_args: dict) -> Optional[str]:
    """A note when pretrain_gpt.py's tokenizer of these flags has other ids than ``tokenizer``
    (megatron-core's, as Megatron-LM's preprocess_data.py uses), or None."""
    args = argparse.Namespace(**tokenizer_args)
    if not preprocesses_with_core_tokenizer(args):
        return None
    kind = args.tokenizer_type
    training = build_tokenizer(args)
    probe = "x"
    what = []
    if training.eod != tokenizer.eod:
        what.append(f"end of document {training.eod} there, {tokenizer.eod} here")
    if training.tokenize(probe) != tokenizer.tokenize(probe):
        what.append("special tokens around each text there, none here")
    if not what:
        return None
    return (f"note: as Megatron-LM's preprocess_data.py, {kind}'s ids are megatron-core's; "
            f"pretrain_gpt.py's {kind} (Megatron-LM's training one) differs: "
            f"{'; '.join(what)}. --legacy-tokenizer writes the training ids")


class Progress:
    """Counts documents and bytes; prints a line every ``interval`` documents."""

    def __init__(self, interval: int):
        self._interval = interval
        self._next = interval
        self._start = time.perf_counter()
        self.documents = 0
        self.bytes = 0

    def update(self, documents: int, num_bytes: int) -> None:
        self.documents += documents
        self.bytes += num_bytes
        if self.documents >= self._next:
            self._next = (self.documents // self._interval + 1) * self._interval
            log(f"processed {self.documents} documents ({self.rates()})")

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def rates(self) -> str:
        seconds = max(self.elapsed(), 1e-9)
        return f"{self.documents / seconds:.1f} docs/s, {self.bytes / seconds / 1e6:.2f} MB/s"


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """The input files: each pattern is a path or a glob (expanded in sorted order)."""
    paths: List[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
            if not matches:
                raise ToolError(f"--input {pattern}: no file matches this pattern")
            paths.extend(matches)
        else:
            check_input_file(pattern, "--input")
            paths.append(pattern)
    return paths


def build_parser() -> ToolArgumentParser:
    """The command-line parser; --help describes every flag."""
    parser = ToolArgumentParser(
        prog="tools/preprocess_data.py",
        description="Tokenize jsonl or plain-text documents into megatron-core .bin/.idx "
                    "files (Megatron-LM's preprocess_data.py flags and file names).",
    )
    group = parser.add_argument_group("input")
    group.add_argument("--input", nargs="+", required=True, metavar="PATH",
                       help="jsonl files (one JSON object per line) or plain UTF-8 text files, "
                            "optionally .gz; globs such as 'data/*.jsonl' are expanded in "
                            "sorted order. All inputs go into one dataset, in the order given")
    group.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto",
                       help="how to read --input, as tools/train_tokenizer.py does; auto: "
                            "jsonl for names ending in .jsonl, .json or .ndjson (before a "
                            ".gz), plain text otherwise (default: %(default)s)")
    group.add_argument("--text-documents", choices=TEXT_DOCUMENTS, default=None,
                       help="how plain text is cut into documents (each ends with the EOD "
                            "under --append-eod): lines: one per non-empty line; blocks: one "
                            "per run of lines between blank lines; file: the whole file. "
                            "Written to {output-prefix}_text_document (default: lines; "
                            "only with plain-text input)")
    group.add_argument("--json-keys", nargs="+", default=None, metavar="KEY",
                       help="keys to tokenize; each key becomes its own dataset "
                            "{output-prefix}_{KEY}_document (default: text; jsonl input only: "
                            "plain text is the one dataset of key text)")
    group.add_argument("--on-error", choices=["fail", "skip"], default="fail",
                       help="a malformed line (invalid JSON, missing key, value neither a "
                            "string nor an array of strings, plain text that is not UTF-8, "
                            "text the tokenizer cannot encode): fail stops with its file:line "
                            "and writes nothing; skip warns, leaves the line (or plain-text "
                            "document) out and counts it (default: %(default)s)")
    group.add_argument("--split-sentences", action="store_true",
                       help="Megatron-LM's NLTK sentence splitting: refused here (Megatron-LM "
                            "downloads NLTK's punkt model when it starts, and nothing is "
                            "downloaded here). Give each document as an array of sentences "
                            "instead: each becomes its own sequence, as Megatron-LM does")
    group.add_argument("--keep-newlines", action="store_true",
                       help="Megatron-LM's option of --split-sentences (keeps newlines "
                            "between sentences); without --split-sentences it does nothing "
                            "there either, so it is accepted for Megatron-LM command lines")
    group.add_argument("--lang", default="english",
                       help="Megatron-LM's NLTK language for --split-sentences; as "
                            "--keep-newlines, it does nothing without it (default: "
                            "%(default)s)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                       default="GPTSentencePieceTokenizer",
                       help="the tokenizer, as pretrain_gpt.py's --tokenizer-type (Megatron-LM's "
                            "classes of these names: see pretrain_gpt.py --help); the ids and "
                            "the end-of-document id are those Megatron-LM's preprocess_data.py "
                            "writes (megatron-core's tokenizers), which are the training ones "
                            "except for SentencePieceTokenizer, Llama2Tokenizer and "
                            "HuggingFaceTokenizer (see --legacy-tokenizer). "
                            "Default: %(default)s")
    group.add_argument("--tokenizer-model", metavar="PATH",
                       help="SentencePiece .model (e.g. from tools/train_tokenizer.py) for "
                            "SentencePieceTokenizer, GPTSentencePieceTokenizer and "
                            "Llama2Tokenizer; a local Hugging Face tokenizer directory or "
                            "tokenizer.json for HuggingFaceTokenizer; Megatron-LM's tiktoken "
                            "JSON vocabulary for TikTokenizer")
    group.add_argument("--vocab-file", metavar="vocab.json",
                       help="GPT2BPETokenizer's vocabulary")
    group.add_argument("--merge-file", metavar="merges.txt",
                       help="GPT2BPETokenizer's merges")
    group.add_argument("--vocab-size", type=positive_int, metavar="N",
                       help="NullTokenizer's vocabulary; TikTokenizer's whole vocabulary, "
                            "special tokens included (default 131072)")
    group.add_argument("--vocab-extra-ids", type=int, default=0, metavar="N",
                       help="SentencePieceTokenizer with --legacy-tokenizer: add N "
                            "<extra_id_i> special tokens, as pretrain_gpt.py's flag (Megatron-"
                            "LM's preprocess_data.py sets it to 0 whatever is given) "
                            "(default: %(default)s)")
    group.add_argument("--tiktoken-pattern", choices=("v1", "v2"),
                       help="TikTokenizer's pre-tokenization pattern (Megatron-LM's v1 or v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=positive_int, default=1000,
                       metavar="N", help="TikTokenizer: ids 0..N-1 are special tokens "
                                         "(default: %(default)s)")
    group.add_argument("--tokenizer-special-tokens", nargs="+", metavar="TOKEN",
                       help="TikTokenizer's special tokens in id order; must include "
                            "<unk> <s> </s> (the default is those three)")
    group.add_argument("--tiktoken-special-tokens", nargs="+", metavar="TOKEN",
                       help="Megatron-LM's older spelling of --tokenizer-special-tokens")
    group.add_argument("--legacy-tokenizer", action="store_true",
                       help="tokenize with pretrain_gpt.py's tokenizers (Megatron-LM's "
                            "megatron/training ones) instead of megatron-core's, which "
                            "Megatron-LM's preprocess_data.py uses by default, as here. They "
                            "differ for SentencePieceTokenizer (training's adds <CLS> <SEP> "
                            "<EOD> <MASK> past the pieces and ends documents with <EOD>, "
                            "megatron-core's ends them with </s>), Llama2Tokenizer (training's "
                            "puts <s> before every text) and HuggingFaceTokenizer (training's "
                            "keeps the special tokens the post-processor adds); the other types "
                            "give the same ids either way")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: the ids include the special tokens the "
                            "tokenizer's post-processor adds (e.g. <s>), tokenizer(text)."
                            "input_ids, as Megatron-LM's flag (default: the text's tokens "
                            "alone)")
    group.add_argument("--append-eod", action="store_true",
                       help="append the tokenizer's end-of-document id to every document "
                            "that has a token (</s> for the SentencePiece models, <EOD> for "
                            "SentencePieceTokenizer with --legacy-tokenizer, <|endoftext|> for "
                            "GPT2BPETokenizer)")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, metavar="PREFIX",
                       help="writes PREFIX_{KEY}_document.bin/.idx; the directory is created "
                            "if missing, existing files of that name are replaced")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=positive_int, default=1, metavar="N",
                       help="tokenizing processes, besides the main process that reads and "
                            "writes; the output does not depend on N (default: %(default)s; "
                            "Megatron-LM requires the flag)")
    group.add_argument("--partitions", type=positive_int, default=1, metavar="N",
                       help="Megatron-LM's input partitions: the output holds the documents "
                            "in the order Megatron-LM's merged N partitions do (line i of the "
                            "inputs, counted across files from 0, in partition i mod N; the "
                            "partitions one after another), so both tools write the same "
                            "files (with several input files, Megatron-LM takes them in "
                            "glob's file-system order, this tool in sorted order). Unlike "
                            "Megatron-LM, no partition files are written, "
                            "--workers alone sets the parallelism, and the input is read N "
                            "times (default: %(default)s)")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="Megatron-LM's contiguous partitions (the first ceil(lines / N) "
                            "lines in partition 0, ...): the documents stay in input order, "
                            "as with --partitions 1")
    group.add_argument("--chunk-lines", type=positive_int, default=256, metavar="N",
                       help="lines per task sent to a worker; a task also ends at "
                            f"{CHUNK_MAX_BYTES // (1 << 20)} MiB (default: %(default)s)")
    group.add_argument("--log-interval", type=positive_int, default=1000, metavar="N",
                       help="print progress every N documents, checked after each chunk "
                            "(default: %(default)s)")
    return parser


def _report_malformed(result: ChunkResult, paths: Sequence[str], on_error: str,
                      skipped_so_far: int, formats: Optional[Sequence[str]] = None) -> None:
    """Raises on the chunk's first malformed line, or warns about the lines it skips."""
    path = paths[result.file_index]
    if on_error == "fail":
        line_number, message = result.errors[0]
        raise ToolError(f"{path}:{line_number}: {message}; "
                        f"{malformed_hint(line_number, message, formats, result.file_index)}")
    for index, (line_number, message) in enumerate(result.errors):
        shown = skipped_so_far + index
        if shown < MAX_PRINTED_WARNINGS:
            log(f"warning: {path}:{line_number}: {message}; skipping the line")
        elif shown == MAX_PRINTED_WARNINGS:
            log("warning: more malformed lines; only counting them from now on")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Tokenizes the inputs into the datasets named by the command line.

    Raises:
        ToolError: bad input; ``run_tool`` prints it and exits with status 2.
    """
    args = build_parser().parse_args(argv)
    if args.split_sentences:
        raise ToolError("--split-sentences is not supported: Megatron-LM splits with NLTK's "
                        "punkt model, which it downloads at start-up, and nothing is "
                        "downloaded here; give each document's sentences as a JSON array "
                        "(each becomes its own sequence, as Megatron-LM does) and drop the flag")
    if args.json_keys and len(set(args.json_keys)) != len(args.json_keys):
        raise ToolError(f"--json-keys {' '.join(args.json_keys)}: a key is repeated")
    paths = expand_inputs(args.input)
    formats = resolve_inputs(args, paths)
    tokenizer_args = {name: getattr(args, name) for name in TOKENIZER_FLAGS}
    tokenizer = load_tokenizer(tokenizer_args)
    note = training_difference(tokenizer, tokenizer_args)
    if note:
        log_start(note)
    eod_id = None
    if args.append_eod:
        eod_id = tokenizer.eod
        if eod_id is None:
            raise ToolError(f"--append-eod: the {args.tokenizer_type} of --tokenizer-model "
                            f"{args.tokenizer_model} has no end-of-document (eos) token")
    if args.output_prefix.endswith(os.sep) or os.path.isdir(args.output_prefix):
        raise ToolError(f"--output-prefix {args.output_prefix} is a directory; give a path "
                        "prefix such as data/corpus")
    prefixes = output_prefixes(args.output_prefix, args.json_keys)
    ensure_parent_dir(args.output_prefix)
    log_start(f"tokenizing {len(paths)} file(s) with {args.workers} worker(s); vocab "
        f"{tokenizer.vocab_size}, EOD {'id ' + str(eod_id) if eod_id is not None else 'off'}")

    writer = DatasetWriter(prefixes, tokenizer.vocab_size)
    progress = Progress(args.log_interval)
    malformed = 0
    empty = {key: 0 for key in args.json_keys}

    def write(result: ChunkResult) -> None:
        nonlocal malformed
        if result.errors:
            _report_malformed(result, paths, args.on_error, malformed, formats)
            malformed += len(result.errors)
        writer.add(result)
        for key in args.json_keys:
            empty[key] += result.empty_documents[key]
        progress.update(result.num_lines, result.num_bytes)

    # A process pool with an ordered window of futures, rather than multiprocessing.Pool's
    # imap: the same input order (so the output does not depend on --workers), but memory
    # stays bounded (imap buffers every finished result), and a worker that dies (e.g.
    # killed for lack of memory) raises BrokenProcessPool where imap would wait forever.
    # The workers start before megatron-core (and torch) is imported here, so each is a
    # small process with only numpy and the tokenizer's library.
    executor = ProcessPoolExecutor(max_workers=args.workers, initializer=init_worker,
                                   initargs=(tokenizer_args, args.json_keys, eod_id))
    pending: Deque[Future] = collections.deque()
    steady_ahead = CHUNKS_AHEAD_PER_WORKER * args.workers
    committed = False
    try:
        partitions = 1 if args.keep_sequential_samples else args.partitions
        chunks = itertools.chain.from_iterable(
            iter_chunks(paths, args.chunk_lines, partitions=partitions, partition=p,
                        formats=formats, text_documents=args.text_documents)
            for p in range(partitions))
        for chunk in chunks:
            pending.append(executor.submit(encode_chunk_in_worker, chunk))
            while len(pending) >= (steady_ahead if writer.is_open
                                   else max(steady_ahead, CHUNKS_AHEAD_AT_START)):
                write(pending.popleft().result())
        while pending:
            write(pending.popleft().result())
        if sum(writer.sequences.values()) == 0:
            raise ToolError(f"no document to write: the {progress.documents} input lines "
                            "were all malformed or empty; check --input and --json-keys")
        written = writer.commit()
        committed = True
    except BrokenProcessPool:
        raise ToolError("a worker process died (killed, e.g. for lack of memory); nothing "
                        "was written. Retry with fewer --workers") from None
    except OSError as err:
        if err.errno not in WRITE_ERRNOS:
            raise
        raise ToolError(f"--output-prefix {args.output_prefix}: writing the dataset failed: "
                        f"{os.strerror(err.errno)}; nothing was written (the temporary files "
                        "are removed): free space there, or give another --output-prefix"
                        ) from None
    finally:
        if not committed:
            for future in pending:
                future.cancel()
            writer.abort()
        # Waits for the chunks the workers are tokenizing right now (a fraction of a
        # second each) and stops them.
        executor.shutdown(wait=True, cancel_futures=True)

    log(f"done: {progress.documents} documents in {progress.elapsed():.1f} s "
        f"({progress.rates()})")
    for key in args.json_keys:
        log(f"  {prefixes[key]}: {writer.documents[key]} documents, {writer.sequences[key]} "
            f"sequences, {writer.tokens[key]} tokens ({np.dtype(writer.dtype).name}); "
            f"{empty[key]} empty documents (no sequence, as Megatron-LM writes them)")
    if malformed:
        log(f"skipped {malformed} malformed line(s) (--on-error skip)")
    log("wrote " + ", ".join(written))


if __name__ == "__main__":
    sys.exit(run_tool(main))
