"""Chaos cell: the webhook sink is down for the whole run, a daemon restart included.

A whole job's life goes through the real Supervisor and the real feed
(:class:`daemon.feed.notify.Notifier`, one signed webhook sink): launch, start, a periodic
commit, an interruption notice, the notice's commit, the node leaving, the daemon
stopped and started again (the sink still down), the replacement admitted, the job
completed, the pool released. The receiver (``test_notify.Receiver``) refuses every
connection all along. Then it comes back: every stored event arrives, in order, in
batches (a few requests for the whole backlog), each event once, except those of
a batch sent again.
"""

from __future__ import annotations

import threading

import pytest

from chaos.conftest import Matrix, lost_events
from daemon.model import NodeState
from daemon.feed.notify import FEED_THREAD
from test_notify import ENV, Receiver, batches_in_order

pytestmark = pytest.mark.chaos


async def test_webhook_down_for_the_whole_run_gets_every_event_when_it_returns(make_sim, matrix: Matrix) -> None:
    rx = await Receiver().start()
    await rx.down()  # before the daemon's first event: down for the whole run
    sink = {"name": "ops", "type": "webhook", "url": rx.url(), "secret_env": "SV_TEST_KEY",
            "timeout_s": 2, "max_backoff_s": 0.05}
    kw = {"pool": {"target_nodes": 1}, "notify": [sink], "notify_environ": ENV}
    seen = []
    try:
        async with make_sim(**kw) as sim:  # first daemon
            n1 = await sim.launched(1)
            sim.boot(n1)
            await sim.until(lambda: n1.state is NodeState.RUNNING, what="job start")
            a1 = sim.start([n1], step=0)
            sim.beat(n1, step=10)
            sim.commit(n1, a1, 10, reason="periodic")
            sim.beat(n1, step=20)
            nid = sim.notice(n1)
            await sim.launched(2)  # its replacement
            sim.commit(n1, a1, 20, ids=(nid,), kinds=("interruption",))
            sim.exit(n1)
            await sim.until(lambda: n1.state is NodeState.TERMINATED, what="node 1 released")
            await sim.notifier.wait_until(lambda: sim.notifier.stats("ops").failed_attempts >= 5, 10)
            assert sim.notifier.stats("ops").delivered == 0
            seen += sim.seen
            provider = sim.provider

        async with make_sim(provider=provider, **kw) as sim:  # the daemon restarted; the sink still down
            n2 = sim.node(2)
            sim.boot(n2)
            await sim.until(lambda: n2.state is NodeState.RUNNING, what="replacement admitted")
            a2 = sim.start([n2], step=20, resumed_from=20)
            sim.beat(n2, step=100)
            sim.commit(n2, a2, 100, reason="final")
            sim.complete(n2, a2, 100)
            await sim.until(lambda: sim.sup._released.is_set(), what="pool released")
            # this daemon's own first attempt on the sink (it starts with the events of the first)
            await sim.notifier.wait_until(lambda: sim.notifier.stats("ops").failed_attempts >= 1, 10)
            assert sim.notifier.stats("ops").delivered == 0 and sim.notifier.stats("ops").failing
            seen += sim.seen

            await rx.up()  # the sink returns
            assert await sim.notifier.drain(20.0), sim.notifier.stats("ops")
            stored = sim.store.events()
            leaked = len(sim.provider.live())
    finally:
        await rx.aclose()

    got = rx.seqs()
    delivered = list(dict.fromkeys(got))
    undelivered = len({e.seq for e in stored} - set(delivered))
    bodies = {e["seq"]: e for e in rx.events()}
    wrong = sum(1 for e in stored if e.seq in bodies and (bodies[e.seq]["kind"], bodies[e.seq]["data"]) != (e.kind, e.data))
    row = matrix.row("webhook sink down for the whole run (+ daemon restart)",
                     job_completed=any(e.kind == "job_completed" for e in stored),
                     lost_checkpoints=len({10, 20, 100} - {e.data["step"] for e in stored
                                                           if e.kind == "checkpoint_committed"}),
                     leaked_instances=leaked, lost_events=lost_events(stored, seen) + undelivered + wrong)
    assert row.clean(), row
    assert delivered == [e.seq for e in stored]  # every event, in order
    assert batches_in_order(rx.requests)  # only a batch sent again repeats events, and never a gap
    assert len(rx.accepted()) <= -(-len(stored) // 100) + 1  # the backlog in batches of max_batch (100)
    assert stored[-1].kind == "pool_released"
    assert not [t for t in threading.enumerate() if t.name == FEED_THREAD]  # both daemons' feeds joined
