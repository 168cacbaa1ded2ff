"""The runtime loop's error report (genie/runtime/loop.py): one line, no traceback formatted."""
from __future__ import annotations

import ast
import logging

from genie.runtime.loop import LoopThread


def _failed_error() -> Exception:
    try:
        raise ValueError("nothing listens there")
    except ValueError as e:
        return e


def test_an_unread_task_error_is_reported_in_one_line_without_formatting_its_traceback(monkeypatch, caplog):
    """The report can run inside a garbage collection in the middle of the user's ast.parse;
    Python 3.11 formats tracebacks with ast.parse, which cannot run inside another."""
    parsed = []
    real_parse = ast.parse
    monkeypatch.setattr(ast, "parse", lambda *a, **k: parsed.append(a) or real_parse(*a, **k))
    thread = LoopThread()
    try:
        with caplog.at_level(logging.INFO, logger="genie.runtime"):
            thread.loop.call_exception_handler({"message": "Task exception was never retrieved",
                                                "exception": _failed_error(), "future": "<the task>"})
        assert parsed == []
        assert [r.getMessage() for r in caplog.records] == [
            "Task exception was never retrieved: ValueError: nothing listens there ('<the task>')"]
        assert all(r.exc_info is None for r in caplog.records)

        caplog.clear()
        with caplog.at_level(logging.DEBUG):  # debugging: the full report, traceback and all
            thread.loop.call_exception_handler({"message": "Task exception was never retrieved",
                                                "exception": _failed_error()})
        assert any(r.exc_info for r in caplog.records)
    finally:
        thread.stop()
        thread.loop.close()
