"""spotctl: supervisorctl-style status of a running spotvisord, over its unix socket.

    spotctl status [--json]                    job line + nodes table
    spotctl nodes [--json]                     nodes table only
    spotctl events [-f] [--since SEQ] [--kind K ...] [--json]
    spotctl checkpoint                         commit a checkpoint now; training goes on
    spotctl drain NODE                         the node commits, then leaves the job cleanly

The socket is ``--socket PATH``, else ``$SPOTVISOR_SOCKET``, else the daemon
socket of ``--config FILE``, else ``.spotvisor/spotvisord.sock`` (the local
default) if it exists, else ``/run/spotvisord/spotvisord.sock`` (systemd).

Exit codes: 0 ok, 1 daemon unreachable (one line naming the socket), 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from daemon.model import Event

__all__ = ["main", "render_status"]

_LOCAL_SOCKET = Path(".spotvisor/spotvisord.sock")
_SYSTEMD_SOCKET = Path("/run/spotvisord/spotvisord.sock")


class Unreachable(Exception):
    pass


class Refused(Exception):
    """The daemon answered with a 4xx: a usage problem (exit 2)."""


def _socket_path(args: argparse.Namespace) -> Path:
    if args.socket:
        return Path(args.socket)
    if os.environ.get("SPOTVISOR_SOCKET"):
        return Path(os.environ["SPOTVISOR_SOCKET"])
    if args.config:
        from daemon.config import ConfigError, load_config

        try:
            return load_config(args.config).daemon.socket_path()
        except ConfigError as exc:
            raise SystemExit(_usage(f"--config {args.config}: {exc.problems[0]}")) from None
    return _LOCAL_SOCKET if _LOCAL_SOCKET.exists() else _SYSTEMD_SOCKET


def _usage(msg: str) -> int:
    print(f"spotctl: {msg}", file=sys.stderr)
    return 2


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def render_nodes(status: dict[str, Any]) -> str:
    rows = [["NODE", "PROVIDER", "ZONE", "TYPE", "GPUS", "STATE", "UPTIME", "USD/H", "STEP"]]
    for n in status["nodes"]:
        rows.append([
            n["id"], n["provider"], n.get("zone") or "-", n["instance_type"], str(n["gpus"]), n["state"],
            _duration(n.get("uptime_s")), f"{n.get('price_usd_h') or 0:.3f}",
            "-" if n.get("step") is None else str(n["step"]),
        ])
    return _table(rows)


def render_status(status: dict[str, Any], now: float | None = None) -> str:
    """The job line and the nodes table, as ``spotctl status`` prints them."""
    now = time.time() if now is None else now
    job = status["job"]
    commit = "none"
    if job.get("last_commit_step") is not None:
        ago = "" if job.get("last_commit_time") is None else f" ({_duration(now - job['last_commit_time'])} ago)"
        commit = f"step {job['last_commit_step']}{ago}"
    head = (
        f"job {job['id']}  {job['state'].upper()}  step {job.get('step') if job.get('step') is not None else '-'}"
        f"/{job['target_steps']}  world size {job.get('world_size') or '-'}  last commit {commit}  "
        f"restarts {job.get('restarts', 0)}"
    )
    pool = status["pool"]
    live = [n for n in status["nodes"] if n["state"] not in ("terminated", "lost", "failed")]
    head += f"\npool {pool['name']}  {len(live)} live / target {pool['target_nodes']} nodes"
    return head + "\n" + render_nodes({"nodes": live or status["nodes"]})


def render_event(ev: dict[str, Any]) -> str:
    from daemon.cli import format_event

    e = Event(ev["seq"], ev["time"], ev["kind"], ev.get("node"), ev.get("data") or {})
    line = format_event(e, 0.0)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time))
    return stamp + line[line.index("]") + 1:]


async def _request(sock: Path, path: str, *, stream: bool = False, out=None, method: str = "GET") -> Any:
    conn = aiohttp.UnixConnector(path=str(sock))
    timeout = aiohttp.ClientTimeout(total=None if stream else 10, sock_connect=5)
    try:
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
            async with s.request(method, f"http://spotvisord{path}") as r:
                if 400 <= r.status < 500:
                    try:
                        raise Refused((await r.json())["error"])
                    except (ValueError, KeyError, aiohttp.ContentTypeError):
                        raise Refused(f"spotvisord answered {r.status}") from None
                if r.status != 200:
                    raise Unreachable(f"spotvisord answered {r.status}: {(await r.text()).strip()}")
                if not stream:
                    return await r.json()
                async for raw in r.content:
                    if raw.strip():
                        out(json.loads(raw))
    except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionRefusedError) as exc:
        raise Unreachable(
            f"cannot reach spotvisord at {sock} ({exc.__class__.__name__}); is it running? "
            "(start it with `spotvisord run --config FILE`, or pass --socket PATH)"
        ) from None


def _common(*, suppress: bool) -> argparse.ArgumentParser:
    # The subcommands repeat these options with SUPPRESS defaults: a subparser's own
    # default would otherwise overwrite a value given before the subcommand
    # (``spotctl --socket PATH status`` would lose PATH).
    d = {"default": argparse.SUPPRESS} if suppress else {}
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", help="daemon control socket", **d)
    common.add_argument("--config", help="read the socket path from this config", **d)
    common.add_argument("--json", action="store_true", help="machine-readable output", **d)
    return common


def _parser() -> argparse.ArgumentParser:
    common = _common(suppress=True)
    p = argparse.ArgumentParser(prog="spotctl", description="talk to spotvisord", parents=[_common(suppress=False)])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", parents=[common], help="job line and nodes table")
    sub.add_parser("nodes", parents=[common], help="nodes table")
    e = sub.add_parser("events", parents=[common], help="the event log")
    e.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    e.add_argument("--since", type=int, default=0, metavar="SEQ", help="only events after SEQ")
    e.add_argument("--kind", action="append", default=[], help="only this kind (repeatable)")
    sub.add_parser("checkpoint", parents=[common], help="commit a checkpoint now (the job keeps training)")
    d = sub.add_parser("drain", parents=[common], help="make a node leave the job cleanly (commit, then leave)")
    d.add_argument("node", help="node id, as `spotctl nodes` shows it")
    return p


async def _amain(args: argparse.Namespace) -> int:
    sock = _socket_path(args)
    if args.cmd in ("status", "nodes"):
        status = await _request(sock, "/v1/status")
        if args.json:
            print(json.dumps(status, indent=2))
        else:
            print(render_status(status) if args.cmd == "status" else render_nodes(status))
        return 0
    if args.cmd == "checkpoint":
        reply = await _request(sock, "/v1/checkpoint", method="POST")
        print(json.dumps(reply) if args.json else f"checkpoint requested ({reply['request_id']}): "
              "the job commits at its next step boundary")
        return 0
    if args.cmd == "drain":
        reply = await _request(sock, f"/v1/nodes/{args.node}/drain", method="POST")
        print(json.dumps(reply) if args.json else f"{reply['node']}: {reply['state']} "
              "(its trainer commits, then the node leaves the job)")
        return 0
    query = f"?since={args.since}" + "".join(f"&kind={k}" for k in args.kind) + ("&follow=1" if args.follow else "")

    def emit(ev: dict[str, Any]) -> None:
        print(json.dumps(ev) if args.json else render_event(ev), flush=True)

    await _request(sock, "/v1/events" + query, stream=True, out=emit)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_amain(args))
    except Unreachable as exc:
        print(f"spotctl: {exc}", file=sys.stderr)
        return 1
    except Refused as exc:
        print(f"spotctl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `spotctl events -f | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
