"""Fenced admissions (issue 29): what a daemon tells an agent (a start, an admission, a
command) follows only from state committed under its fence.

``EtcdStore.durable`` on the real 3-member etcd cluster (tests/etcd_cluster.py): the
agent API awaits it before every reply (``daemon/interfaces/api.py``; the API side is in
``tests/test_agent_api.py``). It commits what the reply follows from through the fenced
txn, refuses once the daemon is deposed, and costs no txn when nothing is pending.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon.controlnode.store import NotLeading  # noqa: E402
from daemon.ha.fence import Fence  # noqa: E402
from daemon.ha.store import EtcdStore  # noqa: E402
from etcd_cluster import etcd_cluster  # noqa: E402,F401  (fixture)
from test_ha_store import _Frozen, _leading, _node  # noqa: E402


async def test_a_reply_follows_only_from_committed_state_and_a_deposed_leader_tells_nothing(clients) -> None:
    a_client, b_client, admin = clients(), clients(), clients()
    a = await _leading(a_client, "a", clock=_Frozen())  # its own clock never shuts it: only etcd's fence can
    store = EtcdStore(Fence(a)).open()
    await store.load()
    store.put_node(_node(1))
    store.append_event("node_admitted", "p-1", {})
    await store.durable()  # before the node is told to start: the admission is where a successor reads it
    assert (await admin.get(b"/spotvisor/p/seq")).value == b"1"
    assert (await admin.get(b"/spotvisor/p/nodes/p-1")) is not None

    await admin.revoke_lease(a.lease_id)  # deposed behind its back
    store.put_node(_node(2))
    store.append_event("node_admitted", "p-2", {})
    with pytest.raises(NotLeading):
        await store.durable()  # the agent API answers 503: p-2 is never told to start
    await a.aclose()
    b = await _leading(b_client, "b")
    try:
        new = EtcdStore(Fence(b)).open()
        await new.load()
        assert [n.id for n in new.nodes()] == ["p-1"] and [e.node for e in new.events()] == ["p-1"]
    finally:
        await b.aclose()


async def test_a_reply_with_nothing_pending_costs_no_txn_and_still_asks_the_clock_gate(clients) -> None:
    a = await _leading(clients(), "a")
    store = EtcdStore(Fence(a)).open()
    await store.load()
    txns = 0
    commit = store.fence.commit

    async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal txns
        txns += 1
        return await commit(*args, **kwargs)

    store.fence.commit = counted  # type: ignore[method-assign]
    store.append_event("node_admitted", "p-1", {})
    await store.durable()
    await store.durable()  # a heartbeat that changed nothing: etcd is not asked again
    assert txns == 1
    await a.aclose()  # steps down: its clock gate shuts at once
    with pytest.raises(NotLeading):
        await store.durable()
    assert txns == 1
