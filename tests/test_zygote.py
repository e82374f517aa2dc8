"""daemon/gpunode/zygote.py: torchrun's workers forked from a process that imported torch.

A real zygote (tests/zygote_host.py, a process of its own) and real clients
(the executable copy of daemon/gpunode/zygote_client.py that torchrun would run as
``PYTHON_EXEC``): what a worker sees is what a fresh ``python -u`` would have given it,
its exit and its signals are the client's, and no worker outlives its client or its
zygote. The launcher with torchrun on top is tests/test_launcher.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.gpunode.zygote import FORKABLE_ENV, LOAD_TIME_ENV, Worker, enabled, entry_module, preloads
from zygote_host import start_host

ROOT = Path(__file__).resolve().parents[1]

PROBE = """\
import json, os, sys
forked = "torch" in sys.modules  # imported by the zygote, before this line ran
name = os.environ["PROBE_OUT"]
json.dump({"forked": forked, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
           "mark": os.environ.get("MARK"), "client_vars": [k for k in os.environ if k.startswith("SPOTVISOR_ZYGOTE")
                                                           or k == "PYTHON_EXEC"],
           "stdin": sys.stdin.read(), "own_session": os.getsid(0) == os.getpid(), "pid": os.getpid()},
          open(name, "w"))
print("to stdout", flush=True)
print("to stderr", file=sys.stderr, flush=True)
sys.exit(int(os.environ.get("EXIT", "0")))
"""

WAITER = """\
import os, signal, sys, time
def term(*_):
    open(os.environ["PROBE_OUT"], "w").write("sigterm")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(os.environ["PROBE_OUT"] + ".pid", "w").write(str(os.getpid()))
signal.pause()
"""


class Host:
    def __init__(self, proc: subprocess.Popen[str], info: dict) -> None:
        self.proc, self.env, self.pid = proc, info["env"], info["pid"]

    def client(self, args: list[str], cwd: Path, stdin: bytes | None = None, **env: str) -> subprocess.Popen[bytes]:
        full = {"PATH": "/usr/bin:/bin", **self.base_env, **self.env, **env}
        return subprocess.Popen([self.env["PYTHON_EXEC"], *args], cwd=cwd, env=full, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    base_env: dict[str, str] = {}


def _start_host(cwd: Path, module: str | None, **more: str) -> Host:
    env = {"PATH": "/usr/bin:/bin", **more}
    proc, info = start_host(env, cwd, module)
    assert info is not None, "the zygote did not start"
    h = Host(proc, info)
    h.base_env = env
    return h


def _end_host(h: Host) -> None:
    if h.proc.poll() is None:
        h.proc.stdin.close()  # type: ignore[union-attr]
        h.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """One zygote for the module's tests (its preload of trainer.run is ~6 s), each worker its own."""
    h = _start_host(tmp_path_factory.mktemp("zygote"), "trainer.run")
    yield h
    _end_host(h)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _worker_pid(out: Path) -> int:
    """The waiter's pid, once it has written it whole (it writes it once it is set up)."""
    pid_file = Path(f"{out}.pid")
    _until(lambda: pid_file.exists() and pid_file.read_text().isdigit(), "the worker started")
    return int(pid_file.read_text())


def _until(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_forked_worker_sees_what_a_fresh_interpreter_would(host: Host, tmp_path: Path) -> None:
    script = _write(tmp_path, "probe.py", PROBE)
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "probe.json"
    proc = host.client(["-u", str(script), "--flag", "x"], work, MARK="job", PROBE_OUT=str(out), EXIT="3")
    stdout, stderr = proc.communicate(b"from stdin", timeout=60)
    assert proc.returncode == 3
    assert stdout == b"to stdout\n" and b"to stderr\n" in stderr, stderr
    seen = json.loads(out.read_text())
    assert seen["forked"] is True
    assert seen | {"pid": 0} == {"forked": True, "argv": [str(script), "--flag", "x"], "cwd": str(work),
                                 "path0": str(tmp_path), "name": "__main__", "mark": "job", "client_vars": [],
                                 "stdin": "from stdin", "own_session": True, "pid": 0}
    assert seen["pid"] != proc.pid  # the client stood in for it


def test_a_module_worker_runs_as_main_with_the_working_directory_first_on_its_path(host: Host,
                                                                                   tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _write(pkg, "probe.py", PROBE)
    out = tmp_path / "m.json"
    proc = host.client(["-u", "-m", "mypkg.probe", "a"], tmp_path, PROBE_OUT=str(out))
    proc.communicate(b"", timeout=60)
    assert proc.returncode == 0
    seen = json.loads(out.read_text())
    assert (seen["forked"], seen["name"], seen["path0"]) == (True, "__main__", str(tmp_path))
    assert seen["argv"] == [str(pkg / "probe.py"), "a"]


def test_the_preloaded_trainer_module_runs_afresh_as_main(host: Host, tmp_path: Path) -> None:
    """trainer.run was imported by the zygote; -m trainer.run still runs its main (its --help)."""
    proc = host.client(["-u", "-m", "trainer.run", "--help"], tmp_path)
    stdout, stderr = proc.communicate(b"", timeout=60)
    assert proc.returncode == 0, stderr
    assert b"--target-steps" in stdout
    assert b"RuntimeWarning" not in stderr


def test_a_workers_exception_reads_as_a_fresh_interpreters_traceback(host: Host, tmp_path: Path) -> None:
    script = _write(tmp_path, "boom.py", "def f():\n    raise ValueError('boom')\nf()\n")
    proc = host.client(["-u", str(script)], tmp_path)
    _, stderr = proc.communicate(b"", timeout=60)
    assert proc.returncode == 1
    lines = stderr.decode().splitlines()
    assert lines[0] == "Traceback (most recent call last):" and str(script) in lines[1], stderr
    assert lines[-1] == "ValueError: boom" and "zygote" not in stderr.decode() and "runpy" not in stderr.decode()


def test_torchruns_sigterm_to_the_clients_group_reaches_the_worker(host: Host, tmp_path: Path) -> None:
    script = _write(tmp_path, "waiter.py", WAITER)
    out = tmp_path / "w.out"
    proc = host.client(["-u", str(script)], tmp_path, PROBE_OUT=str(out))
    _worker_pid(out)
    os.killpg(proc.pid, signal.SIGTERM)  # as torchrun's SubprocessHandler.close does
    proc.wait(timeout=30)
    assert proc.returncode == 0 and out.read_text() == "sigterm"


def test_a_workers_group_exists_when_its_pid_is_answered(host: Host, tmp_path: Path) -> None:
    """torchrun's SIGTERM can reach the client before the zygote's answer (a round ended while
    its workers were being forked); the client relays it to the worker's group the instant
    it reads the pid. That group must exist by then, or the stop is lost and the worker
    trains on until torchrun's SIGKILL (seen under load: 11 steps of a stale world)."""
    script = _write(tmp_path, "pause.py", "import signal\nsignal.pause()\n")
    body = json.dumps({"argv": ["-u", str(script)], "env": {"PATH": "/usr/bin:/bin", **host.base_env},
                       "cwd": str(tmp_path)}).encode()
    for _ in range(10):  # the fork and the answer race; each try is a fresh worker
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, open(os.devnull, "rb") as null:
            s.connect(host.env["SPOTVISOR_ZYGOTE_SOCKET"])
            socket.send_fds(s, [struct.pack("!I", len(body)) + body], [null.fileno()] * 3)
            s.settimeout(120)  # the first request waits for the zygote's preload (slow under load)
            replies = s.makefile("rb")
            pid = json.loads(replies.readline())["pid"]
            os.killpg(pid, signal.SIGTERM)  # what the client does with a SIGTERM it held
            assert json.loads(replies.readline()) == {"exit": -signal.SIGTERM}


def test_a_worker_killed_by_a_signal_kills_its_client_by_that_signal(host: Host, tmp_path: Path) -> None:
    script = _write(tmp_path, "waiter.py", WAITER)
    out = tmp_path / "w.out"
    proc = host.client(["-u", str(script)], tmp_path, PROBE_OUT=str(out))
    os.kill(_worker_pid(out), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, stderr


def test_a_sigkilled_client_takes_its_worker_with_it(host: Host, tmp_path: Path) -> None:
    script = _write(tmp_path, "waiter.py", WAITER)
    out = tmp_path / "w.out"
    proc = host.client(["-u", str(script)], tmp_path, PROBE_OUT=str(out))
    worker = psutil.Process(_worker_pid(out))
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun's last word: it reaches the client only
    proc.wait(timeout=30)
    worker.wait(timeout=30)  # psutil.TimeoutExpired if it lives on
    probe, seen = _write(tmp_path, "probe.py", PROBE), tmp_path / "after.json"
    after = host.client(["-u", str(probe)], tmp_path, PROBE_OUT=str(seen))  # and the zygote serves on
    after.communicate(b"", timeout=60)
    assert after.returncode == 0 and json.loads(seen.read_text())["forked"] is True


def test_the_zygotes_end_ends_its_workers_and_their_clients(tmp_path: Path) -> None:
    host = _start_host(tmp_path, None)
    script = _write(tmp_path, "waiter.py", WAITER)
    out = tmp_path / "w.out"
    proc = host.client(["-u", str(script)], tmp_path, PROBE_OUT=str(out))
    worker = psutil.Process(_worker_pid(out))
    host.proc.kill()  # the launcher SIGKILLed: the zygote's control pipe closes
    host.proc.wait(timeout=30)
    worker.wait(timeout=30)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode != 0
    _until(lambda: not psutil.pid_exists(host.pid) or psutil.Process(host.pid).status() == psutil.STATUS_ZOMBIE,
           "the zygote ended")
    # its directory (the socket and the clients' executable) goes with it: one was left in
    # /tmp per node start before, thousands on a machine that ran the suite for a while
    assert not Path(host.env["PYTHON_EXEC"]).parent.exists()


@pytest.mark.parametrize("args,env", [(["-u", "-X", "dev"], {}), (["-u"], {"LD_PRELOAD": ""}),
                                      (["-u"], {"OMP_NUM_THREADS": "lots"})],
                         ids=["an-interpreter-option", "a-load-time-variable", "a-bad-thread-count"])
def test_what_a_fork_cannot_honour_starts_a_fresh_interpreter(host: Host, tmp_path: Path, args: list[str],
                                                              env: dict[str, str]) -> None:
    script = _write(tmp_path, "probe.py", PROBE)
    out = tmp_path / "p.json"
    proc = host.client([*args, str(script)], tmp_path, PROBE_OUT=str(out), **env)
    _, stderr = proc.communicate(b"", timeout=120)
    assert proc.returncode == 0, stderr
    assert json.loads(out.read_text())["forked"] is False
    assert b"zygote refused" in stderr and b"starting a fresh interpreter" in stderr


def test_a_zygote_whose_imports_started_a_thread_forks_nothing(tmp_path: Path) -> None:
    """A fork of a process with other threads may deadlock (a lock held by a thread that
    is not copied): such a zygote answers every request fallback, and each worker starts fresh."""
    (tmp_path / "threader.py").write_text("import threading, time\n"
                                          "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    host = _start_host(tmp_path, None, SPOTVISOR_ZYGOTE_PRELOAD="threader", PYTHONPATH=str(tmp_path))
    try:
        script = _write(tmp_path, "probe.py", PROBE)
        out = tmp_path / "p.json"
        proc = host.client(["-u", str(script)], tmp_path, PROBE_OUT=str(out))
        _, stderr = proc.communicate(b"", timeout=120)
        assert proc.returncode == 0, stderr
        assert json.loads(out.read_text())["forked"] is False
        assert b"zygote refused: unsafe to fork: 1 thread(s) started by its imports" in stderr, stderr
    finally:
        _end_host(host)


def test_a_variable_the_zygotes_imports_set_refuses_no_worker_and_reaches_each(tmp_path: Path) -> None:
    """DeepSpeed's import sets ``$PYTORCH_NVML_BASED_CUDA_CHECK`` (``os.environ.setdefault``).
    A zygote that preloads such a module still forks the workers, whose environment does
    not name the variable (it is not a difference they asked for), and each sees it, as
    the same import in a fresh interpreter would have set it, as is a worker that sets it
    to that value (a parent process that imported DeepSpeed after the zygote started
    passes it on); a worker that sets it to another value starts fresh (the module loaded
    with the zygote's)."""
    (tmp_path / "setter.py").write_text("import os\nos.environ.setdefault('PYTORCH_SPOTVISOR_PROBE', '1')\n")
    host = _start_host(tmp_path, None, SPOTVISOR_ZYGOTE_PRELOAD="setter", PYTHONPATH=str(tmp_path))
    try:
        script = _write(tmp_path, "probe.py", "import json, os, sys\n"
                        "json.dump([\"setter\" in sys.modules, os.environ.get(\"PYTORCH_SPOTVISOR_PROBE\")], "
                        "open(os.environ[\"PROBE_OUT\"], \"w\"))\n")
        seen = []
        for name, own in (("plain", {}), ("same", {"PYTORCH_SPOTVISOR_PROBE": "1"}),
                          ("other", {"PYTORCH_SPOTVISOR_PROBE": "0"})):
            proc = host.client(["-u", str(script)], tmp_path, PROBE_OUT=str(tmp_path / name), **own)
            _, stderr = proc.communicate(b"", timeout=120)
            assert proc.returncode == 0, stderr
            seen.append(json.loads((tmp_path / name).read_text()))
        assert seen == [[True, "1"], [True, "1"], [False, "0"]], stderr
        assert b"$PYTORCH_SPOTVISOR_PROBE differs from the zygote's" in stderr, stderr
    finally:
        _end_host(host)


def test_a_malformed_request_is_dropped_and_the_zygote_serves_the_next(host: Host, tmp_path: Path) -> None:
    for payload in (struct.pack("!I", 1 << 30), struct.pack("!I", 5) + b"nope!", b"\x00"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(host.env["SPOTVISOR_ZYGOTE_SOCKET"])
            with open(os.devnull, "rb") as null:
                socket.send_fds(s, [payload], [null.fileno()] * 3)
            s.settimeout(30)
            assert s.recv(100) == b""  # closed unanswered
    script = _write(tmp_path, "probe.py", PROBE)
    out = tmp_path / "p.json"
    proc = host.client(["-u", str(script)], tmp_path, PROBE_OUT=str(out))
    proc.communicate(b"", timeout=60)
    assert proc.returncode == 0 and json.loads(out.read_text())["forked"] is True


def test_without_a_zygote_the_client_is_a_plain_interpreter(tmp_path: Path) -> None:
    """The socket is gone (a zygote that never started, or ended): the worker still starts."""
    from daemon.gpunode.zygote import _client_file

    client = _client_file(str(tmp_path))
    assert client is not None
    script = _write(tmp_path, "probe.py", PROBE)
    out = tmp_path / "p.json"
    env = {"PATH": "/usr/bin:/bin", "PROBE_OUT": str(out), "PYTHON_EXEC": client,
           "SPOTVISOR_ZYGOTE_SOCKET": str(tmp_path / "absent.sock"), "SPOTVISOR_ZYGOTE_PYTHON": sys.executable}
    done = subprocess.run([client, "-u", str(script)], env=env, cwd=tmp_path, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(out.read_text())
    assert seen["forked"] is False and seen["client_vars"] == []


# -- the decisions, without processes ---------------------------------------------------------

def test_entry_module_reads_the_jobspecs_torchrun_line() -> None:
    assert entry_module(["-m", "torch.distributed.run", "--nnodes=1:3", "--monitor-interval=0.5", "-m", "trainer.run",
                         "--target-steps", "5"]) == "trainer.run"
    assert entry_module(["-m", "torch.distributed.run", "--nnodes=1", "train.py", "-m", "x"]) == "x"  # harmless: not ours
    assert entry_module(["-m", "torch.distributed.run", "--nnodes=1", "train.py"]) is None


def test_only_this_projects_modules_are_imported_ahead() -> None:
    assert "trainer.run" in preloads("trainer.run")
    assert preloads("users_train") == preloads(None) == ["torch", "torch.distributed", "torch.nn.parallel"]


def test_a_worker_differing_only_in_what_a_fork_can_take_is_forked() -> None:
    base = {"PATH": "/bin", "LD_LIBRARY_PATH": "/x", "OMP_NUM_THREADS": "8"}
    worker = Worker(["-u", "-m", "trainer.run"], {**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": "/code",
                                                  "TORCHELASTIC_RUN_ID": "r", "RANK": "0"}, "/")
    assert worker.refusal(base) is None
    assert Worker(["-u", "-m", "m"], {**base, "LD_LIBRARY_PATH": "/y"}, "/").refusal(base) is not None
    assert Worker(["-u", "-m", "m"], {"PATH": "/bin", "OMP_NUM_THREADS": "8"}, "/").refusal(base) is not None
    assert Worker(["-O", "-m", "m"], base, "/").refusal(base) is not None
    assert Worker(["-u", "-m", "m"], {"PATH": "/bin", "LD_LIBRARY_PATH": "/x"}, "/").refusal(base) is not None


def test_the_zygote_is_off_where_nvidia_devices_are_unless_asked(tmp_path: Path) -> None:
    assert enabled({}, str(tmp_path))
    (tmp_path / "nvidia0").touch()
    assert not enabled({}, str(tmp_path))
    assert enabled({"SPOTVISOR_ZYGOTE": "1"}, str(tmp_path))
    assert not enabled({"SPOTVISOR_ZYGOTE": "0"}, str(ROOT))
    assert enabled({"CUDA_VISIBLE_DEVICES": ""}, str(tmp_path))  # the local provider hid them: no CUDA here
    assert not enabled({"CUDA_VISIBLE_DEVICES": "1"}, str(ROOT))


_NAMES = st.one_of(st.sampled_from(["LD_PRELOAD", "PYTHONPATH", "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                     "HF_HOME", "TORCH_LOGS", "TORCHELASTIC_RUN_ID", "RANK", "PATH"]),
                   st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=12))
_VALUES = st.one_of(st.sampled_from(["1", "4", ""]), st.text(max_size=5))


@given(base=st.dictionaries(_NAMES, _VALUES, max_size=8), changed=st.dictionaries(_NAMES, _VALUES, max_size=8))
def test_a_fork_is_refused_exactly_when_a_load_time_variable_changes(base: dict[str, str],
                                                                     changed: dict[str, str]) -> None:
    worker = Worker(["-u", "-m", "m"], {**base, **changed}, "/")
    differs = {k for k, v in changed.items() if base.get(k) != v}
    load_time = {k for k in differs if k.startswith(LOAD_TIME_ENV) and k not in FORKABLE_ENV}
    threads = {k for k in differs if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") and not changed[k].isdigit()}
    assert (worker.refusal(base) is None) == (not load_time and not threads)


def test_preloads_follow_worker_preload_once_each_and_report_what_fails(tmp_path: Path, monkeypatch) -> None:
    from daemon.gpunode.zygote import _load

    (tmp_path / "zyg_a.py").write_text("WORKER_PRELOAD = ('zyg_b', 'zyg_missing')\n")
    (tmp_path / "zyg_b.py").write_text("WORKER_PRELOAD = ('zyg_a',)\nimport os\nos.environ['ZYG_B_RUNS'] += 'x'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ZYG_B_RUNS", "")
    failed = _load(["zyg_a"])  # a names b, b names a: each imported once, no loop
    assert os.environ["ZYG_B_RUNS"] == "x"
    assert failed == ["zyg_missing: No module named 'zyg_missing'"]


def test_a_stop_asked_for_before_a_refusal_starts_no_fresh_worker(tmp_path: Path) -> None:
    """torchrun's SIGTERM reaches the client while the zygote has not answered yet; the
    answer is a refusal: the client dies by that signal instead of starting the worker fresh."""
    import threading

    from daemon.gpunode.zygote import _client_file

    client = _client_file(str(tmp_path))
    assert client is not None
    path = str(tmp_path / "z.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    asked, answer = threading.Event(), threading.Event()

    def zygote() -> None:
        conn, _ = listener.accept()
        socket.recv_fds(conn, 65536, 3)
        asked.set()
        answer.wait(30)
        conn.sendall(b'{"fallback": "a test refusal"}\n')
        conn.close()

    server = threading.Thread(target=zygote, daemon=True)
    server.start()
    marker = tmp_path / "ran"
    script = _write(tmp_path, "w.py", f"open({str(marker)!r}, 'w').write('ran')\n")
    env = {"PATH": "/usr/bin:/bin", "SPOTVISOR_ZYGOTE_SOCKET": path, "SPOTVISOR_ZYGOTE_PYTHON": sys.executable}
    proc = subprocess.Popen([client, "-u", str(script)], env=env, cwd=tmp_path, start_new_session=True)
    try:
        assert asked.wait(30), "the client never asked"
        # queued before the answer is sent: its handler runs before the client reads the answer
        os.killpg(proc.pid, signal.SIGTERM)
        answer.set()
        assert proc.wait(30) == -signal.SIGTERM
        assert not marker.exists()
    finally:
        answer.set()
        if proc.poll() is None:
            proc.kill()
        listener.close()
