"""End to end (issue 26): the job's code, set-up, environment and a secret, all delivered
to every node, through the demo's chaos schedule (two interruption notices, one node
killed without notice) on the local provider, with real agents and torchrun.

- ``job.workdir``: the trainer module (``spot_code_job``, the paced reference trainer)
  exists only in the workdir, so a node that runs it runs the delivered code. While the
  daemon runs, the test edits the workdir: the replacements bought after the edit still
  get the first version (pinned per daemon run; the next version after a restart is
  tests/test_code_delivery.py::test_the_version_is_pinned_per_daemon_run).
- ``job.setup``: writes a marker the trainer refuses to start without.
- ``job.env`` and ``job.secrets`` (one secret from an owner-only file): every worker of
  every node, replacements included, checks it was given both (by hash:
  :func:`e2e.env_trainer.check_env`).

Then the secret's value is looked for everywhere it must never be: the daemon's output,
every file under the state directory (the store, its WAL, the agents' and trainers' logs,
the unpacked code, checkpoints), a dump of the store, everything a webhook sink received,
and what ``spotctl status / events / tail / cost`` and ``/metrics`` said while the job ran.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from daemon.controlnode.workdir import pack
from bench.ports import free_port
from e2e.conftest import ROOT, SMALL_MODEL
from fakes.serving import http_server
from trainers import TRAINERS

pytestmark = pytest.mark.slow

DEMO_CHAOS = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["chaos"]  # the demo's own schedule


# the paced reference trainer shipped in job.workdir, checking its setup and environment
JOB_MODULE = (TRAINERS / "spot_code_job.py").read_text()


def workdir_job(tmp_path: Path, full_world: int = 3) -> dict[str, Any]:
    """The job fields of this test: the module from the workdir, its setup, the paced trainer's flags."""
    wd = tmp_path / "workdir"
    wd.mkdir()
    (wd / "spot_code_job.py").write_text(JOB_MODULE)
    (wd / "data").mkdir()
    (wd / "data" / "ignored.bin").write_bytes(b"\0" * 1024)  # left out (job.workdir_exclude)
    return {
        "module": "spot_code_job",
        "args": [*SMALL_MODEL, "--full-world", str(full_world), "--pace-s", "0.5"],
        "workdir": str(wd),
        "workdir_exclude": ["data"],
        "setup": ["test -f spot_code_job.py", 'echo "set up on $SPOTVISOR_NODE_ID" | tee setup-marker'],
        "setup_timeout_s": 120,
    }


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
    with http_server(type("Sink", (_Sink,), {"bodies": bodies})) as url:
        yield f"{url}/hook", bodies


def _spotctl(socket: Path, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.ctl", "--socket", str(socket), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    return r.stdout + r.stderr


def _watch(seen: list[str], metrics_url: str, socket: Path) -> dict[str, Any] | None:
    """Record what spotctl and /metrics say now; returns ``status --json`` (None: not up yet)."""
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
    return _status(status)


def _status(text: str) -> dict[str, Any] | None:
    try:
        return json.loads(text)
    except ValueError:
        return None  # not up yet


def test_code_setup_env_and_a_secret_reach_every_worker_and_no_log(run_demo, tmp_path: Path, webhook) -> None:
    job = workdir_job(tmp_path)
    module = Path(job["workdir"]) / "spot_code_job.py"
    # the version the daemon must pin: packing is deterministic, so the test's own pack of v1 is it
    sha = pack(job["workdir"], tmp_path / "expected", exclude=("data",), max_bytes=2**20).sha256
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
    metrics_port = free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    seen: list[str] = []
    before_edit: set[str] = set()

    def during(proc: subprocess.Popen, socket: Path) -> None:
        """Every ~2 s: what spotctl and /metrics say; once status shows the pinned version,
        the user edits the workdir (v2)."""
        while proc.poll() is None:
            if socket.exists():
                status = _watch(seen, metrics_url, socket)
                if not before_edit and status and (status.get("code") or {}).get("version"):
                    assert status["code"]["version"] == sha
                    v2 = JOB_MODULE.replace('CODE_VERSION = "v1"', 'CODE_VERSION = "v2"')
                    assert v2 != JOB_MODULE
                    module.write_text(v2)
                    before_edit.update(n["id"] for n in status["nodes"])
            try:
                proc.wait(timeout=2)  # the watch's period; returns early when the daemon exits
            except subprocess.TimeoutExpired:
                pass

    t0 = time.monotonic()
    s = run_demo(
        target_steps=150, **job, chaos=DEMO_CHAOS,
        daemon_env={"E2E_WEBHOOK_KEY": "e2e-signing-key"},
        config={"daemon": {"metrics_port": metrics_port},
                "notify": [{"name": "audit", "type": "webhook", "url": url, "secret_env": "E2E_WEBHOOK_KEY",
                            "kinds": ["*"]}]},
        env={"E2E_PLAIN": "plain-value", "E2E_PROOF_DIR": str(proofs), "E2E_EXPECT": json.dumps(expect)},
        secrets={"E2E_SECRET": f"file:{secrets_file}#E2E_SECRET"},
        during=during)
    print(f"delivery e2e: {time.monotonic() - t0:.0f} s wall, world sizes {s['world_sizes']}")

    # the job survived the demo's chaos schedule
    assert s["steps_completed"] == s["target_steps"] == 150
    assert s["preemptions_with_notice"] == 2 and s["nodes_lost_without_notice"] == 1
    assert s["lost_steps_on_notice"] == 0 and s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0

    # the delivered code and its setup ran on every node; replacements bought after the edit got v1
    assert before_edit, "the daemon never showed its pinned version"
    out = s["_stdout"]
    ready = re.findall(r"node_ready\s+(\S+)\s+.*code_version=([0-9a-f]{64})", out)
    assert len(ready) >= 6, out[-3000:]  # 3 first nodes and 3 replacements, all prepared
    assert {v for _, v in ready} == {sha}  # the replacements bought after the edit too
    assert {node for node, _ in ready} - before_edit, "no node was bought after the edit"
    assert "node_setup_failed" not in out and "setup_halted" not in out
    (run_dir,) = (tmp_path / "state").glob("demo-*")
    for node, _ in ready:
        code = run_dir / "nodes" / node / "code" / sha
        assert (code / "setup-marker").read_text() == f"set up on {node}\n"
        assert 'CODE_VERSION = "v1"' in (code / "spot_code_job.py").read_text()
        assert not (code / "data").exists()
        log = (run_dir / "nodes" / node / "trainer.log").read_text()
        assert "[spotvisor] job.setup 2/2" in log and "job.setup done in" in log

    # every worker of every node, replacements included, was given the env value and the secret
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
