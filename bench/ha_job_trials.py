"""Seeded HA job trials: a real training job on real node agents, and the leader's control
node (its daemon and the rendezvous store) SIGKILLed at a random moment of one phase;
the standby takes over and runs the job to its end (issue 29).

``python -m bench.ha_job_trials --trials 8 --seed 29 [--json out.json] [--phases notice,grow,training,migration]``

The world is :class:`bench.ha_trials.World` (a real 3-member etcd cluster on loopback,
reused across trials; EC2 as moto's server behind ``fakes.aws_faults.AwsFaultProxy``).
Each trial: a fresh pool (its own key prefix in etcd), a fresh rendezvous store
(:class:`StoreProcess`), two ``spotvisord run`` daemons on one ``ha:`` config
(``lease_s: 5``; which one starts first, and so leads, is drawn), and on every instance
moto runs for the pool a real node agent (``tests/chaos/test_daemon_kill.Ec2Sim``) that
runs the daemon's own job spec: real torchrun (``--rdzv-backend=spotvisor``), the
reference trainer (a small GPT-2, DDP over gloo, 2 nodes), checkpoints in the trial's
directory. The job is ``tests/chaos/test_control_node_kill.py``'s. Then one phase,
round-robin over the trials, and the kill at a moment drawn from ``random.Random(f"{seed}/{i}")``:

- ``notice``: both nodes in the job, one gets a spot interruption notice (60 s lead);
  the kill right after the leader logged ``interruption_notice`` (half the trials) or a
  drawn 0-2 s after it: the notice's commit, the noticed node's exit, the survivors'
  in-process shrink and the replacement's purchase happen around the takeover;
- ``grow``: the same notice, and the kill once the leader has admitted the replacement
  (``node_admitted``), a drawn 0-0.5 s later, before the world is 2 again (``in_phase``
  says whether it was: the grow can land inside the drawn delay);
- ``training``: the kill at a drawn step (20-300 of 400), the world steady;
- ``migration``: the kill a drawn 0-10 s into a whole-job move between regions (below).

The kill is ``kill -9`` of the leader daemon and of the rendezvous store; the store is
started again at once, empty, on the same port (a floating address that moves to the
survivor's node). In half the trials (drawn) the etcd member on the leader's node
(``control-a`` on m0's, ``control-b`` on m1's) is SIGKILLed with them, and restarted once
the survivor serves: the whole control node.

Measured per trial (see :class:`JobTrial`), from the survivor's own log lines (its
timestamps, not the harness's polls, which include the harness's etcd client's own
fail-over when a member died): ``elected_s`` (kill → the survivor logged ``ha_leading``:
it holds the lease), ``serving_s`` (kill → ``ha_serving``: its supervisor runs, its
control API answers; ``harness_serving_s`` is the harness's reading), ``acted_s`` (kill →
its first RunInstances/TerminateInstances before the job completed, when one was due),
``first_event_s`` (kill → the first event the survivor logged: a report it took, a
commit, an admission),
``duplicates`` (instances beyond the first per node id, any state), ``leaked`` (the pool's
live instances once the survivor exited), ``lost`` (:func:`chaos.conftest.lost_events`:
seq gaps in the survivor's log, and events the dead leader's feed had shown, which under
HA are durable ones only, missing or changed there), ``order``
(:func:`bench.ha_trials.causal_violations` over the survivor's log, and that log against
etcd's), and from the trainers' own logs (:func:`daemon.analysis.summary.summarize`):
``steps_completed`` (== the target), ``lost_steps_total``, ``restarts``,
``samples_seen_twice``, ``samples_skipped``, ``resizes_in_process``; for the notice
phases also ``notice_answered`` (a ``checkpoint_committed`` names the notice) and the
final world size (2: the replacement grew the job back).

The ``migration`` phase's world has two placement domains, each with its own
rendezvous store and checkpoint store: ``use1`` (EC2 us-east-1, where the job starts) and
``usw2`` (us-west-2, one of moto's own images there); the sim boots agents in both regions
(:class:`_TwoRegionSim`), and the duplicate and leak counts list both. Once both nodes
train, every RunInstances in us-east-1 fails with ``InsufficientInstanceCapacity`` (a
fault-proxy responder; dry runs pass) and one node gets a notice: the job shrinks to 1,
its replacement cannot be bought, and after ``migration.patience_s`` (5 s) the leader
moves the job (boot in us-west-2, drain and commit in us-east-1, copy the checkpoint,
start there from it). The kill falls a drawn 0-10 s after ``migration_started``
(``drawn["events_since_start"]``: how far the move had got). A survivor that finds a move
before its switch gives it up (``migration_failed``, ``daemon_restarted``) and, the source
still starved, starts another; one that finds it ``starting`` carries it on. Its checks:
``migration_completed`` logged, the job at world size 2 in the end, 0 lost steps, no
sample twice or skipped; a move restarts the trainers from the commit (``restarts`` 1
or more is expected), and the survivor's first action is due only once the target has
trained (the source's release), so ``acted_s`` is reported but not held to 10 s there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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

import yaml  # noqa: E402

from bench.ha_harness import Daemon as HaDaemon, instances, per_node, takeover, until  # noqa: E402
from bench.ha_trials import LEASE_S, TAKEOVER_LIMIT_S, World, _pct, causal_violations  # noqa: E402
from chaos.conftest import lost_events  # noqa: E402
from chaos.test_control_node_kill import GLOBAL_BATCH, NOTICE_TARGET_STEPS, _config, _steps_done  # noqa: E402
from chaos.test_daemon_kill import Daemon, Ec2Sim, _stored_events  # noqa: E402
from daemon.analysis.summary import summarize  # noqa: E402
from daemon.controlnode.rendezvous import StoreProcess  # noqa: E402
from daemon.model import Event  # noqa: E402

__all__ = ["JOB_PHASES", "JobTrial", "one_job_trial", "run_job_trials", "job_summary", "job_table"]

JOB_PHASES = ("notice", "grow", "training", "migration")
EXTRA_JOB_PHASES: tuple[str, ...] = ()
_REGIONS = ("us-east-1", "us-west-2")
MIGRATION_TARGET_STEPS = 800
_MUTATING = ("RunInstances", "TerminateInstances")
#: how long the survivor has to run the job to its end after the kill (2 shared cores: generous)
JOB_TIMEOUT_S = 900.0


@dataclass
class JobTrial:
    """One job trial's record (see the module docstring)."""

    trial: int
    phase: str
    leader: str = ""
    target_steps: int = 0
    drawn: dict[str, Any] = field(default_factory=dict)  # the drawn moment: delay or step
    in_phase: bool = True  # the kill fell inside the phase's window (grow: the world not yet whole)
    kill_step: int = 0  # the highest step any rank had logged at the kill
    etcd_member_killed: bool = False  # the etcd member on the leader's node went with it
    elected_s: float | None = None
    serving_s: float | None = None
    harness_serving_s: float | None = None  # what the harness's own polls read: an upper bound of serving_s
    acted_s: float | None = None
    first_event_s: float | None = None
    duplicates: int = 0
    leaked: int = 0
    lost: int = 0
    order: list[str] = field(default_factory=list)
    completed: bool = False  # job_completed logged and the survivor exited 0
    steps_completed: int = 0
    lost_steps_total: int = 0
    restarts: int = 0
    samples_seen_twice: int = 0
    samples_skipped: int = 0
    resizes_in_process: int = 0
    world_sizes: list[int] = field(default_factory=list)
    notice_answered: bool | None = None  # notice phases: the notice's commit reached the daemon
    migrations: dict[str, int] = field(default_factory=dict)  # migration_started/_completed/_failed counts
    stalled: int = 0  # job_stalled events
    wall_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        fast = self.serving_s is not None and self.serving_s <= TAKEOVER_LIMIT_S \
            and (self.acted_s is None or self.acted_s <= TAKEOVER_LIMIT_S or self.phase == "migration")
        return (self.error is None and fast and self.completed and self.steps_completed == self.target_steps
                and not (self.duplicates or self.leaked or self.lost or self.order or self.lost_steps_total
                         or self.samples_seen_twice or self.samples_skipped or self.stalled)
                and (self.phase == "training" or self.notice_answered is True)
                and (self.phase == "migration" or not self.restarts)  # a move restarts the job from its commit
                and (self.phase != "migration" or (self.migrations.get("migration_completed", 0) >= 1
                                                   and self.world_sizes[-1:] == [2]))
                and (self.phase not in ("notice", "grow") or (self.resizes_in_process >= 2
                                                              and self.world_sizes[-1:] == [2])))


class _TwoRegionSim(Ec2Sim):
    """:class:`Ec2Sim` over the pool's instances in both of :data:`_REGIONS` (the
    migration phase's two domains): each boots a node agent from its own region's user-data."""

    def __init__(self, endpoint: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(endpoint, *args, **kwargs)
        import boto3
        self.clients = {r: boto3.client("ec2", endpoint_url=endpoint, region_name=r) for r in _REGIONS}
        self.region_of: dict[str, str] = {}

    def instances(self, states: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        out = []
        for region, client in self.clients.items():
            for inst in instances(client, self.pool, states):
                self.region_of[inst["InstanceId"]] = region
                out.append(inst)
        return out

    async def _boot(self, iid: str) -> None:  # Ec2Sim._boot, with the instance's own region's client
        import base64
        import re

        from daemon.gpunode.agent import NodeAgent
        from daemon.gpunode.metadata.aws import AwsImds
        from daemon.providers.local_metadata.aws import FakeImds

        await asyncio.sleep(self.boot_s)
        client = self.clients[self.region_of.get(iid, _REGIONS[0])]
        attr = await asyncio.to_thread(client.describe_instance_attribute, InstanceId=iid, Attribute="userData")
        user_data = base64.b64decode(attr["UserData"]["Value"]).decode()
        env = dict(re.findall(r"^(SPOTVISOR_[A-Z_]+)=(\S+)$", user_data, re.M))
        imds = FakeImds(instance_id=iid)
        await imds.start()
        agent = NodeAgent(daemon_url=env["SPOTVISOR_DAEMON_URL"], token=env["SPOTVISOR_AGENT_TOKEN"],
                          node_id=env["SPOTVISOR_NODE_ID"], metadata=AwsImds(imds.url, timeout_s=1.0),
                          workdir=self.workdir / iid, poll_interval_s=0.1, heartbeat_interval_s=0.2,
                          metadata_max_backoff_s=0.5)
        self.agents[iid] = (asyncio.create_task(agent.run(), name=f"agent:{iid}"), imds, env["SPOTVISOR_NODE_ID"])
        self._booting.discard(iid)

    def notice(self, node_id: str, *, lead_s: float) -> None:  # Ec2Sim.notice, reclaimed in its own region
        from datetime import datetime, timedelta, timezone

        iid, (_, imds, _) = next((i, a) for i, a in self.agents.items() if a[2] == node_id)
        imds.publish_interruption("terminate", time=datetime.now(timezone.utc) + timedelta(seconds=lead_s))
        client = self.clients[self.region_of[iid]]

        async def reclaim() -> None:
            await asyncio.sleep(lead_s)
            await asyncio.to_thread(client.terminate_instances, InstanceIds=[iid])

        task = asyncio.create_task(reclaim(), name=f"reclaim:{iid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _all_instances(world: World, pool: str) -> list[dict[str, Any]]:
    import boto3
    out = []
    for region in _REGIONS:
        out += instances(boto3.client("ec2", endpoint_url=world.moto_url, region_name=region), pool)
    return out


def _migration_config(raw: dict[str, Any], tdir: Path, west_store_port: int) -> None:
    """Two domains (us-east-1, where the job starts; us-west-2 with its own checkpoint
    store and rendezvous store), a move after 5 s starved, no cooldown."""
    raw["domains"] = [
        {"name": "use1", "provider": "aws", "region": "us-east-1"},
        {"name": "usw2", "provider": "aws", "region": "us-west-2", "checkpoint_uri": f"file://{tdir}/checkpoints-usw2",
         "rendezvous": {"host": "127.0.0.1", "port": west_store_port},
         "launch": {"image_id": "ami-00007e5803346854a"}},  # one of moto's us-west-2 images
    ]
    raw["migration"] = {"patience_s": 5, "boot_timeout_s": 240, "cooldown_s": 0}
    raw["offers"].append({"provider": "aws", "region": "us-west-2", "zone": "us-west-2a",
                          "instance_type": "g4dn.xlarge", "gpu_type": "T4", "gpus_per_node": 1})


def _capacity_out(region: str) -> Any:
    """A fault-proxy responder: every RunInstances in ``region`` fails with InsufficientInstanceCapacity."""
    from fakes.aws_faults import ec2_error_xml

    def respond(seen: Any) -> tuple[int, str, str] | None:
        if seen.action == "RunInstances" and seen.region == region and seen.params.get("DryRun", "").lower() != "true":
            return 500, ec2_error_xml("InsufficientInstanceCapacity", f"no capacity in {region} (trial)"), "text/xml"
        return None
    return respond


def _dicts(stored: list[Event]) -> list[dict[str, Any]]:
    return [{"seq": e.seq, "time": e.time, "kind": e.kind, "node": e.node, "data": e.data} for e in stored]


async def one_job_trial(world: World, i: int, seed: int, root: Path, phases: Sequence[str] = JOB_PHASES) -> JobTrial:
    """Trial ``i`` of seed ``seed`` (module docstring), its phase ``phases[i % len(phases)]``.
    Never raises: an error is recorded."""
    rng = random.Random(f"{seed}/{i}")
    phase = phases[i % len(phases)]
    # long enough for a replacement to boot and grow, and to outlast a takeover; a move: to outlast it
    target = MIGRATION_TARGET_STEPS if phase == "migration" else NOTICE_TARGET_STEPS
    t = JobTrial(trial=i, phase=phase, target_steps=target)
    pool = f"hj{seed}t{i:03d}"
    tdir = root / pool
    shutil.rmtree(tdir, ignore_errors=True)
    tdir.mkdir(parents=True)
    started = time.monotonic()
    world.faults.reset()
    store = StoreProcess("127.0.0.1", _free_port())
    west = StoreProcess("127.0.0.1", _free_port()) if phase == "migration" else None  # us-west-2's rendezvous
    leader: Daemon | None = None
    survivor: HaDaemon | None = None
    sockdir = ""
    killed_member: int | None = None
    try:
        await asyncio.to_thread(store.start)
        _, raw = _config(tdir, world.faults.url or "", store.port, target)
        raw["pool"]["name"] = pool
        if west is not None:
            await asyncio.to_thread(west.start)
            _migration_config(raw, tdir, west.port)
        sockdir = str(Path(raw["daemon"]["socket"]).parent)
        names = ["control-a", "control-b"]
        if rng.random() < 0.5:
            names.reverse()
        cfgs = {}
        for name in names:
            mine = yaml.safe_load(yaml.safe_dump(raw))
            mine["ha"] = {"name": name, "lease_s": LEASE_S, "endpoints": world.cluster.endpoints}
            mine["daemon"].update(state_dir=str(tdir / name), socket=f"{sockdir}/{name}.sock")
            cfgs[name] = tdir / f"{name}.yaml"
            cfgs[name].write_text(yaml.safe_dump(mine))
        t.leader = names[0]
        member = {"control-a": 0, "control-b": 1}[names[0]]
        t.etcd_member_killed = rng.random() < 0.5
        leader = Daemon(cfgs[names[0]], f"{sockdir}/{names[0]}.sock", tdir / f"{names[0]}.log")
        survivor = HaDaemon(names[1], cfgs[names[1]], f"{sockdir}/{names[1]}.sock", tdir / f"{names[1]}.log")
        nodes_dir = tdir / "instances"
        async with (_TwoRegionSim if west is not None else Ec2Sim)(world.moto_url, pool, nodes_dir, None) as sim:
            await leader.start()  # returns once its control socket answers: it leads
            await survivor.start()
            await until(lambda: "standby:" in survivor.log_text(), f"{survivor.name}'s standby line",
                        timeout_s=60, daemons=(survivor,))
            a = leader
            if phase == "training":
                kill_step = rng.randint(20, 300)
                t.drawn = {"kill_step": kill_step}
                await a.until(lambda: _steps_done(nodes_dir) >= kill_step, timeout_s=400, what=f"step {kill_step}")
            else:
                await a.until(lambda: any(e["data"].get("new") == 2 for e in a.saw("world_size_changed")),
                              timeout_s=400, what="both nodes in the job")
                first = {e["node"] for e in a.saw("node_launched")}
                noticed = a.saw("node_admitted")[-1]["node"]
                if phase == "migration":  # us-east-1 out of capacity: the notice's replacement cannot come
                    world.faults.answer(_capacity_out("us-east-1"))
                sim.notice(noticed, lead_s=60)
                await a.until(lambda: a.saw("interruption_notice"), timeout_s=120, what="the notice reported")
                if phase == "migration":
                    await a.until(lambda: a.saw("migration_started"), timeout_s=300, what="the move started")
                    delay = round(rng.uniform(0.0, 10.0), 3)
                    t.drawn = {"after_migration_started_s": delay, "noticed": noticed}
                elif phase == "notice":
                    delay = 0.0 if rng.random() < 0.5 else round(rng.uniform(0.0, 2.0), 3)
                    t.drawn = {"after_notice_s": delay, "noticed": noticed}
                else:
                    await a.until(lambda: [e for e in a.saw("node_admitted") if e["node"] not in first],
                                  timeout_s=400, what="the replacement admitted")
                    delay = round(rng.uniform(0.0, 0.5), 3)
                    t.drawn = {"after_admitted_s": delay, "noticed": noticed}
                await asyncio.sleep(delay)  # the drawn moment (not a synchronisation)
                if phase == "migration":
                    t.in_phase = not a.saw("migration_completed") and not a.saw("migration_failed")
                    t.drawn["events_since_start"] = [e["kind"] for e in a.seen
                                                     if e["seq"] > a.saw("migration_started")[0]["seq"]][-12:]
                if phase == "grow":
                    shrunk = max(e["seq"] for e in a.saw("interruption_notice"))
                    t.in_phase = not [e for e in a.seen if e["kind"] == "world_size_changed"
                                      and e["data"].get("new") == 2 and e["seq"] > shrunk]
            killed_at, killed_wall = time.monotonic(), time.time()
            await a.sigkill()
            await asyncio.to_thread(store.kill)
            if west is not None:
                await asyncio.to_thread(west.kill)
            if t.etcd_member_killed:
                await asyncio.to_thread(world.cluster.kill, member)
                killed_member = member
            seen = list(a.seen)
            t.kill_step = _steps_done(nodes_dir)
            await asyncio.to_thread(store.start)  # the floating address, now on the survivor's node: empty
            if west is not None:
                await asyncio.to_thread(west.start)

            async def elected() -> bool:
                return await world.leader_of(pool) == survivor.name

            await until(elected, f"{survivor.name} elected", timeout_s=60, daemons=(survivor,))
            elected_read = time.monotonic() - killed_at
            await until(survivor.status, f"{survivor.name} serving", timeout_s=60, daemons=(survivor,))
            t.harness_serving_s = round(time.monotonic() - killed_at, 3)
            t.elected_s, t.serving_s = takeover(survivor, killed_wall, elected_read, t.harness_serving_s)
            if killed_member is not None:
                await asyncio.to_thread(world.cluster.restart, killed_member)
                killed_member = None
            assert survivor.proc is not None
            try:
                rc = await asyncio.wait_for(survivor.proc.wait(), JOB_TIMEOUT_S)
            except TimeoutError:
                raise AssertionError(f"{survivor.name} did not finish the job in {JOB_TIMEOUT_S} s: "
                                     f"{survivor.log_text()[-2000:]}") from None
            stored = _stored_events(tdir / survivor.name / "spotvisord.db")
            done = [e for e in stored if e.kind == "job_completed"]
            t.completed = rc == 0 and bool(done)
            t.leaked = len(await asyncio.to_thread(sim.live))
            t.duplicates = sum(c - 1 for c in per_node(await asyncio.to_thread(_all_instances, world, pool)).values())
        end = killed_at + (done[0].time - killed_wall) if done else float("inf")
        acts = [s.at for s in world.faults.requests if s.action in _MUTATING and killed_at + t.elected_s < s.at < end
                and str(s.params.get("DryRun", "")).lower() != "true"]
        t.acted_s = round(min(acts) - killed_at, 3) if acts else None
        t.lost = lost_events(stored, seen)
        log = _dicts(stored)
        t.order = causal_violations(log)
        in_etcd = await world.committed(pool) or {}
        if [(e["seq"], e["kind"], e["node"]) for e in log] != [(s, v["kind"], v["node"]) for s, v in sorted(in_etcd.items())]:
            t.order.append(f"the survivor's log ({len(log)} events) differs from etcd's ({len(in_etcd)})")
        mine = [e.time for e in stored if e.time > killed_wall]
        t.first_event_s = round(min(mine) - killed_wall, 3) if mine else None
        if phase != "training":
            notice = next(e for e in stored if e.kind == "interruption_notice")
            t.notice_answered = any(notice.data["notice_id"] in e.data.get("notice_ids", []) for e in stored
                                    if e.kind == "checkpoint_committed")
        t.migrations = {k: n for k in ("migration_started", "migration_completed", "migration_failed")
                        if (n := sum(1 for e in stored if e.kind == k))}
        t.stalled = sum(1 for e in stored if e.kind == "job_stalled")
        s = summarize(nodes_dir, stored, target_steps=target, global_batch_size=GLOBAL_BATCH)
        for k in ("steps_completed", "lost_steps_total", "restarts", "samples_seen_twice", "samples_skipped",
                  "resizes_in_process"):
            setattr(t, k, int(s.get(k) or 0))
        t.world_sizes = list(s.get("world_sizes") or [])
    except Exception as exc:  # noqa: BLE001  a trial's failure is a result, recorded with its message
        t.error = f"{type(exc).__name__}: {str(exc)[:1500]}"
    finally:
        for d in (leader, survivor):
            if d is not None and d.proc is not None and d.proc.returncode is None:
                d.proc.kill()
                await d.proc.wait()
        if leader is not None:
            await leader._stop_follower()
        await asyncio.to_thread(store.stop)
        if west is not None:
            await asyncio.to_thread(west.stop)
        world.faults.answer(None)
        if killed_member is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(world.cluster.restart, killed_member)
        with contextlib.suppress(Exception):  # anything left running is counted; clean up for the next trial
            import boto3
            for region in _REGIONS:
                client = boto3.client("ec2", endpoint_url=world.moto_url, region_name=region)
                left = [x["InstanceId"] for x in instances(client, pool) if x["State"]["Name"] in ("pending", "running")]
                if left:
                    await asyncio.to_thread(client.terminate_instances, InstanceIds=left)
        if sockdir:
            shutil.rmtree(sockdir, ignore_errors=True)
        t.wall_s = round(time.monotonic() - started, 2)
        if t.ok:
            shutil.rmtree(tdir, ignore_errors=True)  # a failed trial keeps its logs
    return t


def _free_port() -> int:
    from bench.ports import free_port
    return free_port()


def job_summary(trials: Sequence[JobTrial]) -> dict[str, Any]:
    """The figures over ``trials``: p50/max of each takeover time (s), and the counts."""
    out: dict[str, Any] = {"trials": len(trials), "ok": sum(t.ok for t in trials),
                           "errors": sum(t.error is not None for t in trials),
                           "completed": sum(t.completed and t.steps_completed == t.target_steps for t in trials),
                           "in_phase": sum(t.in_phase for t in trials)}
    for name in ("elected_s", "serving_s", "acted_s", "first_event_s"):
        xs = [getattr(t, name) for t in trials if getattr(t, name) is not None]
        out[name] = {"n": len(xs), "p50": round(statistics.median(xs), 2), "p95": round(_pct(xs, 0.95), 2),
                     "max": round(max(xs), 2)} if xs else {"n": 0}
    for name in ("duplicates", "leaked", "lost", "lost_steps_total", "restarts", "samples_seen_twice",
                 "samples_skipped", "stalled"):
        out[name] = sum(getattr(t, name) for t in trials)
    out["order_violations"] = sum(len(t.order) for t in trials)
    out["notice_unanswered"] = sum(t.notice_answered is False for t in trials)
    out["etcd_member_killed"] = sum(t.etcd_member_killed for t in trials)
    out["phases"] = {p: n for p in JOB_PHASES + EXTRA_JOB_PHASES if (n := sum(t.phase == p for t in trials))}
    return out


def job_table(trials: Sequence[JobTrial]) -> str:
    """A markdown table: one row per phase and one for all."""
    rows = ["| phase | trials | etcd member killed too | elected p50 / max (s) | takeover p50 / max (s) "
            "| first event p50 / max (s) | acted p50 / max (s) | duplicates | leaked | lost | reordered "
            "| jobs completed | lost steps | restarts | samples twice / skipped | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = [*((p, [t for t in trials if t.phase == p]) for p in JOB_PHASES + EXTRA_JOB_PHASES), ("all", list(trials))]
    for name, group in groups:
        if not group:
            continue
        s = job_summary(group)
        sv, el, fe, ac = s["serving_s"], s["elected_s"], s["first_event_s"], s["acted_s"]
        take = f"{sv['p50']} / {sv['max']}" if sv["n"] else "-"
        ele = f"{el['p50']} / {el['max']}" if el["n"] else "-"
        first = f"{fe['p50']} / {fe['max']}" if fe["n"] else "-"
        act = f"{ac['p50']} / {ac['max']} (n={ac['n']})" if ac["n"] else "-"
        rows.append(f"| {name} | {s['trials']} | {s['etcd_member_killed']} | {ele} | {take} | {first} | {act} | "
                    f"{s['duplicates']} | {s['leaked']} | "
                    f"{s['lost']} | {s['order_violations']} | {s['completed']} / {s['trials']} | "
                    f"{s['lost_steps_total']} | {s['restarts']} | {s['samples_seen_twice']} / {s['samples_skipped']} | "
                    f"{s['errors']} |")
    return "\n".join(rows)


async def run_job_trials(n: int, seed: int, root: Path, *, json_out: Path | None = None, quiet: bool = False,
                         deadline: float | None = None, phases: Sequence[str] = JOB_PHASES,
                         first: int = 0) -> list[JobTrial]:
    """Trials ``first``..``first+n-1`` of ``seed`` on one :class:`World` under ``root``;
    stops early once the wall clock passes ``deadline`` (unix s). Writes ``json_out`` after
    each trial (an interrupted run keeps what it measured)."""
    done: list[JobTrial] = []
    async with World(root) as world:
        for i in range(first, first + n):
            if deadline is not None and time.time() > deadline:
                break
            t = await one_job_trial(world, i, seed, root, phases)
            done.append(t)
            if not quiet:
                print(f"trial {i:3d} {t.phase:8s} leader={t.leader} drawn={t.drawn} in_phase={t.in_phase} "
                      f"kill_step={t.kill_step} etcd_killed={t.etcd_member_killed} elected={t.elected_s} serving={t.serving_s} "
                      f"first_event={t.first_event_s} acted={t.acted_s} notice_answered={t.notice_answered} "
                      f"dup={t.duplicates} leak={t.leaked} lost={t.lost} order={len(t.order)} "
                      f"steps={t.steps_completed}/{t.target_steps} lost_steps={t.lost_steps_total} "
                      f"restarts={t.restarts} twice={t.samples_seen_twice} skipped={t.samples_skipped} "
                      f"resizes={t.resizes_in_process} sizes={t.world_sizes[-4:]} moves={t.migrations} "
                      f"wall={t.wall_s}s "
                      f"{'ok' if t.ok else 'FAIL ' + str(t.error or t.order)[:400]}", flush=True)
            if json_out is not None:
                json_out.write_text(json.dumps({"seed": seed, "summary": job_summary(done),
                                                "trials": [asdict(x) | {"ok": x.ok} for x in done]}, indent=1))
    return done


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)  # moto's server: no line per request
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--first", type=int, default=0, help="the first trial's index (trials first..first+n-1)")
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--json", type=Path, default=None, help="write every trial's record here")
    p.add_argument("--dir", type=Path, default=None, help="etcd's data and failed trials' logs (default: a temp dir)")
    p.add_argument("--stop-at", type=float, default=None, help="unix time after which no new trial starts")
    p.add_argument("--phases", default=",".join(JOB_PHASES), help="comma-separated, taken in turn")
    p.add_argument("--report", type=Path, nargs="+", default=None, help="print the table of --json files and exit")
    args = p.parse_args(argv)
    if args.report is not None:
        known = {f.name for f in fields(JobTrial)}
        done = [JobTrial(**{k: v for k, v in d.items() if k in known})
                for f in args.report for d in json.loads(f.read_text())["trials"]]
        print(job_table(done))
        print(json.dumps(job_summary(done)))
        return 0
    phases = [x for x in args.phases.split(",") if x]
    bad = [x for x in phases if x not in JOB_PHASES + EXTRA_JOB_PHASES]
    if bad or not phases or args.trials < 1:
        print(f"ha_job_trials: --trials must be at least 1; --phases from {', '.join(JOB_PHASES + EXTRA_JOB_PHASES)}", file=sys.stderr)
        return 2
    root = args.dir or Path(tempfile.mkdtemp(prefix="ha-job-trials-"))
    root.mkdir(parents=True, exist_ok=True)
    trials = asyncio.run(run_job_trials(args.trials, args.seed, root, json_out=args.json, deadline=args.stop_at,
                                        phases=phases, first=args.first))
    print(job_table(trials))
    print(json.dumps(job_summary(trials)))
    print(f"logs of failed trials (if any) under {root}")
    return 0 if all(t.ok for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
