"""A leader cut off from etcd (issue 29's ``partition_leader``): it cannot learn that it was
deposed, so its own clock must stop it.

Two real ``spotvisord run`` on one HA config (tests/test_ha_daemon.py's pair), a real
3-member etcd cluster, EC2 as moto behind ``AwsFaultProxy``. control-a reaches etcd only
through :class:`daemon.ha.partition.Partition`, TCP forwarders on loopback; ``cut()`` resets every
connection through them and refuses new ones, as a network partition between the leader and
etcd would (the cloud and the operator still reach a). Every wait is on a condition with a
deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any

import pytest
import yaml

from fakes.aws_faults import AwsFaultProxy
from daemon.ha.partition import Partition
from etcd_cluster import etcd_cluster  # noqa: F401  (fixture)
from bench.ha_harness import instances, per_node, until
from test_ha_daemon import _launched_n, ha_pair  # noqa: F401  (ha_pair: fixture)

pytestmark = pytest.mark.slow


async def test_a_leader_cut_off_from_etcd_stops_on_its_own_clock_and_buys_nothing(
        ha_pair: dict[str, Any], faults: AwsFaultProxy) -> None:  # noqa: F811
    """control-a leads through the partition and buys its node; control-b stands by. The
    partition is cut, and control-a is told at once to scale to 2 (its operator still
    reaches it): it buys nothing (no fenced commit can reach etcd), stops once its lease
    has run out by its own clock, and exits 1 saying why. control-b leads within 10 s
    with a's one node and the target etcd last had (1): one instance per node, one
    RunInstances in all."""
    a, b, pool = ha_pair["a"], ha_pair["b"], ha_pair["pool"]
    raw = yaml.safe_load(a.config.read_text())
    partition = await Partition(raw["ha"]["endpoints"]).start()
    raw["ha"]["endpoints"] = partition.endpoints
    a.config.write_text(yaml.safe_dump(raw))
    try:
        await a.start()
        await until(lambda: _launched_n(a, 1), "control-a's node launched", daemons=(a,))
        await b.start()
        await until(lambda: "standby: control-a leads" in b.log.read_text(), "control-b's standby line",
                    daemons=(a, b))
        assert len(faults.actions("RunInstances")) == 1
        partition.cut()
        cut_at = time.monotonic()
        with contextlib.suppress(AssertionError, OSError):
            await a.scale(2)  # it may already refuse: its store cannot commit
        assert a.proc is not None
        assert await asyncio.wait_for(a.proc.wait(), 15) == 1
        stopped_s = time.monotonic() - cut_at
        lines = [line for line in a.log.read_text().splitlines() if line.startswith("spotvisord run:")]
        assert len(lines) == 1 and "control-a lost the leadership" in lines[0], lines
        # cut off from etcd, no request is answered: the lease ran out on its own clock
        assert "no keepalive answered in time" in lines[0] or "etcd no longer knows the lease" in lines[0], lines
        status = await until(b.status, "control-b leading", timeout_s=max(1.0, 10 - stopped_s), daemons=(b,))
        led_s = time.monotonic() - cut_at
        assert [n["id"] for n in status["nodes"]] == [f"{pool}-1"]
        assert status["pool"]["target_nodes"] == 1  # a's scale never reached etcd
        await until(lambda: _launched_n(b, 1), "control-b adopted the node", daemons=(b,))
        assert len(faults.actions("RunInstances")) == 1
        assert per_node(instances(ha_pair["ec2"], pool)) == {f"{pool}-1": 1}
        print(f"partition: control-a stopped {stopped_s:.2f} s and control-b led {led_s:.2f} s after the cut "
              f"(lease {raw['ha']['lease_s']} s)")
    finally:
        if b.alive():
            assert b.proc is not None
            b.proc.send_signal(signal.SIGTERM)
        await partition.close()
