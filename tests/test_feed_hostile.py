"""The feed against hostile event data and secret URLs (issue 13, defects 3 and 8).

Events in a store were written by older versions that did not bound what a node
reported (``failures: Infinity``, ``deadline: Infinity``, strings for numbers, huge
numbers). Rendering one must never stop a sink's worker: the text, the webhook body
(strict JSON: no ``NaN``/``Infinity`` tokens) and the Slack blocks are total functions
of the event. And a sink URL from ``url_env`` (a Slack hook URL is itself a secret)
never reaches a log line whole: only ``scheme://host/…``.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest
import structlog
from slack_sdk.models.blocks import Block

from daemon.feed import feed_messages, notify, sinks
from daemon.config import SinkSpec
from daemon.model import Event, Node, NodeState
from daemon.feed.feed_messages import key_fields, render_text, slack_digest, slack_message, webhook_batch_body
from daemon.feed.notify import CURSOR_KEY, Notifier
from daemon.feed.redaction import Redactor, redact_url
from daemon.controlnode.store import Store
from test_notify import ENV, Receiver, emit, webhook

_NODE = Node(id="n-1", ordinal=1, provider="aws", region="us-east-1", zone="us-east-1a",
             instance_type="g5.xlarge", gpus=1, price_usd_h=0.5, token="t", state=NodeState.RUNNING)


def strict_json(body: bytes) -> Any:
    """Parse as RFC 8259 JSON: ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON."""
    def refuse(token: str) -> Any:
        raise ValueError(f"not JSON: {token}")
    return json.loads(body.decode("utf-8"), parse_constant=refuse)


@pytest.fixture
def no_slack_pacing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sinks, "SLACK_MIN_INTERVAL_S", 0.0)


# events an older daemon stored as they came from a node (the probes, and their kin)
HOSTILE: list[tuple[str, dict[str, Any]]] = [
    ("metadata_unreachable", {"failures": math.inf, "error": "timeout"}),
    ("interruption_notice", {"deadline": math.inf, "provider": "aws"}),
    ("interruption_notice", {"deadline": -math.inf, "lead_s": math.nan}),
    ("checkpoint_committed", {"step": "99999", "seconds": math.inf, "bytes": -math.inf, "world_size": "pwned"}),
    ("checkpoint_committed", {"step": 1e308, "seconds": 1e308, "bytes": 1e308, "price_usd_h": math.inf}),
    ("node_lost", {"boot_s": [1, 2], "reason": {"nested": [math.nan]}, "cost_usd": math.inf}),
    ("job_resumed", {"resumed_from": 10**30, "last_step": -(10**30), "overdue_s": True}),
]


# -- defect 3: rendering is total -----------------------------------------------------------------
@pytest.mark.parametrize("kind,data", HOSTILE, ids=[f"{k}-{i}" for i, (k, _) in enumerate(HOSTILE)])
def test_hostile_stored_event_renders_everywhere(store: Store, kind: str, data: dict[str, Any]) -> None:
    ev = store.append_event(kind, "n-1", data)
    ev = store.events(since=ev.seq - 1)[0]  # as the feed reads it back (Infinity survives the round trip)
    text = render_text(ev, pool="p", node=_NODE)
    assert text.startswith(feed_messages.EMOJI[kind])
    assert render_text(ev, pool="p", node=_NODE, template="{failures:,d} {deadline:.1f} {step:,}")
    body = strict_json(webhook_batch_body([(ev, text)], pool="p"))
    assert body["events"][0]["seq"] == ev.seq and body["events"][0]["text"] == text
    msg = slack_message(ev, pool="p", node=_NODE)
    for b in msg.to_dict()["blocks"]:
        Block.parse(b).validate_json()
    slack_digest([(ev, _NODE, None), (ev, None, "{failures}")], pool="p").to_dict()


def test_non_finite_numbers_are_null_in_the_webhook_body_and_shown_in_the_text() -> None:
    ev = Event(7, 1_700_000_000.0, "metadata_unreachable", "n-1",
               {"failures": math.inf, "nested": [math.nan, {"x": -math.inf}], "ok": 2.5})
    text = render_text(ev, pool="p")
    assert "failures inf" in text
    body = strict_json(webhook_batch_body([(ev, text)], pool="p"))
    assert body["events"][0]["data"] == {"failures": None, "nested": [None, {"x": None}], "ok": 2.5}


def test_a_notice_with_an_infinite_deadline_says_so() -> None:
    ev = Event(8, 1_700_000_000.0, "interruption_notice", "n-1", {"deadline": math.inf})
    assert dict(key_fields(ev))["Deadline"] == "inf"
    ok = Event(9, 1_700_000_000.0, "interruption_notice", "n-1", {"deadline": 1_700_000_120.0})
    assert dict(key_fields(ok))["Deadline"] == "in 2 min 0 s"


async def test_the_feed_goes_on_past_hostile_stored_events(store: Store, no_slack_pacing: None) -> None:
    """The issue's probe: one bad event stopped every sink for good (and again after a
    restart). Now both sinks deliver it, rendered, and every event after it, in order."""
    rx = await Receiver().start()
    slack = SinkSpec(name="ops-slack", type="slack", url=rx.url("/services/T0/B0/X"), max_backoff_s=0.05)
    n = Notifier(store, [webhook("hook", rx.url("/hook")), slack], pool="p", environ=ENV)
    await n.start()
    try:
        seqs = [emit(store, n, kind, "n-1", **data) for kind, data in HOSTILE]
        seqs.append(emit(store, n, "node_ready", "n-2"))
        assert await n.drain(10.0), (n.stats("hook"), n.stats("ops-slack"))
    finally:
        await n.aclose()
        await rx.aclose()
    hook = [r for r in rx.requests if r.path == "/hook"]
    got = [e for r in hook for e in strict_json(r.body)["events"]]
    assert [e["seq"] for e in got] == seqs
    assert got[0]["data"]["failures"] is None and "failures inf" in got[0]["text"]
    slack_bodies = [strict_json(r.body) for r in rx.requests if r.path.startswith("/services/")]
    assert slack_bodies and all(b["text"] and b["blocks"] for b in slack_bodies)
    assert store.get(CURSOR_KEY.format("hook")) == store.get(CURSOR_KEY.format("ops-slack")) == seqs[-1]


async def test_a_rendering_bug_on_one_event_does_not_stop_the_sink(
        store: Store, monkeypatch: pytest.MonkeyPatch, no_slack_pacing: None) -> None:
    """Whatever goes wrong rendering one event (here: a bug injected for one ``seq``), the
    worker logs it once, sends a fallback line for it and goes on, in order."""
    bad: set[int] = set()
    real = sinks.render_text

    def buggy(ev: Event, **kw: Any) -> str:
        if ev.seq in bad:
            raise RuntimeError("renderer bug")
        return real(ev, **kw)

    monkeypatch.setattr(sinks, "render_text", buggy)
    monkeypatch.setattr(sinks, "slack_digest", lambda items, pool: (_ for _ in ()).throw(RuntimeError("bug")))
    rx = await Receiver().start()
    slack = SinkSpec(name="ops-slack", type="slack", url=rx.url("/services/T0/B0/X"), max_backoff_s=0.05)
    n = Notifier(store, [webhook("hook", rx.url("/hook")), slack], pool="p", environ=ENV)
    await n.start()
    try:
        with structlog.testing.capture_logs() as logs:
            for module in (notify, sinks):  # uncached loggers: captured
                monkeypatch.setattr(module, "log", structlog.get_logger("spotvisor.notify"))
            first = emit(store, n, "node_ready", "n-1")
            bad.add(first + 1)
            seqs = [first, emit(store, n, "node_ready", "n-2"), emit(store, n, "node_ready", "n-3")]
            assert await n.drain(10.0), (n.stats("hook"), n.stats("ops-slack"))
    finally:
        await n.aclose()
        await rx.aclose()
    got = [e for r in rx.requests if r.path == "/hook" for e in strict_json(r.body)["events"]]
    assert [e["seq"] for e in got] == seqs
    assert got[1]["kind"] == "node_ready" and got[1]["text"]  # a fallback line, not nothing
    slack_texts = " ".join(strict_json(r.body)["text"] for r in rx.requests if r.path.startswith("/services/"))
    assert "Node ready · n-1" in slack_texts and "Node ready · n-3" in slack_texts
    assert f"seq {seqs[1]}: its details could not be shown" in slack_texts
    failed = [e for e in logs if e["event"] == "notify_render_failed"]
    assert failed and all(e["log_level"] == "error" for e in failed)
    assert not [e for e in logs if e["event"] == "task_crashed"]


# -- defect 8: secret URLs never reach a log --------------------------------------------------------
SECRET_PATH = "services/T0SECRET/B0SECRET/xoxSECRETtoken42"


def test_redact_url_keeps_scheme_and_host_only() -> None:
    assert redact_url(f"https://hooks.slack.com/{SECRET_PATH}") == "https://hooks.slack.com/…"
    assert redact_url("https://user:pw@example.com:8443/a/b?q=1") == "https://example.com:8443/…"
    assert redact_url(f"http://[::1/{SECRET_PATH}") == "http://[::1/…"  # malformed: still no path
    assert redact_url("not a url at all") == "<redacted URL>"


def _all_logs(caplog: pytest.LogCaptureFixture, captured: list[dict[str, Any]]) -> str:
    """Every log line of the test, structlog's and the stdlib's, and every record's fields."""
    return "\n".join([caplog.text, *(repr(e) for e in captured), *(repr(r.__dict__) for r in caplog.records)])


async def test_a_malformed_url_env_url_never_reaches_the_logs(
        store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's probe: a webhook URL with a bad port, from ``url_env``, was logged whole
    at every retry. Now at DEBUG, in our lines and anyone's, only ``http://127.0.0.1:99999/…``."""
    url = f"http://127.0.0.1:99999/{SECRET_PATH}"
    spec = SinkSpec(name="hook", type="webhook", url_env="SV_HOOK_URL", secret_env="SV_TEST_KEY",
                    max_backoff_s=0.01, timeout_s=1.0)
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as captured:
        for module in (notify, sinks):  # uncached loggers: captured
            monkeypatch.setattr(module, "log", structlog.get_logger("spotvisor.notify"))
        n = Notifier(store, [spec], pool="p", environ={**ENV, "SV_HOOK_URL": url})
        await n.start()
        try:
            emit(store, n, "node_ready", "n-1")
            assert await n.wait_until(lambda: n.stats("hook").failed_attempts >= 3, 10.0)
            logging.getLogger("some.library").debug("posting to %s failed", url)  # anyone's record, redacted
            logging.getLogger("some.library").error("boom", exc_info=ValueError(f"bad url {url}"))
        finally:
            await n.aclose(drain_timeout_s=0)
    text = _all_logs(caplog, captured)
    assert "SECRET" not in text
    failed = [e for e in captured if e["event"] == "notify_attempt_failed"]
    assert len(failed) >= 3 and all("http://127.0.0.1:99999/…" in e["error"] for e in failed)
    assert "posting to http://127.0.0.1:99999/… failed" in caplog.text


async def test_slack_sdk_debug_logs_never_show_the_hook_url(
        store: Store, caplog: pytest.LogCaptureFixture, no_slack_pacing: None) -> None:
    """slack-sdk logs every request's URL at DEBUG; the hook URL is the credential."""
    rx = await Receiver().start()
    url = rx.url(f"/{SECRET_PATH}")
    spec = SinkSpec(name="ops-slack", type="slack", url_env="SV_SLACK_URL", max_backoff_s=0.05)
    caplog.set_level(logging.DEBUG)
    n = Notifier(store, [spec], pool="p", environ={"SV_SLACK_URL": url})
    await n.start()
    try:
        emit(store, n, "node_ready", "n-1")
        assert await n.drain(10.0), n.stats("ops-slack")
    finally:
        await n.aclose()
        await rx.aclose()
    assert len(rx.requests) == 1 and rx.requests[0].path == f"/{SECRET_PATH}"  # it did go to the secret URL
    sending = [r for r in caplog.records if "Sending a request" in r.getMessage()]
    assert sending, "slack-sdk's DEBUG line about the request (the thing redacted) was not logged"
    assert f"url: http://127.0.0.1:{rx.port}/…" in sending[0].getMessage()
    assert "SECRET" not in caplog.text


def test_redact_secrets_in_free_text() -> None:
    redactor = Redactor()
    redactor.add_url(f"https://hooks.example.com/{SECRET_PATH}")
    line = f"POST https://hooks.example.com/{SECRET_PATH} failed; path /{SECRET_PATH} again"
    out = redactor.redact(line)
    assert "SECRET" not in out and "https://hooks.example.com/…" in out
