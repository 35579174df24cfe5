"""tools/_common.py: a tool's start lines wait until its work is under way, and a tool that
fails before then prints its error line alone."""

from __future__ import annotations

import time

import _common
import pytest


@pytest.fixture
def quick_hold(monkeypatch):
    monkeypatch.setattr(_common, "START_HOLD_S", 0.2)


def _tool(*steps):
    def main(argv):
        for step in steps:
            step()
    return main


def test_an_error_right_after_the_start_is_printed_alone(capsys, quick_hold):
    def fail():
        raise _common.ToolError("bad input")
    assert _common.run_tool(_tool(lambda: _common.log_start("starting"), fail), []) == 2
    assert capsys.readouterr().err == "error: bad input\n"


def test_start_lines_come_before_the_next_line_and_at_the_end(capsys, quick_hold):
    _common.run_tool(_tool(lambda: _common.log_start("starting"),
                           lambda: _common.log("progress")), [])
    assert capsys.readouterr().err == "starting\nprogress\n"
    _common.run_tool(_tool(lambda: _common.log_start("starting")), [])
    assert capsys.readouterr().err == "starting\n"


def test_a_start_line_is_printed_once_the_work_has_run_a_while(capsys, quick_hold):
    def work():
        time.sleep(0.6)
        assert capsys.readouterr().err == "starting\n"
        raise _common.ToolError("found late")
    assert _common.run_tool(_tool(lambda: _common.log_start("starting"), work), []) == 2
    assert capsys.readouterr().err == "error: found late\n"


def test_a_bug_keeps_what_the_tool_was_doing(capsys, quick_hold):
    def bug():
        raise RuntimeError("bug")
    with pytest.raises(RuntimeError):
        _common.run_tool(_tool(lambda: print("started", file=_common.HeldStream()), bug), [])
    assert capsys.readouterr().err == "started\n"
