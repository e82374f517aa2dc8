"""A node's trainer files as the tests read and write them: the side of the agent's file
contract (``trainer/contract.py``) a test plays. ``folder`` holds ``status.jsonl`` (the
trainer's status lines), ``logs/steps-<attempt>-rank<r>.jsonl`` (its step logs) and
``notices.json`` (the notices the agent hands it)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def status_lines(folder: Path) -> list[dict]:
    """The status lines in ``folder/status.jsonl``, parsed, in the order written."""
    return [json.loads(line) for line in (folder / "status.jsonl").read_text().splitlines()]


def step_records(folder: Path, *, by_time: bool = False) -> list[dict]:
    """Every rank's step-log records under ``folder/logs``: file by file in name order, or
    (``by_time``) by time, then rank."""
    out: list[dict] = []
    for f in sorted((folder / "logs").glob("steps-*-rank*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines()]
    return sorted(out, key=lambda r: (r["time"], r["rank"])) if by_time else out


def write_notices(folder: Path, *notices: tuple[str, str]) -> None:
    """Replace ``folder/notices.json`` with ``(id, kind)`` notices, atomically, in the agent's
    format (``trainer/guard.py``), with ``time`` 0 and no deadline."""
    f = folder / "notices.json"
    f.with_suffix(".tmp").write_text(json.dumps([{"id": i, "kind": k, "time": 0.0, "deadline": None}
                                                 for i, k in notices]))
    os.replace(f.with_suffix(".tmp"), f)
