"""Dataclass field helpers: attribute docstrings and CLI metadata.

Each config field carries its documentation as the string literal written under it
(as in torchtitan and DeepSpeed's configs). :func:`field_docs` reads those strings from
the class source, so ``--help`` and the docs come from one place and cannot drift.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import os
import textwrap
from typing import Any, Callable, Optional, Sequence

from megatron_ext.errors import UsageError


def option(
    default: Any = dataclasses.MISSING,
    *,
    flag: Optional[str] = None,
    choices: Optional[Sequence[Any]] = None,
    nargs: Optional[str] = None,
    metavar: Optional[str] = None,
    parse: Optional[Callable[[str], Any]] = None,
    negate: Optional[str] = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """Declares a config field with its command-line spelling.

    Args:
        default: the default value.
        flag: the flag name when it is not ``--`` + the field name with dashes.
        choices: allowed values.
        nargs: argparse ``nargs`` for list fields.
        metavar: argparse metavar.
        parse: converts one command-line string to the field's value.
        negate: for a boolean that defaults to True, the ``--no-...`` flag that sets it
            False (Megatron-LM style, e.g. ``--no-load-optim``).
        default_factory: a factory for mutable defaults.
    """
    metadata = {
        "flag": flag,
        "choices": choices,
        "nargs": nargs,
        "metavar": metavar,
        "parse": parse,
        "negate": negate,
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def knob(default: Any = None, *, env: str, parse: Callable[[str], Any],
         flag: Optional[str] = None, metavar: Optional[str] = None) -> Any:
    """Declares a tuning or test knob: a config field hidden from ``--help``.

    Its default is read from the environment variable ``env`` when the config is made (so a
    test or a job script can set it for every process of a launch), and a hidden flag can
    give it too. Either way the value lives in the typed config, is recorded with the run,
    and is the only place the code reads it from. The docs list every knob with its variable.

    Args:
        default: the value when neither the variable nor the flag is given.
        env: the environment variable, e.g. ``MEGATRON_EXT_OFFLOAD_FAULT``.
        parse: converts the text to the value; raises ``ValueError`` (or ``UsageError``)
            with what to give instead.
        flag: the hidden flag when it is not ``--`` + the field name with dashes.
        metavar: argparse metavar.
    """
    def from_environ() -> Any:
        text = os.environ.get(env, "").strip()
        if not text:
            return copy.deepcopy(default)  # a list default is not shared between configs
        try:
            return parse(text)
        except UsageError:
            raise
        except ValueError as err:
            raise UsageError(f"{env}={text}: {err}") from None

    metadata = {"flag": flag, "choices": None, "nargs": None, "metavar": metavar,
                "parse": parse, "negate": None, "hidden": True, "env": env}
    return dataclasses.field(default_factory=from_environ, metadata=metadata)


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict:
    """Returns ``{field name: docstring}`` read from the string under each field."""
    docs: dict = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs
