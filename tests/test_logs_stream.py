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
