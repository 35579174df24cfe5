"""Helpers shared by the corpus tools (``tools/*.py``); nothing here is imported by training.

The tools are run as scripts (``python tools/X.py``), so this module is imported as the
top-level module ``_common``: Python puts the script's own directory first on ``sys.path``.
Importing it is the tools' one bootstrap: it puts the repository root on ``sys.path`` (after
``tools/``) so that the tool can import ``megatron_ext`` from a clone that is not installed.

Conventions every tool follows through :func:`run_tool`:

* bad input raises :class:`ToolError`; it is printed as one ``error: ...`` line on stderr
  and the tool exits with status 2, without a traceback;
* Ctrl-C and SIGTERM unwind through ``finally`` blocks (so temporary files are removed)
  and exit with 130 and 143, as a shell reports a process killed by that signal;
* output files are written under a temporary name in the same directory and renamed at
  the end (:func:`temporary_path`), so a reader never sees a half-written file;
* a tool that fails on bad input prints its error line alone: what it says as it starts
  (:func:`log_start`) is held back until its work is under way (the next :func:`log`
  line, :data:`START_HOLD_S` seconds, or its end), and dropped when it fails before.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence, Union

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(1, REPO_ROOT)

EXIT_USAGE = 2
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM


class ToolError(Exception):
    """Bad input: the message says what is wrong and how to fix it, on one line."""


class Terminated(BaseException):
    """Raised in the main thread when the process receives SIGTERM.

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` clauses do not
    swallow it and ``finally`` blocks still run.
    """


def _raise_terminated(signum, frame):
    raise Terminated()


START_HOLD_S = 5.0
"""How long a tool's start lines are held back when nothing else is printed meanwhile."""


class _HeldStart:
    """The start lines of a tool, held back until its work is under way.

    A bad input is usually found right after the tool says what it is about to do (the
    first line of the input, the first write): the error line is then all it prints.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._text: List[str] = []
        self._timer: Optional[threading.Timer] = None

    def add(self, text: str) -> None:
        with self._lock:
            self._text.append(text)
            if self._timer is None:
                self._timer = threading.Timer(START_HOLD_S, self.release)
                self._timer.daemon = True
                self._timer.start()

    def release(self) -> None:
        """Prints what is held (the work is under way, or done)."""
        with self._lock:
            self._cancel()
            if self._text:
                sys.stderr.write("".join(self._text))
                sys.stderr.flush()
                self._text.clear()

    def drop(self) -> None:
        """Forgets what is held (the tool failed before its work got under way)."""
        with self._lock:
            self._cancel()
            self._text.clear()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


_held = _HeldStart()


class HeldStream:
    """A text stream whose writes are start lines (:func:`log_start`): for the output of
    what a tool starts with, such as the trainer's start-up log."""

    def write(self, text: str) -> int:
        _held.add(text)
        return len(text)

    def flush(self) -> None:
        """Nothing to flush: the text is held."""


def log_start(message: str) -> None:
    """A line on what the tool is about to do, on stderr once its work is under way."""
    _held.add(message + "\n")


def log(message: str) -> None:
    """Prints one progress or summary line to stderr (stdout stays free for data)."""
    _held.release()
    print(message, file=sys.stderr, flush=True)


def run_tool(main: Callable[[Optional[Sequence[str]]], None],
             argv: Optional[Sequence[str]] = None) -> int:
    """Runs a tool's ``main`` and turns its outcome into an exit status.

    Args:
        main: the tool's entry point; it parses ``argv`` itself.
        argv: the arguments, without the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        0 on success, 2 for a :class:`ToolError`, 130 for Ctrl-C, 143 for SIGTERM.
    """
    # SIGTERM (what a scheduler or `kill` sends) must unwind like Ctrl-C does, or the
    # process dies inside the write loop and leaves temporary files behind.
    signal.signal(signal.SIGTERM, _raise_terminated)
    _held.drop()
    try:
        main(argv)
    except ToolError as err:
        _held.drop()
        log(f"error: {err}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _held.drop()
        log("interrupted (Ctrl-C); no output written")
        return EXIT_SIGINT
    except Terminated:
        _held.drop()
        log("terminated (SIGTERM); no output written")
        return EXIT_SIGTERM
    except BrokenPipeError:
        # stderr closed by the reader (e.g. `| head`): nothing useful left to say.
        _held.drop()
        return 1
    except BaseException:
        _held.release()  # a bug: its traceback follows what the tool was doing
        raise
    _held.release()
    return 0


def temporary_path(final_path: str) -> str:
    """A name next to ``final_path`` for writing it before an atomic rename.

    The same directory keeps the final ``os.replace`` a rename on one file system; the
    pid keeps two concurrent runs from writing into each other's file.
    """
    return f"{final_path}.tmp-{os.getpid()}"


def remove_quietly(paths: Sequence[str]) -> None:
    """Removes the files that exist among ``paths``; missing ones are not an error."""
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def ensure_parent_dir(path: str) -> None:
    """Creates the directory that will hold ``path`` (a file or a file prefix)."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        # makedirs says "File exists" (or "Not a directory") when a component is a file.
        blocker = parent
        while not os.path.exists(blocker):
            blocker = os.path.dirname(blocker)
        why = (f"{blocker} is a file, not a directory" if not os.path.isdir(blocker)
               else err.strerror)
        raise ToolError(f"cannot create output directory {parent}: {why}; give another "
                        "path") from None


def check_input_file(path: str, flag: str) -> None:
    """Raises a ToolError unless ``path`` is a readable regular file."""
    if not os.path.exists(path):
        raise ToolError(f"{flag} {path}: file not found")
    if not os.path.isfile(path):
        raise ToolError(f"{flag} {path}: not a regular file")
    if not os.access(path, os.R_OK):
        raise ToolError(f"{flag} {path}: permission denied")


def load_sentencepiece(model_path: str, flag: str = "--tokenizer-model", num_threads: int = 1):
    """Loads a SentencePiece model, with a ToolError that names the flag on failure.

    Args:
        model_path: path to a ``.model`` file written by ``tools/train_tokenizer.py``.
        flag: the command-line flag the path came from, for the error message.
        num_threads: threads for batch ``encode``; 1 because the tools parallelise with
            processes, and more threads per process would oversubscribe the cores.

    Returns:
        A ``sentencepiece.SentencePieceProcessor``.
    """
    import sentencepiece

    check_input_file(model_path, flag)
    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_path,
                                                    num_threads=num_threads)
    except (RuntimeError, OSError) as err:
        raise ToolError(f"{flag} {model_path}: not a SentencePiece model ({err}); "
                        "train one with tools/train_tokenizer.py") from None


def parse_json_line(raw: Union[bytes, str], keys: Sequence[str], allow_lists: bool = False
                    ) -> Union[Dict[str, Union[str, List[str]]], str]:
    """Parses one jsonl line and picks the string values of ``keys``.

    Pure: returns either the values or a message saying what is wrong with the line, so
    that callers add the file name and line number and decide whether to stop or skip.

    Args:
        raw: the line, with or without its trailing newline.
        keys: the keys that must be present and hold strings.
        allow_lists: an array of strings is a value too (Megatron-LM's preprocess_data.py
            takes it as the document's sentences), returned as a list.

    Returns:
        ``{key: text}`` on success, else a one-line error message (a ``str``).
    """
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as err:
        return f"not valid UTF-8 ({err.reason} at byte {err.start})"
    except ValueError as err:
        if not raw.strip():
            return "empty line (jsonl needs one JSON object per line)"
        return f"invalid JSON ({err})"
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    values: Dict[str, str] = {}
    for key in keys:
        if key not in record:
            present = ", ".join(f'"{k}"' for k in list(record)[:5]) or "none"
            return f'missing key "{key}" (keys present: {present})'
        value = record[key]
        if allow_lists and isinstance(value, list):
            for index, element in enumerate(value):
                if not isinstance(element, str):
                    return (f'element {index} of key "{key}" is {_json_type_name(element)}, '
                            "expected a string (an array holds the document's sentences)")
        elif not isinstance(value, str):
            expected = "a string or an array of strings" if allow_lists else "a string"
            return f'value of key "{key}" is {_json_type_name(value)}, expected {expected}'
        values[key] = value
    return values


def _json_type_name(value) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


class ToolArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one ``error: ...`` line and exit status 2.

    argparse's default prints the whole usage block before the message; one line that
    names the flag and points at ``--help`` is easier to read in a job log.
    """

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _int(text)
    if value < 1:
        raise _arg_error(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _int(text)
    if value < 0:
        raise _arg_error(f"must be >= 0, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _arg_error(f"expected an integer, got {text!r}") from None


def _arg_error(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(message)


def human_mb(num_bytes: int) -> str:
    """``num_bytes`` in megabytes (10**6), for progress lines."""
    return f"{num_bytes / 1e6:.2f} MB"


# pretrain_gpt.py's tokenizer flags, for the tools that read a checkpoint (their default:
# the run's, as its checkpoint records them). (flag, dest, argparse keywords)
_TOKENIZER_FLAGS = (
    ("--tokenizer-type", "tokenizer_type", {}, "the tokenizer class"),
    ("--tokenizer-model", "tokenizer_model", {"metavar": "FILE"},
     "its file: SentencePiece .model, Hugging Face directory or tokenizer.json, tiktoken JSON"),
    ("--vocab-file", "vocab_file", {"metavar": "FILE"}, "GPT2BPETokenizer's vocab.json"),
    ("--merge-file", "merge_file", {"metavar": "FILE"}, "GPT2BPETokenizer's merges.txt"),
    ("--vocab-size", "vocab_size", {"type": positive_int, "metavar": "N"},
     "NullTokenizer's vocabulary size"),
    ("--tiktoken-pattern", "tiktoken_pattern", {"choices": ("v1", "v2")},
     "TikTokenizer's split pattern"),
)


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """Adds pretrain_gpt.py's tokenizer flags; each defaults to the run's."""
    from megatron_ext.data.tokenizer import TOKENIZER_TYPES

    group = parser.add_argument_group("tokenizer (as pretrain_gpt.py; default: the run's, "
                                      "from the checkpoint)")
    for flag, dest, kwargs, what in _TOKENIZER_FLAGS:
        if dest == "tokenizer_type":
            kwargs = {**kwargs, "choices": TOKENIZER_TYPES}
        group.add_argument(flag, dest=dest, default=None, help=f"{what} (default: the run's)",
                           **kwargs)


def tokenizer_args(args: argparse.Namespace) -> Dict[str, object]:
    """The tokenizer fields the flags of :func:`add_tokenizer_args` gave (None: not given)."""
    return {dest: getattr(args, dest) for _, dest, _, _ in _TOKENIZER_FLAGS}
