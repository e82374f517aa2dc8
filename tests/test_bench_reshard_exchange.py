"""bench/reshard_exchange.py, small: the 3 M model grown from 2 to 3 ranks, once each way.

It checks that the bench runs end to end (real gloo workers, the real exchange) and that
its byte counts are the placement's: the timings belong to the 200 M run (bench/README.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.reshard_exchange", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_placing_the_joiner_moves_a_third_of_the_state_not_half(tmp_path: Path) -> None:
    out = tmp_path / "exchange.json"
    proc = _run("--sizes", "3m", "--grows", "2:3", "--reps", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| 3m | 2 -> 3 | placed |" in proc.stdout
    (row,) = json.loads(out.read_text())["rows"]
    appended, placed = row["appended"], row["placed"]
    # from 2 to 3 the joiner takes a third of the state either way; appended, old rank 1
    # also sends a third and takes a sixth: half of the state moves, placed a third
    assert abs(placed["moved_bytes"] / appended["moved_bytes"] - 2 / 3) < 0.02  # torch.chunk rounds
    assert placed["busiest_bytes"] == placed["moved_bytes"]  # the joiner's receive, from both old ranks
    assert min(placed["median_s"], appended["median_s"], row["link_bytes_per_s"]) > 0


def test_a_bad_grow_is_one_line_and_exit_2() -> None:
    proc = _run("--grows", "3:2")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["error: --grows: '3:2' is not OLD:NEW with 1 <= OLD < NEW <= 16 "
                                                "(e.g. 2:3)"]
