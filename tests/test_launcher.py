"""daemon/gpunode/launcher.py: torchrun started from a process that imported it earlier.

Real ``torchrun`` (``--standalone``, one worker) in the launcher: the go line's
arguments, environment and working directory are the job's; a worker's failure is
torchrun's exit status; the agent going away before the line starts nothing.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from daemon.gpunode.launcher import READY_FD_ENV

WORKER = """\
import json, os, sys
json.dump({"forked": "torch" in sys.modules, "mark": os.environ.get("JOB_MARK"), "rank": os.environ.get("RANK"),
           "world": os.environ.get("WORLD_SIZE"), "cwd": os.getcwd(), "stdin": sys.stdin.read(),
           "agent_only": os.environ.get("AGENT_ONLY")}, open("worker.json", "w"))
sys.exit(int(os.environ.get("JOB_EXIT", "0")))
"""


def _launch(line: bytes | None, **more: str) -> subprocess.CompletedProcess[str]:
    # the zygote on even where NVIDIA devices are (off there by default): these workers touch no GPU
    env = {"PATH": "/usr/bin:/bin", "AGENT_ONLY": "1", "SPOTVISOR_ZYGOTE": "1", **more}
    proc = subprocess.Popen([sys.executable, "-m", "daemon.gpunode.launcher"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    out, _ = proc.communicate(line or b"", timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), "")


def _go(tmp_path: Path, **env: str) -> bytes:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    job_env = {"PATH": "/usr/bin:/bin", "JOB_MARK": "from-the-go-line", "PYTHONPATH": "", **env}
    return json.dumps({"argv": ["--standalone", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=0.1",
                                str(script)], "env": job_env, "cwd": str(tmp_path)}).encode() + b"\n"


def test_the_go_line_starts_torchrun_with_the_jobs_env_and_cwd(tmp_path: Path) -> None:
    done = _launch(_go(tmp_path))
    assert done.returncode == 0, done.stdout
    seen = json.loads((tmp_path / "worker.json").read_text())
    assert seen == {"forked": True, "mark": "from-the-go-line", "rank": "0", "world": "1", "cwd": str(tmp_path),
                    "stdin": "", "agent_only": None}


def test_without_its_zygote_the_launcher_starts_fresh_workers(tmp_path: Path) -> None:
    """$SPOTVISOR_ZYGOTE=0 (or a host with NVIDIA devices): torchrun's own worker start."""
    done = _launch(_go(tmp_path), SPOTVISOR_ZYGOTE="0")
    assert done.returncode == 0, done.stdout
    assert json.loads((tmp_path / "worker.json").read_text())["forked"] is False


def test_a_failed_worker_fails_the_launcher_as_it_fails_torchrun(tmp_path: Path) -> None:
    done = _launch(_go(tmp_path, JOB_EXIT="3"))
    assert done.returncode == 1  # torchrun's ChildFailedError
    assert "ChildFailedError" in done.stdout


def test_each_failure_torchrun_restarts_is_a_status_line_for_the_agent(tmp_path: Path) -> None:
    """A worker that fails at start twice (before writing anything, as an import error or
    a refused NCCL set-up would), then runs: two ``workers_failed`` lines, restarts left
    counted down; the run that ends the job adds none."""
    script = tmp_path / "worker.py"
    script.write_text("import pathlib, sys\np = pathlib.Path('tries')\nn = int(p.read_text()) if p.exists() else 0\n"
                      "p.write_text(str(n + 1))\nsys.exit(1 if n < 2 else 0)\n")
    status = tmp_path / "status.jsonl"
    line = json.dumps({"argv": ["--standalone", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=0.1",
                                "--max-restarts=3", str(script)],
                       "env": {"PATH": "/usr/bin:/bin", "SPOTVISOR_STATUS_FILE": str(status)}, "cwd": str(tmp_path)})
    done = _launch(line.encode() + b"\n")
    assert done.returncode == 0, done.stdout
    lines = [json.loads(x) for x in status.read_text().splitlines()]
    assert [(x["event"], x["restarts_left"], x["state"]) for x in lines] == [
        ("workers_failed", 2, "failed"), ("workers_failed", 1, "failed")]
    assert (tmp_path / "tries").read_text() == "3"


def test_it_says_ready_on_the_agents_pipe_once_imported() -> None:
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "daemon.gpunode.launcher"], stdin=subprocess.PIPE,
                                env={"PATH": "/usr/bin:/bin", READY_FD_ENV: str(w)}, pass_fds=(w,),
                                cwd=Path(__file__).resolve().parents[1])
        os.close(w)
        w = -1
        with os.fdopen(r, "rb") as ready:
            r = -1
            assert ready.readline() == b"ready\n"  # torchrun imported, waiting for the go line
            assert proc.poll() is None
            proc.communicate(b"", timeout=60)
            assert ready.read() == b""  # said once, then closed
        assert proc.returncode == 0
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


def test_sigterm_stops_torchrun_and_its_worker_without_a_traceback(tmp_path: Path) -> None:
    """How a node leaves the job: the agent's SIGTERM. torchrun stops the worker; the
    launcher then dies by the signal, with one line instead of a traceback."""
    script = tmp_path / "worker.py"
    script.write_text("import os, time\nprint('worker', os.getpid(), flush=True)\ntime.sleep(600)\n")
    go = json.dumps({"argv": ["--standalone", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=0.1",
                              str(script)], "env": {"PATH": "/usr/bin:/bin"}, "cwd": str(tmp_path)}).encode()
    proc = subprocess.Popen([sys.executable, "-m", "daemon.gpunode.launcher"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={"PATH": "/usr/bin:/bin"},
                            cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(go + b"\n")
        proc.stdin.close()
        seen, deadline, worker = b"", time.monotonic() + 60, None
        while worker is None:  # the worker's first line says it runs
            left = deadline - time.monotonic()
            assert left > 0 and select.select([proc.stdout], [], [], left)[0], seen.decode()
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, seen.decode()
            seen += chunk
            m = re.search(rb"^worker (\d+)$", seen, re.M)
            worker = int(m.group(1)) if m else None
        proc.send_signal(signal.SIGTERM)
        out = (seen + proc.stdout.read()).decode()
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert "spotvisor launcher: torchrun stopped by SIGTERM" in out
    assert "Traceback" not in out and "SignalException" not in out, out
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]


def test_no_go_line_starts_nothing(tmp_path: Path) -> None:
    done = _launch(None)
    assert done.returncode == 0 and done.stdout == ""
    assert not (tmp_path / "worker.json").exists()


def test_a_malformed_go_line_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = _launch(b'{"argv": "train.py", "env": {}}\n')
    assert done.returncode == 2
    assert done.stdout.strip() == "spotvisor launcher: bad go line: argv: must be a list of strings (torchrun's arguments)"
