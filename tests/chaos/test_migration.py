"""One job, one network: placement domains and whole-job migration, in-process.

The real Supervisor on a ManualClock (:class:`~chaos.conftest.Sim`); the test plays the
agents and the trainer, and writes the trainer's checkpoints into real ``file://``
stores, one per domain, so the migration's copy (:func:`trainer.replicate.replicate`)
is the real one. Two domains: AWS us-east-1 (where the job starts) and Alibaba
cn-hangzhou (where it moves).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from chaos.conftest import ChaosProvider, Sim
from daemon.config import ConfigError, load_config
from daemon.control.lifecycle import ADMITTED
from daemon.model import Event, JobState, Node, NodeState
from daemon.providers.base import CapacityError
from trainer.checkpoint import Manifest, commit, latest_committed, open_store, write_shard

H = 3600.0

pytestmark = pytest.mark.chaos


class RegionProvider(ChaosProvider):
    """:class:`ChaosProvider` serving both clouds, with capacity per region:
    ``capacity[region]`` launches left there (absent: unlimited)."""

    def __init__(self, capacity: dict[str, int]) -> None:
        super().__init__()
        self.capacity = dict(capacity)

    async def launch(self, offer, node):  # type: ignore[override]
        left = self.capacity.get(offer.region)
        if left is not None:
            if left <= 0:
                self.refused.append(node.node_id)
                raise CapacityError(f"InsufficientInstanceCapacity: {offer.key} (test)")
            self.capacity[offer.region] = left - 1
        return await super().launch(offer, node)

    async def spot_stock(self, offer):  # type: ignore[override]
        """In stock while the region has launches left (as DescribeAvailableResource would say)."""
        left = self.capacity.get(offer.region)
        return left is None or left > 0


def _overrides(tmp_path: Path, **migration: Any) -> dict[str, Any]:
    return {
        "pool": {"name": "chaos", "min_nodes": 1, "target_nodes": 2, "max_nodes": 2},
        "job": {"checkpoint_uri": f"file://{tmp_path}/use1"},
        "providers": {"local": None,
                      "aws": {"image_id": "ami-0123456789abcdef0"},
                      "aliyun": {"image_id": "m-image", "security_group_id": "sg-1"}},
        "domains": [
            {"name": "aws-use1", "provider": "aws", "region": "us-east-1", "egress_usd_per_gb": 0.09},
            {"name": "aliyun-hz", "provider": "aliyun", "region": "cn-hangzhou",
             "checkpoint_uri": f"file://{tmp_path}/hz", "rendezvous": {"host": "172.16.0.10", "port": 29400}},
        ],
        "migration": {"patience_s": 60, "boot_timeout_s": 600, "cooldown_s": 0, **migration},
        "offers": [
            {"provider": "aws", "region": "us-east-1", "zone": "us-east-1a", "instance_type": "g5.12xlarge"},
            {"provider": "aliyun", "region": "cn-hangzhou", "zone": "cn-hangzhou-h",
             "instance_type": "ecs.gn7i-c32g1.32xlarge"},
        ],
    }


def _checkpoint(uri: str, step: int, world_size: int) -> None:
    """What the trainer's ranks write for ``step``: a shard per rank, then the manifest."""
    store = open_store(uri)
    shards = tuple(write_shard(store, step, f"rank-{r}.pt", f"state {step} {r}".encode() * 1000)
                   for r in range(world_size))
    commit(store, Manifest(step=step, world_size=world_size, global_batch_size=12,
                           data_position={"consumed_samples": step * 12, "seed": 0}, shards=shards))


def _one_domain_in_the_job(sim: Sim, bad: list[str]) -> None:
    """A listener: after every event, the nodes in the job share one domain."""

    def check(ev: Event) -> None:
        domains = {sim.sup.domain_of(n) for n in sim.sup.nodes.values() if n.state in ADMITTED}
        if len(domains) > 1:
            bad.append(f"#{ev.seq} {ev.kind}: the job spans {sorted(domains)}")

    sim.sup.subscribe(check)


async def _training_on_one_node(sim: Sim, provider: RegionProvider) -> Node:
    """Node 1 boots, node 2 is refused for capacity; past ``rejoin_timeout_s`` the job
    starts on node 1 alone. Returns node 1."""
    n1 = await sim.launched(1)
    sim.boot(n1)
    await sim.until(lambda: provider.refused, what="us-east-1 out of capacity")
    sim.clock.advance(31)  # past rejoin_timeout_s: the job starts on min_nodes
    sim.sup.wake()
    await sim.until(lambda: n1.state is NodeState.RUNNING, what="job start on node 1")
    return n1


async def _moved_at_step_25(sim: Sim, n1: Node, a2: str, target: tuple[Node, ...], tmp_path: Path) -> None:
    """The target's nodes boot; the job, drained in AWS for the move, commits step 25
    there (the drain's request answered) and node 1's trainer exits."""
    for h in target:
        sim.boot(h)
    await sim.until(lambda: n1.state is NodeState.DRAINING, what="the job drained in AWS for the move")
    [drain] = [e for e in sim.events("checkpoint_requested") if e.data.get("why") == "migration"]
    _checkpoint(f"file://{tmp_path}/use1", 25, 1)
    sim.beat(n1, step=25)
    sim.commit(n1, a2, 25, ids=(drain.data["request_id"],), kinds=("interruption",))
    sim.exit(n1)


def _home_zone(tmp_path: Path, **migration: Any) -> dict[str, Any]:
    """:func:`_overrides` with a deadline spent by ``home_zone`` (and the on-demand offer
    a deadline needs)."""
    overrides = _overrides(tmp_path, **migration)
    overrides["job"].update({"target_steps": 3600, "deadline": 10.0, "step_s": 1.0, "deadline_policy": "home_zone"})
    overrides["pool"]["on_demand_fallback"] = True
    overrides["offers"].append({**overrides["offers"][0], "market": "on_demand"})
    return overrides


def test_offers_of_two_providers_without_domains_are_refused(tmp_path: Path) -> None:
    """Today's configs/multi-cloud.yaml shape (offers in AWS and Alibaba, no domains) made
    one job of both clouds; it is now refused with a line that says what to do."""
    path = tmp_path / "c.yaml"
    path.write_text("""
providers:
  aws: {image_id: ami-0123456789abcdef0}
  aliyun: {image_id: m-image, security_group_id: sg-1}
offers:
  - {provider: aws, region: us-east-1, instance_type: g5.12xlarge}
  - {provider: aliyun, region: cn-hangzhou, instance_type: ecs.gn7i-c32g1.32xlarge}
""")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    [line] = info.value.problems
    assert "2 placement domains (aws/us-east-1, aliyun/cn-hangzhou)" in line and "domains:" in line, line


async def test_replacements_come_from_the_jobs_domain_only(make_sim, tmp_path: Path) -> None:
    """AWS has capacity for one node of the two: the job runs on it alone, and Alibaba
    (cheaper or not, usable) is never asked for a replacement while the job stays: no
    node of the job's attempt is ever in another domain."""
    provider = RegionProvider({"us-east-1": 1})
    async with make_sim(provider=provider, **_overrides(tmp_path, enabled=False)) as sim:
        bad: list[str] = []
        _one_domain_in_the_job(sim, bad)
        await _training_on_one_node(sim, provider)
        for i in range(5):  # past every backoff and any patience: capacity never comes back
            sim.clock.advance(500)  # past the longest capacity backoff (300 s + 40 % jitter)
            sim.sup.wake()
            await sim.until(lambda: len(provider.refused) > i + 1, what="another launch attempt")
        regions = {sim.sup.domain_of(n) for n in sim.sup.nodes.values()}
        assert regions == {"aws-use1"}, regions
        assert not sim.events("migration_started")  # migration is off in this config
        assert bad == []


async def _starved_on_one_node(sim: Sim, provider: RegionProvider, tmp_path: Path) -> tuple[Node, str]:
    """The job runs on two AWS nodes; node 2 is noticed at step 10 (the survivor commits
    and resumes alone) and AWS has no capacity left; no move before ``patience_s`` (60 s),
    one after it. Returns (node 1, its attempt)."""
    n1, n2 = await sim.two_running()
    a1 = sim.start([n1, n2], step=0)
    sim.beat(n1, step=10)
    nid = sim.notice(n2)
    _checkpoint(f"file://{tmp_path}/use1", 10, 2)
    sim.commit(n1, a1, 10, ids=(nid,), kinds=("interruption",))
    sim.exit(n2)
    await sim.until(lambda: n2.state is NodeState.TERMINATED, what="node 2 released")
    a2 = sim.start([n1], step=10, resumed_from=10)
    await sim.until(lambda: provider.refused, what="no capacity for the replacement")
    await sim.until(lambda: sim.sup.migrator.starved_since is not None, what="AWS seen starved")
    sim.clock.advance(30)
    sim.sup.wake()
    await sim.until(lambda: sim.sup.migrator.starved_since is not None, what="still starved")
    assert not sim.events("migration_started")  # not before the patience
    sim.clock.advance(31)
    sim.sup.wake()
    sim.beat(n1, step=20)
    await sim.until(lambda: sim.events("migration_started"), what="migration started")
    return n1, a2


async def test_a_starved_domain_moves_the_whole_job(make_sim, tmp_path: Path) -> None:
    """The job runs on two AWS nodes; one gets a notice and AWS has no capacity left. After
    ``patience_s`` the job moves: Alibaba's pool is launched while the job trains on; then
    the job commits once in AWS, the checkpoint is copied and verified, the job starts in
    Alibaba from it, and AWS is released only after the first step there."""
    provider = RegionProvider({"us-east-1": 2})
    async with make_sim(provider=provider, **_overrides(tmp_path)) as sim:
        bad: list[str] = []
        _one_domain_in_the_job(sim, bad)
        n1, a2 = await _starved_on_one_node(sim, provider, tmp_path)
        [started] = sim.events("migration_started")
        assert (started.data["source"], started.data["target"], started.data["reason"]) == \
            ("aws-use1", "aliyun-hz", "capacity")
        # the target's pool boots while the job trains on in AWS
        h1, h2 = await sim.launched(4), await sim.launched(5)
        assert {sim.sup.domain_of(h1), sim.sup.domain_of(h2)} == {"aliyun-hz"}
        assert n1.state is NodeState.RUNNING
        await _moved_at_step_25(sim, n1, a2, (h1, h2), tmp_path)
        await sim.until(lambda: sim.events("checkpoint_replicated"), what="checkpoint copied")
        [copied] = sim.events("checkpoint_replicated")
        assert copied.data["step"] == 25 and copied.data["shards_copied"] == 1
        there = latest_committed(open_store(f"file://{tmp_path}/hz"))
        assert there is not None and there.step == 25 and there.data_position == {"consumed_samples": 300, "seed": 0}
        await sim.until(lambda: h1.state is NodeState.RUNNING and h2.state is NodeState.RUNNING,
                        what="the job starts in Alibaba")
        spec = sim.sup.job_spec(h1)
        assert "--rdzv-endpoint=172.16.0.10:29400" in spec["argv"]
        assert spec["argv"][spec["argv"].index("--checkpoint-uri") + 1] == f"file://{tmp_path}/hz"
        assert n1.state is NodeState.DRAINING  # held until the first step there
        a3 = sim.start([h1, h2], step=25, resumed_from=25)
        sim.beat(h1, step=26)
        sim._status(h1, "step", 26, attempt=a3)  # noqa: SLF001 (a progress line)
        sim.sup.job.step = 26  # what a heartbeat's step report does for the job
        sim.sup.wake()
        await sim.until(lambda: sim.events("migration_completed"), what="migration completed")
        await sim.until(lambda: n1.state is NodeState.TERMINATED, what="AWS released")
        [done] = sim.events("migration_completed")
        assert done.data["commit_step"] == 25 and n1.id in done.data["released"]
        for key in ("boot_s", "commit_s", "copy_s", "first_step_s", "decision_to_first_step_s"):
            assert done.data[key] is not None and done.data[key] >= 0, (key, done.data)
        assert sim.sup.status()["placement"]["domain"] == "aliyun-hz"
        assert sim.sup.job.state is JobState.RUNNING
        assert bad == []


async def test_a_move_whose_job_never_steps_in_the_target_is_stalled_there_after_boot_timeout_s(
        make_sim, tmp_path: Path) -> None:
    """The job switched to Alibaba and its trainers started there, but no step is ever
    recorded (in an HA trial one trainer died in the first round and the other's claim to
    rank 0 waited for its word). The move can do no more: up to ``boot_timeout_s`` after
    the copy it answers for the job (no stall), then the stall rules do: ``job_stalled``
    and the target's trainers restarted in place. One ``migration_slow_start`` line, not
    one per reconcile pass."""
    provider = RegionProvider({"us-east-1": 2})
    overrides = _overrides(tmp_path, boot_timeout_s=300)
    # no first step for 120 s would be a stall: the move's hold is what keeps it off until 300 s
    overrides["daemon"] = {"stall": {"first_step_s": 120, "floor_s": 60}}
    async with make_sim(provider=provider, **overrides) as sim:
        n1, a2 = await _starved_on_one_node(sim, provider, tmp_path)
        h1, h2 = await sim.launched(4), await sim.launched(5)
        await _moved_at_step_25(sim, n1, a2, (h1, h2), tmp_path)
        await sim.until(lambda: h1.state is NodeState.RUNNING and h2.state is NodeState.RUNNING,
                        what="the job starts in Alibaba")
        sim.exit(h2)  # its first round failed; h1's trainer runs on, and no step is recorded
        for _ in range(5):  # within boot_timeout_s of the copy: the move holds the job
            sim.clock.advance(55)
            await sim.sup.reconcile_once()  # a whole pass at this time, the stall check included
            assert sim.sup.migrator.holds_job() and not sim.events("job_stalled")
        sim.clock.advance(60)  # past it
        assert not sim.sup.migrator.holds_job()
        sim.sup.wake()
        await sim.until(lambda: sim.events("job_stalled"), what="the stall rules take the job back")
        [stalled] = sim.events("job_stalled")
        assert sim.sup.domain_of(h1) == "aliyun-hz" and stalled.data["restart"] == sorted([h1.id, h2.id]), \
            stalled.data


async def test_a_target_that_never_boots_gives_the_move_up_and_the_job_trains_on(make_sim, tmp_path) -> None:
    provider = RegionProvider({"us-east-1": 2})
    async with make_sim(provider=provider, **_overrides(tmp_path, boot_timeout_s=600)) as sim:
        n1, _ = await _starved_on_one_node(sim, provider, tmp_path)
        h1, h2 = await sim.launched(4), await sim.launched(5)  # launched, never register
        sim.clock.advance(601)
        sim.beat(n1, step=30)
        sim.sup.wake()
        await sim.until(lambda: sim.events("migration_failed"), what="migration given up")
        [failed] = sim.events("migration_failed")
        assert failed.data["reason"] == "boot_timeout" and failed.data["stays_in"] == "aws-use1"
        await sim.until(lambda: h1.state.is_terminal() and h2.state.is_terminal(), what="target released")
        assert n1.state is NodeState.RUNNING and sim.sup.job.state is JobState.RUNNING  # never drained
        assert sim.sup.domain == "aws-use1"
        assert not sim.events("checkpoint_replicated")


async def test_a_target_out_of_capacity_fails_the_move_at_once(make_sim, tmp_path) -> None:
    """Alibaba refuses the target's launches for capacity: the move is given up at once
    (target_out_of_capacity), not after boot_timeout_s, and the job never left AWS."""
    provider = RegionProvider({"us-east-1": 2, "cn-hangzhou": 0})
    async with make_sim(provider=provider, **_overrides(tmp_path, boot_timeout_s=3600)) as sim:
        n1, _ = await _starved_on_one_node(sim, provider, tmp_path)
        await sim.until(lambda: sim.events("migration_failed"), what="migration given up")
        [failed] = sim.events("migration_failed")
        assert failed.data["reason"] == "target_out_of_capacity" and failed.data["phase"] == "booting"
        assert failed.time - sim.events("migration_started")[0].time < 3600  # long before the boot timeout
        assert n1.state is NodeState.RUNNING and sim.sup.domain == "aws-use1"  # never drained
        # the availability record: Alibaba seen down at the refusal, then unwatched (the job
        # tries nothing there any more: a stale "down" must not condemn it for good)
        [*_, (t_down, down), (t_left, unwatched)] = sim.sup.migrator.availability.changes["aliyun-hz"]
        assert (down, unwatched) == (False, None) and t_left == failed.time >= t_down


async def test_a_failed_copy_never_starts_the_job_on_a_torn_checkpoint(make_sim, tmp_path) -> None:
    """The commit the job made for the move is not in the store (a trainer that reported a
    step it did not write): the copy refuses, the move fails, the target is released and
    the job starts again in its own domain from its newest commit there."""
    provider = RegionProvider({"us-east-1": 2})
    async with make_sim(provider=provider, **_overrides(tmp_path)) as sim:
        n1, a2 = await _starved_on_one_node(sim, provider, tmp_path)
        h1, h2 = await sim.launched(4), await sim.launched(5)
        sim.boot(h1)
        sim.boot(h2)
        await sim.until(lambda: n1.state is NodeState.DRAINING, what="drained for the move")
        [drain] = [e for e in sim.events("checkpoint_requested") if e.data.get("why") == "migration"]
        sim.commit(n1, a2, 25, ids=(drain.data["request_id"],), kinds=("interruption",))  # no step 25 written
        sim.exit(n1)
        await sim.until(lambda: sim.events("migration_failed"), what="migration failed")
        [failed] = sim.events("migration_failed")
        assert failed.data["phase"] == "copying" and failed.data["reason"].startswith("copy_failed"), failed.data
        await sim.until(lambda: all(n.state.is_terminal() for n in (n1, h1, h2)), what="both sides released")
        assert latest_committed(open_store(f"file://{tmp_path}/hz")) is None  # nothing torn to resume from
        assert sim.sup.domain == "aws-use1" and sim.sup.job.state is JobState.PENDING
        assert not sim.events("migration_completed")


async def test_a_daemon_restarted_mid_move_gives_it_up_and_the_job_stays(make_sim, tmp_path) -> None:
    """The daemon is restarted while the target boots (before the switch): the new daemon
    gives the move up (``daemon_restarted``), releases the target's nodes on its first
    pass and keeps the job, still training, in its domain; the store holds no move."""
    provider = RegionProvider({"us-east-1": 2})
    async with make_sim(provider=provider, **_overrides(tmp_path)) as sim:
        n1, _ = await _starved_on_one_node(sim, provider, tmp_path)
        h1, h2 = await sim.launched(4), await sim.launched(5)
        assert sim.store.get("migration")["phase"] == "booting"
    async with make_sim(provider=provider, **_overrides(tmp_path)) as sim:
        [failed] = sim.events("migration_failed")
        assert (failed.data["reason"], failed.data["phase"], failed.data["stays_in"]) == \
            ("daemon_restarted", "booting", "aws-use1")
        nodes = sim.sup.nodes
        await sim.until(lambda: nodes[h1.id].state.is_terminal() and nodes[h2.id].state.is_terminal(),
                        what="the target released")
        assert nodes[n1.id].state is NodeState.RUNNING and sim.sup.domain == "aws-use1"
        assert sim.sup.migrator.move is None and sim.store.get("migration") is None
        assert sim.sup.status()["placement"]["migrations_failed"] == 1


async def test_the_recovery_policy_decides_whether_to_move(make_sim, tmp_path: Path) -> None:
    """Which domain next is the registered policy's decision: one whose migrate() says stay
    keeps the job in its starved domain, however long."""
    from daemon.control.policies import Spotvisor

    class StayPut(Spotvisor):
        name = "stay_put_test"

        def migrate(self, s, domains, current, history, **kw):  # type: ignore[override]
            return None

    provider = RegionProvider({"us-east-1": 1})
    async with make_sim(provider=provider, **_overrides(tmp_path)) as sim:
        sim.sup.migrator.policy = StayPut()
        n1 = await sim.launched(1)
        sim.boot(n1)
        await sim.until(lambda: sim.sup.migrator.starved_since is not None, what="AWS seen starved")
        for i in range(3):
            sim.clock.advance(500)  # past the longest capacity backoff (300 s + 40 % jitter)
            sim.sup.wake()
            await sim.until(lambda: len(provider.refused) > i + 1, what="another launch attempt")
        assert not sim.events("migration_started")
        assert {sim.sup.domain_of(n) for n in sim.sup.nodes.values()} == {"aws-use1"}


class SpotShortProvider(ChaosProvider):
    """Spot capacity for ``spot`` nodes in all; on-demand always has capacity."""

    def __init__(self, spot: int) -> None:
        super().__init__()
        self.spot_left = spot

    async def launch(self, offer, node):  # type: ignore[override]
        if not offer.on_demand:
            if self.spot_left <= 0:
                self.refused.append(node.node_id)
                raise CapacityError(f"InsufficientInstanceCapacity: {offer.key} (test)")
            self.spot_left -= 1
        return await super().launch(offer, node)


async def test_a_job_behind_its_deadline_buys_on_demand_and_goes_back_to_spot_when_ahead(make_sim) -> None:
    """job.deadline: the daemon runs deadline_aware. Spot has room for one node of two. On
    the uniform line (at the start) the pool waits for spot; once the job is behind it by
    more than a start's worth, the
    missing node is bought on demand (market_changed); far ahead again, spot only, and the
    on-demand node is marked to be replaced by a spot one."""
    from daemon.control.deadline import SPOT_ONLY

    offer = {"provider": "aws", "region": "us-east-1", "zone": "us-east-1a", "instance_type": "p3.2xlarge"}
    provider = SpotShortProvider(spot=1)
    async with make_sim(provider=provider, pool={"on_demand_fallback": True},
                        job={"target_steps": 3600, "deadline": 4.0, "step_s": 1.0},
                        providers={"local": None, "aws": {"image_id": "ami-0123456789abcdef0"}},
                        offers=[offer, {**offer, "market": "on_demand"}]) as sim:
        assert sim.sup.policy.name == "deadline_aware"
        n1 = await sim.launched(1)
        await sim.until(lambda: provider.refused, what="no spot capacity for node 2")
        sim.sup.wake()
        await sim.until(lambda: sim.sup.placement.allowed == SPOT_ONLY, what="on the line: spot only")
        assert not [n for n in sim.sup.nodes.values() if n.market == "on_demand"]
        sim.boot(n1)
        await sim.until(lambda: sim.sup.first_ready_at is not None, what="node 1 ready")
        # the job starts on one node after rejoin_timeout_s, and makes no step: behind the line
        # by more than one start's worth (600 s = 600 steps here) after 4 h × 600 / 3600 s of work
        sim.clock.advance(2401)
        sim.beat(n1, trainer="not_started")
        sim.sup.wake()
        await sim.until(lambda: sim.events("market_changed"), what="market changed")
        [changed] = sim.events("market_changed")
        assert changed.data["old"] == ["spot"] and changed.data["new"] == ["on_demand", "spot"]
        await sim.until(lambda: any(n.market == "on_demand" for n in sim.sup.nodes.values()), what="on-demand")
        assert sim.sup.status()["placement"]["deadline"]["markets"] == ["on_demand", "spot"]
        await sim.until(lambda: n1.state is NodeState.RUNNING, what="job start")
        sim.start([n1], step=0)
        od = next(n for n in sim.sup.nodes.values() if n.market == "on_demand")
        await sim.until(lambda: od.state is NodeState.LAUNCHING, what="the on-demand instance launched")
        sim.boot(od)
        await sim.until(lambda: od.state in (NodeState.ADMITTING, NodeState.RUNNING), what="on-demand joins")
        if od.state is NodeState.ADMITTING:  # the grow's rejoin commit
            rid = sim.events("checkpoint_requested")[-1].data["request_id"]
            sim.commit(n1, "a1", 0, ids=(rid,), kinds=("rejoin",))
            await sim.until(lambda: od.state is NodeState.RUNNING, what="on-demand admitted")
        sim.beat(n1, step=3000)  # far ahead of the line now
        sim.sup.wake()
        await sim.until(lambda: len(sim.events("market_changed")) == 2, what="back to spot")
        assert sim.events("market_changed")[-1].data["new"] == ["spot"]
        await sim.until(lambda: od.replacing, what="the on-demand node marked for a spot replacement")


async def test_home_zone_waits_for_its_domain_on_the_slack_and_says_why(make_sim, tmp_path: Path) -> None:
    """``job.deadline_policy: home_zone``: AWS has room for one node of two and the
    deadline leaves hours of slack. Past the patience the job stays (no move), the feed
    gets one ``placement_waiting`` with its figures, and ``spotctl status`` says why; the
    availability record holds what the daemon saw of AWS (up at the launch, down at the
    refusal)."""
    from daemon.interfaces.ctl_render import _placement

    provider = RegionProvider({"us-east-1": 1})
    overrides = _home_zone(tmp_path)
    async with make_sim(provider=provider, **overrides) as sim:
        assert sim.sup.policy.name == "home_zone"
        n1 = await _training_on_one_node(sim, provider)
        sim.start([n1], step=0)
        sim.beat(n1, step=10)  # it has trained: AWS is its home now (before, a move would be free)
        await sim.until(lambda: sim.sup.migrator.starved_since is not None, what="AWS seen starved")
        for i in range(3):  # past the patience (60 s) and every backoff
            sim.clock.advance(500)
            sim.sup.wake()
            await sim.until(lambda: len(provider.refused) > i + 1, what="another launch attempt")
        assert not sim.events("migration_started")
        [waiting] = sim.events("placement_waiting")
        assert waiting.data["action"] == "wait" and waiting.data["home"] == "aws-use1"
        assert waiting.data["left_s"] > 1.2 * waiting.data["wait_s"]
        placement = sim.sup.status()["placement"]
        assert placement["placement"]["action"] == "wait"
        assert "wait: the slack covers aws-use1's outage" in _placement(placement)
        assert sim.sup.migrator.availability.is_up("aws-use1") is False
        assert sim.sup.migrator.availability.runs("aws-use1", sim.clock()).up  # up, then down
        # the providers' stock, asked with the prices: Alibaba in stock, though never launched in
        assert sim.sup.fleet.probe_stock and sim.sup.migrator.availability.is_up("aliyun-hz") is True
        assert not [n for n in sim.sup.nodes.values() if sim.sup.domain_of(n) == "aliyun-hz"]
        seen = sim.sup.migrator.availability.changes["aws-use1"]
    async with make_sim(provider=provider, **overrides) as sim:  # the daemon restarted
        # the record is rebuilt from the store's events: AWS up at the launch, down at the refusal
        # (the stock answers are not events: a restarted daemon asks again)
        after = sim.sup.migrator.availability.changes["aws-use1"]
        assert [up for _, up in after[:2]] == [True, False] and after[1] == seen[1]


async def test_home_zone_leaves_a_starved_domain_at_once_before_the_job_trained(make_sim, tmp_path: Path) -> None:
    """The same, but the job has not trained a step: the home is only where it started
    and a move copies nothing, so the job moves to Alibaba (in stock, as the provider
    says) at once, without waiting out the patience."""
    provider = RegionProvider({"us-east-1": 1})
    async with make_sim(provider=provider, **_home_zone(tmp_path, patience_s=3600)) as sim:
        n1 = await sim.launched(1)
        sim.boot(n1)
        await sim.until(lambda: provider.refused, what="us-east-1 out of capacity")
        sim.sup.wake()
        await sim.until(lambda: sim.events("migration_started"), what="the move")
        [started] = sim.events("migration_started")
        assert (started.data["source"], started.data["target"], started.data["reason"]) == \
            ("aws-use1", "aliyun-hz", "home_out")
        assert "before the job trained" in started.data["decision"]


async def test_home_zone_leaves_at_once_where_another_pool_saw_long_outages(
        make_sim, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The waiting case above, with ``daemon.market_dir`` holding another pool's record of
    the same AWS market (daemon/controlnode/market_memory.py): its outages there lasted
    20 h each, in the 48 h before this pool started. The job has trained and AWS refuses
    again: the outage is expected to outlast the 10 h deadline, so the job moves to
    Alibaba at once, where the blind pool waited. Every share period the pool writes its
    own record (what it saw of AWS, not what it took) for the next pool."""
    from daemon.controlnode import capacity_record
    from daemon.interfaces.ctl_render import _placement

    monkeypatch.setattr(capacity_record, "SHARE_S", 0.01)
    market = tmp_path / "market"
    market.mkdir(mode=0o700)
    t0 = time.time()
    (market / "other.json").write_text(json.dumps({"version": 1, "pool": "other", "written_at": t0 - 60, "markets": {
        "aws/us-east-1/-/us-east-1a:g5.12xlarge": [[t0 - 46 * H, False], [t0 - 26 * H, True], [t0 - 25 * H, False],
                                                   [t0 - 5 * H, True]]}}))
    os.chmod(market / "other.json", 0o600)
    provider = RegionProvider({"us-east-1": 1})
    overrides = _home_zone(tmp_path)
    overrides["daemon"] = {**overrides.get("daemon", {}), "market_dir": str(market)}
    async with make_sim(provider=provider, **overrides) as sim:
        n1 = await _training_on_one_node(sim, provider)
        sim.start([n1], step=0)
        sim.beat(n1, step=10)
        await sim.until(lambda: sim.sup.migrator.starved_since is not None, what="AWS seen starved")
        for i in range(3):
            if sim.events("migration_started"):
                break
            sim.clock.advance(500)
            sim.sup.wake()
            await sim.until(lambda: len(provider.refused) > i + 1 or sim.events("migration_started"), what="a pass")
        [started] = sim.events("migration_started")
        assert (started.data["source"], started.data["target"]) == ("aws-use1", "aliyun-hz"), started.data
        assert not sim.events("placement_waiting")
        assert sim.sup.migrator.availability.changes["aws-use1"][0][0] >= t0  # its own: nothing taken in
        placement = sim.sup.status()["placement"]
        assert placement["market_past"] == 1
        assert "with the past of 1 other pool (daemon.market_dir)" in _placement(placement)
        await sim.until(lambda: (market / "chaos.json").exists(), what="its own record written")
        written = json.loads((market / "chaos.json").read_text())["markets"]["aws/us-east-1/-/us-east-1a:g5.12xlarge"]
        assert written[0][0] >= t0 and [up for _, up in written[:2]] == [True, False]
