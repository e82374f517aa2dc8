"""Seeded HA failover trials: kill -9 of the leading daemon (and, in half the trials, the
etcd member on its control node) at a random moment, on a real 3-member etcd cluster,
with EC2 as moto's server (bench/ha_harness.py).

``python -m bench.ha_trials --trials 100 --seed 29 [--json out.json]``

Each trial: a fresh pool (its own key prefix on the one etcd cluster, reused across
trials), two ``spotvisord run`` daemons (``control-a`` on etcd member m0's node,
``control-b`` on m1's; which one starts first, and so leads, is drawn), the leader's
first node bought, then one phase, round-robin over the trials:

- ``launch``: a RunInstances held by the fault proxy for 0.5-9 s, before moto sees it
  (the instance lands after the kill: with a long hold, after the survivor took over and
  gave the node up) or after (it exists, the answer never reaches the daemon); the kill
  falls inside the hold (0-2.5 s into it);
- ``grow``: scale 1 → 2 or 3, each RunInstances taking 0.3-1.5 s (EC2's order of
  magnitude; moto answers in milliseconds), the kill 0-2 s after the API's answer
  (before, during or after the purchases);
- ``shrink``: scale 3 → 1 or 2, each TerminateInstances taking 0.3-1.5 s, the kill 0-1 s after;
- ``replace``: one instance terminated behind the daemon's back (a spot reclaim with no
  notice), the replacement's RunInstances taking 0.3-1.5 s, the kill 0-2 s after (before,
  during or after the replacement's purchase);
- ``idle``: the kill at a random moment of a steady pool;
- ``late_launch`` (only with ``--phases``): a RunInstances held 10-14 s before moto sees
  it, the kill 0-2.5 s into the hold: the survivor finds no instance, gives the node up
  and buys another; the first instance lands later and must be terminated, not leaked.

Not covered here: mid-notice and mid-migration. Both need node agents that report a notice
and a trainer that commits (the AWS path reads its notices through the agent on the node);
this harness runs no agents, so its nodes never become ready and no job step runs: "the
job completes" is replaced by "the pool converges to the acknowledged target and
``spotctl down`` releases every instance". bench/ha_job_trials.py runs them, with a real
job: kills mid-notice, mid-grow, mid-training and mid-migration.

Measured per trial (kill = the SIGKILL of the leading daemon):

- ``elected_s``: kill → the survivor logged ``ha_leading`` (it holds the leader key);
- ``serving_s``: kill → the survivor logged ``ha_serving`` (state loaded from etcd, its
  supervisor runs, its control API answers). Both from the survivor's own timestamps:
  the harness's polls (``harness_serving_s``) include its etcd client's own fail-over
  when a member died;
- ``acted_s``: kill → the survivor's first RunInstances/TerminateInstances, when one was
  due before the harness's own ``down`` (a purchase to finish, a replacement, a shrink);
- ``duplicates``: instances beyond the first carrying one node id (every state, so a
  second purchase that was later terminated counts too);
- ``leaked``: the pool's pending/running instances after ``down`` completed;
- ``lost``: events the dead leader had committed to etcd (its log, read through its API
  just before the kill, up to the seq etcd held 0.5 s after it) that are missing from, or
  differ in, the survivor's log;
- ``order``: violations in the survivor's log (= etcd's): seq not 1..N, or a node's events
  out of the lifecycle's causal order (:func:`causal_violations`), or operator targets
  (``pool_scaled``) not in the order they were acknowledged;
- ``acked_lost``: ``POST /v1/scale`` calls answered 200 whose target is not in the final log;
- ``uncommitted``: events the dead leader served through its API but had not yet
  committed (its outbox flushes every 0.2 s and before each purchase): gone with it.

Prints a table and writes every trial's record as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench.ha_harness import Daemon, ha_configs, instances, per_node, takeover, until  # noqa: E402
from bench.ports import free_port  # noqa: E402
from daemon.ha.client import EtcdClient  # noqa: E402
from daemon.ha.elector import leader_key, pool_prefix  # noqa: E402

__all__ = ["PHASES", "TAKEOVER_LIMIT_S", "Trial", "World", "causal_violations", "run_trials", "summary"]

PHASES = ("launch", "grow", "shrink", "replace", "idle")
#: not in the default round-robin: a purchase that reaches EC2 only after the survivor gave its node up
EXTRA_PHASES = ("late_launch",)
TAKEOVER_LIMIT_S = 10.0
LEASE_S = 5
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
_MUTATING = ("RunInstances", "TerminateInstances")
_LIVE = ("pending", "running")


@dataclass
class Trial:
    """One trial's record (see the module docstring for each figure)."""

    trial: int
    phase: str
    leader: str = ""
    store_killed: bool = False
    etcd_leader_killed: bool = False  # the member killed with the daemon led etcd's raft group
    kill_after_s: float = 0.0  # the drawn moment, from the phase's start
    drawn: dict[str, Any] = field(default_factory=dict)  # the phase's drawn parameters (holds, targets)
    elected_s: float | None = None
    serving_s: float | None = None
    harness_serving_s: float | None = None  # what the harness's own polls read: an upper bound of serving_s
    acted_s: float | None = None
    duplicates: int = 0
    leaked: int = 0
    lost: int = 0
    order: list[str] = field(default_factory=list)
    acked_lost: int = 0
    uncommitted: int = 0
    uncommitted_events: list[str] = field(default_factory=list)  # "kind node reason" of each
    survivor_events: list[str] = field(default_factory=list)  # what the survivor logged after the committed seq
    run_instances: int = 0
    replayed: int = 0
    adopted: int = 0
    interrupted: int = 0
    unowned_terminated: int = 0
    wall_s: float = 0.0
    error: str | None = None

    def __post_init__(self) -> None:
        if self.acted_s is not None and self.elected_s is not None and self.acted_s < self.elected_s:
            self.acted_s = None  # a call the dead leader had on the wire: the survivor acts only once elected

    @property
    def ok(self) -> bool:
        fast = self.serving_s is not None and self.serving_s <= TAKEOVER_LIMIT_S \
            and (self.acted_s is None or self.acted_s <= TAKEOVER_LIMIT_S)
        return (self.error is None and fast and not self.duplicates and not self.leaked and not self.lost
                and not self.order and not self.acked_lost)


def causal_violations(events: Sequence[dict[str, Any]], scaled: Sequence[int] = ()) -> list[str]:
    """What is out of order in one pool's event log (``/v1/events`` records: ``seq``,
    ``kind``, ``node``, ``data``), as one line each; [] when causal.

    - seqs are exactly 1..N in log order;
    - per node: ``node_launch_requested`` first; then one ``node_launched`` (adopted or
      not) or one ``node_launch_failed``; ``node_terminated``/``node_lost`` only after
      ``node_launched``; after a node is over (failed, terminated, lost) only
      ``node_terminated`` with reason ``unowned_instance`` (an instance that landed late);
    - ``scaled``: the targets the operator's scale calls were acknowledged with, in order:
      the log's ``pool_scaled`` targets must be a prefix of them, in that order.
    """
    out: list[str] = []
    seqs = [e["seq"] for e in events]
    if seqs != list(range(1, len(seqs) + 1)):
        gaps = sorted(set(range(1, max(seqs, default=0) + 1)) - set(seqs))
        out.append(f"seq not 1..{len(seqs)}: missing {gaps[:5]}, duplicated "
                   f"{sorted({s for s in seqs if seqs.count(s) > 1})[:5]}, sorted {seqs == sorted(seqs)}")
    state: dict[str, str] = {}
    for e in events:
        node, kind = e.get("node"), e["kind"]
        if not node or not kind.startswith("node_"):
            continue
        now = state.get(node)
        nxt = {
            (None, "node_launch_requested"): "requested",
            ("requested", "node_launched"): "launched",
            ("requested", "node_launch_failed"): "over",
            ("launched", "node_terminated"): "over",
            ("launched", "node_lost"): "over",
        }.get((now, kind))
        if nxt is None and now == "over" and kind == "node_terminated" and e["data"].get("reason") == "unowned_instance":
            nxt = "over"
        if nxt is None and now == "launched" and kind not in ("node_launch_requested", "node_launched", "node_launch_failed"):
            nxt = "launched"  # node_ready, node_admitted, ...: a live node's news
        if nxt is None:
            out.append(f"seq {e['seq']}: {kind} of {node} while it is {now or 'unknown'}")
            nxt = now or "requested"
        state[node] = nxt
    targets = [e["data"].get("new") for e in events if e["kind"] == "pool_scaled"]
    if targets != list(scaled[:len(targets)]):
        out.append(f"pool_scaled targets {targets} are not the acknowledged {list(scaled)} in order")
    return out


class World:
    """The parts shared by every trial: a 3-member etcd cluster, moto's server and the
    fault proxy in front of it, a boto3 EC2 client and an etcd client. ``async with``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    async def __aenter__(self) -> "World":
        import boto3
        from etcd_cluster import EtcdCluster
        from fakes.aws_faults import AwsFaultProxy
        from moto.server import ThreadedMotoServer

        os.environ.update(AWS_ENV)  # the daemons inherit them (moto takes any credentials)
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.moto_url = f"http://{host}:{port}"
        self.ec2 = boto3.client("ec2", endpoint_url=self.moto_url, region_name="us-east-1")
        await asyncio.to_thread(self.ec2.describe_instances)  # moto builds the region's state once (seconds)
        self.faults = AwsFaultProxy(self.moto_url)
        self.faults.start()
        self.cluster = await asyncio.to_thread(EtcdCluster(self.root / "etcd").start)
        self.etcd = EtcdClient(self.cluster.endpoints)
        await self.etcd.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self.etcd.close()
        await asyncio.to_thread(self.cluster.stop)
        self.faults.close()
        self.moto.stop()

    async def leader_of(self, pool: str) -> str | None:
        with contextlib.suppress(Exception):  # a member down: the next poll asks another
            kv = await self.etcd.get(leader_key(pool))
            return kv.value.decode() if kv is not None else None
        return None

    async def committed(self, pool: str) -> dict[int, dict[str, Any]] | None:
        """The pool's events in etcd: seq → ``{"time", "kind", "node", "data"}``; None if etcd did not answer."""
        prefix = pool_prefix(pool) + b"events/"
        try:
            rows = await self.etcd.get_prefix(prefix)
        except Exception:  # noqa: BLE001  a member down: the caller asks again
            return None
        return {int(kv.key[len(prefix):]): json.loads(kv.value) for kv in rows}


async def _converged(world: World, d: Daemon, pool: str, n: int) -> dict[str, str] | None:
    """:func:`_launched` ``n``, and its instances are exactly the pool's live ones in EC2
    (the daemon has seen every reclaim and every purchase landed)."""
    nodes = await _launched(d, n)
    if nodes is None:
        return None
    live = {i["InstanceId"] for i in await asyncio.to_thread(_live_instances, world, pool)}
    return nodes if set(nodes.values()) == live else None


async def _launched(d: Daemon, n: int) -> dict[str, str] | None:
    """``d``'s live nodes with an instance (id → instance id) once there are exactly ``n``
    and none is still being bought."""
    status = await d.status()
    if status is None:
        return None
    live = [x for x in status["nodes"] if x["state"] not in ("terminated", "lost", "failed")]
    nodes = {x["id"]: x["instance_id"] for x in live if x["instance_id"]}
    return nodes if len(nodes) == n and len(live) == n else None


def _live_instances(world: World, pool: str) -> list[dict[str, Any]]:
    return [i for i in instances(world.ec2, pool) if i["State"]["Name"] in _LIVE]


def _brief(e: dict[str, Any]) -> str:
    return " ".join(str(x) for x in (e["kind"], e.get("node"), e["data"].get("reason") or e["data"].get("error")) if x)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["kind"], a.get("node"), a.get("data"), round(float(a["time"]), 3)) == \
        (b["kind"], b.get("node"), b.get("data"), round(float(b["time"]), 3))


async def one_trial(world: World, i: int, seed: int, root: Path, phases: Sequence[str] = PHASES) -> Trial:
    """Trial ``i`` of seed ``seed`` (module docstring), its phase ``phases[i % len(phases)]``.
    Never raises: an error is recorded."""
    rng = random.Random(f"{seed}/{i}")
    t = Trial(trial=i, phase=phases[i % len(phases)])
    landed_by = 0.0  # monotonic time by which a held purchase has reached moto
    pool = f"ha{seed}t{i:03d}"
    tdir = root / pool
    tdir.mkdir(parents=True, exist_ok=True)
    sockdir = tempfile.mkdtemp(prefix="svt-", dir="/tmp")
    world.faults.reset()
    daemons = ha_configs(tdir, sockdir, pool=pool, endpoints=world.cluster.endpoints, ec2_url=world.faults.url or "",
                         agent_port=free_port(), lease_s=LEASE_S)
    member = {d.name: k for k, d in enumerate(daemons)}  # control-a on m0's node, control-b on m1's
    if rng.random() < 0.5:
        daemons.reverse()
    leader, survivor = daemons
    t.leader, t.store_killed = leader.name, rng.random() < 0.5
    started = time.monotonic()
    killed_member: int | None = None
    scaled: list[int] = []
    try:
        await leader.start()
        await until(leader.status, f"{leader.name} leading", timeout_s=60, daemons=(leader,))
        await survivor.start()
        await until(lambda: "standby:" in survivor.log_text(), f"{survivor.name}'s standby line", timeout_s=60,
                    daemons=(leader, survivor))
        await until(lambda: _launched(leader, 1), "the first node bought", timeout_s=30, daemons=(leader, survivor))

        async def scale(n: int) -> None:
            await leader.scale(n)
            scaled.append(n)

        phase_at = time.monotonic()
        if t.phase == "launch":
            hold, before = rng.uniform(0.5, 9.0), rng.random() < 0.5
            t.drawn = {"hold_s": round(hold, 2), "held_before_moto": before}
            world.faults.delay_next("RunInstances", hold, after_forward=not before)
            sent = len(world.faults.actions("RunInstances"))
            await scale(2)
            await until(lambda: len(world.faults.actions("RunInstances")) > sent, "the held RunInstances",
                        timeout_s=15, daemons=(leader,))
            await asyncio.sleep(rng.uniform(0.0, min(hold, 2.5)))  # the drawn moment inside the held call
        elif t.phase == "late_launch":
            hold = rng.uniform(10.0, 14.0)
            t.drawn = {"hold_s": round(hold, 2), "held_before_moto": True}
            world.faults.delay_next("RunInstances", hold, after_forward=False)
            sent = len(world.faults.actions("RunInstances"))
            await scale(2)
            await until(lambda: len(world.faults.actions("RunInstances")) > sent, "the held RunInstances",
                        timeout_s=15, daemons=(leader,))
            landed_by = time.monotonic() + hold + 0.5
            await asyncio.sleep(rng.uniform(0.0, 2.5))  # the drawn moment inside the held call
        elif t.phase == "grow":
            latency = rng.uniform(0.3, 1.5)  # moto answers in ms; EC2's RunInstances takes about a second
            world.faults.delay_next("RunInstances", latency, n=2, after_forward=rng.random() < 0.5)
            t.drawn = {"target": rng.choice((2, 3)), "run_instances_s": round(latency, 2)}
            await scale(t.drawn["target"])
            await asyncio.sleep(rng.uniform(0.0, 2.0))  # the drawn moment
        elif t.phase == "shrink":
            await scale(3)
            await until(lambda: _launched(leader, 3), "3 nodes bought", timeout_s=30, daemons=(leader,))
            latency = rng.uniform(0.3, 1.5)
            world.faults.delay_next("TerminateInstances", latency, n=2, after_forward=rng.random() < 0.5)
            t.drawn = {"target": rng.choice((1, 2)), "terminate_instances_s": round(latency, 2)}
            phase_at = time.monotonic()
            await scale(t.drawn["target"])
            await asyncio.sleep(rng.uniform(0.0, 1.0))  # the drawn moment
        elif t.phase == "replace":
            await scale(2)
            got = await until(lambda: _launched(leader, 2), "2 nodes bought", timeout_s=30, daemons=(leader,))
            phase_at = time.monotonic()
            victim = rng.choice(sorted(got.values()))
            latency = rng.uniform(0.3, 1.5)
            world.faults.delay_next("RunInstances", latency, after_forward=rng.random() < 0.5)  # the replacement's
            t.drawn = {"run_instances_s": round(latency, 2)}
            await asyncio.to_thread(world.ec2.terminate_instances, InstanceIds=[victim])  # a reclaim, no notice
            await asyncio.sleep(rng.uniform(0.0, 2.0))  # the drawn moment
        else:
            await asyncio.sleep(rng.uniform(0.0, 2.0))  # the drawn moment
        if t.store_killed:
            t.etcd_leader_killed = await asyncio.to_thread(world.cluster.raft_leader) == member[leader.name]
        seen = await leader.events()  # what the leader's API showed, just before its death
        t.kill_after_s = round(time.monotonic() - phase_at, 3)
        killed_at, killed_wall = time.monotonic(), time.time()
        await leader.kill()
        if t.store_killed:
            killed_member = member[leader.name]
            await asyncio.to_thread(world.cluster.kill, killed_member)
        await asyncio.sleep(0.5)  # a txn the dead leader had on the wire is applied by now (or never)
        committed = await until(lambda: world.committed(pool), "etcd's events after the kill", timeout_s=10)

        async def elected() -> bool:
            return await world.leader_of(pool) == survivor.name

        await until(elected, f"{survivor.name} elected", timeout_s=30, daemons=(survivor,))
        elected_read = time.monotonic() - killed_at
        await until(survivor.status, f"{survivor.name} serving", timeout_s=30, daemons=(survivor,))
        t.harness_serving_s = round(time.monotonic() - killed_at, 3)
        t.elected_s, t.serving_s = takeover(survivor, killed_wall, elected_read, t.harness_serving_s)
        if killed_member is not None:
            await asyncio.to_thread(world.cluster.restart, killed_member)
            killed_member = None

        status = await survivor.status()
        assert status is not None
        target = status["pool"]["target_nodes"]
        await until(lambda: _converged(world, survivor, pool, target), f"the pool at its target {target}",
                    timeout_s=30, daemons=(survivor,), poll_s=0.2)
        downed_at = time.monotonic()
        acts = [s.at for s in world.faults.requests if s.action in _MUTATING and killed_at + t.elected_s < s.at < downed_at
                and str(s.params.get("DryRun", "")).lower() != "true"]
        t.acted_s = min(acts) - killed_at if acts else None
        await survivor.down()

        async def released() -> bool:
            s = await survivor.status()
            return s is not None and not [n for n in s["nodes"] if n["state"] not in ("terminated", "lost", "failed")]

        await until(released, "every node released", timeout_s=30, daemons=(survivor,))
        await asyncio.sleep(max(0.0, landed_by - time.monotonic()))  # a late purchase has landed: is it released?
        with contextlib.suppress(AssertionError):  # what is still up after 10 s is a leak
            await until(lambda: not _live_instances(world, pool), "no live instance", timeout_s=10)
        t.leaked = len(await asyncio.to_thread(_live_instances, world, pool))
        t.duplicates = sum(c - 1 for c in per_node(await asyncio.to_thread(instances, world.ec2, pool)).values())
        t.run_instances = len(world.faults.actions("RunInstances"))
        t.replayed = world.faults.replayed

        final = await survivor.events()

        async def flushed() -> dict[int, dict[str, Any]] | None:
            got = await world.committed(pool)
            return got if got and max(got) >= final[-1]["seq"] else None

        in_etcd = await until(flushed, "the survivor's events in etcd", timeout_s=10)
        if [(e["seq"], e["kind"], e.get("node")) for e in final] != \
                [(s, v["kind"], v["node"]) for s, v in sorted(in_etcd.items()) if s <= final[-1]["seq"]]:
            t.order.append("the survivor's log differs from etcd's")
        by_seq = {e["seq"]: e for e in final}
        for e in seen:
            if e["seq"] in committed:
                t.lost += e["seq"] not in by_seq or not _same(e, by_seq[e["seq"]])
            else:
                t.uncommitted += 1
                t.uncommitted_events.append(_brief(e))
        t.survivor_events = [_brief(e) for e in final if e["seq"] > max(committed, default=0)]
        t.order += causal_violations(final, scaled)
        t.acked_lost = sum(1 for n in scaled) - len([e for e in final if e["kind"] == "pool_scaled"])
        t.adopted = sum(1 for e in final if e["kind"] == "node_launched" and e["data"].get("adopted"))
        t.interrupted = sum(1 for e in final if e["kind"] == "node_launch_failed" and e["data"].get("error") == "interrupted")
        t.unowned_terminated = sum(1 for e in final if e["kind"] == "node_terminated"
                                   and e["data"].get("reason") == "unowned_instance")
    except Exception as exc:  # noqa: BLE001  a trial's failure is a result, recorded with its message
        t.error = f"{type(exc).__name__}: {str(exc)[:1500]}"
    finally:
        for d in daemons:
            if d.alive():
                assert d.proc is not None
                d.proc.terminate()
                try:
                    await asyncio.wait_for(d.proc.wait(), 20)
                except TimeoutError:
                    await d.kill()
        if killed_member is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(world.cluster.restart, killed_member)
        # anything left running is already counted; terminate it so the next trial starts clean
        with contextlib.suppress(Exception):
            left = [x["InstanceId"] for x in await asyncio.to_thread(_live_instances, world, pool)]
            if left:
                await asyncio.to_thread(world.ec2.terminate_instances, InstanceIds=left)
        shutil.rmtree(sockdir, ignore_errors=True)
        t.wall_s = round(time.monotonic() - started, 2)
        if t.ok:
            shutil.rmtree(tdir, ignore_errors=True)  # a failed trial keeps its daemons' logs
    return t


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * len(xs) + 0.5)) - 1))]


def summary(trials: Sequence[Trial]) -> dict[str, Any]:
    """The figures over ``trials``: p50/p95/max of each takeover time (s), and the counts."""
    out: dict[str, Any] = {"trials": len(trials), "ok": sum(t.ok for t in trials),
                           "errors": sum(t.error is not None for t in trials)}
    for name in ("elected_s", "serving_s", "acted_s"):
        xs = [getattr(t, name) for t in trials if getattr(t, name) is not None]
        out[name] = {"n": len(xs), "p50": round(statistics.median(xs), 2), "p95": round(_pct(xs, 0.95), 2),
                     "max": round(max(xs), 2)} if xs else {"n": 0}
    for name in ("duplicates", "leaked", "lost", "acked_lost", "uncommitted", "adopted", "interrupted",
                 "unowned_terminated", "replayed"):
        out[name] = sum(getattr(t, name) for t in trials)
    out["order_violations"] = sum(len(t.order) for t in trials)
    out["over_10s"] = sum(1 for t in trials if (t.serving_s or 0) > TAKEOVER_LIMIT_S or (t.acted_s or 0) > TAKEOVER_LIMIT_S)
    out["phases"] = {p: n for p in PHASES + EXTRA_PHASES if (n := sum(t.phase == p for t in trials))}
    out["store_killed"] = sum(t.store_killed for t in trials)
    return out


def table(trials: Sequence[Trial]) -> str:
    """A markdown table: one row per phase and one for all."""
    rows = ["| phase | trials | store killed | takeover p50 / p95 / max (s) | acted p50 / max (s) | duplicates "
            "| leaked | lost | reordered | acked lost | uncommitted dropped | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = [*((p, [t for t in trials if t.phase == p]) for p in PHASES + EXTRA_PHASES),
              ("daemon only", [t for t in trials if not t.store_killed]),
              ("daemon + its etcd member", [t for t in trials if t.store_killed]),
              ("... that led etcd's raft group", [t for t in trials if t.etcd_leader_killed]),
              ("all", list(trials))]
    for name, group in groups:
        if not group:
            continue
        s = summary(group)
        sv, ac = s["serving_s"], s["acted_s"]
        take = f"{sv['p50']} / {sv['p95']} / {sv['max']}" if sv["n"] else "-"
        act = f"{ac['p50']} / {ac['max']} (n={ac['n']})" if ac["n"] else "-"
        rows.append(f"| {name} | {s['trials']} | {s['store_killed']} | {take} | {act} | {s['duplicates']} | "
                    f"{s['leaked']} | {s['lost']} | {s['order_violations']} | {s['acked_lost']} | "
                    f"{s['uncommitted']} | {s['errors']} |")
    return "\n".join(rows)


async def run_trials(n: int, seed: int, root: Path, *, json_out: Path | None = None, quiet: bool = False,
                     deadline: float | None = None, stop_file: Path | None = None,
                     phases: Sequence[str] = PHASES) -> list[Trial]:
    """``n`` trials (0..n-1) of ``seed`` on one :class:`World` under ``root``; stops early
    (fewer trials) once the wall clock passes ``deadline`` (unix s) or ``stop_file`` exists. Writes ``json_out``
    after each trial (so an interrupted run keeps what it measured)."""
    done: list[Trial] = []
    async with World(root) as world:
        for i in range(n):
            if (deadline is not None and time.time() > deadline) or (stop_file is not None and stop_file.exists()):
                break
            t = await one_trial(world, i, seed, root, phases)
            done.append(t)
            if not quiet:
                print(f"trial {i:3d} {t.phase:7s} leader={t.leader} store_killed={t.store_killed!s:5s} "
                      f"kill@{t.kill_after_s:.2f}s elected={t.elected_s or 0:.2f}s serving={t.serving_s or 0:.2f}s "
                      f"acted={t.acted_s if t.acted_s is None else round(t.acted_s, 2)} dup={t.duplicates} "
                      f"leak={t.leaked} lost={t.lost} order={len(t.order)} acked_lost={t.acked_lost} "
                      f"uncommitted={t.uncommitted} adopted={t.adopted} interrupted={t.interrupted} "
                      f"unowned={t.unowned_terminated} wall={t.wall_s}s {'ok' if t.ok else 'FAIL ' + str(t.error or t.order)[:300]}",
                      flush=True)
            if json_out is not None:
                json_out.write_text(json.dumps({"seed": seed, "summary": summary(done),
                                                "trials": [asdict(x) | {"ok": x.ok} for x in done]}, indent=1))
    return done


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)  # moto's server: no line per request
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--json", type=Path, default=None, help="write every trial's record here")
    p.add_argument("--dir", type=Path, default=None, help="where etcd's data and failed trials' logs go (default: a temp dir)")
    p.add_argument("--stop-at", type=float, default=None, help="unix time after which no new trial starts")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated, taken in turn (default: all five; also: {', '.join(EXTRA_PHASES)})")
    p.add_argument("--report", type=Path, default=None, help="print the table of a --json file and exit")
    p.add_argument("--stop-file", type=Path, default=None,
                   help="once this file exists no new trial starts (a clean stop: gRPC swallows SIGINT)")
    args = p.parse_args(argv)
    if args.report is not None:
        known = {f.name for f in fields(Trial)}
        done = [Trial(**{k: v for k, v in d.items() if k in known}) for d in json.loads(args.report.read_text())["trials"]]
        print(table(done))
        print(json.dumps(summary(done)))
        return 0
    if args.trials < 1:
        print("ha_trials: --trials must be at least 1", file=sys.stderr)
        return 2
    phases = [x for x in args.phases.split(",") if x]
    bad = [x for x in phases if x not in PHASES + EXTRA_PHASES]
    if bad or not phases:
        print(f"ha_trials: --phases: unknown {bad or 'none given'}; choose from {', '.join(PHASES + EXTRA_PHASES)}",
              file=sys.stderr)
        return 2
    root = args.dir or Path(tempfile.mkdtemp(prefix="ha-trials-"))
    root.mkdir(parents=True, exist_ok=True)
    trials = asyncio.run(run_trials(args.trials, args.seed, root, json_out=args.json, deadline=args.stop_at,
                                       stop_file=args.stop_file, phases=phases))
    print(table(trials))
    print(json.dumps(summary(trials)))
    print(f"logs of failed trials (if any) under {root}")
    return 0 if all(t.ok for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
