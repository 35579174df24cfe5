"""Command line: argparse groups generated from the config dataclasses.

Each section of :class:`RunConfig` becomes one argparse group; each field one flag whose
help is the field's docstring. Engines never import this module: they take their config.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import typing
from typing import List, Optional, Sequence

from megatron_ext.config.megatron_compat import did_you_mean, first_refused
from megatron_ext.config.run import RunConfig
from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import field_docs


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (a :class:`UsageError`), not the usage.

    argparse prints the whole usage (80+ lines for this parser) before its one-line
    message; the message alone says what is wrong, and ``--help`` lists the flags.
    """

    def error(self, message: str):
        """Raises the message as a UsageError instead of printing the usage and exiting."""
        raise UsageError(message)


def config_sections():
    """``[(section name, section config class)]`` of :class:`RunConfig`, in order."""
    hints = typing.get_type_hints(RunConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(RunConfig)]


def _without_optional(annotation):
    """``X`` for ``Optional[X]``; any other annotation as it is."""
    if typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _base_type(annotation):
    """Int for Optional[int], list for List[str], ..."""
    annotation = _without_optional(annotation)
    if typing.get_origin(annotation) in (list, List):
        return list
    return annotation


def _element_type(annotation):
    """The element type of a list field: str for List[str], int for Optional[List[int]]."""
    args = typing.get_args(_without_optional(annotation))
    return args[0] if args else str


def _flag(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: ...)" to help, except on ``--no-...`` switches.

    Their help says what giving them does; "(default: True)" would describe the feature
    they turn off, not the switch.
    """

    def _get_help_string(self, action):
        if isinstance(action, argparse._StoreFalseAction):
            return action.help
        return super()._get_help_string(action)


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """Builds the parser of pretrain_gpt.py from the config dataclasses."""
    parser = OneLineArgumentParser(
        prog=prog,
        description="Pretrain a GPT on megatron-core (see README.md). Flags with Megatron-LM "
        "names keep Megatron-LM's meanings.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )
    for section_name, section_cls in config_sections():
        title = (section_cls.__doc__ or section_name).strip().splitlines()[0]
        group = parser.add_argument_group(f"{section_name}: {title}")
        docs = field_docs(section_cls)
        hints = typing.get_type_hints(section_cls)
        for field in dataclasses.fields(section_cls):
            meta = field.metadata
            dest = f"{section_name}.{field.name}"
            help_text = docs.get(field.name, "")
            if meta.get("hidden"):
                help_text = argparse.SUPPRESS  # a knob (runtime.fields.knob): in the docs only
            base = _base_type(hints[field.name])
            default = (field.default if field.default is not dataclasses.MISSING
                       else field.default_factory())
            if base is bool:
                if meta.get("negate"):
                    group.add_argument(meta["negate"], dest=dest, action="store_false",
                                       default=default, help=help_text)
                else:
                    group.add_argument(_flag(field), dest=dest, action="store_true",
                                       default=default, help=help_text)
                continue
            kwargs = {"dest": dest, "default": default, "help": help_text}
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            if meta.get("metavar") or not meta.get("choices"):
                kwargs["metavar"] = meta.get("metavar") or field.name.upper()
            if base is list:
                kwargs["nargs"] = meta.get("nargs") or "+"
                kwargs["type"] = meta.get("parse") or _element_type(hints[field.name])
            else:
                kwargs["type"] = meta.get("parse") or base
            group.add_argument(_flag(field), **kwargs)
    return parser



def _check_finite(parser: argparse.ArgumentParser, values: dict) -> None:
    """Refuses nan and inf for every number flag.

    float('nan') parses, and compares False with every bound a section checks, so it
    would pass them.
    """
    for action in parser._actions:
        value = values.get(action.dest)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise UsageError(f"{action.option_strings[0]} {item}: must be a finite number")


def parse_config(argv: Optional[Sequence[str]] = None) -> RunConfig:
    """Parses the command line into a :class:`RunConfig`.

    Raises:
        UsageError: a flag value or a combination of flags is invalid.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    refused = first_refused(argv)
    if refused:
        raise UsageError(refused)
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        raise UsageError(_unknown_message(parser, unknown))
    values = vars(namespace)
    _check_finite(parser, values)
    sections = {}
    for section_name, section_cls in config_sections():
        prefix = section_name + "."
        kwargs = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
        sections[section_name] = section_cls(**kwargs)
    return RunConfig(**sections)


def _unknown_message(parser: argparse.ArgumentParser, unknown: List[str]) -> str:
    flags = [a for a in unknown if a.startswith("-")]
    if not flags:
        return f"unexpected argument {unknown[0]!r} (every value follows its flag)"
    known = [opt for action in parser._actions for opt in action.option_strings]
    return (f"unrecognized argument {flags[0].split('=', 1)[0]}{did_you_mean(flags[0], known)}; "
            "see --help for the flags")
