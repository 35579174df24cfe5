"""Markdown tables of every flag, generated from the config dataclasses.

``python -m megatron_ext.config.docs`` prints them; ``docs/flags.md`` holds the same text
between its ``flags:begin``/``flags:end`` markers, and the README the refused-flags table
between its ``refused-flags:begin``/``refused-flags:end`` markers; a test keeps them equal.
``python -m megatron_ext.config.docs --write`` rewrites both sections.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Optional

from megatron_ext.config.cli import build_parser, config_sections
from megatron_ext.config.megatron_compat import MEGATRON_LM, refused_groups
from megatron_ext.runtime.fields import field_docs

# The page that holds the tables between these markers (a test keeps them equal to the code).
FLAGS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
BEGIN, END = "<!-- flags:begin -->\n", "<!-- flags:end -->"
# The README's table of the Megatron-LM flags refused, between these markers.
README = Path(__file__).resolve().parents[2] / "README.md"
REFUSED_BEGIN, REFUSED_END = "<!-- refused-flags:begin -->\n", "<!-- refused-flags:end -->"


def flags_markdown() -> str:
    """One table per argparse group: flag, default, meaning."""
    parser = build_parser()
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)
                   and a.help != argparse.SUPPRESS]
        if not actions:
            continue
        lines += [f"#### {group.title}", "", "| flag | default | meaning | vs Megatron-LM |",
                  "|---|---|---|---|"]
        for action in actions:
            flag = action.option_strings[0]
            if action.choices:
                flag += " {" + ",".join(str(c) for c in action.choices) + "}"
            elif action.nargs == 0:
                pass
            elif isinstance(action.metavar, tuple):
                flag += " " + " ".join(action.metavar)
            elif action.metavar:
                flag += f" {action.metavar}"
            default = "" if action.default in (None, False, []) else f"`{action.default}`"
            if action.nargs == 0:
                default = "off"  # a switch: absent unless given
            help_text = action.help.replace("|", "\\|")
            name = action.option_strings[0]
            if name not in MEGATRON_LM:
                versus = "this project's flag"
            else:
                versus = MEGATRON_LM[name].replace("|", "\\|") or "as Megatron-LM"
            lines.append(f"| `{flag}` | {default} | {help_text} | {versus} |")
        lines.append("")
    lines += knobs_markdown()
    lines += ["#### Megatron-LM flags refused", "",
              "Each gives one line `error: FLAG: why` (`error: FLAG VALUE: why` for a refused "
              "value) and exit status 2.", "", *refused_markdown()]
    return "\n".join(lines).rstrip() + "\n"


def refused_markdown() -> list:
    """The table of refused Megatron-LM flags (megatron_compat's rows), one row per reason."""
    rows = ["| flags | why |", "|---|---|"]
    for flags, why in refused_groups():
        names = ", ".join(f"`{flag}`" for flag in flags)
        rows.append(f"| {names} | {why.replace('|', chr(92) + '|')} |")
    return rows


def knobs_markdown() -> list:
    """The knobs (``runtime.fields.knob``): hidden from ``--help``, each with its variable."""
    rows = []
    for section_name, section_cls in config_sections():
        docs = field_docs(section_cls)
        for field in dataclasses.fields(section_cls):
            if field.metadata.get("hidden"):
                flag = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
                text = docs.get(field.name, "").replace("|", "\\|")
                rows.append(f"| `{flag}` | `{field.metadata['env']}` | {text} |")
    if not rows:
        return []
    return ["#### Knobs for tests and tuning (hidden from --help)", "",
            "Each is a config field, recorded with the run; its default is read from the "
            "variable when the config is made, and the flag overrides it.", "",
            "| flag | variable | meaning |", "|---|---|---|", *rows, ""]


def _write_section(path: Path, begin: str, end: str, text: str) -> bool:
    page = path.read_text()
    start, stop = page.index(begin) + len(begin), page.index(end)
    new_page = page[:start] + text + page[stop:]
    if new_page == page:
        return False
    path.write_text(new_page)
    return True


def write_flags_page(path: Optional[Path] = None) -> bool:
    """Rewrites the section between the markers of ``path`` with :func:`flags_markdown`.

    Args:
        path: The page holding the markers; ``FLAGS_PAGE`` (docs/flags.md) when None.

    Returns:
        Whether the page changed.
    """
    return _write_section(FLAGS_PAGE if path is None else path, BEGIN, END, flags_markdown())


def write_readme_table(path: Optional[Path] = None) -> bool:
    """Rewrites the README's refused-flags table (between its markers) from the table.

    Args:
        path: The page holding the ``refused-flags`` markers; ``README`` when None.

    Returns:
        Whether the page changed.
    """
    text = "\n".join(refused_markdown()) + "\n"
    return _write_section(README if path is None else path, REFUSED_BEGIN, REFUSED_END, text)


def main(argv=None) -> None:
    """Prints the flag tables, or with ``--write`` rewrites them in docs/flags.md and README."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.config.docs",
        description="Print the flag tables (markdown), or rewrite them in docs/flags.md and "
                    "the README's refused-flags table.")
    parser.add_argument("--write", action="store_true",
                        help="rewrite the section between the flags markers of docs/flags.md "
                             "and the refused-flags table of README.md")
    args = parser.parse_args(argv)
    if not args.write:
        print(flags_markdown(), end="")
        return
    for name, changed in (("docs/flags.md", write_flags_page()),
                          ("README.md", write_readme_table())):
        print(f"{name}: {'rewritten' if changed else 'already up to date'}")


if __name__ == "__main__":
    main()
