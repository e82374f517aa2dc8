"""The node agent against every metadata dialect's fake (aws, aliyun, gcp, azure).

Each test runs a real :class:`~daemon.gpunode.agent.NodeAgent` (the ``running_agent`` helper of
``test_agent.py``, with its trainer stand-in) against the real Supervisor + ApiServer
of the ``spot_daemon`` fixture; the agent polls the dialect's client from
``make_client(dialect, fake.url, ...)`` every 0.05 s (GCP: hanging GETs,
``wait_s=2``, as the agent uses them in production). What is checked is what the
daemon records: ``interruption_notice``, ``metadata_unreachable`` and
``metadata_recovered`` events.

No sleeps as synchronization: every wait is ``DaemonHarness.until`` on a condition,
bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from conftest import ManualClock
from daemon.gpunode.metadata.aliyun import TERMINATION_TIME_PATH
from daemon.gpunode.metadata.aws import INSTANCE_ACTION_PATH
from daemon.gpunode.metadata.azure import SCHEDULED_EVENTS_PATH
from daemon.gpunode.metadata.base import MetadataDialect
from daemon.gpunode.metadata.gcp import PREEMPTED_PATH
from daemon.gpunode.metadata.registry import DIALECTS, make_client
from daemon.providers.local_metadata import make_fake
from daemon.model import NodeState
from test_agent import notice_file, running_agent, trainer_running

POLL_S = 0.05  # the agent's poll interval in these tests
SLACK_S = 0.5  # detection allowance on top of one poll interval (loaded CI machines)
GCP_WAIT_S = 2  # the hanging GET's wait_s
QUIET_POLLS = 20  # "a whole run" of polls without a notice
QUIET_HANGING_GETS = 1  # the same for GCP: one full hanging GET covers GCP_WAIT_S (40 intervals)
ALARM_AFTER = 3  # metadata_alarm_after in the fault tests
TOKEN_TTL_S = 60

#: The item each dialect's ``poll()`` reads (the agent may read others too, e.g. AWS's
#: rebalance recommendation; those are not counted as polls here).
NOTICE_PATH = {"aws": INSTANCE_ACTION_PATH, "aliyun": TERMINATION_TIME_PATH, "gcp": PREEMPTED_PATH,
               "azure": SCHEDULED_EVENTS_PATH}

#: What each dialect's notice looks like once the daemon has it.
ACTION = {"aws": "terminate", "aliyun": "terminate", "gcp": "terminate", "azure": "preempt"}

#: An unparsable body per dialect, served at its own notice item as ``(item, body)``:
#: truncated JSON where the item is JSON (AWS; Azure, which serves one document, no
#: item), a truncated value where it is plain text (Alibaba's time, GCP's TRUE/FALSE).
BAD_BODY: dict[str, tuple[str | None, str]] = {
    "aws": ("spot/instance-action", '{"action": "terminate", "time": "2017-09-18T0'),
    "aliyun": ("instance/spot/termination-time", "2017-09-18T08:2"),
    "gcp": ("instance/preempted", "TRU"),
    "azure": (None, '{"DocumentIncarnation": 2, "Events": [{"EventId": "C7061BAC-AFDC-4513-B24B-AA5F'),
}


# -- helpers ------------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def started_fake(dialect: str, **kwargs: Any) -> AsyncIterator[Any]:
    fake = make_fake(dialect, **kwargs)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.aclose()


def client_of(dialect: str, fake: Any, **kwargs: Any) -> Callable[[], MetadataDialect]:
    """A factory of the dialect's client on ``fake`` (GCP: hanging GETs)."""
    base: dict[str, Any] = {"wait_s": GCP_WAIT_S} if dialect == "gcp" else {}

    def build() -> MetadataDialect:
        return make_client(dialect, fake.url, **{**base, **kwargs})

    return build


def statuses(fake: Any) -> list[int]:
    """Status of every answered request, oldest first (Azure's log has a 4th field)."""
    return [entry[2] for entry in fake.request_log]


def answered_ok(fake: Any, dialect: str, since: int = 0) -> int:
    """Polls of the notice item answered with "nothing pending" or a value (200/404),
    among the requests logged from index ``since`` on."""
    return sum(1 for method, path, status, *_ in fake.request_log[since:]
               if method == "GET" and path.split("?")[0] == NOTICE_PATH[dialect] and status in (200, 404))


def publish_bad_body(dialect: str, fake: Any) -> None:
    item, body = BAD_BODY[dialect]
    if item is None:
        fake.publish_raw(body)
    else:
        fake.publish_raw(item, body)


def until_timeout(dialect: str, base: float = 5.0) -> float:
    """A timeout for ``until``: GCP's hanging GETs add up to GCP_WAIT_S per poll."""
    return base + (4 * GCP_WAIT_S if dialect == "gcp" else 0.0)


def report_published_at(h, fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the daemon learn when the fake published (as the local provider does)."""
    monkeypatch.setattr(h.provider, "notice_published_at", lambda instance_id: fake.published_at, raising=False)


async def polling(h, dialect: str, fake: Any) -> None:
    """Until the agent is registered and has polled the fake (GCP: a hanging GET is parked)."""
    def ready() -> bool:
        if not h.events("node_ready"):
            return False
        if dialect == "gcp":
            return answered_ok(fake, dialect) >= 1 and fake.watchers >= 1
        return answered_ok(fake, dialect) >= 2

    await h.until(ready, timeout_s=until_timeout(dialect), what="the agent polling")


# -- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dialect", DIALECTS)
async def test_notice_is_detected_within_one_poll_interval(spot_daemon, dialect, monkeypatch) -> None:
    h = spot_daemon
    async with started_fake(dialect) as fake:
        report_published_at(h, fake, monkeypatch)
        async with running_agent(h, None, None, monkeypatch, metadata=client_of(dialect, fake)) as agent:
            await polling(h, dialect, fake)
            fake.publish_interruption("terminate")
            await h.until(lambda: h.events("interruption_notice"), what="interruption_notice")

            (ev,) = h.events("interruption_notice")
            assert ev.data["provider"] == dialect
            assert ev.data["action"] == ACTION[dialect]
            assert ev.data["notice_published_at"] == fake.published_at
            latency = ev.data["notice_seen_at"] - fake.published_at
            assert 0 <= latency < POLL_S + SLACK_S, latency
            assert ev.data["detection_latency_s"] == pytest.approx(latency, abs=1e-3)
            assert ev.node == agent.node_id
            # draining, or already released if the stand-in answered the notice at once
            assert h.sup.nodes[agent.node_id].state in (NodeState.DRAINING, NodeState.TERMINATED)
            assert not h.events("metadata_unreachable")


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_after_a_notice_polling_keeps_its_pace(spot_daemon, dialect, monkeypatch) -> None:
    """The notice stays pending until the VM goes; the agent keeps reading it once per
    poll interval, not in a tight loop (which would burn a core while the trainer
    commits, and hammer the endpoint)."""
    h = spot_daemon
    window_s = 10 * POLL_S
    async with started_fake(dialect) as fake:
        async with running_agent(h, None, None, monkeypatch, metadata=client_of(dialect, fake)):
            await polling(h, dialect, fake)
            fake.publish_interruption("terminate")
            await h.until(lambda: h.events("interruption_notice"), what="interruption_notice")
            loop = asyncio.get_running_loop()
            n, t0 = len(fake.request_log), loop.time()
            # a rate check: a bounded window, left early once the rate is clearly too high
            with contextlib.suppress(AssertionError):
                await h.until(lambda: answered_ok(fake, dialect, n) > 100, timeout_s=window_s)
            polls, elapsed = answered_ok(fake, dialect, n), loop.time() - t0
            assert polls <= elapsed / POLL_S + 3, f"{polls} polls in {elapsed:.2f} s"
            assert len(h.events("interruption_notice")) == 1


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_no_notice_means_no_event_for_a_whole_run(spot_daemon, dialect, monkeypatch) -> None:
    h = spot_daemon
    quota = 1 + QUIET_HANGING_GETS if dialect == "gcp" else QUIET_POLLS  # GCP: a plain GET, then hanging

    def quiet_run_done() -> bool:
        # GCP: and the next hanging GET is parked again (the loop goes on hanging)
        return answered_ok(fake, dialect) >= quota and (dialect != "gcp" or fake.watchers >= 1)
    async with started_fake(dialect) as fake:
        # alarm_after=1: a single failed poll would show as metadata_unreachable
        async with running_agent(h, None, None, monkeypatch, metadata=client_of(dialect, fake),
                                 alarm_after=1) as agent:
            await h.until(quiet_run_done, timeout_s=until_timeout(dialect, 5.0 + quota * POLL_S),
                          what=f"{quota} answered polls")
            # every poll was answered "nothing pending" (no 5xx, no 401 left unhandled)
            assert set(statuses(fake)) <= {200, 404}, fake.request_log
            if dialect == "gcp":  # hanging GETs after the first plain one: no busy loop
                hanging = [e for e in fake.request_log if "wait_for_change=true" in e[1]]
                assert len(hanging) == len(fake.request_log) - 1, fake.request_log
            assert not h.events("interruption_notice")
            assert not h.events("metadata_unreachable")
            assert agent.metadata_failures == 0
            assert notice_file(agent) == []


@pytest.mark.parametrize("clocks", ["shared", "endpoint_only"])
@pytest.mark.parametrize("dialect", ["aws", "aliyun"])
async def test_token_expiry_mid_run_is_refreshed(spot_daemon, dialect, clocks, monkeypatch) -> None:
    """``shared``: the client sees its token age and refreshes before use; ``endpoint_only``:
    only the endpoint's clock moves, so it rejects the token (401) and the client must
    fetch a new one and retry the read. Neither is a failed poll."""
    h = spot_daemon
    fake_clock = ManualClock()
    client_clock = fake_clock if clocks == "shared" else ManualClock()
    hardened = {"hardened": True} if dialect == "aliyun" else {}
    async with started_fake(dialect, clock=fake_clock, **hardened) as fake:
        metadata = client_of(dialect, fake, token_ttl_s=TOKEN_TTL_S, clock=client_clock, **hardened)
        async with running_agent(h, None, None, monkeypatch, metadata=metadata, alarm_after=1) as agent:
            await polling(h, dialect, fake)
            assert fake.token_puts == 1
            fake_clock.advance(TOKEN_TTL_S + 1)  # past the token's TTL, between polls
            n = len(fake.request_log)
            await h.until(lambda: fake.token_puts >= 2 and answered_ok(fake, dialect, n) >= 1,
                          what="a fresh token and a poll with it")
            if clocks == "endpoint_only":
                assert 401 in statuses(fake)[n:], fake.request_log[n:]
            assert not h.events("metadata_unreachable")
            assert agent.metadata_failures == 0

            fake.publish_interruption("terminate")
            await h.until(lambda: h.events("interruption_notice"), what="interruption_notice")
            assert h.events("interruption_notice")[0].data["provider"] == dialect
            assert not h.events("metadata_unreachable")


@pytest.mark.parametrize("fault", ["503", "timeout", "bad_body"])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_failure_streak_raises_one_alarm_then_recovers(spot_daemon, dialect, fault, monkeypatch) -> None:
    """503s, timeouts and unparsable bodies are failed polls, never notices: one
    ``metadata_unreachable`` per streak, ``metadata_recovered`` after it, and a real
    notice published afterwards is still seen."""
    h = spot_daemon
    timeout = {"timeout_s": 0.2} if fault == "timeout" else {}
    async with started_fake(dialect) as fake:
        async with running_agent(h, None, None, monkeypatch, metadata=client_of(dialect, fake, **timeout),
                                 alarm_after=ALARM_AFTER) as agent:
            await polling(h, dialect, fake)
            streak: range | None  # how many polls in a row fail
            if fault == "503":
                streak = range(ALARM_AFTER + 1, ALARM_AFTER + 2)  # longer than the alarm threshold
                fake.fail_next(ALARM_AFTER + 1, status=503, path=NOTICE_PATH[dialect])
            elif fault == "timeout":
                # AWS's agent also polls the rebalance item beside the notice: hang only
                # the notice item there, so the streak is exactly the hung polls
                only = {"path": NOTICE_PATH[dialect]} if dialect == "aws" else {}
                fake.hang_next(ALARM_AFTER, **only)
                streak = range(ALARM_AFTER, ALARM_AFTER + 1)
            else:
                streak = None  # until the body is fixed
                publish_bad_body(dialect, fake)
            # GCP: a hung request times out only after wait_s + timeout_s (hanging GET)
            await h.until(lambda: h.events("metadata_unreachable"), timeout_s=until_timeout(dialect, 5.0),
                          what="the alarm")
            assert not h.events("metadata_recovered")
            if streak is None:
                fake.clear()  # the endpoint serves a well-formed "nothing pending" again
            await h.until(lambda: h.events("metadata_recovered"), timeout_s=until_timeout(dialect, 5.0),
                          what="the recovery")

            (alarm,) = h.events("metadata_unreachable")  # one per streak, not one per failure
            assert alarm.data["failures"] == ALARM_AFTER
            assert alarm.data["url"] == fake.url
            (recovered,) = h.events("metadata_recovered")
            assert recovered.seq > alarm.seq
            if streak is not None:
                assert recovered.data["failures"] in streak, recovered.data
            else:
                assert recovered.data["failures"] >= ALARM_AFTER
            assert not h.events("interruption_notice")
            assert notice_file(agent) == []
            assert h.sup.nodes[agent.node_id].state in (NodeState.READY, NodeState.RUNNING)  # not draining

            fake.publish_interruption("terminate")
            await h.until(lambda: h.events("interruption_notice"), what="the real notice after the streak")
            assert h.events("interruption_notice")[0].data["provider"] == dialect
            assert len(h.events("metadata_unreachable")) == 1


async def test_azure_acknowledges_only_after_the_commit(spot_daemon, monkeypatch) -> None:
    h = spot_daemon
    gate = h.tmp_path / "commit-ok"  # the stand-in commits only once this exists
    async with started_fake("azure") as fake:
        async with running_agent(h, None, None, monkeypatch, env={"STANDIN_GATE": str(gate)},
                                 metadata=client_of("azure", fake)) as agent:
            await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
            fake.publish_interruption("terminate")
            (event,) = fake.events
            event_id = event["EventId"]
            await h.until(lambda: h.events("interruption_notice"), what="interruption_notice")
            (notice,) = h.events("interruption_notice")
            assert [n["id"] for n in notice_file(agent)] == [notice.data["notice_id"]]

            # the agent keeps polling; it must not approve the eviction before the commit
            n = len(fake.request_log)
            await h.until(lambda: answered_ok(fake, "azure", n) >= 5, what="five more polls")
            assert fake.acknowledged == []
            assert not any(entry[0] == "POST" for entry in fake.request_log)
            assert not h.events("checkpoint_committed")

            gate.touch()
            await h.until(lambda: h.events("checkpoint_committed") and fake.acknowledged, what="the approval")
            (commit,) = h.events("checkpoint_committed")
            assert commit.data["notice_ids"] == [notice.data["notice_id"]]
            assert fake.acknowledged == [event_id]
            i = next(k for k, entry in enumerate(fake.request_log) if entry[0] == "POST")
            assert fake.request_log[i][2] == 200
            assert fake.events[0]["EventStatus"] == "Started"

            # Scheduled -> Started is the same notice: the agent reports nothing new
            await h.until(lambda: len(fake.request_log) >= i + 6, what="polls after the approval")
            assert len(h.events("interruption_notice")) == 1
            assert fake.acknowledged == [event_id]
