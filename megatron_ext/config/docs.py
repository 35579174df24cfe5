"""Markdown tables of every flag, generated from the config dataclasses.

``python -m megatron_ext.config.docs`` prints them; the README holds the same text
between its ``flags:begin``/``flags:end`` markers, and a test keeps the two equal.
"""

from __future__ import annotations

import argparse

from megatron_ext.config.cli import build_parser
from megatron_ext.config.megatron_compat import MEGATRON_LM, REFUSED, REFUSED_PREFIXES


def flags_markdown() -> str:
    """One table per argparse group: flag, default, meaning."""
    parser = build_parser()
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
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
    lines += ["#### Megatron-LM flags refused", "",
              "Each gives one line `error: FLAG: why` and exit status 2.", "",
              "| flag | why |", "|---|---|"]
    lines += [f"| `{flag}` | {why} |" for flag, why in sorted(REFUSED.items())]
    lines += [f"| `{prefix}*` | {why} |" for prefix, why in sorted(REFUSED_PREFIXES.items())]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(flags_markdown(), end="")
