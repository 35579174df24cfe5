"""Helpers for the corpus tools' tests: run a tool as a subprocess, check how it failed.

A module of its own, not conftest.py, so that test files import it by a name no other
test directory uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS_DIR = os.path.join(REPO_ROOT, "tools")

# Small enough to keep the suite fast on 2 cores, large enough for a 512-piece BPE model.
SMALL_CORPUS_DOCS = 150
SMALL_CORPUS_MAX_CHARS = 4000
TINY_VOCAB = 512


@dataclass
class ToolRun:
    """A finished tool subprocess."""

    returncode: int
    stdout: str
    stderr: str

    def error_lines(self) -> List[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def tool_command(tool: str, args: Sequence[str]) -> List[str]:
    """The command line that runs ``tools/{tool}`` with the test's Python."""
    return [sys.executable, os.path.join(TOOLS_DIR, tool), *[str(a) for a in args]]


def run_tool(tool: str, *args, timeout: float = 120) -> ToolRun:
    """Runs ``python tools/{tool} args...`` and returns its exit status and output."""
    proc = subprocess.run(tool_command(tool, args), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)
    return ToolRun(proc.returncode, proc.stdout, proc.stderr)


def assert_ok(run: ToolRun) -> None:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stderr}"


def assert_usage_error(run: ToolRun, expected: str) -> None:
    """The tool failed the way bad input must fail: exit 2, one error line, no traceback."""
    assert run.returncode == 2, f"exit {run.returncode}\n{run.stderr}"
    assert "Traceback" not in run.stderr, run.stderr
    errors = run.error_lines()
    assert len(errors) == 1, run.stderr
    assert expected in errors[0], f"{expected!r} not in {errors[0]!r}"
