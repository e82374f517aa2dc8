"""The fleet process of :mod:`bench.scale`: the simulated nodes and their job
(``python -m bench.scale_sim``; the provider that launches into it is
:class:`bench.scale_daemon.SimProvider`, in the daemon's process).

:class:`Fleet` is the "cloud": it boots each launched instance ``boot_s`` later into
a :class:`SimAgent`, which speaks the real agent HTTP API (``/v1/agent/register``,
``heartbeat`` at the interval the daemon's last reply said — ``--heartbeat-interval-s``
until the first —, one ``commands`` long-poll always outstanding, ``events``) with its
own token and its own aiohttp session (keep-alive connections, as real nodes have),
sending what :class:`daemon.gpunode.agent.NodeAgent` sends: the step, the trainer's state,
one GPU sample per GPU, a ``trainer.log`` chunk when the log grew, and the
trainer's status lines (``started``, ``checkpoint_committed``) as reports, from the
node of rank 0 and from a node whose own notice a commit answers, as the agent does;
it applies commands from either channel (each comes by one).
:class:`SimJob` is the training job those trainers run: it steps every ``step_s``;
commits at the next step boundary when a notice or a checkpoint request is pending
(taking ``flush_s``), and every ``checkpoint_every`` steps; holds after a notice or
rejoin commit; a noticed node's trainer exits after the commit that
answers its notice; and the job restarts (rank 0's node reports ``started``, new
attempt, new world size) ``rdzv_s`` after a node left or joined, as torchrun's
re-rendezvous would.

What the fleet does not simulate: the metadata endpoint poll (it is node-local and
never reaches the daemon; ``bench/detection_latency.py`` measures it), the cloud
reclaiming an instance at its notice deadline (the drained nodes are terminated by
the daemon long before the default 120 s lead), torchrun and the rendezvous store.

Control endpoints of the fleet (127.0.0.1): ``POST /launch``, ``POST /terminate``,
``POST /storm {"frac", "spread_s", "lead_s", "seed"}`` (notices to that fraction of
the job's nodes, at uniform moments within ``spread_s``), ``GET /stats?since=T``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

if __package__ in (None, ""):  # run as a script: import this checkout's daemon package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.gpunode.daemon_link import COMMAND_WAIT_S, KEEPALIVE_S  # noqa: E402
from daemon.gpunode.metadata.base import Notice, NoticeKind  # noqa: E402

__all__ = ["SimAgent", "SimJob", "Fleet", "main"]


# -- in the fleet's process -----------------------------------------------------------------------
class SimAgent:
    """One simulated node agent: register, then heartbeat and report as NodeAgent does."""

    __slots__ = ("fleet", "instance_id", "node_id", "token", "daemon_url", "gpus", "session", "trainer",
                 "exit_code", "step", "rank", "interruption", "outbox", "tasks", "gpu", "log_buf", "log_start",
                 "log_want", "log_lines", "started_at", "registered", "interval_s", "beat_now")

    def __init__(self, fleet: Fleet, *, instance_id: str, node_id: str, token: str, daemon_url: str,
                 gpus: int) -> None:
        self.fleet = fleet
        self.instance_id, self.node_id, self.token = instance_id, node_id, token
        self.daemon_url = daemon_url.rstrip("/")
        self.gpus = gpus
        self.session: aiohttp.ClientSession | None = None
        self.trainer = "not_started"  # not_started | running | exited, as the agent says it
        self.exit_code: int | None = None
        self.step: int | None = None
        self.rank = 0
        self.interruption: str | None = None  # this node's own notice (or drain) id, once seen
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.tasks: set[asyncio.Task[None]] = set()
        self.gpu = [{"index": i, "sm_util_pct": 0.0, "mem_used_bytes": 0, "mem_total_bytes": 80 * 2**30,
                     "name": "NVIDIA H100 80GB HBM3"} for i in range(gpus)]
        self.log_buf = ""  # trainer.log bytes [log_start, log_start + len) not yet acknowledged
        self.log_start = 0
        self.log_want: int | None = None
        self.log_lines = 0
        self.started_at: float | None = None
        self.registered = False
        self.interval_s = fleet.heartbeat_interval_s  # until the daemon says otherwise
        self.beat_now = asyncio.Event()  # the trainer started or exited: heartbeat now, as the agent does

    def spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=f"{name}:{self.node_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def stop(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def _post(self, path: str, body: dict[str, Any], *, timeout_s: float | None = None) -> dict[str, Any]:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        async with self.session.post(f"{self.daemon_url}{path}", json={"node_id": self.node_id, **body},
                                     timeout=timeout) as r:
            if r.status == 401:
                raise PermissionError(f"{self.node_id}: the daemon refused this node's token")
            r.raise_for_status()
            return await r.json()

    async def boot(self) -> None:
        await asyncio.sleep(self.fleet.boot_s)  # the VM boots
        self.session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"},
                                             timeout=aiohttp.ClientTimeout(total=10),
                                             connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S))
        delay = 0.2
        while True:
            try:
                self._heed_interval(await self._post("/v1/agent/register", {"pid": os.getpid()}))
                break
            except (aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.registered = True
        self.spawn(self._outbox_loop(), "outbox")
        self.spawn(self._heartbeat_loop(), "heartbeat")
        self.spawn(self._command_loop(), "commands")

    def _heed_interval(self, reply: dict[str, Any]) -> None:
        v = reply.get("heartbeat_interval_s")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 600:
            self.interval_s = float(v)

    async def _command_loop(self) -> None:
        """One command long-poll outstanding, as the agent keeps (404: heartbeats only)."""
        fleet, delay = self.fleet, 0.2
        while True:
            try:
                reply = await self._post("/v1/agent/commands", {"wait_s": COMMAND_WAIT_S},
                                         timeout_s=COMMAND_WAIT_S + 10.0)
            except aiohttp.ClientResponseError as exc:
                if exc.status in (404, 405):
                    return
                fleet.cmd_failed += 1
            except (aiohttp.ClientError, TimeoutError):
                fleet.cmd_failed += 1
            else:
                fleet.cmd_polls += 1
                fleet.poll_times.append(time.time())
                fleet.cmd_by_poll += len(reply.get("commands") or ())
                self._apply(reply)
                delay = 0.2
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    def report(self, kind: str, **data: Any) -> None:
        self.outbox.put_nowait({"kind": kind, "time": time.time(), **data})

    async def _outbox_loop(self) -> None:
        delay = 0.2
        while True:
            batch = [await self.outbox.get()]
            while not self.outbox.empty():
                batch.append(self.outbox.get_nowait())
            while True:
                try:
                    await self._post("/v1/agent/events", {"events": batch})
                    self.fleet.reports_ok += 1
                    self.fleet.report_times.append(time.time())
                    delay = 0.2
                    break
                except (aiohttp.ClientError, TimeoutError):
                    self.fleet.reports_failed += 1
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

    async def _heartbeat_loop(self) -> None:
        fleet = self.fleet
        while True:
            self.beat_now.clear()
            job = fleet.job
            step = job.step if self.node_id in job.members else self.step
            self.step = step
            body = {"step": step, "trainer": {"state": self.trainer, "exit_code": self.exit_code},
                    "gpu": self._gpu_sample(), "log": self._log_chunk()}
            t0 = time.perf_counter()
            try:
                reply = await self._post("/v1/agent/heartbeat", body)
            except (aiohttp.ClientError, TimeoutError):
                fleet.hb_failed += 1
            else:
                fleet.hb_times.append(time.time())
                fleet.hb_rtts.append(time.perf_counter() - t0)
                fleet.cmd_by_heartbeat += len(reply.get("commands") or ())
                self._heed_interval(reply)
                self._apply(reply)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self.beat_now.wait()

    def _gpu_sample(self) -> list[dict[str, Any]]:
        busy = self.trainer == "running" and self.node_id in self.fleet.job.members
        for g in self.gpu:
            g["sm_util_pct"] = round(random.uniform(88.0, 99.0), 1) if busy else 0.0
            g["mem_used_bytes"] = 71 * 2**30 if busy else 0
        return self.gpu

    def _log_chunk(self) -> dict[str, Any] | None:
        every = self.fleet.log_every_s
        if every > 0 and self.started_at is not None:
            due = int((time.time() - self.started_at) / every)
            while self.log_lines < due:
                self.log_lines += 1
                self.log_buf += (f"[rank{self.rank}] step {self.step} loss {random.uniform(1.5, 3.0):.4f} "
                                 f"{self.fleet.job.step_s:.3f} s/step world {self.fleet.job.world_size}\n")
        if not self.log_buf:
            return None
        size = self.log_start + len(self.log_buf)
        start = self.log_start if self.log_want is None or self.log_want < self.log_start else self.log_want
        data = self.log_buf[start - self.log_start:]
        if not data:
            return None
        return {"offset": start, "next": size, "size": size, "data": data}

    def _apply(self, reply: dict[str, Any]) -> None:
        job = self.fleet.job
        log = reply.get("log")
        if isinstance(log, dict) and isinstance(log.get("offset"), int):
            self.log_want = log["offset"]
            cut = min(len(self.log_buf), max(0, self.log_want - self.log_start))
            self.log_buf, self.log_start = self.log_buf[cut:], self.log_start + cut
        for cmd in reply.get("commands", []):
            kind = cmd.get("kind")
            if kind == "drain" and self.interruption is None:
                self.interruption = cmd["id"]
                job.request(cmd["id"], "interruption")
            elif kind == "cancel":
                job.requests.pop(cmd["id"], None)
            elif kind == "checkpoint":
                job.request(cmd["id"], "rejoin" if cmd.get("reason") == "rejoin" else "checkpoint")
        if reply.get("start_trainer") and self.trainer == "not_started" and self.interruption is None:
            self.trainer = "running"
            self.started_at = time.time()
            self.beat_now.set()
            job.join(self)

    def notice(self, lead_s: float) -> None:
        """An interruption notice on this node's metadata endpoint, as the agent handles it."""
        now = time.time()
        deadline = datetime.fromtimestamp(now + lead_s, tz=timezone.utc)
        # the body AWS serves; a storm serves the same body to many nodes, so the agent
        # names the notice by node and body (NodeAgent._on_interruption)
        raw = json.dumps({"action": "terminate", "time": deadline.strftime("%Y-%m-%dT%H:%M:%SZ")})
        n = Notice.build(provider="aws", kind=NoticeKind.INTERRUPTION, action="terminate", deadline=deadline, raw=raw)
        nid = f"{self.node_id}:{n.id}"
        self.interruption = nid
        self.fleet.notices_sent.append(now)
        self.report("interruption_notice", notice={**n.to_dict(), "id": nid}, seen_at=now,
                    deadline=deadline.timestamp())
        if self.trainer == "running":
            self.fleet.job.request(nid, "interruption")


class SimJob:
    """The training job as its trainers report it; see the module docstring.

    Args:
        step_s: seconds per training step.
        flush_s: seconds a checkpoint commit takes (save + upload).
        rdzv_s: seconds from a node leaving or joining to the restart (torchrun's last call).
        checkpoint_every: periodic commit interval in steps.
        hold_timeout_s: a hold with no restart ends after this (the trainer's ``--hold-timeout-s``).
    """

    def __init__(self, *, step_s: float, flush_s: float, rdzv_s: float, checkpoint_every: int,
                 hold_timeout_s: float = 90.0) -> None:
        self.step_s, self.flush_s, self.rdzv_s = step_s, flush_s, rdzv_s
        self.checkpoint_every = checkpoint_every
        self.hold_timeout_s = hold_timeout_s
        self.members: dict[str, SimAgent] = {}
        self.joined: dict[str, SimAgent] = {}  # trainer running: members, and joiners waiting for a restart
        self.attempt = ""
        self.world_size = 0
        self.step = 0
        self.last_commit: int | None = None
        self.training = False
        self.holding_since: float | None = None
        self.requests: dict[str, str] = {}  # request (notice) id → kind, not yet committed
        self.restart_at: float | None = None
        self.restarts = 0
        self.commits = 0

    def request(self, rid: str, kind: str) -> None:
        self.requests.setdefault(rid, kind)

    def join(self, agent: SimAgent) -> None:
        self.joined[agent.node_id] = agent
        self._schedule_restart()

    def leave(self, agent: SimAgent, *, exit_code: int) -> None:
        agent.trainer, agent.exit_code = "exited", exit_code
        agent.beat_now.set()
        agent.report("trainer_exited", exit_code=exit_code)
        self.joined.pop(agent.node_id, None)
        if self.members.pop(agent.node_id, None) is not None:
            self._schedule_restart()

    def forget(self, agent: SimAgent) -> None:
        """The instance is gone (terminated): its torchrun is gone with it."""
        self.joined.pop(agent.node_id, None)
        if self.members.pop(agent.node_id, None) is not None:
            self._schedule_restart()

    def _schedule_restart(self) -> None:
        if self.restart_at is None:
            self.restart_at = time.time() + self.rdzv_s

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            now = time.time()
            if self.restart_at is not None and now >= self.restart_at:
                self._restart(now)
            elif self.requests and self.members:
                await self._commit()
            elif self.training and self.holding_since is None:
                self.step += 1
                if self.step % self.checkpoint_every == 0:
                    await self._commit()
            elif self.holding_since is not None and now - self.holding_since > self.hold_timeout_s:
                self.holding_since = None  # the trainer's hold timed out: it trains on

    def _restart(self, now: float) -> None:
        self.restart_at = None
        self.members = dict(self.joined)
        self.holding_since = None
        if not self.members:
            self.training = False
            return
        self.restarts += 1
        self.attempt = secrets.token_hex(4)
        self.world_size = sum(a.gpus for a in self.members.values())
        self.step = self.last_commit if self.last_commit is not None else 0
        self.training = True
        rank = 0
        for a in self.members.values():
            a.rank = rank
            rank += a.gpus
        # every node's agent forwards its own workers' started line, rank 0's first here
        # (daemon.gpunode.agent._on_status): a new rank 0 is taken on the old one's word
        # (daemon.control.attempts)
        for a in self.members.values():
            a.report("trainer_status", line=self._line(a, "started", now, resumed_from=self.last_commit,
                                                       global_batch_size=0, micro_batch_size=0,
                                                       grad_accum_steps=0))

    async def _commit(self) -> None:
        ids = list(self.requests)
        kinds = sorted(set(self.requests.values())) or ["periodic"]
        step = self.step
        await asyncio.sleep(self.flush_s)  # every rank waits for rank 0's save and upload
        for rid in ids:
            self.requests.pop(rid, None)
        self.last_commit = step
        self.commits += 1
        now = time.time()
        hold = bool({"interruption", "rejoin"} & set(kinds))
        reason = "notice" if "interruption" in kinds else kinds[0]
        leaving = []
        for a in list(self.members.values()):
            answers_its_notice = a.interruption is not None and a.interruption in ids
            if a.rank == 0 or answers_its_notice:  # as daemon.gpunode.agent._on_status forwards
                a.report("trainer_status", line=self._line(
                    a, "checkpoint_committed", now, notice_ids=ids, kinds=kinds, seconds=self.flush_s,
                    save_s=self.flush_s / 4, upload_s=self.flush_s * 3 / 4, bytes=2 * 10**9, reason=reason,
                    reused=False))
            if answers_its_notice:
                leaving.append(a)
        if hold:
            self.holding_since = now
        for a in leaving:  # its agent SIGTERMs torchrun once the commit answers its notice
            self.leave(a, exit_code=-15)

    def _line(self, a: SimAgent, event: str, now: float, **fields: Any) -> dict[str, Any]:
        return {"event": event, "time": now, "attempt": self.attempt, "rank": a.rank,
                "world_size": self.world_size, "step": self.step, **fields}

    def view(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "world_size": self.world_size, "members": len(self.members),
                "joined": len(self.joined), "step": self.step, "training": self.training,
                "holding": self.holding_since is not None, "restarts": self.restarts, "commits": self.commits,
                "last_commit": self.last_commit, "pending_requests": len(self.requests)}


class Fleet:
    """The fleet process: control endpoints, the simulated agents and their job."""

    def __init__(self, *, boot_s: float, heartbeat_interval_s: float, log_every_s: float, job: SimJob) -> None:
        self.boot_s = boot_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.log_every_s = log_every_s
        self.job = job
        self.agents: dict[str, SimAgent] = {}  # instance id → agent
        self.launches: list[tuple[float, str]] = []  # (receive time, node id)
        self.terminated = 0
        self.notices_sent: list[float] = []
        self.hb_times: list[float] = []
        self.hb_rtts: list[float] = []
        self.hb_failed = 0
        self.reports_ok = 0
        self.reports_failed = 0
        self.cmd_polls = 0  # command long-polls answered
        self.poll_times: list[float] = []  # when each was answered
        self.report_times: list[float] = []  # when each report batch was accepted
        self.cmd_failed = 0
        self.cmd_by_poll = 0  # commands that came by the long-poll / by a heartbeat reply
        self.cmd_by_heartbeat = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/launch", self._launch)
        app.router.add_post("/terminate", self._terminate)
        app.router.add_post("/storm", self._storm)
        app.router.add_get("/stats", self._stats)
        return app

    async def _launch(self, request: web.Request) -> web.Response:
        b = await request.json()
        self.launches.append((time.time(), b["node_id"]))
        agent = SimAgent(self, instance_id=b["instance_id"], node_id=b["node_id"], token=b["token"],
                         daemon_url=b["daemon_url"], gpus=int(b["gpus"]))
        self.agents[agent.instance_id] = agent
        agent.spawn(agent.boot(), "boot")
        return web.json_response({"ok": True})

    async def _terminate(self, request: web.Request) -> web.Response:
        b = await request.json()
        agent = self.agents.pop(b["instance_id"], None)
        if agent is not None:
            self.terminated += 1
            self.job.forget(agent)
            asyncio.get_running_loop().create_task(agent.stop(), name=f"stop:{agent.node_id}")
        return web.json_response({"ok": True})

    async def _storm(self, request: web.Request) -> web.Response:
        b = await request.json()
        rng = random.Random(b.get("seed"))
        pool = sorted(self.job.members.values(), key=lambda a: a.node_id)
        k = max(1, round(float(b["frac"]) * len(pool)))
        victims = rng.sample(pool, k)
        offsets = sorted(rng.uniform(0.0, float(b["spread_s"])) for _ in victims)
        loop = asyncio.get_running_loop()
        for a, off in zip(victims, offsets):
            loop.call_later(off, a.notice, float(b["lead_s"]))
        return web.json_response({"k": k, "nodes": [a.node_id for a in victims], "offsets_s": offsets})

    async def _stats(self, request: web.Request) -> web.Response:
        """Counters and the job; ``?launches=1`` adds every launch call, ``?since=T&until=U``
        the heartbeats answered in that window (count, round trip p50/p99/max), and the
        command long-polls answered and report batches accepted in it."""
        told = [a.interval_s for a in self.agents.values() if a.registered]
        doc: dict[str, Any] = {
            "terminated": self.terminated, "agents": len(self.agents), "launch_calls": len(self.launches),
            "registered": sum(1 for a in self.agents.values() if a.registered),
            "notices_sent": self.notices_sent, "hb_total": len(self.hb_times), "hb_failed": self.hb_failed,
            "reports_ok": self.reports_ok, "reports_failed": self.reports_failed, "job": self.job.view(),
            "cmd_polls": self.cmd_polls, "cmd_failed": self.cmd_failed, "cmd_by_poll": self.cmd_by_poll,
            "cmd_by_heartbeat": self.cmd_by_heartbeat,
            # the intervals the daemon told the registered nodes: [shortest, longest] (s)
            "heartbeat_interval_s": [min(told, default=None), max(told, default=None)],
        }
        if request.query.get("launches"):
            doc["launches"] = self.launches
        if "since" in request.query:
            since, until = float(request.query["since"]), float(request.query.get("until", "inf"))
            rtts = sorted(r for t, r in zip(self.hb_times, self.hb_rtts) if since <= t <= until)
            doc["window"] = {"heartbeats": len(rtts), "rtt_p50_s": _pct(rtts, 50), "rtt_p99_s": _pct(rtts, 99),
                             "rtt_max_s": rtts[-1] if rtts else None,
                             "command_polls": sum(1 for t in self.poll_times if since <= t <= until),
                             "report_posts": sum(1 for t in self.report_times if since <= t <= until)}
        return web.json_response(doc)

    async def aclose(self) -> None:
        agents, self.agents = list(self.agents.values()), {}
        await asyncio.gather(*(a.stop() for a in agents), return_exceptions=True)


def _pct(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    i = max(0, min(len(sorted_values) - 1, -(-len(sorted_values) * p // 100) - 1))
    return sorted_values[int(i)]


async def _serve(args: argparse.Namespace) -> int:
    job = SimJob(step_s=args.step_s, flush_s=args.flush_s, rdzv_s=args.rdzv_s,
                 checkpoint_every=args.checkpoint_every)
    fleet = Fleet(boot_s=args.boot_s, heartbeat_interval_s=args.heartbeat_interval_s,
                  log_every_s=args.log_every_s, job=job)
    runner = web.AppRunner(fleet.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"http://127.0.0.1:{port}", flush=True)  # the parent reads this line
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    job_task = asyncio.create_task(job.run(), name="sim:job")
    try:
        await stop.wait()
    finally:
        job_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job_task
        await fleet.aclose()
        await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale_sim", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--boot-s", type=float, default=2.0, help="launch → agent starts (seconds)")
    p.add_argument("--heartbeat-interval-s", type=float, default=1.0,
                   help="until the daemon's first reply says the interval it wants")
    p.add_argument("--log-every-s", type=float, default=10.0, help="a trainer.log line per node this often (0: none)")
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--flush-s", type=float, default=2.0)
    p.add_argument("--rdzv-s", type=float, default=3.0)
    p.add_argument("--checkpoint-every", type=int, default=100)
    args = p.parse_args(argv)
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
