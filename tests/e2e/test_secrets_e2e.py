"""End to end (issue 26): a demo run on the local provider with ``job.env`` and one secret
from an owner-only file, through the demo's chaos schedule (two notices, one kill).

Every worker, the first ones and each replacement's, checks it was given the ``job.env``
value and the secret (by hash: :mod:`e2e.env_trainer`); the job completes. Then the
secret's value is looked for everywhere it must never be: the daemon's output, every file
under the state directory (the store, its WAL, the agents' and trainers' logs,
checkpoints), a dump of the store, everything a webhook sink received, and what
``spotctl status / nodes / events / tail / cost`` and ``/metrics`` said while the job ran.

To fold in more of the job's delivery (a workdir, setup commands), add entries to
``EXPECT`` (checked by hash on every worker) and to the ``job`` fields; the sweep for the
secret stays as it is.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from e2e.conftest import ROOT, _free_port, paced

pytestmark = pytest.mark.slow

DEMO_CHAOS = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["chaos"]  # the demo's own schedule


class _Sink(BaseHTTPRequestHandler):
    bodies: list[bytes]

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[bytes]]]:
    """A webhook receiver on 127.0.0.1: (its URL, the bodies it got)."""
    bodies: list[bytes] = []
    handler = type("Sink", (_Sink,), {"bodies": bodies})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", bodies
    finally:
        server.shutdown()
        server.server_close()


def _spotctl(socket: Path, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.ctl", "--socket", str(socket), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    return r.stdout + r.stderr


def _watch(seen: list[str], metrics_url: str):
    """``during``: while the daemon runs, every ~2 s record what spotctl and /metrics say."""

    def during(proc: subprocess.Popen, socket: Path) -> None:
        while proc.poll() is None:
            if socket.exists():
                status = _spotctl(socket, "status", "--json")
                seen.append(status)
                seen.append(_spotctl(socket, "status"))
                seen.append(_spotctl(socket, "events", "--json"))
                seen.append(_spotctl(socket, "cost"))
                try:
                    nodes = json.loads(status).get("nodes", [])
                except ValueError:
                    nodes = []
                for node in nodes:
                    seen.append(_spotctl(socket, "tail", node["id"], "-n", "200"))
                try:
                    with urllib.request.urlopen(metrics_url, timeout=5) as r:
                        seen.append(r.read().decode())
                except OSError:
                    pass
            try:
                proc.wait(timeout=2)  # the watch's period; returns early when the daemon exits
            except subprocess.TimeoutExpired:
                pass

    return during


def test_job_env_and_a_secret_reach_every_worker_and_no_log(run_demo, tmp_path: Path, webhook) -> None:
    secret = f"sv-secret-{uuid.uuid4().hex}"
    secrets_file = tmp_path / "etc" / "job.env"
    secrets_file.parent.mkdir()
    secrets_file.write_text(f"# the job's secrets\nE2E_SECRET={secret}\n")
    secrets_file.chmod(0o600)
    proofs = tmp_path / "proofs"
    proofs.mkdir()
    expect = {"E2E_SECRET": hashlib.sha256(secret.encode()).hexdigest(),
              "E2E_PLAIN": hashlib.sha256(b"plain-value").hexdigest()}
    url, bodies = webhook
    metrics_port = _free_port()
    seen: list[str] = []
    t0 = time.monotonic()
    s = run_demo(
        target_steps=150, **{**paced(3), "module": "e2e.env_trainer"}, chaos=DEMO_CHAOS,
        daemon_env={"E2E_WEBHOOK_KEY": "e2e-signing-key"},
        config={"daemon": {"metrics_port": metrics_port},
                "notify": [{"name": "audit", "type": "webhook", "url": url, "secret_env": "E2E_WEBHOOK_KEY",
                            "kinds": ["*"]}]},
        env={"E2E_PLAIN": "plain-value", "E2E_PROOF_DIR": str(proofs), "E2E_EXPECT": json.dumps(expect)},
        secrets={"E2E_SECRET": f"file:{secrets_file}#E2E_SECRET"},
        during=_watch(seen, f"http://127.0.0.1:{metrics_port}/metrics"))
    wall_s = time.monotonic() - t0
    print(f"secrets e2e: {wall_s:.0f} s wall, world sizes {s['world_sizes']}")

    # the job survived the demo's chaos schedule
    assert s["steps_completed"] == s["target_steps"] == 150
    assert s["preemptions_with_notice"] == 2 and s["nodes_lost_without_notice"] == 1
    assert s["lost_steps_on_notice"] == 0

    # every worker of every node, replacements included, was given both values
    got = [json.loads(p.read_text()) for p in proofs.glob("*.json")]
    assert got and all(g["got"] == expect for g in got), got
    assert len({g["node"] for g in got}) >= 4, got  # the three first nodes and at least one replacement

    # ... and the secret is nowhere else
    assert bodies and any(b"job_completed" in b for b in bodies), "the webhook sink got nothing: the sweep is blind"
    assert any("spotvisor_" in text for text in seen) and any('"nodes"' in text for text in seen), \
        "neither /metrics nor spotctl status was read while the job ran"
    needle = secret.encode()
    leaks = [f"webhook body {i}" for i, b in enumerate(bodies) if needle in b]
    leaks += [f"spotctl or /metrics output {i}" for i, text in enumerate(seen) if secret in text]
    leaks += [name for name, text in (("daemon stdout", s["_stdout"]), ("daemon stderr", s["_stderr"]))
              if secret in text]
    state = tmp_path / "state"
    files = [p for p in state.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.name == "spotvisord.db" for p in files) and any(p.name == "trainer.log" for p in files)
    leaks += [str(p.relative_to(tmp_path)) for p in files if needle in p.read_bytes()]
    for db in state.rglob("spotvisord.db"):
        dump = "\n".join(sqlite3.connect(f"file:{db}?mode=ro", uri=True).iterdump())
        assert "node_ready" in dump  # the dump holds the run
        if secret in dump:
            leaks.append(f"dump of {db.relative_to(tmp_path)}")
    assert leaks == [], f"the secret's value leaked into: {leaks}"
