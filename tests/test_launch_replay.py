"""When a launch a daemon died in is sent again under its client token
(daemon/control/launch_replay.py): only byte for byte, only where the cloud honours the
token, and only while the node could still boot from what it was sent.

The daemon-level flow (a RunInstances held on the wire at a SIGKILL, the new daemon's
replay, the late request answered with the replay's instance) is
tests/chaos/test_daemon_kill.py::test_daemon_sigkill_mid_launch[launch_lands_after_restart].
"""

from __future__ import annotations

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
    if got is None:  # replayed: a token the cloud honours, and either a first call or the same parameters
        assert idempotent and offer_known and call is not None
        if kind == "sent":
            assert set(daemon_url.split(",")) == set(URLS.split(",")) and ca == "ca1"
            assert left_s >= REPLAY_MARGIN_S
    else:
        assert isinstance(got, str) and got
