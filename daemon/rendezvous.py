"""The rendezvous store: a c10d TCPStore in its own process, on the control node.

torchrun's c10d rendezvous keeps its state in a TCPStore. By default the agent
whose host matches the endpoint hosts it, and if that (spot) node dies every
node dies (pytorch#67742). spotvisor runs the store here instead, as its own
process/unit so a daemon restart does not touch the job, and every torchrun
agent connects as a client (``--rdzv-conf is_host=false``). See ELASTIC.md.

Run: ``python -m daemon.rendezvous --host 0.0.0.0 --port 29400`` (or the
``spotvisor-rendezvous.service`` unit). Exits on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from datetime import timedelta

__all__ = ["serve", "wait_until_listening", "main"]


def serve(host: str, port: int, stop: threading.Event) -> None:
    """Host a multi-tenant TCPStore on ``host:port`` until ``stop`` is set."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60))
    print(f"rendezvous store listening on {host}:{port}", flush=True)
    stop.wait()
    del store


def wait_until_listening(host: str, port: int, timeout_s: float) -> bool:
    """True once a TCP connect to ``host:port`` succeeds within ``timeout_s`` seconds."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spotvisor-rendezvous", description="c10d rendezvous store")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=29400)
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve(args.host, args.port, stop)
    except RuntimeError as exc:  # e.g. the port is taken
        print(f"spotvisor-rendezvous: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
