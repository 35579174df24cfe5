"""Markdown tables of every flag, generated from the config dataclasses.

``python -m megatron_ext.config.docs`` prints them; the README holds the same text
between its ``flags:begin``/``flags:end`` markers, and a test keeps the two equal.
"""

from __future__ import annotations

import argparse

from megatron_ext.config.cli import build_parser


def flags_markdown() -> str:
    """One table per argparse group: flag, default, meaning."""
    parser = build_parser()
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        lines += [f"#### {group.title}", "", "| flag | default | meaning |", "|---|---|---|"]
        for action in actions:
            flag = action.option_strings[0]
            if action.choices:
                flag += " {" + ",".join(str(c) for c in action.choices) + "}"
            elif action.nargs == 0:
                pass
            elif action.metavar:
                flag += f" {action.metavar}"
            default = "" if action.default in (None, False, []) else f"`{action.default}`"
            if action.nargs == 0:
                default = "off"  # a switch: absent unless given
            help_text = action.help.replace("|", "\\|")
            lines.append(f"| `{flag}` | {default} | {help_text} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(flags_markdown(), end="")
