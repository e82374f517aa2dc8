"""bench/gpu_check.py runs before a GPU is at hand: its dry run on gloo and the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="local ranks are Linux processes here")
def test_the_gpu_check_dry_run_shrinks_grows_and_survives_a_kill() -> None:
    """Three ranks on gloo: the all-reduce sums exactly, the last rank leaves and the two
    others go on in their processes, it joins back and receives the model from rank 0, and
    a rank killed with SIGKILL is found by the next collective and left behind; AdamW's
    state allocated for a reshard is a real step's, for both kernels; a buddy copy comes
    through the staging area whole."""
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--ranks", "3", "--mb", "1", "--params-m", "1",
                        "--timeout-s", "120"], cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    table = dict(line.split("  ", 1) for line in r.stdout.splitlines() if "  " in line)
    table = {k.strip(): v.strip() for k, v in table.items()}
    assert table["ranks, backend, device"].startswith("3, gloo")
    assert table["every collective summed exactly"] == "True"
    assert "not detected" not in table["loss without notice: detected by a failed collective (s)"]
    assert float(table["shrink 3 -> 2 in-process (s)"]) < 30
    assert table["optimizer state allocated for a reshard (cpu)"] == "foreach: ok, fused: ok"
    copy = table["buddy copy: 12 MB cpu -> host through staging"]  # a --replicate-shards copy's arrival
    assert copy.startswith("unpinned ") and copy.endswith(" GB/s"), copy
