"""spotvisord and spotctl piped into a reader that has gone (``... | head -1``): exit 1
quietly, not a BrokenPipeError traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [
    ["-m", "daemon.interfaces.cli", "check-config", "configs/local.yaml"],
    ["-m", "daemon.interfaces.ctl", "--help"],
])
def test_a_closed_reader_ends_the_command_without_a_traceback(argv: list[str]) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte: every write fails (EPIPE)
    try:
        p = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True,
                           timeout=60)
    finally:
        os.close(write)
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr
