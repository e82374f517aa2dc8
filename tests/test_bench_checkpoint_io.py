"""bench/checkpoint_io.py runs end to end and repeats: each sample commits to a fresh
store and reads it back (the second sample once crashed: the job believed the step
committed already and looked for its manifest in the new, empty store). The figures
belong to bench/README.md; here only that they are there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_ddp_sample_repeats_on_a_fresh_store(tmp_path: Path) -> None:
    out = tmp_path / "io.json"
    proc = subprocess.run([sys.executable, "-m", "bench.checkpoint_io", "--stores", "file", "--integrations", "ddp",
                           "--model", "small", "--repeat", "2", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    samples = [s for s in doc["samples"] if s["integration"] == "ddp" and s["store"] == "file"]
    assert len(samples) == 2 and all(s["bytes"] > 0 for s in samples), doc
