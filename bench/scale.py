"""The daemon against a thousand simulated nodes: CPU, memory, feed latency, storm reaction.

Three processes on this machine:

1. **the daemon**: ``python -m bench.scale_daemon`` runs exactly what ``spotvisord
   run`` runs (:func:`daemon.interfaces.cli.running_daemon` under :func:`daemon.interfaces.service.serve`:
   store, supervisor, agent API, notifier; logging at INFO to a file), except that
   the pool's offers are served by :class:`bench.scale_daemon.SimProvider` instead of
   the local provider. With ``--profile PATH`` (``SPOTVISOR_BENCH_PROFILE=PATH`` in
   its environment) it runs cProfile over one window, the steady one or the storm
   (``--profile-phase``; SIGUSR1 starts it, SIGUSR2 stops it) and writes ``PATH``
   (pstats) and ``PATH.txt`` (the top functions).
2. **the fleet** (``python -m bench.scale_sim``): the "cloud" the provider launches
   into. Each launch becomes, ``--boot-s`` later, a simulated agent speaking the real
   agent HTTP API with the node's real token, heartbeating at the interval the
   daemon tells it (``agent.heartbeat_interval_s``, default 1 s, stretched to keep
   the pool under ``daemon.max_heartbeats_per_second``, default 25: 40 s for 1,000
   nodes), keeping a command long-poll outstanding, and reporting what the
   trainers of a running job report (see :mod:`bench.scale_sim`).
3. **this process**: writes the config, receives the feed on a local webhook sink
   (``notify:``, signed; the signature is checked), samples the daemon's CPU and RSS
   with psutil, triggers the storm, prints the table and writes JSON.

Phases: **ramp** (the pool launches ``--nodes``, they register, the job starts at
full size; then the bench waits until the webhook has every event so far, and
``--settle-s`` or 1.5 heartbeat intervals, whichever is longer, so every node
heartbeats at its slot), **steady** (``--steady-s``: heartbeats, log chunks, the occasional
periodic checkpoint, and one ``pool_scaled`` event a second from a ``spotctl scale``
to the same target, to time the feed under load; the daemon's CPU over the window,
its RSS each second), **storm** (``--storm-frac`` of the job's
nodes get interruption notices at uniform moments within ``--storm-spread-s``,
reported through ``/v1/agent/events`` as the agent reports them; the job commits,
the noticed nodes leave, replacements launch, boot, are admitted after a rejoin
commit, and the job runs at full size again).

Figures: daemon CPU (% of one core: CPU seconds ÷ wall seconds) and RSS at steady
state, and the CPU per heartbeat answered (with that cost at the full rate, which
holds when a loaded machine answered fewer heartbeats than the nodes sent);
event → webhook latency (receive time − the event's ``time``, matched by ``seq``)
per phase; from the storm's first notice: all notices recorded, all replacements
planned (the ``node_launch_requested`` events' times), all launch calls made on the
provider (received by the fleet), and the job back at full world size; and the
daemon's event-loop stalls (its loop thread out of ``epoll_wait`` for over 50 ms,
sampled from this process by :class:`bench.loopwatch.LoopWatch`, with the share of each
stall spent running daemon code and waiting for a CPU), which tell a slow daemon from a
busy machine.

Run from the repository root::

    python -m bench.scale                              # 1000 nodes, 10 % storm, 100 s steady
    python -m bench.scale --nodes 200 --steady-s 10 --json /tmp/scale.json

Goals (issue 7): daemon under 5 % of one core and 200 MB RSS at steady state, event
→ webhook p99 under 100 ms. Nothing is asserted; missed goals are marked in the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml
from aiohttp import web

if __package__ in (None, ""):  # run as a script: import this checkout's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loopwatch import LoopWatch  # noqa: E402
from bench.scale_daemon import PROFILE_ENV  # noqa: E402
from daemon.config import AgentSpec, DaemonSpec  # noqa: E402
from daemon.control.pool import heartbeat_interval_s as scaled_heartbeat_interval  # noqa: E402
from daemon.feed.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify_signature  # noqa: E402

__all__ = ["Options", "run", "main"]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = "bench-results-scale.json"
SECRET_ENV = "SPOTVISOR_BENCH_WEBHOOK_SECRET"
GOAL_CPU_PCT, GOAL_RSS_MB, GOAL_P99_MS = 5.0, 200.0, 100.0


@dataclass(frozen=True, slots=True)
class Options:
    nodes: int = 1000
    gpus_per_node: int = 8
    storm_frac: float = 0.1
    storm_spread_s: float = 1.0
    # the steady window: one periodic-commit period (checkpoint_every × step_s, 100 s), so
    # it holds one commit's reports as a long average would; the other periodic work
    # (heartbeats, long-poll renewals, reconcile passes) is spread evenly over it
    steady_s: float = 100.0
    settle_s: float = 5.0
    heartbeat_interval_s: float = AgentSpec().heartbeat_interval_s  # the shortest interval (config default)
    max_heartbeats_per_second: float = DaemonSpec().max_heartbeats_per_second  # the pool's cap (config default)
    boot_s: float = 2.0
    step_s: float = 1.0
    flush_s: float = 2.0
    rdzv_s: float = 3.0
    log_every_s: float = 10.0
    checkpoint_every: int = 100
    lead_s: float = 120.0  # AWS's notice
    ramp_timeout_s: float = 300.0
    recover_timeout_s: float = 180.0
    seed: int = 0
    feed_timeout_s: float = 180.0  # after the ramp and after the storm: wait this long at most for the feed
    probe_every_s: float = 1.0  # steady window: one pool_scaled event this often (0: none)
    profile: str | None = None
    profile_phase: str = "steady"  # steady | storm
    keep: bool = False  # keep the run's directory (config, store, daemon and fleet logs)

    @property
    def storm_nodes(self) -> int:
        return max(1, round(self.storm_frac * self.nodes))

    @property
    def scaled_interval_s(self) -> float:
        """The heartbeat interval at full size (each node is told the time to its slot in it)."""
        return scaled_heartbeat_interval(self.nodes, min_interval_s=self.heartbeat_interval_s,
                                         max_per_second=self.max_heartbeats_per_second)


# -- this process -----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Hook:
    """The webhook sink: checks each signature, keeps the first delivery of each ``seq``
    (a body is a batch, ``{"pool", "events": [...]}``; each event's ``recv`` is the
    request's receive time)."""

    secret: str
    events: dict[int, dict[str, Any]] = field(default_factory=dict)
    bad: int = 0
    duplicates: int = 0
    last_recv: float = 0.0

    async def handle(self, request: web.Request) -> web.Response:
        recv = time.time()
        body = await request.read()
        if not verify_signature(self.secret, request.headers.get(TIMESTAMP_HEADER, ""), body,
                                request.headers.get(SIGNATURE_HEADER, "")):
            self.bad += 1
            return web.Response(status=401)
        self.last_recv = recv
        for ev in json.loads(body)["events"]:
            if ev["seq"] in self.events:
                self.duplicates += 1
            else:
                self.events[ev["seq"]] = {"kind": ev["kind"], "time": ev["time"], "recv": recv, "node": ev["node"],
                                          "data": ev["data"]}
        return web.Response(text="ok")

    def of(self, kind: str, since: float = 0.0) -> list[dict[str, Any]]:
        return sorted((e for e in self.events.values() if e["kind"] == kind and e["time"] >= since),
                      key=lambda e: e["time"])


class _Proc:
    """CPU seconds and RSS of one process (psutil)."""

    def __init__(self, pid: int) -> None:
        self.p = psutil.Process(pid)

    def cpu_s(self) -> float:
        t = self.p.cpu_times()
        return t.user + t.system

    def rss_mb(self) -> float:
        return self.p.memory_info().rss / 2**20

    def wakeups(self) -> int:
        """Voluntary context switches of all its threads: how often it slept and woke."""
        return self.p.num_ctx_switches().voluntary


@dataclass(slots=True)
class _Window:
    """CPU % of one core over a window, RSS sampled each second, per process."""

    wall_s: float = 0.0
    cpu_pct: dict[str, float] = field(default_factory=dict)
    rss_mb: dict[str, list[float]] = field(default_factory=dict)
    machine_pct: float = 0.0  # all CPUs busy, % of the whole machine (other sessions share it)
    wakeups_per_s: dict[str, float] = field(default_factory=dict)


async def _sample(procs: dict[str, _Proc], *, seconds: float | None = None, until: Any = None) -> _Window:
    """Sample until ``seconds`` have passed or ``until()`` is true (checked every 0.5 s)."""
    w = _Window(rss_mb={name: [] for name in procs})
    cpu0 = {name: p.cpu_s() for name, p in procs.items()}
    woke0 = {name: p.wakeups() for name, p in procs.items()}
    psutil.cpu_percent(None)
    t0 = time.monotonic()
    next_rss = t0
    while True:
        now = time.monotonic()
        if now >= next_rss:
            for name, p in procs.items():
                w.rss_mb[name].append(p.rss_mb())
            next_rss += 1.0
        if (seconds is not None and now - t0 >= seconds) or (until is not None and await until()):
            break
        await asyncio.sleep(0.5 if until is not None else min(0.5, max(0.0, t0 + seconds - now)))
    w.wall_s = time.monotonic() - t0
    w.machine_pct = psutil.cpu_percent(None)
    w.cpu_pct = {name: 100.0 * (p.cpu_s() - cpu0[name]) / w.wall_s for name, p in procs.items()}
    w.wakeups_per_s = {name: (p.wakeups() - woke0[name]) / w.wall_s for name, p in procs.items()}
    return w


def _config(o: Options, tmp: Path, sock: str, hook_url: str) -> dict[str, Any]:
    n, g, k = o.nodes, o.gpus_per_node, o.storm_nodes
    # the global batch splits evenly over the full world and over the world after the storm
    batch = math.lcm(n * g, max(1, n - k) * g)
    offer = {"provider": "local", "region": "sim", "instance_type": "sim.gpu", "gpus_per_node": g}
    return {
        "pool": {"name": "scale", "min_nodes": 1, "target_nodes": n, "max_nodes": n},
        "job": {"id": "scale", "target_steps": 10**9, "global_batch_size": batch, "micro_batch_size": 1,
                "checkpoint_interval_steps": o.checkpoint_every},
        "agent": {"heartbeat_interval_s": o.heartbeat_interval_s},
        # a longer shortest interval than the default needs a longer loss timeout (at least 4 beats);
        # the daemon stretches it further by itself for the intervals it scales up (daemon/control/pool.py)
        "daemon": {"verify_commits": False, "state_dir": str(tmp / "state"), "socket": sock, "agent_host": "127.0.0.1", "agent_port": 0,
                   "heartbeat_timeout_s": max(DaemonSpec().heartbeat_timeout_s, 4 * o.heartbeat_interval_s),
                   "max_heartbeats_per_second": o.max_heartbeats_per_second},
        # two zones: a replacement goes to the zone that did not just get notices
        "offers": [{**offer, "zone": "sim-a"}, {**offer, "zone": "sim-b"}],
        # the simulated agents are coroutines, not processes: the local provider's cap does not apply
        "providers": {"local": {"max_nodes": n}},
        "notify": [{"name": "bench", "type": "webhook", "url": hook_url, "secret_env": SECRET_ENV}],
    }


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(len(s) * p / 100) - 1))]


def _lat(events: list[dict[str, Any]]) -> dict[str, Any]:
    ms = [1000.0 * (e["recv"] - e["time"]) for e in events]
    # the sink gets one POST per event, one at a time: while a backlog waits (the next
    # event was recorded before this one arrived), the gap between arrivals is what one
    # delivery takes, and a burst of N events needs N of them
    by_seq = sorted(events, key=lambda e: e["recv"])
    gaps = [1000.0 * (b["recv"] - a["recv"]) for a, b in zip(by_seq, by_seq[1:]) if b["time"] <= a["recv"]]
    return {"n": len(ms), "p50_ms": _pct(ms, 50), "p99_ms": _pct(ms, 99), "max_ms": max(ms) if ms else None,
            "backlogged_ms_per_event": _pct(gaps, 50)}


class PhaseTimeout(RuntimeError):
    """A phase did not finish within its timeout."""


async def _feed_caught_up(sock: str, hook: _Hook, *, timeout_s: float) -> float | None:
    """Wait until the webhook has every event the daemon stored (its control socket's
    ``/v1/events?since=`` the newest seq received answers nothing); returns how long
    ago the last one arrived (seconds), or None after ``timeout_s``."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock),
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        while time.monotonic() - t0 < timeout_s:
            since = max(hook.events, default=0)
            async with s.get("http://daemon/v1/events", params={"since": str(since)}) as r:
                if not (await r.read()).strip():
                    return time.time() - hook.last_recv
            await asyncio.sleep(0.5)
    return None


async def _probe(sock: str, o: Options) -> None:
    """During the steady window, one event every ``probe_every_s``: ``POST /v1/scale`` to the
    current target on the control socket (what ``spotctl scale N`` does). It records a
    ``pool_scaled`` event and changes nothing else, so the feed's latency is measured
    under the full heartbeat load without adding work of its own."""
    if o.probe_every_s <= 0:
        return
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock),
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        while True:
            async with s.post("http://daemon/v1/scale", json={"nodes": o.nodes}) as r:
                if r.status != 200:
                    raise PhaseTimeout(f"the steady probe (POST /v1/scale) got HTTP {r.status}: {await r.text()}")
            await asyncio.sleep(o.probe_every_s)


async def run(o: Options, *, progress: Any = print) -> dict[str, Any]:
    """All phases; returns the results document (see ``main`` for the table)."""
    tmp = Path(tempfile.mkdtemp(prefix="sv-scale-"))
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    secret = secrets.token_hex(16)
    hook = _Hook(secret)
    app = web.Application()
    app.router.add_post("/hook", hook.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    hook_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/hook"  # type: ignore[union-attr]
    cfg_path = tmp / "scale.yaml"
    sock = f"{sockdir}/d.sock"
    cfg_path.write_text(yaml.safe_dump(_config(o, tmp, sock, hook_url)))
    env = {**os.environ, SECRET_ENV: secret, "PYTHONPATH": str(REPO)}
    env.pop(PROFILE_ENV, None)
    logs: list[Any] = []  # the children's stderr files, closed at the end
    fleet = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.scale_sim", "--boot-s", f"{o.boot_s:g}",
        "--heartbeat-interval-s", f"{o.heartbeat_interval_s:g}", "--log-every-s", f"{o.log_every_s:g}",
        "--step-s", f"{o.step_s:g}", "--flush-s", f"{o.flush_s:g}", "--rdzv-s", f"{o.rdzv_s:g}",
        "--checkpoint-every", str(o.checkpoint_every),
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=_log(tmp / "fleet.log", logs))
    daemon: asyncio.subprocess.Process | None = None
    watch: LoopWatch | None = None
    lags: list[dict[str, Any]] | None = None
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    try:
        assert fleet.stdout is not None
        cloud = (await asyncio.wait_for(fleet.stdout.readline(), 30)).decode().strip()
        if not cloud.startswith("http://"):
            raise PhaseTimeout(f"the fleet did not start (see {tmp / 'fleet.log'})")

        async def stats(**q: Any) -> dict[str, Any]:
            async with http.get(f"{cloud}/stats", params={k: str(v) for k, v in q.items()}) as r:
                return await r.json()

        denv = dict(env)
        if o.profile:
            denv[PROFILE_ENV] = str(Path(o.profile).resolve())
        t_start = time.time()
        daemon = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.scale_daemon", "--config", str(cfg_path), "--cloud-url", cloud,
            cwd=REPO, env=denv, stdout=asyncio.subprocess.DEVNULL, stderr=_log(tmp / "daemon.log", logs))
        procs = {"daemon": _Proc(daemon.pid), "fleet": _Proc(fleet.pid), "bench": _Proc(os.getpid())}
        watch = LoopWatch(daemon.pid)  # its loop's stalls, sampled from this process
        try:
            watch.start()
        except OSError:  # not Linux
            watch = None
        full = o.nodes * o.gpus_per_node

        async def at_full_size(attempt_not: str = "") -> bool:
            j = (await stats())["job"]
            return (j["world_size"] == full and j["members"] == o.nodes and j["training"] and not j["holding"]
                    and j["attempt"] != attempt_not)

        progress(f"ramp: launching {o.nodes} nodes ...")
        ramp = await _sample(procs, until=lambda: _guard(daemon, at_full_size(), time.time() - t_start,
                                                           o.ramp_timeout_s))
        if not await at_full_size():
            raise PhaseTimeout(f"the job did not reach world size {full} within {o.ramp_timeout_s:g} s "
                               f"(fleet: {await stats()}; daemon log: {tmp / 'daemon.log'})")
        t_full = time.time()
        # after its trainer started (an extra heartbeat, on every node at once) a node is
        # told the way to its slot, at most 1.5 intervals away: the steady window starts
        # once every node is heartbeating at its slot
        settle_s = max(o.settle_s, 1.5 * o.scaled_interval_s)
        progress(f"ramp: job at world size {full} after {t_full - t_start:.1f} s; waiting for the feed "
                 f"to catch up, then settling {settle_s:.0f} s")
        ramp_feed_s = await _feed_caught_up(sock, hook, timeout_s=o.feed_timeout_s)
        ramp_feed_s = None if ramp_feed_s is None else round(max(0.0, time.time() - ramp_feed_s - t_full), 2)
        await asyncio.sleep(max(0.0, t_full + settle_s - time.time()))

        progress(f"steady: {o.steady_s:g} s ...")
        t_steady0 = time.time()
        probe = asyncio.create_task(_probe(sock, o), name="bench:probe")
        if o.profile and o.profile_phase == "steady":
            daemon.send_signal(signal.SIGUSR1)  # cProfile on, for the steady window only
        try:
            steady = await _sample(procs, seconds=o.steady_s)
        finally:
            if o.profile and o.profile_phase == "steady":
                daemon.send_signal(signal.SIGUSR2)
            probe.cancel()
            probes = await asyncio.gather(probe, return_exceptions=True)
        if isinstance(probes[0], BaseException) and not isinstance(probes[0], asyncio.CancelledError):
            raise probes[0]
        t_steady1 = time.time()
        hb = (await stats(since=t_steady0, until=t_steady1))["window"]
        attempt_before = (await stats())["job"]["attempt"]

        k = o.storm_nodes
        progress(f"storm: {k} notices within {o.storm_spread_s:g} s ...")
        if o.profile and o.profile_phase == "storm":
            daemon.send_signal(signal.SIGUSR1)  # cProfile on, from the storm until the job is back
        t_storm_req = time.time()
        async with http.post(f"{cloud}/storm", json={"frac": o.storm_frac, "spread_s": o.storm_spread_s,
                                                     "lead_s": o.lead_s, "seed": o.seed}) as r:
            storm_reply = await r.json()
        k = storm_reply["k"]

        async def recovered() -> bool:
            return await at_full_size(attempt_not=attempt_before)

        storm = await _sample(procs, until=lambda: _guard(daemon, recovered(), time.time() - t_storm_req,
                                                            o.recover_timeout_s))
        t_recovered = time.time() if await recovered() else None
        if o.profile and o.profile_phase == "storm":
            daemon.send_signal(signal.SIGUSR2)
        progress("storm: " + ("job back at full size" if t_recovered else "NOT back at full size")
                 + f" after {time.time() - t_storm_req:.1f} s; waiting for the feed to catch up")
        storm_feed = await _feed_caught_up(sock, hook, timeout_s=o.feed_timeout_s)
        final = await stats(launches=1)
    finally:
        if watch is not None:
            lags = watch.stop()
        for proc in (daemon, fleet):
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        await http.close()
        await runner.cleanup()
        shutil.rmtree(sockdir, ignore_errors=True)
        for f in logs:
            f.close()

    notices = sorted(t for t in final["notices_sent"] if t >= t_storm_req)
    t0 = notices[0] if notices else t_storm_req
    launches_after = sorted(t for t, _ in final["launches"] if t >= t0)
    recorded = hook.of("interruption_notice", since=t0)
    planned = hook.of("node_launch_requested", since=t0)

    def nth(times: list[float], n: int) -> float | None:
        return round(times[n - 1] - t0, 3) if len(times) >= n else None

    phases = {
        "ramp": [e for e in hook.events.values() if e["time"] < t_steady0],
        "steady": [e for e in hook.events.values() if t_steady0 <= e["time"] < t_storm_req],
        "storm": [e for e in hook.events.values() if e["time"] >= t_storm_req],
    }
    rss = steady.rss_mb["daemon"]
    log_text = (tmp / "daemon.log").read_text(errors="replace")
    if not o.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "bench": "scale",
        "time": time.time(),
        "options": _vars(o),
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "shared": "other sessions run on this machine: CPU figures are noisy"},
        "ramp_s": round(t_full - t_start, 2),
        # every node once per interval at full size, at its own slot
        "full_heartbeat_rate": round(o.nodes / o.scaled_interval_s, 1),
        "heartbeat_interval_told_s": final["heartbeat_interval_s"],  # [shortest, longest] at the end
        # the job at full size → the webhook had every event of the ramp (None: not within the timeout)
        "ramp_feed_caught_up_s": ramp_feed_s,
        "storm_feed_caught_up": storm_feed is not None,
        "steady": {
            "window_s": round(steady.wall_s, 2),
            "daemon_cpu_pct": round(steady.cpu_pct["daemon"], 2),
            # how often its threads slept and woke (voluntary context switches): on a VM each
            # wake-up has a fixed cost, whatever the work
            "daemon_wakeups_per_s": round(steady.wakeups_per_s["daemon"], 1),
            "daemon_rss_mb": {"mean": round(statistics.fmean(rss), 1), "max": round(max(rss), 1)},
            "fleet_cpu_pct": round(steady.cpu_pct["fleet"], 2),
            "bench_cpu_pct": round(steady.cpu_pct["bench"], 2),
            "machine_busy_pct": round(steady.machine_pct, 1),
            # everything else on the machine (other sessions' tests), % of one core
            "others_cpu_pct": round(max(0.0, steady.machine_pct * (os.cpu_count() or 1)
                                        - sum(steady.cpu_pct.values())), 1),
            "heartbeats_per_s": round(hb["heartbeats"] / steady.wall_s, 1),
            # the other agent requests the daemon answered in the window, and the commits in it
            "command_polls_per_s": round(hb["command_polls"] / steady.wall_s, 1),
            "report_posts_per_s": round(hb["report_posts"] / steady.wall_s, 1),
            "commits": sum(1 for e in hook.of("checkpoint_committed", since=t_steady0) if e["time"] <= t_steady1),
            # less sensitive to the machine's load than the % itself: CPU time per heartbeat
            # answered, and that cost at the full rate (every node once per interval)
            "daemon_cpu_us_per_heartbeat": (round(1e4 * steady.cpu_pct["daemon"] / (hb["heartbeats"] / steady.wall_s))
                                            if hb["heartbeats"] else None),
            "daemon_cpu_pct_at_full_rate": (round(steady.cpu_pct["daemon"] * (o.nodes / o.scaled_interval_s)
                                                  / (hb["heartbeats"] / steady.wall_s), 1)
                                            if hb["heartbeats"] else None),
            "heartbeat_rtt_ms": {k_: None if hb[f"rtt_{k_}_s"] is None else round(1000 * hb[f"rtt_{k_}_s"], 2)
                                 for k_ in ("p50", "p99", "max")},
        },
        "ramp_window": {"daemon_cpu_pct": round(ramp.cpu_pct["daemon"], 2),
                        "daemon_rss_mb_max": round(max(ramp.rss_mb["daemon"] or [0.0]), 1)},
        "storm": {
            "notices": k,
            "notices_sent_within_s": round(notices[-1] - t0, 3) if notices else None,
            "all_notices_recorded_s": nth([e["time"] for e in recorded], k),
            "all_replacements_planned_s": nth([e["time"] for e in planned], k),
            "last_notice_to_all_planned_s": (round(planned[k - 1]["time"] - notices[-1], 3)
                                             if len(planned) >= k and notices else None),
            "all_replacements_issued_s": nth(launches_after, k),
            "replacements_planned": len(planned),
            "replacements_issued": len(launches_after),
            "back_at_full_size_s": None if t_recovered is None else round(t_recovered - t0, 2),
            "daemon_cpu_pct": round(storm.cpu_pct["daemon"], 2),
            "daemon_rss_mb_max": round(max(storm.rss_mb["daemon"] or [0.0]), 1),
        },
        "loop_stalls": {name: _stalls(None if lags is None else [x for x in lags if a <= x["t"] < b])
                        for name, a, b in (("steady", t_steady0, t_steady1), ("storm", t_storm_req, math.inf))},
        # what the daemon recorded from the first notice on: kind → count, first and last (s after it)
        "storm_timeline": _timeline([e for e in hook.events.values() if e["time"] >= t0], t0),
        "webhook_latency": {name: _lat(evs) for name, evs in [("all", list(hook.events.values())), *phases.items()]},
        "webhook": {"events": len(hook.events), "bad_signatures": hook.bad, "duplicates": hook.duplicates},
        # every storm event as the sink got it: [seq, kind, node, recorded (s after the first notice), latency ms]
        "storm_events": [[seq, e["kind"], e["node"], round(e["time"] - t0, 4), round(1000 * (e["recv"] - e["time"]), 2)]
                         for seq, e in sorted(hook.events.items()) if e["time"] >= t_storm_req],
        "fleet": {k_: final[k_] for k_ in ("hb_total", "hb_failed", "reports_ok", "reports_failed", "terminated",
                                           "cmd_polls", "cmd_failed", "cmd_by_poll", "cmd_by_heartbeat")},
        "daemon_log": {"errors": log_text.count("level='error'") + log_text.count("level=error"),
                       "warnings": log_text.count("level='warning'") + log_text.count("level=warning"),
                       "path": str(tmp / "daemon.log") if o.keep else None},
        "profile": o.profile,
    }
    return doc


def _stalls(lags: list[dict[str, float]] | None) -> dict[str, Any]:
    """Event-loop stalls over 50 ms in a window (:class:`bench.loopwatch.LoopWatch`): how
    many, the longest, and the share of the stalled time during which the daemon's loop
    thread had a CPU and waited for one (the rest it was blocked). None: not measured."""
    if lags is None:
        return {"n_over_50ms": None, "n_over_200ms": None, "max_ms": None, "cpu_share": None, "runq_share": None}
    period = sum(x["lag_s"] for x in lags)
    return {"n_over_50ms": len(lags), "n_over_200ms": sum(1 for x in lags if x["lag_s"] > 0.2),
            "max_ms": round(1000 * max((x["lag_s"] for x in lags), default=0.0), 1),
            "cpu_share": round(min(1.0, sum(x["cpu_s"] for x in lags) / period), 2) if lags else None,
            "runq_share": round(min(1.0, sum(x["runq_s"] for x in lags) / period), 2) if lags else None}


def _log(path: Path, opened: list[Any]) -> Any:
    f = open(path, "wb")
    opened.append(f)
    return f


def _timeline(events: list[dict[str, Any]], t0: float) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: e["time"]):
        x = out.setdefault(e["kind"], {"n": 0, "first_s": round(e["time"] - t0, 3)})
        x["n"] += 1
        x["last_s"] = round(e["time"] - t0, 3)
    return out


def _vars(o: Options) -> dict[str, Any]:
    return {name: getattr(o, name) for name in Options.__dataclass_fields__}


async def _guard(daemon: asyncio.subprocess.Process, pred: Any, elapsed_s: float = 0.0,
                 timeout_s: float = math.inf) -> bool:
    """``await pred``, but stop waiting when the daemon died or the phase ran out of time."""
    if daemon.returncode is not None:
        pred.close()
        raise PhaseTimeout(f"the daemon exited (rc {daemon.returncode})")
    if elapsed_s > timeout_s:
        pred.close()
        return True
    return await pred


# -- the table --------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _s1(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(doc: dict[str, Any]) -> str:
    """The printed table: metric, value, goal, verdict."""
    st, sm, lat = doc["steady"], doc["storm"], doc["webhook_latency"]
    rss = st["daemon_rss_mb"]

    def verdict(ok: bool | None) -> str:
        return "" if ok is None else ("ok" if ok else "MISSED")

    p99 = lat["all"]["p99_ms"]
    rows: list[tuple[str, str, str, str]] = [
        ("daemon CPU, steady (% of one core)", f"{st['daemon_cpu_pct']:.1f}", f"< {GOAL_CPU_PCT:g}",
         verdict(st["daemon_cpu_pct"] < GOAL_CPU_PCT)),
        ("daemon RSS, steady (MB, mean / max)", f"{rss['mean']:.0f} / {rss['max']:.0f}", f"< {GOAL_RSS_MB:g}",
         verdict(rss["max"] < GOAL_RSS_MB)),
        ("event -> webhook p50 / p99 (ms), all", f"{_ms(lat['all']['p50_ms'])} / {_ms(p99)}",
         f"p99 < {GOAL_P99_MS:g}", verdict(None if p99 is None else p99 < GOAL_P99_MS)),
    ]
    for phase in ("ramp", "steady", "storm"):
        x = lat[phase]
        rows.append((f"  {phase}{' (probes)' if phase == 'steady' else ''}, {x['n']} events: p50 / p99 / max", f"{_ms(x['p50_ms'])} / {_ms(x['p99_ms'])} / "
                     f"{_ms(x['max_ms'])}", "", ""))
    rows += [
        ("ramp: daemon start -> job at full size (s)", _s(doc["ramp_s"]), "", ""),
        ("  job at full size -> feed has every ramp event (s)", _s(doc["ramp_feed_caught_up_s"]), "", ""),
        ("  feed, backlogged: one delivery every (ms, median)", _ms(lat["ramp"]["backlogged_ms_per_event"]),
         "", ""),
        (f"storm: {sm['notices']} notices sent within (s)", _s(sm["notices_sent_within_s"]), "", ""),
        ("  first notice -> all notices recorded (s)", _s(sm["all_notices_recorded_s"]), "", ""),
        ("  first notice -> all replacements planned (s)", _s(sm["all_replacements_planned_s"]), "", ""),
        ("  first notice -> all launch calls made (s)", _s(sm["all_replacements_issued_s"]), "", ""),
        ("  last notice -> all replacements planned (s)", _s(sm["last_notice_to_all_planned_s"]), "", ""),
        ("  first notice -> job at full size again (s)", _s(sm["back_at_full_size_s"]), "", ""),
        ("  daemon CPU during storm (% of one core)", f"{sm['daemon_cpu_pct']:.1f}", "", ""),
        ("  feed, backlogged: one delivery every (ms, median)", _ms(lat["storm"]["backlogged_ms_per_event"]),
         "", ""),
        (f"heartbeats answered per s, steady (full rate {doc['full_heartbeat_rate']:g})",
         f"{st['heartbeats_per_s']:.0f}", "", ""),
        ("  daemon threads' wake-ups per s, steady", f"{st['daemon_wakeups_per_s']:.0f}", "", ""),
        ("  command long-polls / report posts answered per s; commits",
         f"{st['command_polls_per_s']:.1f} / {st['report_posts_per_s']:.1f}; {st['commits']}", "", ""),
        ("  daemon CPU per heartbeat answered (us)", _us(st["daemon_cpu_us_per_heartbeat"]), "", ""),
        ("  daemon CPU at the full rate, extrapolated (%)", _s1(st["daemon_cpu_pct_at_full_rate"]),
         f"< {GOAL_CPU_PCT:g}", verdict(None if st["daemon_cpu_pct_at_full_rate"] is None
                                         else st["daemon_cpu_pct_at_full_rate"] < GOAL_CPU_PCT)),
        ("daemon loop stalls > 50 ms, steady / storm (n, max ms)",
         " / ".join(f"{'-' if x['n_over_50ms'] is None else x['n_over_50ms']}, {_ms(x['max_ms'])}"
                    for x in (doc["loop_stalls"]["steady"], doc["loop_stalls"]["storm"])), "", ""),
        ("  of their time: on a CPU / waiting for one, steady",
         f"{_s(doc['loop_stalls']['steady']['cpu_share'])} / {_s(doc['loop_stalls']['steady']['runq_share'])}",
         "", ""),
        ("  of their time: on a CPU / waiting for one, storm",
         f"{_s(doc['loop_stalls']['storm']['cpu_share'])} / {_s(doc['loop_stalls']['storm']['runq_share'])}",
         "", ""),
        ("heartbeat round trip p50 / p99 (ms), steady",
         f"{_ms(st['heartbeat_rtt_ms']['p50'])} / {_ms(st['heartbeat_rtt_ms']['p99'])}", "", ""),
        ("fleet process CPU, steady (% of one core)", f"{st['fleet_cpu_pct']:.1f}", "", ""),
        (f"machine busy, steady (% of {doc['machine']['cpus']} CPUs)", f"{st['machine_busy_pct']:.0f}", "", ""),
        ("  other processes, steady (% of one core)", f"{st['others_cpu_pct']:.0f}", "", ""),
    ]
    w = max(len(r[0]) for r in rows)
    v = max(len(r[1]) for r in rows)
    g = max(len(r[2]) for r in rows)
    lines = [f"{'metric':<{w}}  {'value':>{v}}  {'goal':<{g}}"]
    lines += [f"{a:<{w}}  {b:>{v}}  {c:<{g}}  {d}".rstrip() for a, b, c, d in rows]
    return "\n".join(lines)


def _options(argv: list[str] | None) -> tuple[Options, str, bool]:
    d = Options()
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=d.nodes, help=f"pool size (default {d.nodes})")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node,
                   help=f"GPUs per node: one GPU sample each per heartbeat (default {d.gpus_per_node})")
    p.add_argument("--storm-frac", type=float, default=d.storm_frac,
                   help=f"fraction of the nodes that get notices (default {d.storm_frac:g})")
    p.add_argument("--storm-spread-s", type=float, default=d.storm_spread_s,
                   help=f"the notices fall within this many seconds (default {d.storm_spread_s:g})")
    p.add_argument("--steady-s", type=float, default=d.steady_s, help=f"steady window (default {d.steady_s:g})")
    p.add_argument("--settle-s", type=float, default=d.settle_s,
                   help=f"wait after the ramp before the steady window (default {d.settle_s:g})")
    p.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s,
                   help="agent.heartbeat_interval_s, the shortest interval the daemon tells "
                        f"(default: the config's default, {d.heartbeat_interval_s:g})")
    p.add_argument("--max-heartbeats-per-second", type=float, default=d.max_heartbeats_per_second,
                   help="daemon.max_heartbeats_per_second, the pool's cap that stretches the interval "
                        f"(default: the config's default, {d.max_heartbeats_per_second:g})")
    p.add_argument("--boot-s", type=float, default=d.boot_s, help=f"launch -> agent up (default {d.boot_s:g})")
    p.add_argument("--step-s", type=float, default=d.step_s, help=f"seconds per training step (default {d.step_s:g})")
    p.add_argument("--flush-s", type=float, default=d.flush_s, help=f"seconds per commit (default {d.flush_s:g})")
    p.add_argument("--rdzv-s", type=float, default=d.rdzv_s,
                   help=f"node left/joined -> job restarted (default {d.rdzv_s:g})")
    p.add_argument("--log-every-s", type=float, default=d.log_every_s,
                   help=f"a trainer.log line per node this often, 0 = none (default {d.log_every_s:g})")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help=f"periodic commit every N steps (default {d.checkpoint_every})")
    p.add_argument("--lead-s", type=float, default=d.lead_s,
                   help=f"each notice's lead time before its deadline (default {d.lead_s:g}, AWS's)")
    p.add_argument("--ramp-timeout-s", type=float, default=d.ramp_timeout_s)
    p.add_argument("--recover-timeout-s", type=float, default=d.recover_timeout_s)
    p.add_argument("--feed-timeout-s", type=float, default=d.feed_timeout_s,
                   help="after the ramp and the storm, wait at most this long for the webhook to have every event")
    p.add_argument("--probe-every-s", type=float, default=d.probe_every_s,
                   help="steady window: one event (spotctl scale to the same target) this often, to measure "
                        f"the feed under load; 0 = none (default {d.probe_every_s:g})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the storm's choice and timing")
    p.add_argument("--profile", metavar="PATH",
                   help="cProfile the daemon over one window (--profile-phase): PATH (pstats) and PATH.txt "
                        "(the profiler inflates the CPU figures of that run)")
    p.add_argument("--profile-phase", choices=("steady", "storm"), default=d.profile_phase,
                   help="the window --profile covers: the steady window, or the storm until the job is back")
    p.add_argument("--keep", action="store_true", help="keep the run's directory (config, store, logs)")
    p.add_argument("--json", default=DEFAULT_OUT, metavar="PATH", help=f"results file (default {DEFAULT_OUT})")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    if a.nodes < 2:
        p.error(f"--nodes must be >= 2, got {a.nodes}")
    if not 0 < a.storm_frac < 1:
        p.error(f"--storm-frac must be within (0, 1), got {a.storm_frac}")
    for name in ("steady_s", "heartbeat_interval_s", "max_heartbeats_per_second", "step_s"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    o = Options(**{name: getattr(a, name) for name in Options.__dataclass_fields__})
    return o, a.json, a.quiet


def main(argv: list[str] | None = None) -> int:
    o, out, quiet = _options(argv)
    started = time.monotonic()
    try:
        doc = asyncio.run(run(o, progress=(lambda s: None) if quiet else
                              (lambda s: print(f"[{time.monotonic() - started:6.1f}s] {s}", file=sys.stderr,
                                               flush=True))))
    except PhaseTimeout as exc:
        print(f"bench.scale: {exc}", file=sys.stderr)
        return 1
    doc["wall_s"] = round(time.monotonic() - started, 1)
    print(f"scale: {o.nodes} nodes x {o.gpus_per_node} GPUs, heartbeat every {o.scaled_interval_s:g} s "
          f"(max({o.heartbeat_interval_s:g} s, nodes / {o.max_heartbeats_per_second:g} per s), each node at its slot), "
          f"ramp {doc['ramp_s']:.1f} s, steady {doc['steady']['window_s']:.0f} s, storm {doc['storm']['notices']} "
          f"notices within {o.storm_spread_s:g} s; {doc['machine']['cpus']} CPUs shared with other work, "
          f"Python {doc['machine']['python']}, {doc['wall_s']:.0f} s wall"
          + ("; PROFILED (CPU inflated)" if o.profile else ""))
    print(table(doc))
    f, dl = doc["fleet"], doc["daemon_log"]
    print(f"feed: {doc['webhook']['events']} events, {doc['webhook']['bad_signatures']} bad signatures; "
          f"fleet: {f['hb_failed']} failed heartbeats, {f['reports_failed']} failed reports, "
          f"{f['cmd_polls']} command long-polls answered ({f['cmd_failed']} failed), commands by long-poll / "
          f"by heartbeat {f['cmd_by_poll']} / {f['cmd_by_heartbeat']}, intervals told "
          f"{doc['heartbeat_interval_told_s']} s; daemon log: {dl['errors']} errors, {dl['warnings']} warnings")
    Path(out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
