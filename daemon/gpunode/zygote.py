"""A fork server for torchrun's workers: each starts with torch and its trainer imported.

A fresh worker spends most of its start importing: ``trainer.run`` with its GPT-2 model
class is 5.6 CPU-s on this project's 2-core test machine, and a node pays it again for each
worker and for each time torchrun restarts them; forked from a process that imported
them already, a worker's start costs 0.2 CPU-s. The launcher
(:mod:`daemon.gpunode.launcher`) forks the zygote right after its own import, while the
node still waits for admission. The zygote imports the worker's modules (:func:`preloads`),
listens on a Unix socket in a directory only this user can enter, and forks one worker per
request of :mod:`daemon.gpunode.zygote_client`, the command torchrun runs in the
worker's place (``PYTHON_EXEC``).

What a forked worker keeps from a fresh ``python -u -m <module>`` (or ``python -u
script.py``): its arguments (``sys.argv``), environment, working directory, ``sys.path``
(the script's directory or the working directory first, then ``$PYTHONPATH``, then the
interpreter's), standard streams, ``__main__`` run by :mod:`runpy`, a session and process
group of its own (torchrun signals the group), ``random`` and NumPy's global generator
seeded anew, and ``OMP_NUM_THREADS`` (torchrun sets it per worker) applied with
``torch.set_num_threads``. What it cannot keep, it does not pretend to: a request with
other interpreter options than ``-u``, or whose environment differs from the zygote's in
a variable read when a library loads (:data:`LOAD_TIME_ENV`), is answered ``fallback``,
and the client execs a fresh interpreter.

It listens before it imports, and the launcher says ``ready`` to the agent without
waiting for the imports: the node is admitted as early as before, and a worker asked for
during the imports waits in the socket's backlog for them (about as long as its own
fresh import would have taken).

Safe to fork only while single-threaded and with CUDA untouched: after its preloads the
zygote checks both (``/proc/self/task``, ``torch.cuda.is_initialized``) and otherwise
answers every request ``fallback``. On a host with NVIDIA devices it is off unless ``$SPOTVISOR_ZYGOTE`` is
``1`` (:func:`enabled`): a CUDA driver touched by an import would break every forked
worker's CUDA, and that has not been measured on a GPU yet. ``0`` turns it off anywhere.

Its workers end with it: when the launcher's end of its control pipe closes (the
launcher exited or was killed), it SIGKILLs each worker's process group it still has
and exits; when a client's connection closes before its worker ended (torchrun SIGKILLed
the client), that worker's group is SIGKILLed.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from daemon.gpunode import zygote_client
from daemon.gpunode.zygote_client import PYTHON_ENV, SOCKET_ENV
from daemon.host_gpus import host_gpus
from trainer.contract import ZYGOTE_PRELOAD_ENV

__all__ = ["Worker", "Zygote", "enabled", "entry_module", "preloads", "fork_server", "LOAD_TIME_ENV", "ENABLE_ENV",
           "MODULE_ENV", "PRELOAD_ENV"]

ENABLE_ENV = "SPOTVISOR_ZYGOTE"  # "1": on even where NVIDIA devices are; "0": off
MODULE_ENV = "SPOTVISOR_ZYGOTE_MODULE"  # the prewarmed launcher's: the module the job's workers will run
PRELOAD_ENV = ZYGOTE_PRELOAD_ENV  # job.preload: more modules to import before the fork (preloads)
MAX_REQUEST = 1 << 20  # bytes: an environment and a command line, never more
MAX_WORKERS = 256  # connections (workers) at once; one more is closed unanswered
REQUEST_TIMEOUT_S = 10.0  # a client that connects and does not send its request in time is dropped

# environment variables read when the interpreter, torch, its OpenMP or the allocator
# loads: a worker whose value differs from the zygote's cannot be forked faithfully
LOAD_TIME_ENV = ("LD_", "PYTHON", "MALLOC_", "GOMP_", "KMP_", "MKL_", "OMP_", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL",
                 "TORCH_SHOW_CPP_STACKTRACES", "HF_", "TRANSFORMERS_", "CUDA_MODULE_LOADING", "PYTORCH_")
# ...but these the worker can take after the fork: sys.path from PYTHONPATH, unbuffered
# standard streams from -u, sys.dont_write_bytecode, thread counts with torch.set_num_threads
FORKABLE_ENV = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def enabled(environ: dict[str, str] | os._Environ[str], dev: str = "/dev") -> bool:
    """Whether the launcher forks a zygote: ``$SPOTVISOR_ZYGOTE`` ``1``/``0`` decides;
    unset, only where this process sees no GPU (:func:`daemon.host_gpus.host_gpus`:
    none in ``/dev``, or ``CUDA_VISIBLE_DEVICES`` empty, as the local provider hides them)."""
    said = environ.get(ENABLE_ENV, "")
    if said in ("0", "1"):
        return said == "1"
    return not host_gpus(environ, dev)


def entry_module(torchrun_argv: list[str]) -> str | None:
    """The module torchrun's workers run in a torchrun command line (``["-m",
    "torch.distributed.run", <options>, "-m", <module>, <args>]``, as
    :mod:`daemon.controlnode.jobspec` builds it): the name after the first ``-m`` past the
    first two words; None for a script."""
    rest = list(torchrun_argv[2:])
    if "-m" in rest and rest.index("-m") + 1 < len(rest):
        return rest[rest.index("-m") + 1]
    return None


def preloads(entry_module: str | None, extra: str = "") -> list[str]:
    """The modules the zygote imports for a job whose workers run ``entry_module``: torch's
    distributed package always; this project's own modules (``trainer.*``) themselves and
    what they name in ``WORKER_PRELOAD`` (lazy imports such as the model classes); then
    ``extra``, the job's ``$SPOTVISOR_ZYGOTE_PRELOAD`` (``job.preload``, comma-separated
    module names: a user's script's heavy imports, ``transformers`` say). A user's entry
    module itself is not imported: its import might do work; its workers import it after
    the fork."""
    names = ["torch", "torch.distributed", "torch.nn.parallel"]
    if entry_module and (entry_module == "trainer" or entry_module.startswith("trainer.")):
        names.append(entry_module)
    names += [n.strip() for n in extra.split(",") if n.strip() and n.strip() not in names]
    return names


def _load(names: list[str]) -> list[str]:
    """Import each name, and what each module lists in ``WORKER_PRELOAD``; the failures
    as ``"name: error"`` (a worker that needs it then fails with its own traceback)."""
    failed = []
    todo, seen = list(names), set(names)
    while todo:
        name = todo.pop(0)
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import error is the worker's to show
            failed.append(f"{name}: {exc}")
            continue
        more = [m for m in getattr(mod, "WORKER_PRELOAD", ()) if m not in seen]
        todo += more
        seen.update(more)
    return failed


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _cuda_touched() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


@dataclass
class Worker:
    """One forked worker, in the child: the interpreter ``argv`` after the executable
    (``["-u", "-m", "trainer.run", ...]``), its environment and working directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: str

    def entry(self) -> tuple[str, str, list[str]] | None:
        """``("module" | "script", name, args)``; None when an option other than ``-u``
        comes first (the client then starts a fresh interpreter)."""
        argv = list(self.argv)
        while argv and argv[0] == "-u":
            argv.pop(0)
        if len(argv) >= 2 and argv[0] == "-m":
            return "module", argv[1], argv[2:]
        if argv and not argv[0].startswith("-"):
            return "script", argv[0], argv[1:]
        return None

    def refusal(self, base_env: dict[str, str], set_by_imports: dict[str, str] | None = None) -> str | None:
        """Why this worker cannot be forked from a zygote started with ``base_env``, whose
        imports then set ``set_by_imports``, or None. A variable the imports set may be
        absent from the worker's environment or hold the value they gave it."""
        if self.entry() is None:
            return f"interpreter options {self.argv[:3]} other than -u"
        imported = set_by_imports or {}
        for key in sorted(set(base_env) | set(self.env)):
            mine = self.env.get(key)
            if (key.startswith(LOAD_TIME_ENV) and key not in FORKABLE_ENV and mine != base_env.get(key)
                    and not (key in imported and mine == imported[key])):
                return f"${key} differs from the zygote's (read when a library loads)"
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            value = self.env.get(key)
            if value is None and base_env.get(key) is not None:
                return f"${key} unset, where the zygote's was set (read when a library loads)"
            if value is not None and not value.isdigit() and value != base_env.get(key):
                return f"${key}={value!r} is not a thread count"
        return None

    def become(self, base_path: list[str], base_pythonpath: list[str],
               set_by_imports: dict[str, str] | None = None) -> None:
        """In the forked child: take this worker's environment, directory, ``sys.path`` and
        thread counts (the session and streams are set by the zygote before).
        ``set_by_imports``: the variables the zygote's imports set (``os.environ.setdefault``
        as DeepSpeed's does); the worker keeps each one its own environment does not name,
        as the same import in a fresh interpreter would have left it."""
        os.environ.clear()
        os.environ.update({**(set_by_imports or {}), **self.env})
        os.chdir(self.cwd)
        kind, name, _ = self.entry() or ("module", "", [])
        first = os.getcwd() if kind == "module" else os.path.dirname(os.path.realpath(name))
        pythonpath = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        rest = [p for p in base_path[1:] if p not in base_pythonpath]
        sys.path[:] = [first, *pythonpath, *rest]
        importlib.invalidate_caches()
        sys.dont_write_bytecode = bool(self.env.get("PYTHONDONTWRITEBYTECODE"))
        torch = sys.modules.get("torch")
        threads = self.env.get("OMP_NUM_THREADS") or self.env.get("MKL_NUM_THREADS")
        if torch is not None and threads and threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()  # a fresh process's: from the OS's entropy

    def run(self) -> None:
        """Run the worker's ``__main__`` as ``python -m``/``python script`` would: its
        SystemExit and KeyboardInterrupt propagate (the interpreter exits as it would); an
        exception is reported, without this module's frames or runpy's, and exits 1."""
        import runpy

        kind, name, args = self.entry() or ("module", "", [])
        sys.argv = [name, *args]  # runpy sets [0] to the module's file
        try:
            if kind == "module":
                sys.modules.pop(name, None)  # preloaded: run afresh as __main__, as -m does
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(name, run_name="__main__")
        except Exception as exc:  # noqa: BLE001 - reported as the interpreter would
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
                tb = tb.tb_next
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)
            sys.exit(1)


class Zygote:
    """The launcher's handle on its zygote: ``pid``, the socket ``path``, and the write end
    of the control pipe (closing it, or the launcher's exit, ends the zygote)."""

    def __init__(self, pid: int, path: str, control_w: int, client: str) -> None:
        self.pid, self.path, self.control_w, self.client = pid, path, control_w, client

    def worker_env(self) -> dict[str, str]:
        """The variables torchrun's environment needs for its workers to come from here."""
        return {"PYTHON_EXEC": self.client, SOCKET_ENV: self.path, PYTHON_ENV: sys.executable}


def _client_file(directory: str) -> str | None:
    """An executable copy of :mod:`daemon.gpunode.zygote_client` run by this interpreter
    in isolated mode; None if a shebang cannot name it (a space, or longer than Linux reads)."""
    shebang = f"#!{sys.executable} -IS\n"
    if " " in sys.executable or len(shebang) > 200:
        return None
    path = os.path.join(directory, "python")
    source = Path(zygote_client.__file__).read_text()
    with open(path, "w") as f:
        f.write(shebang + source)
    os.chmod(path, stat.S_IRWXU)
    return path


def fork_server(entry_module: str | None, close_fds: tuple[int, ...] = ()) -> Zygote | Worker | None:
    """Fork the zygote. Returns, in the launcher, its :class:`Zygote` once it listens (it
    imports after that, while the launcher goes on; None if it could not start, with a
    line on standard error saying why); in a forked worker,
    that :class:`Worker`, to :meth:`Worker.run` (this call returns there a second time,
    once per worker). ``close_fds``: the launcher's descriptors the zygote must not keep
    (the agent's ready pipe)."""
    directory = tempfile.mkdtemp(prefix="spotvisor-zygote-")  # 0700
    client = _client_file(directory)
    if client is None:
        shutil.rmtree(directory, ignore_errors=True)
        print("spotvisor launcher: no zygote: the interpreter's path cannot be a shebang", file=sys.stderr, flush=True)
        return None
    path = os.path.join(directory, "sock")
    ready_r, ready_w = os.pipe()
    control_r, control_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the zygote (and, returning from _serve, each worker)
        os.close(ready_r)
        os.close(control_w)
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the launcher's standard input is the agent's go line: not ours
        os.close(devnull)
        try:
            return _Server(path, control_r).serve(entry_module, ready_w)
        except BaseException as exc:  # neither the zygote nor a worker not yet set up unwinds into the launcher
            print(f"spotvisor zygote: {exc!r}", file=sys.stderr, flush=True)
            os._exit(1)
    os.close(ready_w)
    os.close(control_r)
    with os.fdopen(ready_r, "rb") as r:
        said = r.read()
    if said != b"ok":
        print(f"spotvisor launcher: no zygote: {said.decode(errors='replace') or 'it exited'}", file=sys.stderr,
              flush=True)
        os.close(control_w)
        os.waitpid(pid, 0)
        shutil.rmtree(directory, ignore_errors=True)
        return None
    return Zygote(pid, path, control_w, client)


class _Server:
    """The zygote's loop: one thread, :mod:`selectors` over the listening socket, the
    control pipe, SIGCHLD's wake-up socket and each client's connection."""

    def __init__(self, path: str, control_r: int) -> None:
        self.path = path
        self.control_r = control_r
        self.workers: dict[int, socket.socket] = {}  # worker pid -> its client's connection
        self.unsafe: str | None = None  # why nothing may be forked here (its imports started threads or CUDA)
        self.set_by_imports: dict[str, str] = {}  # the environment variables the preloads set
        self.sel = selectors.DefaultSelector()

    def serve(self, entry_module: str | None, ready_w: int) -> Worker:
        """Listen, say ``ok`` on ``ready_w`` (the launcher goes on at once), import, check,
        and fork a worker per request (those that came during the imports waited in the
        socket's backlog); returns only in a forked worker, set up as its :class:`Worker`.
        Imports that leave the process unsafe to fork make it answer every request
        ``fallback`` (each worker then starts fresh, as without a zygote)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(64)
        os.write(ready_w, b"ok")
        os.close(ready_w)
        started_with = dict(os.environ)  # the job's environment, as the launcher gave it: what workers compare with
        # NumPy's OpenBLAS starts its thread pool when it loads and stops it around each fork
        # itself (pthread_atfork, OpenBLAS's memory.c): those threads are no hazard
        _load(["numpy"])
        baseline = _threads()
        failed = _load(preloads(entry_module, os.environ.get(PRELOAD_ENV, "")))
        for line in failed:
            print(f"spotvisor zygote: preload {line}", file=sys.stderr, flush=True)
        threads = _threads()
        if threads > baseline or _cuda_touched():
            self.unsafe = (f"unsafe to fork: {threads - baseline} thread(s) started by its imports" if threads > baseline
                           else "unsafe to fork: CUDA initialised by its imports")
            print(f"spotvisor zygote: {self.unsafe}; every worker starts fresh", file=sys.stderr, flush=True)
        # what the imports themselves set (DeepSpeed's import sets $PYTORCH_NVML_BASED_CUDA_CHECK):
        # not a difference a worker could have asked for, and in a fresh interpreter the
        # same import would set it where the worker's environment does not
        self.set_by_imports = {k: v for k, v in os.environ.items() if started_with.get(k) != v}
        base_env, base_path = started_with, list(sys.path)
        base_pythonpath = [p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        listener.setblocking(False)
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so the wake-up fd is written
        signal.set_wakeup_fd(wake_w.fileno())
        self.sel.register(listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.control_r, selectors.EVENT_READ, "control")
        self.sel.register(wake_r, selectors.EVENT_READ, "child")
        while True:
            for key, _ in self.sel.select():
                if key.data == "accept":
                    spec = self._accept(listener, base_env)
                    if spec is not None:  # in the worker now
                        worker, conn, fds, grouped = spec
                        self._become_child(worker, fds, [listener, wake_r, wake_w, conn], grouped)
                        worker.become(base_path, base_pythonpath, self.set_by_imports)
                        return worker
                elif key.data == "control":
                    self._end()
                elif key.data == "child":
                    try:
                        wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                    self._reap()
                else:  # a client's connection: readable means it closed (it sends nothing after the request)
                    self._client_gone(key.data)

    def _accept(self, listener: socket.socket,
                base_env: dict[str, str]) -> tuple[Worker, socket.socket, list[int], int] | None:
        """Serve one request: fork its worker and answer its pid, or refuse it. In the forked
        worker: ``(worker, connection, its three descriptors, grouped)``, ``grouped`` the
        descriptor to close once it has its own session (:meth:`_become_child`); None here.

        The pid is answered only once the worker's process group exists (it closes
        ``grouped`` right after ``setsid``, or dies): the client relays torchrun's signals
        to that group, and a SIGTERM sent the instant the pid is known, to a group that did
        not exist yet, was lost (``killpg``: no such process): the worker of a round
        torchrun had already ended trained on until torchrun's SIGKILL 30 s later (seen
        under load: 11 steps of a stale world, the stop's wait for nothing)."""
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return None
        if len(self.workers) >= MAX_WORKERS:
            conn.close()
            return None
        fds: list[int] = []
        try:
            conn.setblocking(True)
            conn.settimeout(REQUEST_TIMEOUT_S)
            worker, fds = _read_request(conn)
            why = self.unsafe or worker.refusal(base_env, self.set_by_imports)
            if why is not None:
                conn.sendall(json.dumps({"fallback": why}).encode() + b"\n")
                raise ValueError(why)
        except (OSError, ValueError, KeyError, TypeError):
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        grouped_r, grouped_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (*fds, grouped_r, grouped_w):
                os.close(fd)
            conn.close()
            return None
        if pid == 0:
            os.close(grouped_r)
            return worker, conn, fds, grouped_w
        os.close(grouped_w)
        for fd in fds:
            os.close(fd)
        try:
            os.read(grouped_r, 1)  # end of file: the worker has its own group now, or is gone
        finally:
            os.close(grouped_r)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:  # the client is gone already: so is its worker
            _killpg(pid)
        conn.setblocking(False)
        self.workers[pid] = conn
        self.sel.register(conn, selectors.EVENT_READ, pid)
        return None

    def _become_child(self, worker: Worker, fds: list[int], close: list[socket.socket], grouped: int) -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.sel.close()
        for sock in close:
            sock.close()
        for conn in self.workers.values():
            conn.close()
        os.close(self.control_r)
        os.setsid()  # a session and group of its own: torchrun's killpg reaches it and its children
        os.close(grouped)  # the zygote may answer its pid now (_accept)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        _name_process(worker)

    def _reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            if conn is None:
                continue
            if conn.fileno() in self.sel.get_map():  # not if _client_gone took it out already
                self.sel.unregister(conn)
            try:
                conn.setblocking(True)
                conn.settimeout(1.0)
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            conn.close()

    def _client_gone(self, pid: int) -> None:
        conn = self.workers.get(pid)
        if conn is None:
            return
        self.sel.unregister(conn)
        _killpg(pid)  # reaped (and its connection closed) by _reap

    def _end(self) -> None:
        for pid in list(self.workers):
            _killpg(pid)
        for pid in list(self.workers):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)  # the socket and the client's copy
        os._exit(0)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _name_process(worker: Worker) -> None:
    """The worker's name in ``ps``/``top`` (``/proc/self/comm``, 15 bytes): its module or script."""
    entry = worker.entry()
    name = (entry[1].rsplit(".", 1)[-1] if entry and entry[0] == "module" else os.path.basename(entry[1]) if entry
            else "worker")
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _read_request(conn: socket.socket) -> tuple[Worker, list[int]]:
    """A client's request and its three descriptors. Raises ValueError (malformed, too
    long, not three descriptors) or OSError (closed, timed out)."""
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    try:
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors, not 3")
        while len(data) < 4:
            chunk = conn.recv(65536)
            if not chunk:
                raise ValueError("closed in the length")
            data += chunk
        (length,) = struct.unpack("!I", data[:4])
        if length > MAX_REQUEST:
            raise ValueError(f"a request of {length} bytes")
        while len(data) < 4 + length:
            chunk = conn.recv(65536)
            if not chunk:
                raise ValueError("closed in the request")
            data += chunk
        req = json.loads(data[4:4 + length])
        argv, env, cwd = req["argv"], req["env"], req["cwd"]
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv) and isinstance(cwd, str)
                and isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ValueError("argv, env or cwd of the wrong type")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return Worker(argv, env, cwd), fds
