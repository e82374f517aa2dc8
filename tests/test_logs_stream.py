"""An entry point's logging set-up, called in-process, does not outlive the stream it found."""

from __future__ import annotations

import io
import sys

import structlog

from daemon.logs import configure_logging


def test_lines_go_to_the_stderr_of_now_not_the_one_configured_with(monkeypatch) -> None:
    first, now = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    try:
        configure_logging()  # as cli.main does, called in-process by a test
        first.close()  # pytest closes a test's captured stream once the test is over
        monkeypatch.setattr(sys, "stderr", now)
        structlog.get_logger("spotvisor.test").info("still_said")  # raised "I/O operation on closed file"
    finally:
        structlog.reset_defaults()
    assert "still_said" in now.getvalue()


def test_a_module_logger_used_under_the_entry_points_set_up_follows_a_later_one(monkeypatch) -> None:
    """A module-level logger first used while an entry point's set-up held (an in-process
    ``spotvisord check`` in a test) still follows a later configuration: structlog's
    ``capture_logs`` after a reset sees its line (a cached logger kept the first processor
    list: a test of ``kill -USR1``'s dump saw nothing, its line printed instead)."""
    module_log = structlog.get_logger("spotvisor.some_module")  # as a module binds it at import
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    try:
        configure_logging()
        module_log.warning("under_the_set_up")
    finally:
        structlog.reset_defaults()
    with structlog.testing.capture_logs() as logs:
        module_log.warning("after_a_reset")
    assert [e["event"] for e in logs] == ["after_a_reset"]
