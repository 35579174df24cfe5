"""Megatron-LM's ``--data-path [W1] P1 [W2] P2 ...``: weights and prefixes."""

from __future__ import annotations

from typing import List

from megatron_ext.errors import UsageError


def parse_data_path(items: List[str]) -> List[tuple]:
    """Splits '--data-path [W1] P1 [W2] P2 ...' into [(weight, prefix), ...].

    Raises:
        UsageError: weights are given for some prefixes but not all.
    """
    def is_number(text):
        try:
            float(text)
            return True
        except ValueError:
            return False

    if not any(is_number(x) for x in items):
        return [(1.0, p) for p in items]
    if len(items) % 2 or not all(is_number(w) for w in items[0::2]):
        raise UsageError("--data-path: give either prefixes only, or a weight before every prefix "
                         "('0.7 PREFIX_A 0.3 PREFIX_B')")
    pairs = [(float(w), p) for w, p in zip(items[0::2], items[1::2])]
    if any(w <= 0 for w, _ in pairs):
        raise UsageError("--data-path: weights must be positive")
    return pairs
