"""When a launch a daemon died in is sent again under its client token
(daemon/control/launch_replay.py): only byte for byte, only where the cloud honours the
token, and only while the node could still boot from what it was sent.

The fleet's use of the decision is the last test here; the flow against EC2's protocol (a
RunInstances held on the wire at a SIGKILL, or a landed instance the listing leaves out;
the new daemon's replay, answered with the one instance) is
tests/chaos/test_daemon_kill.py::test_daemon_sigkill_mid_launch.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.control.launch_replay import NOT_SENT, REPLAY_MARGIN_S, replay_refusal, sent

URLS = "https://10.0.0.10:8443,https://10.0.0.11:8443"
WHEEL = {"url": "https://bucket.s3.amazonaws.com/agent.whl?X-Amz-Signature=abc", "sha256": "0" * 64, "version": "1.0"}
NOW = 1_000_000.0


def _refusal(call, now=NOW, *, idempotent=True, offer_known=True, daemon_url=URLS, ca_sha256="ca1"):
    return replay_refusal(call, now, idempotent=idempotent, offer_known=offer_known, daemon_url=daemon_url,
                          ca_sha256=ca_sha256)


@pytest.mark.parametrize(("case", "call", "kw", "why"), [
    ("a sent call, nothing changed", sent(URLS, "ca1", WHEEL, NOW + 780), {}, None),
    # a new HA leader lists itself first: the same control nodes, another order
    ("sent by the other leader", sent("https://10.0.0.11:8443/,https://10.0.0.10:8443", "ca1", WHEEL, NOW + 780),
     {}, None),
    ("never sent: its first call", dict(NOT_SENT), {}, None),
    ("no wheel (the image has the agent)", sent(URLS, None, None, None), {"ca_sha256": None}, None),
    ("the local provider", sent(URLS, "ca1", WHEEL, NOW + 780), {"idempotent": False}, "no client token"),
    # the daemon died before it called the provider (fetching the agent's wheel): nothing to repeat
    ("never sent, the local provider", dict(NOT_SENT), {"idempotent": False}, None),
    ("its offer left the config", sent(URLS, "ca1", WHEEL, NOW + 780), {"offer_known": False}, "no longer in the config"),
    ("a row from before the record", None, {}, "was not recorded"),
    ("another control node since", sent(URLS, "ca1", WHEEL, NOW + 780), {"daemon_url": "https://10.0.0.12:8443"},
     "agent URLs changed"),
    ("another CA since", sent(URLS, "ca1", WHEEL, NOW + 780), {"ca_sha256": "ca2"}, "CA changed"),
    ("TLS since", sent(URLS, None, WHEEL, NOW + 780), {}, "CA changed"),
    ("the URL about to expire", sent(URLS, "ca1", WHEEL, NOW + REPLAY_MARGIN_S - 1), {}, "expires in under 300 s"),
    ("the URL expired", sent(URLS, "ca1", WHEEL, NOW - 5), {}, "expires in under"),
])
def test_a_launch_is_sent_again_only_byte_for_byte_and_while_the_node_could_boot(case, call, kw, why) -> None:
    got = _refusal(call, **kw)
    if why is None:
        assert got is None, case
    else:
        assert got is not None and why in got, (case, got)


@given(st.booleans(), st.booleans(), st.sampled_from(["sent", "not_sent", "none"]),
       st.sampled_from([URLS, "https://10.0.0.11:8443,https://10.0.0.10:8443", "https://10.0.0.12:8443"]),
       st.sampled_from(["ca1", "ca2", None]), st.floats(-1000, 2000))
def test_a_replay_never_goes_out_with_other_parameters_or_without_a_token(
        idempotent: bool, offer_known: bool, kind: str, daemon_url: str, ca: str | None, left_s: float) -> None:
    call = {"sent": sent(URLS, "ca1", WHEEL, NOW + left_s), "not_sent": dict(NOT_SENT), "none": None}[kind]
    got = _refusal(call, idempotent=idempotent, offer_known=offer_known, daemon_url=daemon_url, ca_sha256=ca)
    if got is None:  # a first call (any provider), or the same parameters under a token the cloud honours
        assert offer_known and call is not None
        if kind == "sent":
            assert idempotent and set(daemon_url.split(",")) == set(URLS.split(",")) and ca == "ca1"
            assert left_s >= REPLAY_MARGIN_S
    else:
        assert isinstance(got, str) and got


async def test_the_next_daemon_replays_what_it_may_and_gives_up_the_rest(spot_daemon) -> None:
    """What ``Fleet.settle_unowned`` does with nodes a dead daemon left ``requested`` and no
    listing shows (the daemon's own fleet and store; a provider that records each call):
    a call never sent is made now, on any provider; a sent one is sent again with the
    parameters it was recorded with on a provider with tokens, and given up on one without."""
    from daemon.controlnode.launch_calls import agent_urls
    from daemon.model import Node, NodeState

    h = spot_daemon
    sup, fleet = h.sup, h.sup.fleet
    await h.until(lambda: h.provider.launched, what="the pool's own first node")
    offer = fleet.book.offer(0)
    recorded = sent(agent_urls(sup), None, WHEEL, time.time() + 780)

    def requested(ordinal: int, call: dict | None) -> Node:
        node = Node(id=f"test-{ordinal}", ordinal=ordinal, provider=offer.provider, region=offer.region,
                    zone=offer.zone, instance_type=offer.instance_type, gpus=offer.gpus_per_node, price_usd_h=0.5,
                    token=f"tok-{ordinal}", market="on_demand" if offer.on_demand else "spot", launch_call=call)
        sup.add_node(node)
        return node

    never, given_up = requested(10, dict(NOT_SENT)), requested(11, dict(recorded))
    await fleet.settle_unowned([])
    await h.until(lambda: never.instance_id is not None, what="the never-sent call made")
    assert given_up.state is NodeState.FAILED and "daemon restart" in given_up.detail
    (failed,) = [e for e in h.events("node_launch_failed") if e.node == "test-11"]
    assert failed.data["error"] == "interrupted"

    h.provider.idempotent_launch = True  # as EC2 and ECS
    replayed = requested(12, dict(recorded))
    await fleet.settle_unowned([])
    await h.until(lambda: replayed.instance_id is not None, what="the sent call replayed")
    spec = next(s for s, _ in h.provider.launched if s.node_id == "test-12")
    assert spec.daemon_url == recorded["daemon_url"] and spec.agent_wheel is not None
    assert (spec.agent_wheel.url, spec.agent_wheel.sha256) == (WHEEL["url"], WHEEL["sha256"])  # not signed again
    (launched,) = [e for e in h.events("node_launched") if e.node == "test-12"]
    assert launched.data.get("replayed") is True
