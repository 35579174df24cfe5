"""The --no-offload-* switches say what giving them does, not what they turn off."""

from __future__ import annotations

import argparse

import pytest

from megatron_ext.config.cli import build_parser

# What each switch's help must say first: the behaviour with the switch given.
SWITCHES = {
    "--no-offload-rebalance": "Keep every subgroup on the path it was placed on",
    "--no-offload-alternate-order": "Walk the subgroups in ascending order on every step",
    "--no-offload-delayed-grad-conversion": "Convert the whole shard's gradients to fp32",
    "--no-offload-concurrency-control": "Let every process of a node do I/O on a path",
}


def _help_of(flag: str) -> str:
    parser = build_parser()
    formatter = parser._get_formatter()
    action = next(a for a in parser._actions if flag in a.option_strings)
    return " ".join(formatter._expand_help(action).split()) if action.help else ""


@pytest.mark.parametrize("flag", sorted(SWITCHES))
def test_no_offload_switch_describes_turning_off(flag):
    text = _help_of(flag)
    assert text.startswith(SWITCHES[flag]), text
    assert "Without this flag" in text, text


def test_no_switch_claims_a_default_of_true():
    parser = build_parser()
    switches = [a for a in parser._actions if isinstance(a, argparse._StoreFalseAction)]
    assert {f for a in switches for f in a.option_strings} >= set(SWITCHES)
    help_text = " ".join(parser.format_help().split())
    for action in switches:
        assert "(default: True)" not in _help_of(action.option_strings[0]), action.option_strings
    assert "(default: True)" not in help_text
