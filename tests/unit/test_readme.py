"""README.md stays a front door: short, its links resolve, its test command is CI's."""

from __future__ import annotations

from markdown_links import broken_links, relative_links

from mext_testing import ROOT

README = ROOT / "README.md"
# .ci/run fails the build past this many lines (its first check); the README aims at 200.
MAX_LINES = 220
TEST_COMMAND = "python -m pytest -q -n 2 --dist loadgroup"


def test_the_readme_is_at_most_220_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines (at most {MAX_LINES}): move reference text to docs/")


def test_every_relative_link_of_the_readme_resolves_to_a_file():
    assert relative_links(README), "no links found: the pattern is broken"
    assert broken_links(README, ROOT) == []


def test_the_readme_gives_the_test_command_that_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"\n{TEST_COMMAND}\n" in ci
    assert f"\n{TEST_COMMAND}\n" in README.read_text()
    assert f"[ \"$(wc -l < README.md)\" -le {MAX_LINES} ]" in ci
