"""The rendezvous store: a c10d TCPStore in its own process, on the control node.

torchrun's c10d rendezvous keeps its state in a TCPStore. By default the agent
whose host matches the endpoint hosts it, and if that (spot) node dies every
node dies (pytorch#67742). spotvisor runs the store here instead, as its own
process/unit so a daemon restart does not touch the job, and every torchrun
agent connects as a client (``--rdzv-conf is_host=false``,
https://pytorch.org/docs/stable/elastic/rendezvous.html).

The store has no authentication, and torchrun's dynamic rendezvous unpickles the
state it reads from it: whoever reaches the port can run code in every node's
torchrun agent. So it listens on exactly the address it is given (c10d's own
server would bind every interface whatever host it is passed: this module binds
the socket itself and hands c10d the listening descriptor, ``master_listen_fd``),
the default is loopback, and on a cloud it is the control node's private address,
reachable from the job's nodes only (README, "Trust model").

Run: ``python -m daemon.controlnode.rendezvous --host 10.0.0.10 --port 29400`` (or the
``spotvisor-rendezvous.service`` unit). Exits on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

from daemon.hosts import bind_fix, is_wildcard
from trainer.listen import listen_socket  # re-exported: the control node's store binds with it

__all__ = ["DEFAULT_HOST", "RunnerStore", "StoreProcess", "listen_socket", "read_pid", "serve", "wait_until_listening",
           "write_pid", "main"]

DEFAULT_HOST = "127.0.0.1"


def serve(host: str, port: int, stop: threading.Event,
          on_listening: Callable[[str, int], None] | None = None) -> None:
    """Host a multi-tenant TCPStore on exactly ``host:port`` until ``stop`` is set.

    ``on_listening(address, port)`` is called once the store accepts connections: the
    address ``host`` resolved to and the port it took (for ``port`` 0). Raises what
    :func:`listen_socket` raises, and ``RuntimeError`` if c10d cannot start its server."""
    sock = listen_socket(host, port)  # before torch's import: a taken port is said at once
    from torch.distributed import TCPStore

    address, bound = sock.getsockname()[:2]
    # c10d owns the descriptor from here on (it closes it with the store)
    store = TCPStore(host, bound, is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60), master_listen_fd=sock.detach())
    if on_listening is not None:
        on_listening(address, bound)
    stop.wait()
    del store


def wait_until_listening(host: str, port: int, timeout_s: float) -> bool:
    """True once a TCP connect to ``host:port`` succeeds within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


class StoreProcess:
    """The store as a child process of a one-shot run (``spotvisord demo``): it stops when
    this process ends, SIGKILL included (``--exit-with-stdin``: its standard input is a
    pipe only this process holds). :meth:`kill` and :meth:`start` again are the chaos
    schedule's ``kill_store``: the store SIGKILLed, then a new one, empty, on the same
    port, as the unit's ``Restart=`` would. Every method blocks (a thread, from an event
    loop)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the store and wait until it accepts connections (``timeout_s`` seconds).

        Raises:
            RuntimeError: it did not listen in time or exited (the port is taken); the
                message says so, with the store's own line.
        """
        self.proc = proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.controlnode.rendezvous", "--host", self.host, "--port", str(self.port),
             "--exit-with-stdin"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        if not wait_until_listening(self.host, self.port, timeout_s) or proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.poll() is not None and proc.stderr else ""
            self.stop()
            raise RuntimeError(f"rendezvous store did not start on {self.host}:{self.port} ({err or 'timeout'}); "
                               "is the port taken? set rendezvous.port")

    def kill(self) -> None:
        """SIGKILL the store (its state is gone with it) and reap it; :meth:`start` starts a new one."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        _close_pipes(proc)

    def stop(self) -> None:
        """Stop the store: SIGTERM and end of input, SIGKILL after 10 s. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _close_pipes(proc)


def write_pid(path: Path, pid: int) -> None:
    """Write ``pid`` to ``path`` whole (a temporary file renamed over it): a reader sees
    the old pid or the new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{pid}\n")
    os.replace(tmp, path)


def read_pid(path: Path) -> int | None:
    """The pid in ``path`` (:func:`write_pid`), or None: no file, or not a pid."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


class RunnerStore:
    """The rendezvous store an outside runner started (``spotvisord demo`` when its chaos
    kills the daemon, :mod:`daemon.interfaces.demo_runner`), as its daemon child sees it:
    the same :meth:`kill` and :meth:`start` as :class:`StoreProcess`, for the chaos
    schedule's ``kill_store``. The store is the runner's child, so the runner restarts it
    (as ``spotvisor-rendezvous.service``'s ``Restart=`` would) and writes each one's pid
    to ``pid_file`` (:func:`write_pid`); a pid passed once would name a dead process after
    the first restart. Every method blocks (a thread, from an event loop)."""

    def __init__(self, pid_file: Path, host: str, port: int) -> None:
        self.pid_file, self.host, self.port = pid_file, host, port
        self._killed: int | None = None

    @property
    def pid(self) -> int | None:
        """The running store's pid, as the runner last wrote it; None before its first."""
        return read_pid(self.pid_file)

    def kill(self) -> None:
        """SIGKILL the store the runner last started (gone already: nothing to do)."""
        self._killed = pid = self.pid
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def start(self, timeout_s: float = 30.0) -> None:
        """Wait (``timeout_s`` seconds) until the runner has started the next store: a pid
        other than the one :meth:`kill` killed, and the port accepting connections.

        Raises:
            RuntimeError: no new store within ``timeout_s``; the message names the pid file.
        """
        deadline = time.monotonic() + timeout_s
        while self.pid in (None, self._killed):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the runner started no new rendezvous store within {timeout_s:g} s "
                                   f"({self.pid_file} still names pid {self.pid})")
            time.sleep(0.1)  # polling another process's file, not synchronising threads
        if not wait_until_listening(self.host, self.port, max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"rendezvous store pid {self.pid} did not listen on {self.host}:{self.port} "
                               f"within {timeout_s:g} s")


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stderr):
        if pipe is not None:
            pipe.close()


def main(argv: list[str] | None = None) -> int:
    """``spotvisor-rendezvous [--host H] [--port P]``. Exit 0 on SIGTERM/SIGINT, 1 when it
    cannot listen (port taken, address not this machine's), 2 for a bad ``--host``."""
    p = argparse.ArgumentParser(prog="spotvisor-rendezvous", description="c10d rendezvous store")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="the one address to listen on (default %(default)s; on a cloud the control "
                        "node's private address)")
    p.add_argument("--port", type=int, default=29400, help="TCP port (default %(default)s; 0: a free one)")
    p.add_argument("--exit-with-stdin", action="store_true",
                   help="also stop when standard input ends: a one-shot run (spotvisord demo) keeps the "
                        "other end, so the store ends with it, SIGKILL included")
    args = p.parse_args(argv)
    host = args.host
    if not host.strip():
        print("spotvisor-rendezvous: --host is empty; give the control node's private address "
              "(the unit reads it from SPOTVISOR_RDZV_HOST in /etc/spotvisor/rendezvous.env)", file=sys.stderr)
        return 2
    if is_wildcard(host):
        print(f"spotvisor-rendezvous: --host {host} is a wildcard (every interface), and whoever reaches the "
              "port can run code in the job's torchrun agents; give the control node's private address "
              "(e.g. 10.0.0.10, reachable by the job's nodes only)", file=sys.stderr)
        return 2
    shown = f"[{host}]" if ":" in host else host
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.exit_with_stdin:
        def watch_stdin() -> None:
            while sys.stdin.buffer.read(4096):
                pass
            stop.set()  # end of input: the process that started us is gone

        threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()

    def listening(address: str, port: int) -> None:
        print(f"rendezvous store listening on {f'[{address}]' if ':' in address else address}:{port}", flush=True)

    try:
        serve(host, args.port, stop, on_listening=listening)
    except ValueError:  # a name that resolves to a wildcard address
        print(f"spotvisor-rendezvous: --host {host} resolves to a wildcard address (every interface); give "
              "the control node's private address (e.g. 10.0.0.10, reachable by the job's nodes only)",
              file=sys.stderr)
        return 2
    except socket.gaierror as exc:
        print(f"spotvisor-rendezvous: --host {host!r} does not resolve ({exc.strerror}); "
              "give the control node's private address", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:  # the port is taken, the address is not this machine's
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        fix = bind_fix(exc.errno if isinstance(exc, OSError) else None)
        print(f"spotvisor-rendezvous: cannot listen on {shown}:{args.port}: {reason}; {fix}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
