"""End to end: the job's code comes from ``job.workdir``, set up by ``job.setup`` on every
node, through the demo's chaos schedule (two interruption notices, one node killed
without notice) on the local provider, with real agents and torchrun.

The trainer module (``spot_code_job``, the paced reference trainer) exists only in the
workdir, so a node that runs it runs the delivered code; it refuses to train unless the
setup's marker is in its working directory. While the daemon runs, the test edits the
workdir: the replacements bought after the edit still get the first version (the version
is pinned per daemon run; the next version after a restart is
tests/test_code_delivery.py::test_the_version_is_pinned_per_daemon_run).

To extend (``job.env``, ``job.secrets``): add fields to :func:`workdir_job`'s dict.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from daemon.controlnode.workdir import pack
from e2e.conftest import ROOT, SMALL_MODEL

pytestmark = pytest.mark.slow

JOB_MODULE = textwrap.dedent(
    """\
    \"\"\"The paced reference trainer, shipped in job.workdir (tests/e2e/paced_trainer.py's twin).\"\"\"
    import os
    import sys
    import time

    from trainer.loop import run_job
    from trainer.run import ReferenceJob, build_parser

    CODE_VERSION = "v1"


    class PacedJob(ReferenceJob):
        def train_step(self):
            if self.ctx.world_size < self.args.full_world:
                time.sleep(self.args.pace_s)
            return super().train_step()


    def main() -> int:
        if not os.path.exists("setup-marker"):  # job.setup runs first, in this directory
            print("spot_code_job: no setup-marker in", os.getcwd(), file=sys.stderr)
            return 3
        p = build_parser()
        p.add_argument("--full-world", type=int, required=True)
        p.add_argument("--pace-s", type=float, default=0.5)
        return run_job(None, job_cls=PacedJob, parser=p)


    if __name__ == "__main__":
        sys.exit(main())
    """
)


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


def _spotctl_status(socket: Path) -> dict[str, Any] | None:
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.ctl", "--socket", str(socket), "status", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return None  # not up yet


def test_the_job_runs_delivered_code_through_the_chaos_schedule(run_demo, tmp_path: Path) -> None:
    job = workdir_job(tmp_path)
    module = Path(job["workdir"]) / "spot_code_job.py"
    # the version the daemon must pin: packing is deterministic, so the test's own pack of v1 is it
    sha = pack(job["workdir"], tmp_path / "expected", exclude=("data",), max_bytes=2**20).sha256
    before_edit: set[str] = set()

    def during(proc: subprocess.Popen, socket: Path) -> None:
        """Once spotctl status shows the pinned version, the user edits the workdir (v2)."""
        while proc.poll() is None:
            status = _spotctl_status(socket) if socket.exists() else None
            if status and (status.get("code") or {}).get("version"):
                assert status["code"]["version"] == sha
                module.write_text(JOB_MODULE.replace('CODE_VERSION = "v1"', 'CODE_VERSION = "v2"'))
                before_edit.update(n["id"] for n in status["nodes"])
                return
            try:
                proc.wait(timeout=0.5)  # the watch's period; returns early when the daemon exits
            except subprocess.TimeoutExpired:
                pass

    t0 = time.monotonic()
    s = run_demo(target_steps=300, during=during, **job, chaos=[
        {"action": "notice", "node": 2, "at_step": 20, "lead_s": 20},
        {"action": "notice", "node": 3, "at_step": 60, "lead_s": 20},
        {"action": "kill", "node": 1, "at_step": 105},
    ])
    print(f"workdir e2e: {time.monotonic() - t0:.0f} s wall, world sizes {s['world_sizes']}")
    assert before_edit, "the daemon never showed its pinned version"
    assert s["steps_completed"] == s["target_steps"] == 300
    assert s["preemptions_with_notice"] == 2 and s["nodes_lost_without_notice"] == 1
    assert s["lost_steps_on_notice"] == 0 and s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
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
