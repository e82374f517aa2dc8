"""daemon.ha.store on the real 3-member etcd cluster: the pool state a new leader reads,
written only under the writer's fence, and the provider gate before the cloud."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon.control import leadership as ld  # noqa: E402
from daemon.ha.client import EtcdClient  # noqa: E402
from daemon.ha.elector import Elector  # noqa: E402
from daemon.ha.fence import Deposed, Fence  # noqa: E402
from daemon.ha.store import MAX_OPS_PER_TXN, EtcdStore, FencedProvider  # noqa: E402
from daemon.model import Node, NodeState  # noqa: E402
from etcd_cluster import etcd_cluster  # noqa: E402,F401  (fixture)

CFG = ld.LeaderConfig(ttl_s=5.0)


class _Frozen:
    def __call__(self) -> float:
        return 1000.0


async def _leading(client: EtcdClient, name: str, **kw) -> Elector:
    """An elector for pool ``p``, once it may act (waits on its ``changed`` event)."""
    e = Elector(client, pool="p", name=name, cfg=CFG, **kw).start()
    async with asyncio.timeout(15):
        while True:
            e.changed.clear()
            if e.may_act():
                return e
            await e.changed.wait()


def _node(i: int) -> Node:
    return Node(id=f"p-{i}", ordinal=i, provider="aws", market="spot", region="r", zone="z",
                instance_type="t", gpus=1, price_usd_h=1.0, token="tok", created_at=1.0)


class _Counting:
    """A provider that counts what reaches it."""

    name = "counting"

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def launch(self, offer, node):
        self.calls.append(f"launch {node}")

    async def terminate(self, instance_id: str) -> None:
        self.calls.append(f"terminate {instance_id}")


async def test_a_new_leader_reads_the_nodes_values_and_events_in_order(clients, tmp_path: Path) -> None:
    a_client, b_client = clients(), clients()
    a = await _leading(a_client, "a")
    store = EtcdStore(Fence(a)).open()
    await store.load()
    store.set("target_nodes", 3)
    store.set("run_nonce", "abcd")
    for i in range(1, 4):
        store.put_node(_node(i))
        store.append_event("node_launch_requested", f"p-{i}", {"offer": "x"})
    store.set_node_state(store.node("p-1"), NodeState.LAUNCHING)
    for i in range(2 * MAX_OPS_PER_TXN):  # more than one txn's worth
        store.append_event("heartbeat", None, {"i": i})
    moved: list[int] = []
    store.on_durable(lambda: moved.append(store.durable_seq()))
    assert store.durable_seq() == 0  # in the mirror only: the feed sends none of it yet
    await store.sync()
    assert store.pending == 0
    before = store.events()
    assert store.durable_seq() == before[-1].seq and moved[-1] == before[-1].seq
    await a.aclose()  # a goes (revokes its lease); b takes over and reads
    b = await _leading(b_client, "b")
    try:
        stale = tmp_path / "mirror.db"
        old = EtcdStore(Fence(b), mirror=stale).open()
        old.set("target_nodes", 99)  # a previous run's file: emptied at open, never read
        old.append_event("stale", None, {})
        old.close()
        new = EtcdStore(Fence(b), mirror=stale).open()
        await new.load()
        sibling = new.open_sibling()  # the feed's thread reads the mirror file
        assert sibling.events() == before
        sibling.close()
        assert new.get("target_nodes") == 3 and new.get("run_nonce") == "abcd"
        assert [n.id for n in new.nodes()] == ["p-1", "p-2", "p-3"]
        assert new.node("p-1").state is NodeState.LAUNCHING
        assert new.events() == before
        assert [e.seq for e in before] == list(range(1, len(before) + 1))
        assert new.durable_seq() == before[-1].seq  # what it read from etcd is durable
        ev = new.append_event("leader_changed", None, {"to": "b"})
        assert ev.seq == before[-1].seq + 1  # the counter goes on
        assert new.durable_seq() == before[-1].seq
        await new.sync()
        assert new.durable_seq() == ev.seq
    finally:
        await b.aclose()


async def test_a_deposed_leaders_writes_never_land_and_its_provider_is_not_called(clients) -> None:
    a_client, b_client, admin = clients(), clients(), clients()
    a = await _leading(a_client, "a", clock=_Frozen())  # believes it leads whatever happens
    store = EtcdStore(Fence(a)).open()
    await store.load()
    cloud = _Counting()
    provider = FencedProvider(cloud, store)  # type: ignore[arg-type]
    store.put_node(_node(1))
    store.append_event("node_launch_requested", "p-1", {})
    await provider.launch("offer", "p-1")
    assert cloud.calls == ["launch p-1"]
    await admin.revoke_lease(a.lease_id)  # deposed behind its back
    store.put_node(_node(2))
    store.append_event("node_launch_requested", "p-2", {})
    with pytest.raises(Deposed):
        await provider.launch("offer", "p-2")
    with pytest.raises(Deposed):
        await provider.terminate("i-1")
    assert cloud.calls == ["launch p-1"]  # the cloud never heard of the deposed leader's decisions
    with pytest.raises(Deposed):
        store.set("target_nodes", 9)  # and its store takes no more writes
    await a.aclose()
    b = await _leading(b_client, "b")
    try:
        new = EtcdStore(Fence(b)).open()
        await new.load()
        assert [n.id for n in new.nodes()] == ["p-1"]
        assert [e.node for e in new.events()] == ["p-1"]
    finally:
        await b.aclose()


async def test_the_background_flush_commits_without_a_provider_call(clients) -> None:
    client = clients()
    a = await _leading(client, "a")
    store = EtcdStore(Fence(a), flush_every_s=0.05).open()
    await store.load()
    store.start()
    try:
        watch = await client.watch(b"/spotvisor/p/seq")  # the flush's put, seen by etcd's watch
        try:
            store.append_event("x", None, {})
            async with asyncio.timeout(10):
                async for event in watch:
                    assert event.kind == "PUT" and event.kv.value == b"1"
                    break
        finally:
            await watch.cancel()
    finally:
        await store.aclose()
        await a.aclose()


async def test_a_flush_on_the_wire_at_close_loses_none_of_the_last_writes(clients, monkeypatch) -> None:
    """The daemon exits (its last event, ``pool_released``, just written) while the
    background flush's txn is on the wire: etcd applied it, its answer has not come. The
    close lets that flush finish, then commits the rest: both events in etcd. (Cancelled
    halfway, the flush left the store's view of the seq key stale, the close's sync was
    refused as if deposed and the last event never reached etcd: found by
    bench/ha_job_trials.py, seed 29 trial 6.)"""
    client = clients()
    a = await _leading(client, "a")
    fence = Fence(a)
    store = EtcdStore(fence, flush_every_s=0.05).open()
    await store.load()
    applied, answer = asyncio.Event(), asyncio.Event()
    commit = fence.commit

    async def late_answer(ops, **kw):
        answers = await commit(ops, **kw)  # applied by etcd
        if not applied.is_set():
            applied.set()
            await answer.wait()  # the reply still on its way back
        return answers

    monkeypatch.setattr(fence, "commit", late_answer)
    store.start()
    try:
        store.append_event("node_terminated", "p-1", {})
        async with asyncio.timeout(10):
            await applied.wait()
        store.append_event("pool_released", None, {})
        closing = asyncio.create_task(store.aclose())
        async with asyncio.timeout(10):
            while store._flusher is not None:  # the close has begun: it took the flusher
                await asyncio.sleep(0)
        # the premise: the close waits on the lock the flush holds with its txn on the wire
        assert store._lock.locked() and not closing.done()
        answer.set()
        async with asyncio.timeout(10):
            await closing
        seq = await client.get(b"/spotvisor/p/seq")
        assert seq is not None and seq.value == b"2"
        kinds = [json.loads(kv.value)["kind"] for kv in await client.get_prefix(b"/spotvisor/p/events/")]
        assert sorted(kinds) == ["node_terminated", "pool_released"]
    finally:
        await a.aclose()


async def test_the_leader_keeps_its_fence_and_commits_when_the_etcd_raft_leader_is_killed(clients, etcd_cluster) -> None:
    """One member of three down (kill -9 of the one that leads raft: the worst of the three)
    is survived: the daemon keeps leading with the same fence, its commits go on."""
    a = await _leading(clients(), "a")
    fence = a.fence
    store = EtcdStore(Fence(a)).open()
    await store.load()
    try:
        store.append_event("before", None, {})
        await store.sync()
        await asyncio.to_thread(etcd_cluster.kill, await asyncio.to_thread(etcd_cluster.raft_leader))
        store.append_event("after", None, {})
        async with asyncio.timeout(CFG.ttl_s):
            while True:
                try:
                    await store.sync()
                    break
                except Deposed:
                    raise
                except Exception:  # noqa: BLE001  the raft election: unavailable for a moment
                    await asyncio.sleep(0.05)
        assert a.may_act() and a.fence == fence
        assert (await clients().get(b"/spotvisor/p/seq")).value == b"2"
    finally:
        await store.aclose()
        await a.aclose()


async def test_the_event_log_in_etcd_is_trimmed_and_a_new_leader_keeps_what_it_reads_back(clients) -> None:
    """500 events, most of them noise (trainer exits), some of the kinds the daemon reads
    over the whole history: etcd keeps the newest ``keep_events`` and every kept-kind event,
    and a new leader's store (read in pages of 7 keys) holds exactly that, seq going on."""
    from daemon.ha.store import KEPT_KINDS

    a_client, b_client = clients(), clients()
    a = await _leading(a_client, "a")
    store = EtcdStore(Fence(a), keep_events=50, trim_every=20).open()
    await store.load()
    kept_written = []
    for i in range(1, 501):
        kind = "checkpoint_committed" if i % 40 == 0 else "job_resumed" if i % 97 == 0 else "trainer_exited"
        ev = store.append_event(kind, "p-1", {"step": i, "attempt": f"r{i}"})
        if kind in KEPT_KINDS:
            kept_written.append(ev.seq)
        if i % 150 == 0:
            await store.sync()
    await store.sync()
    stored = await a_client.get_prefix(b"/spotvisor/p/events/")
    seqs = sorted(int(kv.key.rsplit(b"/", 1)[1]) for kv in stored)
    assert set(kept_written) <= set(seqs)  # what a new leader reads back: all of it
    noise = [s for s in seqs if s not in kept_written]
    assert len(noise) <= 50 + 20 and noise[-1] == 500  # the newest 50 (and the trim's slack), not 480
    assert [e.seq for e in store.events()] == seqs  # the mirror agrees
    before = store.events()
    await a.aclose()
    b = await _leading(b_client, "b")
    try:
        pages: list[int] = []
        real = b_client.range_page

        async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            page = await real(*args, **kwargs)
            pages.append(len(page.kvs))
            return page

        b_client.range_page = counted  # type: ignore[method-assign]
        new = EtcdStore(Fence(b), page_keys=7).open()
        await new.load()
        assert max(pages) == 7 and sum(pages) == len(seqs) + 2 and len(pages) >= (len(seqs) + 2) // 7  # + seq, leader
        assert new.events() == before
        assert [e.data["step"] for e in new.events(kinds=["checkpoint_committed"])] == list(range(40, 501, 40))
        assert new.append_event("leader_changed", None, {}).seq == 501
        await new.sync()
    finally:
        await b.aclose()


def test_the_trim_cutoff_leaves_the_newest_events() -> None:
    from daemon.ha.store import trim_cutoff

    assert trim_cutoff(100, 10_000) == 0
    assert trim_cutoff(10_500, 10_000) == 500


async def test_a_store_loaded_in_one_term_writes_nothing_in_the_next(clients) -> None:
    """a leads, loads its store, loses its key (revoked) and leads again with a new fence
    (nobody else campaigns): the old store, whose mirror may lack what another leader
    wrote meanwhile, commits nothing and its provider is not called."""
    a_client, admin = clients(), clients()
    a = await _leading(a_client, "a")
    try:
        store = EtcdStore(Fence(a)).open()
        await store.load()
        cloud = _Counting()
        provider = FencedProvider(cloud, store)  # type: ignore[arg-type]
        first = a.fence
        await admin.revoke_lease(a.lease_id)
        async with asyncio.timeout(15):  # a's watch sees its key go; it starts over and wins again
            while a.fence in (None, first) or not a.may_act():
                a.changed.clear()
                if a.fence not in (None, first) and a.may_act():
                    break
                await a.changed.wait()
        store.put_node(_node(1))
        with pytest.raises(Deposed, match="loaded under fence"):
            await provider.launch("offer", "p-1")
        assert cloud.calls == []
        assert await a_client.get(b"/spotvisor/p/nodes/p-1") is None
    finally:
        await a.aclose()


@pytest.mark.parametrize("kind", ["aws", "aliyun", "local"])
def test_a_fenced_provider_has_its_inner_providers_traits(kind: str, tmp_path: Path) -> None:
    """Every trait the daemon reads off a provider (Provider's class attributes: does it
    install the agent from the wheel, how long its listing lags, is its launch idempotent)
    is the inner provider's, not Provider's default."""
    from daemon.config import AliyunProviderSpec, AwsProviderSpec, LocalProviderSpec
    from daemon.providers.base import Provider, create_provider

    spec = {"aws": AwsProviderSpec(image_id="ami-12345678"), "aliyun": AliyunProviderSpec(image_id="m-123"),
            "local": LocalProviderSpec()}[kind]
    inner = create_provider(kind, spec=spec, state_dir=tmp_path)
    fenced = FencedProvider(inner, None)  # type: ignore[arg-type]
    traits = [k for k, v in vars(Provider).items() if not k.startswith("_") and isinstance(v, (bool, int, float, str))]
    assert {"installs_agent", "listing_lag_s", "idempotent_launch"} <= set(traits)
    assert {t: getattr(fenced, t) for t in traits} == {t: getattr(inner, t) for t in traits}
