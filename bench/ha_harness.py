"""The HA harness: real ``spotvisord run`` processes on one ``ha:`` config, a real 3-member
etcd cluster (tests/etcd_cluster.py) and EC2 as moto's server behind
``tests/fakes/aws_faults.AwsFaultProxy`` (which counts every RunInstances and honours its
``ClientToken`` as EC2 does). Used by tests/test_ha_daemon.py and bench/ha_trials.py.

- :class:`Daemon`: one ``spotvisord run --config FILE`` process and its control socket's API.
- :func:`until`: wait on a condition with a deadline (never a bare sleep).
- :func:`ha_configs`: the two daemons' configs for one pool (``control-a``, ``control-b``).
- :func:`instances`, :func:`per_node`: the pool's instances as EC2 lists them.

Each daemon has its own ``ha.name``, state dir and control socket; they share the agent
port (on one host a standby has not bound it; a real deployment puts a floating address
or a DNS name that follows the leader there).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import aiohttp
import yaml

from daemon.providers.base import NODE_TAG, POOL_TAG

__all__ = ["Daemon", "ROOT", "ha_configs", "instances", "logged_at", "per_node", "takeover", "until"]

ROOT = Path(__file__).resolve().parents[1]


class Daemon:
    """``spotvisord run --config FILE`` in its own process; its control socket's API."""

    def __init__(self, name: str, config: Path, socket_path: str, log: Path) -> None:
        self.name, self.config, self.socket_path, self.log = name, config, socket_path, log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "daemon.interfaces.cli", "run", "--config", str(self.config), cwd=ROOT,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT)

    async def _get(self, path: str) -> str | None:
        """The body of ``GET path`` on the control socket; None while nothing answers there."""
        try:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket_path)) as s, \
                    s.get(f"http://spotvisord{path}", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket_path)) as s, \
                s.post(f"http://spotvisord{path}", json=body, timeout=aiohttp.ClientTimeout(total=10)) as r:
            text = await r.text()
            assert r.status == 200, f"POST {path} on {self.name}: {r.status} {text}"
            return json.loads(text)

    async def status(self) -> dict[str, Any] | None:
        body = await self._get("/v1/status")
        return None if body is None else json.loads(body)

    async def events(self) -> list[dict[str, Any]]:
        body = await self._get("/v1/events?since=0")
        return [json.loads(line) for line in (body or "").splitlines() if line.strip()]

    async def scale(self, nodes: int) -> dict[str, Any]:
        return await self._post("/v1/scale", {"nodes": nodes})

    async def down(self) -> dict[str, Any]:
        return await self._post("/v1/down", {})

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def logged_at(self, event: str, *, after: float) -> float | None:
        """The wall time (UNIX seconds) of the first ``event`` line in this daemon's own log
        stamped after ``after`` (UNIX seconds); None if there is none. The daemon stamps each
        line itself (structlog's ISO UTC ``timestamp``), so a takeover measured from here
        does not include the harness's own waits (an etcd client stuck on a killed member)."""
        return logged_at(self.log_text(), event, after=after)

    async def kill(self) -> None:
        """SIGKILL (``kill -9``) and reap; nothing if it is not running."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            await self.proc.wait()


_STAMPED = re.compile(r"timestamp='([^']+)' level='[a-z]+' event='([a-z_]+)'")


def logged_at(text: str, event: str, *, after: float) -> float | None:
    """The wall time of the first line of ``text`` (a daemon's key=value log, as
    :mod:`daemon.logs` renders it) whose event is ``event`` and whose timestamp is after
    ``after`` (UNIX seconds); None if there is none."""
    for stamp, name in _STAMPED.findall(text):
        if name == event:
            at = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
            if at > after:
                return at
    return None


def takeover(survivor: Daemon, killed_wall: float, elected_read_s: float,
             serving_read_s: float) -> tuple[float, float]:
    """``(elected_s, serving_s)``: seconds from a kill at ``killed_wall`` (UNIX seconds) to
    the survivor's own ``ha_leading`` (it holds the lease) and ``ha_serving`` (its
    supervisor runs, its control API answers) log lines. Where a line is missing, the
    harness's own readings (``*_read_s``, seconds since the kill) stand: they are upper
    bounds, since the harness's etcd client can hang on a killed member for seconds before
    it reads the new leader (4.8 s in a survivor's log, 16.2 s read by the harness)."""
    led, serving = (survivor.logged_at(e, after=killed_wall) for e in ("ha_leading", "ha_serving"))
    return (round(led - killed_wall, 3) if led is not None else round(elected_read_s, 3),
            round(serving - killed_wall, 3) if serving is not None else round(serving_read_s, 3))


async def until(pred: Callable[[], Any], what: str, *, timeout_s: float = 20.0,
                daemons: tuple[Daemon, ...] = (), poll_s: float = 0.05) -> Any:
    """``await pred()`` (or ``pred()``) until it is truthy; returns that value.

    Raises:
        AssertionError: ``timeout_s`` passed, or a daemon of ``daemons`` (those that must
            run) exited; with the daemons' log tails.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        for d in daemons:
            if not d.alive():
                raise AssertionError(f"{d.name} exited waiting for {what}: {d.log_text()[-3000:]}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {d.name}\n{d.log_text()[-2000:]}" for d in daemons)
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")
        await asyncio.sleep(poll_s)  # a poll interval inside a deadline


def ha_configs(root: Path, sockdir: str, *, pool: str, endpoints: list[str], ec2_url: str, agent_port: int,
               lease_s: float = 4, target_nodes: int = 1, max_nodes: int = 3,
               names: tuple[str, ...] = ("control-a", "control-b")) -> list[Daemon]:
    """One config per daemon of ``names`` for ``pool`` (written under ``root``; sockets in
    ``sockdir``, which must be short: a unix socket's path has 107 bytes at most); none started.

    The job (48 sequences a step, 8 GPUs a node) splits over 1, 2, 3 or 6 nodes."""
    daemons = []
    for name in names:
        raw = {
            "pool": {"name": pool, "min_nodes": 1, "target_nodes": target_nodes, "max_nodes": max_nodes},
            "job": {"id": "j", "global_batch_size": 48, "micro_batch_size": 1, "target_steps": 30},
            "ha": {"name": name, "lease_s": lease_s, "endpoints": endpoints},
            "daemon": {"verify_commits": False, "state_dir": str(root / name), "socket": f"{sockdir}/{name}.sock",
                       "agent_host": "127.0.0.1", "agent_port": agent_port, "reconcile_interval_s": 0.1},
            "providers": {"local": None, "aws": {"image_id": "ami-03cf127a", "endpoint_url": ec2_url}},
            "offers": [{"provider": "aws", "region": "us-east-1", "zone": "us-east-1a",
                        "instance_type": "p4d.24xlarge", "gpu_type": "A100-40GB", "gpus_per_node": 8}],
        }
        cfg = root / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump(raw))
        daemons.append(Daemon(name, cfg, f"{sockdir}/{name}.sock", root / f"{name}.log"))
    return daemons


def instances(ec2: Any, pool: str, states: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every instance tagged ``spotvisor-pool=pool``, in any state (boto3 EC2 client ``ec2``);
    only those in ``states`` if given (EC2's ``instance-state-name`` filter: moto then
    serializes only those, where a pool's whole history grows with every replacement)."""
    filters = [{"Name": f"tag:{POOL_TAG}", "Values": [pool]}]
    if states:
        filters.append({"Name": "instance-state-name", "Values": list(states)})
    out = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for r in page["Reservations"]:
            out += r["Instances"]
    return out


def per_node(found: list[dict[str, Any]]) -> dict[str, int]:
    """Node id (its ``spotvisor-node`` tag) → how many instances carry it."""
    counts: dict[str, int] = {}
    for inst in found:
        node = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}.get(NODE_TAG, "")
        counts[node] = counts.get(node, 0) + 1
    return counts
