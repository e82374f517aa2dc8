"""Chaos cells: the whole control node (the daemon and the rendezvous store) SIGKILLed under
a real training job, then started again, as systemd's ``Restart=`` or a rebooted control
node would (issue 29: training does not depend on the control node while it trains).

The daemon is the real service, ``spotvisord run --config FILE``; the rendezvous store is
the real one (``spotvisord rendezvous``'s process, :class:`StoreProcess`), restarted empty.
The cloud is EC2 as moto's server behind ``fakes.aws_faults.AwsFaultProxy``, whose
instances outlive the daemon as a cloud's do; on each instance :class:`Ec2Sim` runs a
real node agent that runs the daemon's own job spec: real torchrun
(``--rdzv-backend=spotvisor``), the reference trainer (DDP, gloo), its checkpoints in a
directory of this machine. The local provider cannot play this: its instances end with
the daemon by design (``tests/test_local_orphans.py``). The HA cell runs two daemons on a
real 3-member etcd cluster (``ha:``) and kills the leader's control node.

Measured from what the run left: the restarted daemon's event log, the trainers' own step
logs and status lines (:func:`daemon.analysis.summary.summarize`), the checkpoint
directory and the pool's instances in EC2.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.ha_harness import Daemon as HaDaemon, until as ha_until
from bench.ports import free_port
from chaos.conftest import Matrix, lost_events
from chaos.test_daemon_kill import Daemon, Ec2Sim, _stored_events
from daemon.ha.partition import Partition
from etcd_cluster import EtcdCluster, etcd_cluster  # noqa: F401  (fixture)
from daemon.analysis.summary import summarize
from daemon.controlnode.rendezvous import StoreProcess
from daemon.model import Event
from fakes.aws_faults import AwsFaultProxy
from trainer.checkpoint import FileStore, list_committed

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

TARGET_STEPS = 70
#: the HA notice cells' and trials' job (paced while the world is short of 2: the replacement grows it
#: back before the end, however fast the survivor trains). The notice comes at step ~20
#: and the grow lands by step ~55 (~90 at half speed): 220 leaves the survivor ~100 s at
#: 0.5 s a step for two daemon restarts and a replacement's boot, and no more steps after
#: the grow than the check needs (400 spent ~40 s of both cores on them)
NOTICE_TARGET_STEPS = 220
#: the notice cell's own target: its last 60 steps wait for the world of 2 (the paced
#: trainer's --hold-last), so it ends a few steps after the grow, however late the grow
#: lands (220 left ~17 s of both cores after it); the HA trials keep NOTICE_TARGET_STEPS
NOTICE_CELL_STEPS, NOTICE_CELL_HOLD = 120, 60
GLOBAL_BATCH = 12
SMALL_MODEL = ["--seq-len", "64", "--n-layer", "2", "--n-embd", "128", "--n-head", "2"]


def _config(tmp_path: Path, proxy_url: str, store_port: int,
            target_steps: int = TARGET_STEPS, paced: bool = False,
            pace_file: Path | None = None, hold_last: int = 0) -> tuple[Path, dict[str, Any]]:
    """The daemon's config file and its content: a 2-node pool of 1-GPU EC2 instances (moto)
    running the reference trainer (a small GPT-2) to ``target_steps``; with ``paced``, under
    ``e2e.paced_trainer``: 0.5 s a step while the world is short of 2, so the job cannot end
    before its replacement has grown it back, however fast the survivor trains; with
    ``pace_file``, also while that file exists; with ``hold_last``, its last steps wait
    for the world of 2 (``--hold-last``)."""
    pool = f"cn-{uuid.uuid4().hex[:8]}"
    sockdir = tempfile.mkdtemp(prefix="svc-", dir="/tmp")
    raw = {
        "pool": {"name": pool, "min_nodes": 1, "target_nodes": 2, "max_nodes": 2},
        "job": {"id": "cn", "module": "trainer.run", "target_steps": target_steps,
                "global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2,
                "checkpoint_uri": f"file://{tmp_path}/checkpoints", "checkpoint_interval_steps": 20,
                "hold_timeout_s": 90, "grow": "in_process",
                "args": [*SMALL_MODEL, "--keep-checkpoints", "1000"]},
        "rendezvous": {"host": "127.0.0.1", "port": store_port, "last_call_timeout_s": 3,
                       "keep_alive_interval_s": 1, "keep_alive_max_attempt": 3},
        "agent": {"heartbeat_interval_s": 0.2},
        "daemon": {"state_dir": str(tmp_path / "state"), "socket": f"{sockdir}/d.sock",
                   "agent_host": "127.0.0.1", "agent_port": free_port(), "reconcile_interval_s": 0.1,
                   "rejoin_timeout_s": 60, "heartbeat_timeout_s": 30},
        "providers": {"local": None, "aws": {"image_id": "ami-03cf127a", "endpoint_url": proxy_url}},
        "offers": [{"provider": "aws", "region": "us-east-1", "zone": "us-east-1a", "instance_type": "g4dn.xlarge",
                    "gpu_type": "T4", "gpus_per_node": 1}],
    }
    if paced or pace_file is not None:
        raw["job"].update(module="e2e.paced_trainer", preload=["trainer.run"],
                          args=[*raw["job"]["args"], "--full-world", "2", "--pace-s", "0.5",
                                *(["--pace-file", str(pace_file)] if pace_file is not None else []),
                                *(["--hold-last", str(hold_last)] if hold_last else [])],
                          env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # tests/: e2e.paced_trainer
    cfg = tmp_path / "spotvisord.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg, raw


def _steps_done(instances: Path) -> int:
    """The highest step any rank has logged (the trainers' own step logs)."""
    best = 0
    for f in instances.glob("*/logs/steps-*.jsonl"):
        for line in f.read_text().splitlines()[-3:]:
            try:
                best = max(best, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a kill
    return best


def _endpoints(instances: Path) -> set[str]:
    """The rendezvous endpoints the nodes' files hold (the agents' copy of the leader's word)."""
    return {f.read_text().strip() for f in instances.glob("*/rendezvous")}


async def _until(cond: Any, what: str, timeout_s: float) -> None:
    """Poll ``cond()`` (another process's doing) every 0.1 s until it holds, within ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.1)
    assert cond(), what


@pytest.mark.parametrize("moment", ["mid_training", "right_after_a_notice"])
async def test_a_control_node_kill_costs_no_step_and_no_worker_restart(
        tmp_path: Path, faults: AwsFaultProxy, ec2_server: str, matrix: Matrix, moment: str) -> None:
    """mid_training: the daemon and the store are SIGKILLed while the job trains; the
    trainers train on while both are down (their steps keep coming), and after both come
    back (the store empty) the job completes in the same attempt: no worker restart, no
    new torchrun, no ``job_stalled``, 0 lost steps.
    right_after_a_notice: one node gets an interruption notice and the control node is
    killed as soon as the daemon has it: the notice's commit, the noticed node's exit and
    the survivors' in-process shrink happen while it is down (the reports wait in the
    agents' queues), the restarted daemon reads the commit that answers the notice and
    launches the replacement. Then, during the replacement's grow (once the daemon has
    admitted it, before the world is 2 again), the control node is killed a second time:
    the third daemon sees the grow land in process. 0 lost steps, no worker restart."""
    store = StoreProcess("127.0.0.1", free_port())
    await asyncio.to_thread(store.start)
    notice = moment == "right_after_a_notice"
    target = NOTICE_CELL_STEPS if notice else TARGET_STEPS
    cfg, raw = _config(tmp_path, faults.url, store.port, target, paced=notice, hold_last=NOTICE_CELL_HOLD * notice)
    pool = raw["pool"]["name"]
    instances = tmp_path / "instances"
    log = tmp_path / "spotvisord.log"
    daemons: list[Daemon] = []
    try:
        async with Ec2Sim(ec2_server, pool, instances, None) as sim:
            a = Daemon(cfg, raw["daemon"]["socket"], log)
            daemons.append(a)
            await a.start()
            await a.until(lambda: a.saw("checkpoint_committed"), timeout_s=240, what="the first periodic commit")
            attempt = a.saw("checkpoint_committed")[0]["data"]["attempt"]
            if moment == "right_after_a_notice":  # a node in the job: under load one may join late
                await a.until(lambda: any(e["data"].get("new") == 2 for e in a.saw("world_size_changed")),
                              timeout_s=240, what="both nodes in the job")
                sim.notice(a.saw("node_admitted")[-1]["node"], lead_s=60)
                await a.until(lambda: a.saw("interruption_notice"), timeout_s=60, what="the notice reported")
            await a.sigkill()
            await asyncio.to_thread(store.kill)
            seen = list(a.seen)
            at_kill = _steps_done(instances)
            if moment == "mid_training":  # the control node is down: the trainers train on
                await _until(lambda: _steps_done(instances) >= at_kill + 5, "steps while the control node is down",
                             timeout_s=120)
            await asyncio.to_thread(store.start)  # empty, on the same port
            b = Daemon(cfg, raw["daemon"]["socket"], log)
            daemons.append(b)
            await b.start()
            last = b
            if moment == "right_after_a_notice":  # the replacement's grow: kill the control node again
                first = {e["node"] for e in seen if e["kind"] == "node_admitted"}  # the job's own two
                await b.until(lambda: [e for e in b.saw("node_admitted") if e["node"] not in first],
                              timeout_s=240, what="the replacement admitted")
                assert not [e for e in b.saw("world_size_changed") if e["data"].get("new") == 2
                            and e["seq"] > max(x["seq"] for x in seen)], "the grow landed before the kill"
                await b.sigkill()
                await asyncio.to_thread(store.kill)
                seen += [e for e in b.seen if e["seq"] > max(x["seq"] for x in seen)]
                await asyncio.to_thread(store.start)
                last = Daemon(cfg, raw["daemon"]["socket"], log)
                daemons.append(last)
                await last.start()
            assert await last.exited(400) == 0  # the job completed and every instance was released
            stored = _stored_events(Path(raw["daemon"]["state_dir"]) / "spotvisord.db")
            s = summarize(instances, stored, target_steps=target, global_batch_size=GLOBAL_BATCH)
            live = sim.live()
    finally:
        for d in daemons:
            if d.proc is not None and d.proc.returncode is None:
                d.proc.kill()
                await d.proc.wait()
            await d._stop_follower()
        await asyncio.to_thread(store.stop)
    _check(matrix, moment, s, stored, seen, tmp_path, live, attempt, at_kill, target_steps=target)


def _check(matrix: Matrix, moment: str, s: dict[str, Any], stored: list[Event], seen: list[dict[str, Any]],
           tmp_path: Path, live: list[Any], attempt: str, at_kill: int, *, scenario: str | None = None,
           target_steps: int = TARGET_STEPS) -> None:
    commits = {e.data["step"] for e in stored if e.kind == "checkpoint_committed"}
    on_disk = {m.step for m in list_committed(FileStore(tmp_path / "checkpoints"))}
    completed = [e for e in stored if e.kind == "job_completed"]
    row = matrix.row(scenario or f"control node (daemon + store) SIGKILL {moment.replace('_', ' ')}"
                     + (", then during the replacement's grow" if moment == "right_after_a_notice" else "")
                     + " (real job, 2 nodes)",
                     job_completed=bool(completed) and s["steps_completed"] == target_steps,
                     lost_checkpoints=len(commits - on_disk), leaked_instances=len(live),
                     lost_events=lost_events(stored, seen))
    print(f"\ncontrol node killed {moment} at step {at_kill}: " + ", ".join(
        f"{k}={s[k]}" for k in ("steps_completed", "lost_steps_total", "restarts", "resizes_in_process",
                                "world_sizes", "wall_s") if k in s))
    assert row.clean(), (row, s)
    assert s["lost_steps_total"] == 0 and s["restarts"] == 0
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
    assert s["resumes_before_their_commit"] == 0
    assert not [e for e in stored if e.kind == "job_stalled"]
    if moment == "mid_training":  # the same worker group from before the kill to the end
        assert completed[0].data["attempt"] == attempt
        assert not [e for e in stored if e.kind in ("trainer_exited", "node_lost") and e.data.get("exit_code") != 0]
    else:  # the notice's commit answered it, and the job went on in process, not by a restart
        notice = next(e for e in stored if e.kind == "interruption_notice")
        answered = [e for e in stored if e.kind == "checkpoint_committed"
                    and notice.data["notice_id"] in e.data.get("notice_ids", [])]
        assert answered, "the notice's commit never reached the daemon"
        assert [e for e in stored if e.kind == "job_resumed" and e.data.get("world_size") == 1
                and (e.data.get("resumed_from") or 0) >= max(c.data["step"] for c in answered)], \
            "the survivors' shrink never reached the daemon"
        assert s["resizes_in_process"] >= 2  # the shrink, then the replacement's grow
        assert s["world_sizes"][-1] == 2


@pytest.mark.parametrize(("fault", "moment"), [("killed", "mid_training"), ("cut_off", "mid_training"),
                                               ("cut_off", "right_after_a_notice"), ("cut_off", "during_a_grow")],
                         ids=["killed", "cut_off", "cut_off_after_a_notice", "cut_off_during_a_grow"])
async def test_a_leader_lost_mid_training_costs_no_step(
        tmp_path: Path, faults: AwsFaultProxy, ec2_server: str, matrix: Matrix,
        etcd_cluster: EtcdCluster, fault: str, moment: str) -> None:  # noqa: F811
    """HA (``ha:``, a real 3-member etcd cluster): control-a leads, control-b stands by.
    Mid-training control-a is lost: ``killed``, its control node dies (the daemon and the
    rendezvous store, SIGKILLed); ``cut_off`` (the ``partition_leader`` fault), a network
    partition between it and etcd (it reaches etcd only through
    :class:`daemon.ha.partition.Partition`, which is cut): it cannot learn it was deposed, so its
    own clock stops it (exit 1, fail closed) while its store stays up. Either way
    control-b leads within 10 s, reads the pool from etcd and runs the job to its end: the
    same worker group, 0 lost steps, no stall. Nothing floats: the two daemons listen for
    agents on ports of their own (``ha.agent_urls``), and control-b serves the rendezvous
    store from its own node, on its own address (its ``rendezvous.port``): its heartbeat
    replies say so, every agent writes it to its node's endpoint file, and torchrun's
    rendezvous handlers move there and put their round back. The steps are paced
    (``pace_file``) from the fault until a handler has, so the job is still training when
    the store moves however long the takeover took. ``cut_off_after_a_notice``: the cut
    comes as soon as control-a has a node's interruption notice, so the notice's commit,
    the survivors' shrink and the replacement's purchase and grow are control-b's (a report
    control-a cannot make durable is answered 503, and the agent sends it to control-b).
    ``cut_off_during_a_grow``: control-a handles the notice, buys the replacement and admits
    it; the cut comes then, before the grow lands, and control-b records it. The joiner
    queues wherever the store is when its trainer starts (control-b's in these runs, about
    10 s after the cut; a ticket queued in control-a's store follows the move:
    ``tests/test_store_address.py``)."""
    notice = moment != "mid_training"
    # with a notice: the last 60 steps wait for the world of 2 (the grow), and the ~115 steps
    # after the fault, paced until the store has moved, leave the takeover ~55 s
    target = NOTICE_CELL_STEPS + 20 if notice else TARGET_STEPS
    store = StoreProcess("127.0.0.1", free_port())
    store_b = StoreProcess("127.0.0.1", free_port())  # control-b's node's
    await asyncio.to_thread(store.start)
    partition = await Partition(etcd_cluster.endpoints).start()
    pace = tmp_path / "pace"
    cfg, raw = _config(tmp_path, faults.url, store.port, target, paced=notice, pace_file=pace,
                       hold_last=NOTICE_CELL_HOLD * notice)
    pool, instances = raw["pool"]["name"], tmp_path / "instances"
    configs = {}
    ports = {"control-a": free_port(), "control-b": free_port()}
    agent_urls = [f"http://127.0.0.1:{port}" for port in ports.values()]
    for name in ("control-a", "control-b"):
        mine = yaml.safe_load(yaml.safe_dump(raw))
        # only a cut needs the forwarders: a killed control node reaches etcd as a node does
        endpoints = partition.endpoints if name == "control-a" and fault == "cut_off" else etcd_cluster.endpoints
        mine["ha"] = {"name": name, "lease_s": 4, "endpoints": endpoints, "agent_urls": agent_urls}
        mine["daemon"].update(state_dir=str(tmp_path / name), socket=raw["daemon"]["socket"].replace("d.sock",
                                                                                                   f"{name}.sock"),
                              agent_port=ports[name])
        if name == "control-b":
            mine["rendezvous"]["port"] = store_b.port
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(mine))
    a = Daemon(configs["control-a"], raw["daemon"]["socket"].replace("d.sock", "control-a.sock"),
               tmp_path / "control-a.log")
    b = HaDaemon("control-b", configs["control-b"], raw["daemon"]["socket"].replace("d.sock", "control-b.sock"),
                  tmp_path / "control-b.log")
    try:
        async with Ec2Sim(ec2_server, pool, instances, None) as sim:
            await a.start()  # returns once its control socket answers: it leads
            await b.start()
            await ha_until(lambda: "standby: control-a leads" in b.log.read_text(), "control-b's standby line",
                           timeout_s=60, daemons=(b,))
            await a.until(lambda: a.saw("checkpoint_committed"), timeout_s=240, what="the first periodic commit")
            attempt = a.saw("checkpoint_committed")[0]["data"]["attempt"]
            if notice:  # a node in the job: under load one may join late
                await a.until(lambda: any(e["data"].get("new") == 2 for e in a.saw("world_size_changed")),
                              timeout_s=240, what="both nodes in the job")
                first = {e["node"] for e in a.saw("node_admitted")}  # the job's own two
                sim.notice(a.saw("node_admitted")[-1]["node"], lead_s=60)
                await a.until(lambda: a.saw("interruption_notice"), timeout_s=60, what="the notice reported")
                if moment == "during_a_grow":  # control-a buys the replacement and admits it: cut then
                    await a.until(lambda: [e for e in a.saw("node_admitted") if e["node"] not in first],
                                  timeout_s=240, what="the replacement admitted")
                    noticed = a.saw("interruption_notice")[0]["seq"]
                    assert not [e for e in a.saw("world_size_changed") if e["data"].get("new") == 2
                                and e["seq"] > noticed], "the grow landed before the cut"
            pace.touch()
            if fault == "killed":
                await a.sigkill()
                await asyncio.to_thread(store.kill)
            else:
                partition.cut()
            lost_at = time.monotonic()
            at_kill = _steps_done(instances)
            if fault == "cut_off":  # its own clock stops it, with one line saying why
                assert a.proc is not None
                assert await asyncio.wait_for(a.proc.wait(), 15) == 1
                lines = [x for x in a.log.read_text().splitlines() if x.startswith("spotvisord run:")]
                assert len(lines) == 1 and "control-a lost the leadership" in lines[0], lines
                await a._stop_follower()
            seen = list(a.seen)
            await asyncio.to_thread(store_b.start)  # control-b's node's store, on its own address: empty
            await ha_until(b.status, "control-b leading", timeout_s=10, daemons=(b,))
            led_s = time.monotonic() - lost_at
            moved = f"rendezvous store 127.0.0.1:{store_b.port} was empty: re-published"
            await _until(lambda: any(moved in f.read_text(errors="replace") for f in instances.glob("*/trainer.log"))
                         and (notice or _endpoints(instances) == {f"127.0.0.1:{store_b.port}"}),
                         "every node following control-b's store", timeout_s=60)
            pace.unlink()  # seen: train on at full speed
            assert b.proc is not None
            assert await asyncio.wait_for(b.proc.wait(), 400) == 0  # the job completed, the pool released
            stored = _stored_events(tmp_path / "control-b" / "spotvisord.db")
            s = summarize(instances, stored, target_steps=target, global_batch_size=GLOBAL_BATCH)
            live = sim.live()
    finally:
        for proc in (a.proc, b.proc):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
        await a._stop_follower()
        await partition.close()
        await asyncio.to_thread(store.stop)
        await asyncio.to_thread(store_b.stop)
    what = {"killed": "control-a's control node was killed", "cut_off": "control-a was cut off from etcd"}[fault]
    print(f"\nHA: control-b led {led_s:.2f} s after {what} (lease 4 s)")
    _check(matrix, moment, s, stored, seen, tmp_path, live, attempt, at_kill, target_steps=target,
           scenario={("killed", "mid_training"): "HA leader's control node (daemon + store) SIGKILL mid training",
                     ("cut_off", "mid_training"): "HA leader cut off from etcd mid training",
                     ("cut_off", "right_after_a_notice"): "HA leader cut off from etcd right after a notice, "
                                                          "the shrink and the grow its standby's",
                     ("cut_off", "during_a_grow"): "HA leader cut off from etcd during the replacement's grow"
                     }[fault, moment]
           + " (real job, 2 nodes)")
