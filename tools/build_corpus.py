"""Builds a real text corpus, as jsonl, from text that ships with every Python installation.

Nobody on this project wrote the text, and any machine has it offline, so tests and
benchmarks run on real-world data without a download. Two kinds:

* ``stdlib-python`` (the default): the ``.py`` files of the standard library of the Python
  running this tool (``sysconfig.get_paths()["stdlib"]``), one document per file or per
  chunk of a file; ``source`` is the path relative to the library root.
* ``pydoc-topics``: the English prose of the Python documentation's topics that ``help()``
  shows (``pydoc_data.topics.topics``, a dict topic name -> text, e.g. ``"assert"``,
  ``"for"``, ``"typesseq"``), one document per topic or per chunk of a topic; ``source``
  is the topic name. Another domain than the code of ``stdlib-python`` (prose, not
  source), e.g. for fine-tuning a model pretrained on the code.
* ``--files GLOB [GLOB ...]`` (instead of ``--kind``): plain text files of your own, one
  document per file (or per chunk of a file with ``--max-chars``); ``source`` is the path
  as matched. Patterns are expanded by the tool (quote them; ``**`` matches directories
  recursively), the matches sorted; files that are not UTF-8 or only whitespace are
  skipped and counted.

Output, one JSON object per line::

    {"text": "<file text or chunk>", "source": "json/decoder.py", "chunk": 0}

``source`` names the file or topic, ``chunk`` the 0-based index of the chunk within it
(always 0 without ``--max-chars``). The same Python installation and flags give a
byte-identical file: file paths and topic names are sorted before anything else happens.

Example::

    python tools/build_corpus.py --output data/stdlib.jsonl --max-chars 8000
    python tools/build_corpus.py --kind pydoc-topics --output data/topics.jsonl --max-chars 4000
    python tools/build_corpus.py --files 'books/**/*.txt' --output data/books.jsonl
"""

from __future__ import annotations

import glob
import json
import os
import random
import sys
import sysconfig
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from _common import (
    ToolArgumentParser,
    ToolError,
    ensure_parent_dir,
    human_mb,
    log,
    log_start,
    non_negative_int,
    positive_int,
    remove_quietly,
    run_tool,
    temporary_path,
)

# Directories under the stdlib root that hold third-party or generated files: they vary
# from one installation (or virtualenv) to the next, so the corpus would too.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_PROGRESS_EVERY_FILES = 250


@dataclass(frozen=True)
class SourceTexts:
    """The texts of one corpus kind: their sorted names and how to read one of them.

    Attributes:
        origin: where the texts come from (a directory, a module file), for the log lines.
        unit: what one name stands for, in the plural ("files", "topics"), for the log lines.
        names: the ``source`` of each text, sorted.
        read: gives the raw bytes of the text of a name; the caller decodes them as UTF-8
            (and skips a text that is not valid UTF-8).
    """

    origin: str
    unit: str
    names: Tuple[str, ...]
    read: Callable[[str], bytes]


def stdlib_python_files() -> SourceTexts:
    """The ``.py`` files of the running Python's standard library, in sorted order."""
    root = sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise ToolError(f"the standard library directory {root} does not exist; "
                        "run this tool with a full Python installation")
    found: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into excluded directories.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.relpath(os.path.join(dirpath, name), root)
                found.append(path.replace(os.sep, "/"))

    def read(rel_path: str) -> bytes:
        with open(os.path.join(root, rel_path), "rb") as stream:
            return stream.read()

    # Sorted by the relative path, not by os.walk's order, which depends on the file system.
    return SourceTexts(origin=root, unit="files", names=tuple(sorted(found)), read=read)


def pydoc_topics() -> SourceTexts:
    """The documentation topics of the running Python (``pydoc_data``), sorted by name."""
    try:
        from pydoc_data import topics as topics_module
    except ImportError as err:
        raise ToolError(f"this Python has no pydoc_data module ({err}); run this tool with "
                        "a full Python installation") from err
    topics: Dict[str, str] = topics_module.topics

    def read(name: str) -> bytes:
        # Encoded so that these texts go through the same decoding and checks as files do.
        return topics[name].encode("utf-8")

    return SourceTexts(origin=topics_module.__file__, unit="topics",
                       names=tuple(sorted(topics)), read=read)


def text_files(patterns: Sequence[str]) -> SourceTexts:
    """The regular files matching ``patterns`` (glob, ``**`` recursive), sorted, each once.

    Raises:
        ToolError: a pattern matches no regular file.
    """
    found = set()
    for pattern in patterns:
        matches = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        if not matches:
            raise ToolError(f"--files {pattern}: no file matches; quote the pattern so that "
                            "the shell does not expand it, and check the path")
        found.update(matches)

    def read(path: str) -> bytes:
        with open(path, "rb") as stream:
            return stream.read()

    return SourceTexts(origin=" ".join(patterns), unit="files", names=tuple(sorted(found)),
                       read=read)


# Each kind maps to a function that lists its texts; add a kind by adding an entry.
KINDS: Dict[str, Callable[[], SourceTexts]] = {
    "pydoc-topics": pydoc_topics,
    "stdlib-python": stdlib_python_files,
}


def split_text(text: str, max_chars: Optional[int]) -> List[str]:
    """Splits ``text`` into chunks of at most ``max_chars`` characters.

    Chunks end at line ends where possible, so code is cut between statements rather than
    inside identifiers; a single line longer than ``max_chars`` is cut inside the line.
    Concatenating the chunks gives back ``text`` exactly.

    Args:
        text: the text to split.
        max_chars: the chunk size limit; ``None`` keeps ``text`` whole.

    Returns:
        The chunks, none of them empty (an empty ``text`` gives no chunk).
    """
    if not text:
        return []
    if max_chars is None or len(text) <= max_chars:
        return [text]
    chunks: List[str] = []
    current: List[str] = []
    current_len = 0
    for line in text.splitlines(keepends=True):
        if current_len + len(line) > max_chars and current:
            chunks.append("".join(current))
            current, current_len = [], 0
        while len(line) > max_chars:
            chunks.append(line[:max_chars])
            line = line[max_chars:]
        if line:
            current.append(line)
            current_len += len(line)
    if current:
        chunks.append("".join(current))
    return chunks


def order_files(paths: Sequence[str], seed: Optional[int]) -> List[str]:
    """The files (or topics) in the order the corpus visits them.

    Args:
        paths: relative paths (or topic names), already sorted.
        seed: ``None`` keeps the sorted order; an integer shuffles it with that seed, so
            that ``--max-docs`` samples the whole library instead of its first packages.

    Returns:
        A new list.
    """
    ordered = list(paths)
    if seed is not None:
        random.Random(seed).shuffle(ordered)
    return ordered


@dataclass
class CorpusStats:
    """Counters for the summary line."""

    files_read: int = 0
    files_skipped_not_utf8: int = 0
    files_skipped_blank: int = 0
    documents: int = 0
    bytes_written: int = 0


def iter_documents(texts: SourceTexts, names: Sequence[str], max_chars: Optional[int],
                   stats: CorpusStats) -> Iterator[dict]:
    """Reads ``names`` of ``texts`` and yields one record per document.

    Texts that are not valid UTF-8 (the test suite ships some files on purpose) and texts
    with only whitespace (many ``__init__.py``) are skipped and counted in ``stats``.
    """
    for index, name in enumerate(names):
        if index and index % _PROGRESS_EVERY_FILES == 0:
            log(f"build_corpus: {index}/{len(names)} {texts.unit}, {stats.documents} "
                f"documents, {human_mb(stats.bytes_written)}")
        raw = texts.read(name)
        stats.files_read += 1
        try:
            # Decoding the bytes ourselves keeps "\r\n" as the file has it (text mode
            # would turn it into "\n").
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats.files_skipped_not_utf8 += 1
            continue
        if not text.strip():
            stats.files_skipped_blank += 1
            continue
        for chunk_index, chunk in enumerate(split_text(text, max_chars)):
            yield {"text": chunk, "source": name, "chunk": chunk_index}


# json.dumps(ensure_ascii=False) leaves these raw, and str.splitlines() (unlike a file's
# own line iteration) breaks lines at them; escaping keeps one record per line for every
# reader.
_LINE_BREAKS_TO_ESCAPE = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def to_jsonl_line(record: dict) -> str:
    """One record as a jsonl line (UTF-8 text, no raw line break inside, ending in "\\n")."""
    line = json.dumps(record, ensure_ascii=False)
    for char, escaped in _LINE_BREAKS_TO_ESCAPE.items():
        if char in line:
            line = line.replace(char, escaped)
    return line + "\n"


def build_parser() -> ToolArgumentParser:
    """The command-line parser; --help describes every flag."""
    parser = ToolArgumentParser(
        prog="tools/build_corpus.py",
        description="Build a jsonl corpus from text shipped with the Python installation "
                    "(deterministic: same installation and flags, same bytes).",
    )
    parser.add_argument("--output", required=True, metavar="PATH.jsonl",
                        help="where to write the corpus; its directory is created if missing. "
                             "Written to PATH.jsonl.tmp-PID first, then renamed.")
    parser.add_argument("--files", nargs="+", metavar="GLOB", default=None,
                        help="build the corpus from these text files instead of a --kind: "
                             "one document per file (per chunk with --max-chars), source = "
                             "the path; quote the patterns ('docs/**/*.txt': ** recurses)")
    parser.add_argument("--kind", choices=sorted(KINDS), default=None,
                        help="which text to collect. stdlib-python: the .py files of the "
                             "standard library of this Python; pydoc-topics: the English "
                             "prose of the documentation topics of this Python's help() "
                             "(pydoc_data.topics), one document per topic, source = the "
                             "topic name (default: stdlib-python)")
    parser.add_argument("--max-docs", type=positive_int, default=None, metavar="N",
                        help="stop after N documents (default: all)")
    parser.add_argument("--max-chars", type=positive_int, default=None, metavar="N",
                        help="split files (topics) longer than N characters into chunks of "
                             "at most N characters, at line ends where possible; each chunk "
                             "is a document (default: one document per file or topic)")
    parser.add_argument("--seed", type=non_negative_int, default=None,
                        help="shuffle the file (topic) order with this seed before taking "
                             "documents, so --max-docs samples the whole library (default: "
                             "sorted path or topic-name order)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Builds the corpus named by the command line.

    Raises:
        ToolError: bad input; ``run_tool`` prints it and exits with status 2.
    """
    args = build_parser().parse_args(argv)
    if args.output.endswith(os.sep) or os.path.isdir(args.output):
        raise ToolError(f"--output {args.output} is a directory; give a file path such as "
                        f"{os.path.join(args.output, 'corpus.jsonl')}")
    if args.files and args.kind:
        raise ToolError("--files and --kind are exclusive: give one source of text")
    kind = "files" if args.files else args.kind or "stdlib-python"
    texts = text_files(args.files) if args.files else KINDS[kind]()
    names = order_files(texts.names, args.seed)
    ensure_parent_dir(args.output)
    log_start(f"build_corpus: kind {kind}, {len(names)} {texts.unit} from {texts.origin}")

    tmp_path = temporary_path(args.output)
    stats = CorpusStats()
    done = False
    try:
        # newline="\n" so the file is the same bytes on every platform.
        with open(tmp_path, "w", encoding="utf-8", newline="\n") as out:
            for record in iter_documents(texts, names, args.max_chars, stats):
                line = to_jsonl_line(record)
                out.write(line)
                stats.documents += 1
                stats.bytes_written += len(line.encode("utf-8"))
                if args.max_docs is not None and stats.documents >= args.max_docs:
                    break
        if stats.documents == 0:
            raise ToolError(f"no documents found for --kind {kind} in {texts.origin}")
        os.replace(tmp_path, args.output)
        done = True
    finally:
        if not done:
            remove_quietly([tmp_path])
    log(f"build_corpus: wrote {stats.documents} documents ({human_mb(stats.bytes_written)}) "
        f"from {stats.files_read} {texts.unit} to {args.output}; skipped "
        f"{stats.files_skipped_not_utf8} non-UTF-8 and {stats.files_skipped_blank} blank "
        f"{texts.unit}")


if __name__ == "__main__":
    sys.exit(run_tool(main))
