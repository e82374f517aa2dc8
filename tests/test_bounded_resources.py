"""Issue 25, items 4-5: a real daemon under attack keeps serving its nodes.

``spotvisord run`` on a local config, its open-file limit set as
``systemd/spotvisord.service`` sets it (``LimitNOFILE``; this machine's hard limit if that
is lower), two nodes training ``trainer.run`` under torchrun with periodic commits
(paced: each step at least 0.15 s, as a GPU step leaves the CPU idle)
(verified against the checkpoint store, as by default). Then an attacker process
(``tests/flood_attacker.py``) holds 5,000 idle connections to the agent port from 250
loopback addresses (each reopened as soon as the daemon closes it) and 200 more from one
address, and floods reports from one node's token, while this test

- sends a heartbeat every 0.2 s from 127.0.0.1 and times each answer;
- reads from the store how long each real commit took from the trainer's status line to
  its ``checkpoint_committed`` event (agent's tail, report, manifest verified, recorded);
- samples the daemon's memory and descriptors.

It asserts the nodes are served (heartbeat p95 and every commit within the bounds
below, no node lost, no commit left unconfirmed), memory and the database grow by less
than the stated bounds, the flood's drops are counted in ``/metrics``, and no accept()
ever failed. A table of what was measured is printed (``pytest -s``).

**The flood lasts 15 s here**, not the issue's 30 s: the bounds are per second (the
token buckets) and the test's two torchrun nodes already take ~40 s to come up on a
loaded 2-core machine. ``FLOOD_S=30`` runs the 30 s flood (the figures for it are in
the branch's report).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import yaml

from bench.loopwatch import LoopWatch
from daemon.control.bounds import INTAKE_RATES, ReportClass
from bench.ports import free_port
from conftest import stop_process

ROOT = Path(__file__).resolve().parents[1]
SMALL_MODEL = ["--seq-len", "32", "--n-layer", "1", "--n-embd", "64", "--n-head", "2"]
FLOOD_S = float(os.environ.get("FLOOD_S", "15"))
IDLE, HOSTS, ONE_HOST = 5000, 250, 200
BASELINE_S = 8.0  # the same measures before the attack
# A real attacker's CPU is not the control node's: here it shares two cores with the
# daemon, the trainers and this test, so it runs at a lower priority, and the daemon's
# loop measures what the attack costs the daemon, not what the attacker costs the machine
ATTACKER_NICE = 10
# What must hold. On the shared 2-core machine, six runs under attack measured a heartbeat
# p95 of 0.03-0.48 s, a commit p95 of 0.22-0.96 s (the commit path crosses the node's
# agent, which shares those cores: it tails the status file every 0.2 s, reports, and
# the daemon reads the manifest), RSS +29-34 MB, the database +0.8-1.1 MB (the job's own
# commits included); the daemon loop's stalls were mostly waiting for a CPU, not running.
HEARTBEAT_P95_S = 1.0
COMMIT_P90_S = 1.0
COMMIT_MAX_S = 3.0  # no commit starved
RSS_GROWTH_MAX_MB = 100.0  # 5,200 connections' handlers and buffers, the flood's batches
DB_GROWTH_MAX_MB = 5.0


def _unit_nofile() -> int:
    (v,) = re.findall(r"^LimitNOFILE=(\d+)$", (ROOT / "systemd" / "spotvisord.service").read_text(), re.M)
    return int(v)


def _query(db: Path, sql: str, *args: Any) -> list[tuple]:
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as conn:
            return conn.execute(sql, args).fetchall()
    except sqlite3.OperationalError:  # not created yet
        return []


def _db_bytes(db: Path) -> int:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file())


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)


@pytest.mark.slow  # two torchrun nodes, 5,200 connections and a flood: ~70 s on two loaded cores
def test_a_daemon_under_connection_and_report_floods_keeps_serving_its_nodes(tmp_path: Path, rendezvous: int) -> None:
    nofile = min(_unit_nofile(), resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    with tempfile.TemporaryDirectory(prefix="svb-", dir="/tmp") as sockdir:
        raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
        raw["pool"].update({"min_nodes": 1, "target_nodes": 2, "max_nodes": 2})
        # steps of at least 0.15 s (e2e.paced_trainer): a commit every 1.5 s, and trainers
        # that wait as on a GPU instead of taking the cores the daemon and the flood need
        raw["job"].update({"target_steps": 1_000_000, "checkpoint_interval_steps": 10, "module": "e2e.paced_trainer",
                           "args": [*SMALL_MODEL, "--full-world", "2", "--pace-s", "0", "--min-step-s", "0.15"]})
        raw["job"].pop("model", None)
        raw["rendezvous"]["port"] = rendezvous
        agent_port = free_port()
        raw["daemon"].update({"state_dir": str(tmp_path / "state"), "socket": f"{sockdir}/d.sock",
                              "agent_host": "127.0.0.1", "agent_port": agent_port, "reconcile_interval_s": 0.1})
        raw["providers"]["local"]["launch_delay_s"] = 0.1
        raw["chaos"] = []
        cfg = tmp_path / "spotvisord.yaml"
        cfg.write_text(yaml.safe_dump(raw))
        db = tmp_path / "state" / "spotvisord.db"
        log = tmp_path / "daemon.log"

        def limit() -> None:  # in the child, before exec: what systemd's LimitNOFILE= does
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(log, "wb") as out:
            tests = str(ROOT / "tests")  # e2e.paced_trainer, for the nodes' workers
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}
            daemon = subprocess.Popen([sys.executable, "-m", "daemon.interfaces.cli", "run", "--config", str(cfg)],
                                      cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      preexec_fn=limit, env=env)
        try:
            result = asyncio.run(_attack_and_measure(daemon, db, f"{sockdir}/d.sock", f"http://127.0.0.1:{agent_port}",
                                                     log))
        finally:
            stop_process(daemon, 30)
    _report_and_check(result, nofile)


async def _until(daemon: subprocess.Popen, pred: Any, what: str, timeout_s: float, log: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        assert daemon.poll() is None, f"the daemon exited ({daemon.returncode}): {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {log.read_text()[-3000:]}"
        await asyncio.sleep(0.1)  # polling another process's store
    return got


async def _attack_and_measure(daemon: subprocess.Popen, db: Path, sock: str, agent_url: str,
                              log: Path) -> dict[str, Any]:
    def training() -> Any:
        rows = _query(db, "SELECT node, data FROM events WHERE kind = 'job_resumed' ORDER BY seq")
        full = [(n, json.loads(d)) for n, d in rows if json.loads(d).get("world_size") == 2]
        committed = _query(db, "SELECT count(*) FROM events WHERE kind = 'checkpoint_committed'")
        return full[-1][0] if full and committed and committed[0][0] >= 1 else None

    leader = await _until(daemon, training, "training at world size 2 with a commit", 240, log)
    nodes = {i: json.loads(b) for i, b in _query(db, "SELECT id, body FROM nodes")}
    victim = nodes[leader]  # rank 0's node: its commits are the job's
    attacker = next(n for i, n in nodes.items() if i != leader and n["state"] == "running")
    proc = psutil.Process(daemon.pid)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {attacker['token']}"},
                                     timeout=aiohttp.ClientTimeout(total=10)) as s:
        # the same measures with nobody attacking, for comparison
        b_start = time.time()
        base_hb, _, _ = await _heartbeats(s, agent_url, attacker["id"], asyncio.sleep(BASELINE_S), proc)
        base_commits = _commit_latencies(db, victim["id"], b_start, time.time())
    rss0, db0 = proc.memory_info().rss, _db_bytes(db)
    last_seq0 = _query(db, "SELECT max(seq) FROM events")[0][0]

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    atk = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "tests" / "flood_attacker.py"), "--agent-url", agent_url,
        "--node-id", attacker["id"], f"--token={attacker['token']}", "--idle", str(IDLE), "--hosts", str(HOSTS),
        "--one-host", str(ONE_HOST), "--flood-s", f"{FLOOD_S:g}", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=lambda: os.nice(ATTACKER_NICE))
    assert atk.stdout is not None
    line = (await asyncio.wait_for(atk.stdout.readline(), 180)).decode()
    assert line.startswith("attacking"), line + (await atk.stderr.read()).decode()[-2000:]  # type: ignore[union-attr]
    t_start = time.time()
    watch = LoopWatch(daemon.pid)  # the daemon loop's stalls, from outside it (bench/loopwatch.py)
    watch.start()
    done = asyncio.ensure_future(atk.stdout.readline())
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {attacker['token']}"},
                                     timeout=aiohttp.ClientTimeout(total=10)) as s:
        heartbeats, failed_heartbeats, (rss_peak, fds_peak) = await _heartbeats(s, agent_url, attacker["id"], done,
                                                                                proc)
    t_end = time.time()
    stalls = watch.stop()
    attack = json.loads(done.result().decode())
    await atk.wait()
    commits = _commits(db, victim["id"], t_start, t_end)
    kinds = dict(_query(db, "SELECT kind, count(*) FROM events WHERE seq > ? GROUP BY kind", last_seq0))
    by_attacker = _query(db, "SELECT count(*) FROM events WHERE seq > ? AND node = ?", last_seq0, attacker["id"])[0][0]
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s:
        async with s.get("http://daemon/metrics") as r:
            metrics = await r.text()
    return {
        "attack": attack, "window_s": t_end - t_start, "heartbeats": heartbeats, "failed_heartbeats": failed_heartbeats,
        "commit_latencies": [t - d["trainer_time"] for t, d in commits],
        "base_heartbeats": base_hb, "base_commit_latencies": base_commits,
        "unconfirmed": sum(1 for _, d in commits if d.get("commit_unconfirmed")),
        "rss_growth_mb": (rss_peak - rss0) / 2**20, "rss0_mb": rss0 / 2**20, "fds_peak": fds_peak,
        "db_growth_mb": (_db_bytes(db) - db0) / 2**20, "kinds": kinds, "events_by_attacker": by_attacker,
        "metrics": metrics, "attacker": attacker["id"], "stalls": stalls,
    }


async def _heartbeats(s: aiohttp.ClientSession, agent_url: str, node_id: str, until: Any,
                     proc: psutil.Process) -> tuple[list[float], int, tuple[int, int]]:
    """Heartbeat as ``node_id`` every 0.2 s until ``until`` (an awaitable) is done: each
    answer's seconds, the failures, and the daemon's peak RSS and descriptors meanwhile."""
    until = asyncio.ensure_future(until)
    times: list[float] = []
    failed = 0
    rss, fds = proc.memory_info().rss, proc.num_fds()
    while not until.done():
        t0 = time.monotonic()
        try:  # its heartbeats too are served; no command is pending for it in a steady job
            async with s.post(f"{agent_url}/v1/agent/heartbeat", json={"node_id": node_id}) as r:
                reply = await r.json()
                assert r.status == 200 and reply["commands"] == [], reply
            times.append(time.monotonic() - t0)
        except (aiohttp.ClientError, TimeoutError):
            failed += 1
        rss, fds = max(rss, proc.memory_info().rss), max(fds, proc.num_fds())
        await asyncio.wait({until}, timeout=0.2)  # the heartbeat period, or the end
    return times, failed, (rss, fds)


def _commits(db: Path, node_id: str, t0: float, t1: float) -> list[tuple[float, dict[str, Any]]]:
    return [(t, json.loads(d)) for t, d in _query(
        db, "SELECT time, data FROM events WHERE kind = 'checkpoint_committed' AND node = ? AND time BETWEEN ? AND ?",
        node_id, t0, t1)]


def _commit_latencies(db: Path, node_id: str, t0: float, t1: float) -> list[float]:
    """Seconds from each commit's status line (the trainer's clock, this machine's) to its event."""
    return [t - d["trainer_time"] for t, d in _commits(db, node_id, t0, t1)]


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{(.*?)}})? (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _stalls(stalls: list[dict[str, Any]]) -> str:
    if not stalls:
        return "0"
    worst = max(stalls, key=lambda x: x["lag_s"])
    return (f"{len(stalls)} / {worst['lag_s']:.3f} s / {sum(x['cpu_s'] for x in stalls):.2f} s on a CPU, "
            f"{sum(x['runq_s'] for x in stalls):.2f} s waiting for one")


def _report_and_check(r: dict[str, Any], nofile: int) -> None:
    m, hb, cl = r["metrics"], r["heartbeats"], r["commit_latencies"]
    bh, bc = r["base_heartbeats"], r["base_commit_latencies"]
    refused = {k: _sample(m, "spotvisor_agent_connections_refused_total", reason=k) for k in ("total", "per_peer")}
    limited = {k: _sample(m, "spotvisor_agent_reports_limited_total", node=r["attacker"], reason=k)
               for k in ("rate", "duplicate", "too_many")}
    rows = [
        ("RLIMIT_NOFILE (daemon)", f"{nofile}"),
        ("attack window", f"{r['window_s']:.1f} s (flood {r['attack']['flood_s']} s; idle conns first open "
                          f"after {r['attack']['first_open_s']} s)"),
        ("idle connections opened / closed by daemon", f"{r['attack']['idle'].get('opened', 0)} / "
                                                       f"{r['attack']['idle'].get('closed_by_daemon', 0)}"),
        ("refused: total / per_peer", f"{refused['total']:.0f} / {refused['per_peer']:.0f}"),
        ("timed out (no request head)", f"{_sample(m, 'spotvisor_agent_connections_timed_out_total'):.0f}"),
        ("flood POSTs (status 200) / reports sent", f"{r['attack']['flood'].get('status_200', 0)} / "
                                                    f"{r['attack']['flood'].get('reports_sent', 0)}"),
        ("reports limited: rate / duplicate / too_many", f"{limited['rate']:.0f} / {limited['duplicate']:.0f} / "
                                                         f"{limited['too_many']:.0f}"),
        ("events recorded for the attacker's node", f"{r['events_by_attacker']}"),
        ("heartbeats: n / p50 / p95 / max", f"{len(hb)} / {_pct(hb, 50):.3f} / {_pct(hb, 95):.3f} / "
                                            f"{max(hb, default=0):.3f} s (failed {r['failed_heartbeats']})"),
        ("  the same before the attack", f"{len(bh)} / {_pct(bh, 50):.3f} / {_pct(bh, 95):.3f} / "
                                         f"{max(bh, default=0):.3f} s"),
        ("victim commits: n / p50 / p95 / max", f"{len(cl)} / {_pct(cl, 50):.3f} / {_pct(cl, 95):.3f} / "
                                                f"{max(cl, default=0):.3f} s (unconfirmed {r['unconfirmed']})"),
        ("  the same before the attack", f"{len(bc)} / {_pct(bc, 50):.3f} / {_pct(bc, 95):.3f} / "
                                         f"{max(bc, default=0):.3f} s"),
        ("daemon loop stalls > 50 ms: n / longest / cpu, runq", _stalls(r["stalls"])),
        ("daemon RSS: before / peak growth", f"{r['rss0_mb']:.0f} MB / +{r['rss_growth_mb']:.1f} MB"),
        ("daemon descriptors, peak", f"{r['fds_peak']}"),
        ("database growth", f"{r['db_growth_mb']:.2f} MB"),
        ("accept() failures", f"{_sample(m, 'spotvisor_accept_errors_total'):.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))

    routine, vital = INTAKE_RATES[ReportClass.ROUTINE], INTAKE_RATES[ReportClass.VITAL]
    assert r["failed_heartbeats"] == 0 and len(hb) >= 10
    assert _pct(hb, 95) <= HEARTBEAT_P95_S, rows
    assert len(cl) >= 3 and _pct(cl, 90) <= COMMIT_P90_S and max(cl) <= COMMIT_MAX_S, rows
    assert r["unconfirmed"] == 0, rows
    assert r["kinds"].get("node_lost", 0) == 0, r["kinds"]
    assert r["rss_growth_mb"] <= RSS_GROWTH_MAX_MB and r["db_growth_mb"] <= DB_GROWTH_MAX_MB, rows
    # what the attacker's token recorded: at most its buckets' worth over the attack
    assert r["events_by_attacker"] <= routine.burst + vital.burst + (routine.per_s + vital.per_s) * r["window_s"]
    assert limited["rate"] > 0 and limited["duplicate"] > 0 and refused["per_peer"] > 0, rows
    assert _sample(m, "spotvisor_accept_errors_total") == 0
