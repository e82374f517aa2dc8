"""Trainer workers started as a node's launcher starts them, for the in-process resize tests
(tests/test_grow.py, tests/test_fsdp_resize.py): one process per "node", torchrun's
environment given by the test, the node's agent files under ``tmp_path/<node>``, its join
credential from :data:`AUTHORITY` (as the daemon issues one to each node it admits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainer.contract import JOIN_CREDENTIAL_ENV, NODE_ID_ENV, RDZV_ENDPOINT_ENV, RUN_ID_ENV
from trainer.credential import Authority

#: the tests' stand-in for the daemon's join key
AUTHORITY = Authority.generate()


def start_worker(tmp_path: Path, name: str, env: dict[str, str], rdzv_port: int, script: str,
                 argv: list[str], *, run_id: str) -> subprocess.Popen:
    """``python -c script *argv`` as node ``name``'s only worker (``env``: torchrun's variables,
    and anything the script reads); its status file, step logs, notices and scratch are under
    ``tmp_path/name``, ``$OUT`` is ``tmp_path``; its join credential is :data:`AUTHORITY`'s for
    ``name`` in ``run_id`` unless ``env`` sets one. Output captured (text)."""
    node = tmp_path / name
    node.mkdir()
    full = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(tmp_path), RUN_ID_ENV: run_id, NODE_ID_ENV: name,
            JOIN_CREDENTIAL_ENV: AUTHORITY.issue(run=run_id, node=name, now=time.time()),
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", **env,
            "SPOTVISOR_NOTICE_FILE": str(node / "notices.json"), "SPOTVISOR_STATUS_FILE": str(node / "status.jsonl"),
            "SPOTVISOR_LOG_DIR": str(node / "logs"), "SPOTVISOR_SCRATCH_DIR": str(node / "scratch"),
            RDZV_ENDPOINT_ENV: f"127.0.0.1:{rdzv_port}"}
    return subprocess.Popen([sys.executable, "-c", script, *argv], env=full, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen]) -> list[str]:
    """Each worker's output once all have exited; on a hang, all of it in the failure."""
    try:
        return [p.communicate(timeout=300)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("\n".join(p.communicate()[0] for p in procs)) from None


def status_lines(tmp_path: Path, node: str) -> list[dict]:
    """Node ``node``'s status lines, parsed."""
    return [json.loads(x) for x in (tmp_path / node / "status.jsonl").read_text().splitlines()]


def trained(tmp_path: Path) -> dict[int, list[int]]:
    """Step -> the sample positions trained for it, over every worker's step logs."""
    out: dict[int, list[int]] = {}
    for log in tmp_path.glob("node*/logs/steps-*.jsonl"):
        for rec in map(json.loads, log.read_text().splitlines()):
            out.setdefault(rec["step"], []).extend(rec["positions"])
    return out
