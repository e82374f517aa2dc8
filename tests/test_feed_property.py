"""A property of the feed's renderers (daemon/feed/feed_messages.py; issue 13, defect 3):
for any JSON-ish event data (NaN/Infinity, huge integers, strings for numbers, lists,
nested objects, data that is not an object, odd kinds and nodes) and any template,
every renderer returns: the text line, the key fields, the Slack message and digest
(valid Block Kit) and the webhook body (strict JSON, no NaN/Infinity tokens).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from slack_sdk.models.blocks import Block  # noqa: E402

from daemon.config import SLACK_MAX_BATCH  # noqa: E402
from daemon.model import Event, EventKind, Node, NodeState  # noqa: E402
from daemon.feed.feed_messages import key_fields, render_text, slack_digest, slack_message, webhook_batch_body  # noqa: E402
from test_feed_hostile import strict_json  # noqa: E402

_NODE = Node(id="n-1", ordinal=1, provider="aws", region="us-east-1", zone="us-east-1a",
             instance_type="g5.xlarge", gpus=1, price_usd_h=0.5, token="t", state=NodeState.RUNNING)


# -- the property: every renderer is total --------------------------------------------------------
_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**400), max_value=10**400)
            | st.floats() | st.text(max_size=30) | st.sampled_from(["", "nan", "inf", "1e999", "-1", "NaN"]))
_KEYS = st.sampled_from(["step", "last_step", "resumed_from", "last_commit_step", "world_size", "seconds",
                         "bytes", "boot_s", "detection_latency_s", "overdue_s", "lead_s", "backoff_s",
                         "price_usd_h", "reason", "error", "message", "failures", "deadline", "provider",
                         "offer", "old", "new", "cost_usd", "savings_usd_h", "_usd"]) | st.text(max_size=10)
_json = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                          kids, max_size=4),
                     max_leaves=12)
_data = st.dictionaries(_KEYS, _json, max_size=8)
_event = st.builds(Event, seq=st.integers(min_value=1, max_value=2**62),
                   time=st.floats(min_value=0, max_value=4e9) | st.floats(),
                   kind=st.sampled_from([k.value for k in EventKind]) | st.text(max_size=20),
                   node=st.none() | st.text(max_size=40), data=_data | _json)
_templates = st.none() | st.sampled_from(["{failures:,d} {deadline:.1f}", "{step:,} {data[x]}", "{message}",
                                          "{emoji} {node} {reason!r:>5}", "{0}", "{seconds:%}", "{time:%Y}"])


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(_event, min_size=1, max_size=3), template=_templates)
def test_every_renderer_is_total(events: list[Event], template: str | None) -> None:
    for ev in events:
        assert isinstance(render_text(ev, pool="p", node=_NODE, template=template), str)
        assert all(isinstance(a, str) and isinstance(b, str) for a, b in key_fields(ev, None))
        for b in slack_message(ev, pool="p", template=template).to_dict()["blocks"]:
            Block.parse(b).validate_json()
    texts = [(ev, render_text(ev, pool="p")) for ev in events]
    body = strict_json(webhook_batch_body(texts, pool="p"))
    assert [e["seq"] for e in body["events"]] == [ev.seq for ev in events]
    digest = slack_digest([(ev, None, template) for ev in events][:SLACK_MAX_BATCH], pool="p").to_dict()
    json.dumps(digest, allow_nan=False)
