"""The worker command torchrun runs on a node whose launcher has a zygote (:mod:`daemon.gpunode.zygote`).

torchrun starts each worker as ``$PYTHON_EXEC -u -m <module> <args>`` (``PYTHON_EXEC``:
documented in ``torch/distributed/run.py``, "System executable override"). The launcher
points ``PYTHON_EXEC`` at an executable copy of this file (``#!<python> -IS``: no site
packages, standard library only, ~20 ms to start), which asks the zygote, over the Unix
socket named by ``$SPOTVISOR_ZYGOTE_SOCKET``, to fork the worker with this process's
arguments, environment, working directory and standard input, output and error (its file
descriptors, passed with ``SCM_RIGHTS``), then stands in for it:

- a signal torchrun sends it (``os.killpg`` of its session: SIGTERM, SIGINT, SIGHUP,
  SIGQUIT, SIGUSR1, SIGUSR2) goes on to the worker's process group, as it would have
  reached a worker torchrun started itself;
- it exits with the worker's exit status, or dies by the signal that killed the worker;
- if it is SIGKILLed (torchrun's last word), the zygote sees its socket close and
  SIGKILLs the worker's process group.

The protocol, one connection per worker: the request is a 4-byte big-endian length and a
JSON object ``{"argv": [the interpreter's arguments], "env": {...}, "cwd": "/path"}``, with
the three descriptors on its first bytes; the replies are JSON lines, ``{"pid": N}`` when
the worker is forked, or ``{"fallback": "why"}`` when the zygote will not fork this one
(an option or an environment variable a forked process cannot honour), then ``{"exit":
code}`` (negative: killed by that signal) when it has ended.

Without a zygote (no socket, a refused connection, a ``fallback`` reply, or the zygote
gone before it forked), this process becomes the real interpreter
(``$SPOTVISOR_ZYGOTE_PYTHON``) with the same arguments: the worker starts as it would have
without the zygote, only slower.
"""

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "SPOTVISOR_ZYGOTE_SOCKET"  # the zygote's Unix socket
PYTHON_ENV = "SPOTVISOR_ZYGOTE_PYTHON"  # the interpreter to exec without one
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
MAX_REPLY = 4096  # bytes of one reply line


def worker_env(environ, me):
    """The worker's environment: this process's, less the zygote's own variables and
    ``PYTHON_EXEC`` when it names this client (torchrun's workers never see it otherwise)."""
    env = dict(environ)
    env.pop(SOCKET_ENV, None)
    env.pop(PYTHON_ENV, None)
    if env.get("PYTHON_EXEC") == me:
        del env["PYTHON_EXEC"]
    return env


def _exec_python(args, env, why):
    python = os.environ.get(PYTHON_ENV)
    if not python:
        print(f"spotvisor zygote client: {why}, and ${PYTHON_ENV} is unset", file=sys.stderr, flush=True)
        os._exit(127)
    # the worker's log says why this one started slowly
    print(f"spotvisor zygote client: {why}; starting a fresh interpreter", file=sys.stderr, flush=True)
    os.execve(python, [python, *args], env)


def _replies(sock):
    """The zygote's reply lines, as dicts, until it closes the connection."""
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)
        if len(buf) > MAX_REPLY:
            return
        chunk = sock.recv(MAX_REPLY)
        if not chunk:
            return
        buf += chunk


def main(args):
    me = os.path.abspath(sys.argv[0])
    env = worker_env(os.environ, me)
    path = os.environ.get(SOCKET_ENV)
    if not path:
        _exec_python(args, env, "no zygote socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        _exec_python(args, env, f"zygote unreachable ({exc})")
    state = {"pid": None, "pending": []}

    def relay(sig, _frame):
        if state["pid"] is None:
            state["pending"].append(sig)
            return
        try:
            os.killpg(state["pid"], sig)
        except ProcessLookupError:
            pass

    for sig in RELAYED:
        signal.signal(sig, relay)
    body = json.dumps({"argv": list(args), "env": env, "cwd": os.getcwd()}).encode()
    payload = struct.pack("!I", len(body)) + body
    exc_text = "it closed the connection"
    try:
        sent = socket.send_fds(sock, [payload], [0, 1, 2])
        if sent < len(payload):
            sock.sendall(payload[sent:])
    except OSError as exc:  # a reply may still be there to read (a refusal, then the close)
        exc_text = str(exc)
    replies = _replies(sock)
    try:
        first = next(replies, None)
    except OSError as exc:
        first, exc_text = None, str(exc)
    if first is None or "fallback" in first:
        sock.close()
        why = f"zygote refused: {first['fallback']}" if first else f"zygote gone before it forked ({exc_text})"
        for sig in RELAYED:
            signal.signal(sig, signal.SIG_DFL)
        if state["pending"]:  # torchrun already asked its worker to stop: start none
            os.kill(os.getpid(), state["pending"][0])
        _exec_python(args, env, why)
    state["pid"] = int(first["pid"])
    for sig in state["pending"]:
        relay(sig, None)
    code = None
    try:
        for reply in replies:
            if "exit" in reply:
                code = int(reply["exit"])
                break
    except OSError:
        pass
    if code is None:  # the zygote died with the worker running: it has no parent left to answer to
        try:
            os.killpg(state["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        print("spotvisor zygote client: the zygote went away before the worker ended", file=sys.stderr, flush=True)
        return 1
    if code < 0:  # die by the worker's signal, as torchrun would have seen the worker die
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
