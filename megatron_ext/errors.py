"""The error type for bad user input.

A :class:`UsageError` carries one line that says what is wrong and how to fix it.
``pretrain_gpt.py`` prints it as ``error: <message>`` and exits with status 2, without a
traceback; every other exception is a bug and keeps its traceback, followed by its own
``error:`` line (out of memory and Ctrl-C are one line too: see runtime/fatal.py).
"""


class UsageError(Exception):
    """Bad input from the user: a flag, a path, a file, or a combination of them."""

    exit_code = 2
