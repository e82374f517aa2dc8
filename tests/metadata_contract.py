"""The metadata-dialect contract, run against every dialect and its local fake.

What every dialect (``daemon/gpunode/metadata/<cloud>.py``) and its fake
(``daemon/providers/local_metadata/<cloud>.py``) must do alike lives here, once, as
test functions that take a :class:`Dialect`; ``tests/test_metadata_dialects.py``
runs them for each. What one cloud does its own way stays in its own file
(``tests/test_metadata_<cloud>.py``).

The fixtures ``fake_clock``, ``http``, ``fake`` (the fake of the test's ``dialect``,
started on ``fake_clock``) and ``client`` (the dialect's client on it) are defined here
once; a test module imports the ones it uses and provides ``dialect``.

A :class:`Dialect` is the per-cloud parameter set: how to build the fake and the client,
how a published notice looks once parsed, which bodies are garbage, which statuses a
fault test injects. :data:`DIALECTS` holds the four; :data:`TOKEN_DIALECTS` the two
IMDS-style ones (AWS IMDSv2, Alibaba ECS in hardened mode), whose session tokens have
their own contract (:class:`TokenContract`).

No sleeps: token expiry is driven by an injected clock, timeouts by a request the fake
never answers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import aiohttp
import pytest

from conftest import ManualClock as Clock
from daemon.gpunode.metadata import MetadataDialect, MetadataUnavailable, Notice, NoticeKind, notice_id
from daemon.gpunode.metadata.aliyun import TERMINATION_TIME_PATH, AliyunMetadata
from daemon.gpunode.metadata.aliyun import TOKEN_PROTOCOL as ALIYUN_TOKEN
from daemon.gpunode.metadata.aws import INSTANCE_ACTION_PATH, AwsImds
from daemon.gpunode.metadata.aws import TOKEN_PROTOCOL as AWS_TOKEN
from daemon.gpunode.metadata.azure import SCHEDULED_EVENTS_PATH, AzureScheduledEvents
from daemon.gpunode.metadata.gcp import PREEMPTED_PATH, GcpMetadata
from daemon.gpunode.metadata.http import META_DATA_PREFIX, TokenProtocol
from daemon.gpunode.metadata.registry import DEFAULT_URLS
from daemon.providers.local_metadata.aliyun import FakeAliyunMetadata
from daemon.providers.local_metadata.aws import FakeImds
from daemon.providers.local_metadata.azure import FakeAzureScheduledEvents
from daemon.providers.local_metadata.gcp import PROJECT_NUMBER, FakeGcpMetadata

__all__ = ["AWS", "ALIYUN", "AZURE", "GCP", "client", "fake", "fake_clock", "http", "DIALECTS", "TOKEN_DIALECTS", "Dialect", "MetadataContract", "TokenContract", "TokenDialect", "dialects"]

DEADLINE = datetime(2017, 9, 18, 8, 22, tzinfo=timezone.utc)
VM = "vm-spot-0"


@dataclass(frozen=True)
class Dialect:
    """One cloud's parameters for the contract.

    Attributes:
        name: the dialect (``Notice.provider``).
        fake: ``fake(clock, **kwargs) -> fake`` (not started; ``port=`` to pick its port).
        client: ``client(url, **kwargs) -> dialect client``.
        notice_path: the path ``poll()`` reads.
        published_action / expected_action: the action passed to ``publish_interruption``
            and the one the notice carries whatever was published (Alibaba and GCP serve
            none, Azure says preempt); None: the published one (AWS).
        exact_deadline: the notice's deadline is the published time (GCP: first seen + 30 s).
        lead_s: the default lead of ``publish_interruption()`` (GCP: from first sight).
        raw_of: the notice's expected ``raw``, from the fake and the published deadline.
        id_key: what the notice id hashes instead of ``raw`` (Azure: the EventId), or None.
        distinct_ids: a second publish with another time is a new notice (GCP: no time).
        static_items: ``get_metadata`` item -> value the fake serves; ``missing_item``: a 404.
        item_prefix: where those items live.
        error_statuses: the statuses a one-request fault is injected with.
        garbage: bodies that are not a notice; ``publish_garbage(fake, body)`` serves one.
        garbage_match: a word the error names (None: any MetadataUnavailable).
    """

    name: str
    fake: Callable[..., Any]
    client: Callable[..., Any]
    notice_path: str
    published_action: str
    expected_action: str | None
    exact_deadline: bool
    lead_s: float
    raw_of: Callable[[Any, datetime], str | None]
    error_statuses: tuple[int, ...]
    garbage: tuple[str, ...]
    publish_garbage: Callable[[Any, str], None]
    garbage_match: str | None = None
    id_key: Callable[[Any], str] | None = None
    distinct_ids: bool = True
    static_items: dict[str, str] = field(default_factory=dict)
    missing_item: str = ""
    item_prefix: str = META_DATA_PREFIX

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class TokenDialect:
    """An IMDS-style dialect's token parameters (see :class:`TokenContract`).

    Attributes:
        dialect: the :class:`Dialect` (its fake requires tokens, its client sends them).
        protocol: the cloud's token constants.
        rejected: the read statuses the client takes as "token rejected".
        foreign_ttl_header: the other cloud's TTL header, which this fake must refuse.
    """

    dialect: Dialect
    protocol: TokenProtocol
    rejected: tuple[int, ...]
    foreign_ttl_header: str

    def __str__(self) -> str:
        return self.dialect.name


def _azure_raw(fake: FakeAzureScheduledEvents, deadline: datetime) -> str | None:
    return None  # the event's JSON: checked by field in the contract


AWS = Dialect(
    name="aws",
    fake=lambda clock, **kw: FakeImds(instance_id="i-0abc", clock=clock, **kw),
    client=AwsImds,
    notice_path=INSTANCE_ACTION_PATH,
    published_action="stop",
    expected_action=None,  # the published one
    exact_deadline=True,
    lead_s=120.0,
    raw_of=lambda fake, t: json.dumps({"action": "stop", "time": t.strftime("%Y-%m-%dT%H:%M:%SZ")}),
    error_statuses=(500, 503, 403),
    garbage=(
        "not json",
        "",
        "[1, 2]",
        '{"time": "2017-09-18T08:22:00Z"}',
        '{"action": "terminate"}',
        '{"action": "terminate", "time": "soon"}',
        '{"action": "terminate", "time": "2017-09-18T08:22:00"}',  # no offset
        '{"action": 3, "time": "2017-09-18T08:22:00Z"}',
    ),
    publish_garbage=lambda fake, body: fake.publish_raw("spot/instance-action", body),
    static_items={"instance-id": "i-0abc", "instance-type": "p4d.24xlarge",
                  "placement/availability-zone": "us-east-1a"},
    missing_item="no/such/item",
)

ALIYUN = Dialect(
    name="aliyun",
    fake=lambda clock, **kw: FakeAliyunMetadata(instance_id="i-bp1abc", hardened=True, clock=clock, **kw),
    client=lambda url, **kw: AliyunMetadata(url, **{"hardened": True, **kw}),
    notice_path=TERMINATION_TIME_PATH,
    published_action="stop",  # ECS publishes no action: ignored
    expected_action="terminate",
    exact_deadline=True,
    lead_s=300.0,
    raw_of=lambda fake, t: t.strftime("%Y-%m-%dT%H:%M:%SZ"),
    error_statuses=(500, 503),
    garbage=(
        "",
        "soon",
        "2015-01-05T18:02:00",  # no offset
        "2015-13-05T18:02:00Z",
        '{"action": "terminate", "time": "2015-01-05T18:02:00Z"}',  # the AWS document
        "<html>busy</html>",
    ),
    publish_garbage=lambda fake, body: fake.publish_raw("instance/spot/termination-time", body),
    garbage_match="termination-time",
    static_items={"instance-id": "i-bp1abc", "instance/instance-type": "ecs.gn7i-c8g1.2xlarge",
                  "region-id": "cn-hangzhou", "zone-id": "cn-hangzhou-h"},
    missing_item="no/such/item",
)

GCP = Dialect(
    name="gcp",
    fake=lambda clock, **kw: FakeGcpMetadata(instance_id="4242", clock=clock, **kw),
    client=GcpMetadata,
    notice_path=PREEMPTED_PATH,
    published_action="terminate",
    expected_action="terminate",
    exact_deadline=False,
    lead_s=30.0,
    raw_of=lambda fake, t: "TRUE",
    error_statuses=(503, 500, 403),
    garbage=("", "true", "YES", "<html>", "TRUE FALSE"),
    publish_garbage=lambda fake, body: fake.publish_raw("instance/preempted", body),
    garbage_match="preempted",
    distinct_ids=False,  # GCP serves TRUE, no time: one preemption, one id
    static_items={"instance/id": "4242",
                  "instance/machine-type": f"projects/{PROJECT_NUMBER}/machineTypes/a2-highgpu-1g",
                  "instance/zone": f"projects/{PROJECT_NUMBER}/zones/us-central1-a"},
    missing_item="instance/no-such-item",
    item_prefix="/computeMetadata/v1/",
)

AZURE = Dialect(
    name="azure",
    fake=lambda clock, **kw: FakeAzureScheduledEvents(vm_name=VM, clock=clock, **kw),
    client=lambda url, **kw: AzureScheduledEvents(url, **{"resource_name": VM, **kw}),
    notice_path=SCHEDULED_EVENTS_PATH,
    published_action="terminate",
    expected_action="preempt",
    exact_deadline=True,
    lead_s=30.0,
    raw_of=_azure_raw,
    id_key=lambda fake: next(e["EventId"] for e in fake.events if e["EventType"] == "Preempt"),
    error_statuses=(500, 503, 400, 429, 410),
    garbage=(
        '{"DocumentIncarnation": 2, "Events": [{"EventId": "A1", "EventTy',  # truncated
        "",
        "not json",
        "[1, 2]",
        '{"DocumentIncarnation": 2}',
        '{"DocumentIncarnation": 2, "Events": {}}',
        '{"DocumentIncarnation": 2, "Events": [1]}',
        '{"DocumentIncarnation": 2, "Events": [{"EventType": "Preempt"}]}',
        '{"DocumentIncarnation": 2, "Events": [{"EventId": "A1"}]}',
        '{"DocumentIncarnation": 2, "Events": [{"EventId": "A1", "EventType": "Preempt",'
        ' "Resources": ["vm-spot-0"], "NotBefore": "soon"}]}',
        '{"DocumentIncarnation": 2, "Events": [{"EventId": "A1", "EventType": "Preempt",'
        ' "Resources": "vm-spot-0", "NotBefore": ""}]}',
        '{"DocumentIncarnation": 2, "Events": [{"EventId": "A1", "EventType": "Preempt",'
        ' "Resources": ["vm-spot-0"], "NotBefore": "Sat, 11 Apr 2026 22:26:58 -0000"}]}',
    ),
    publish_garbage=lambda fake, body: fake.publish_raw(body),
)

DIALECTS: tuple[Dialect, ...] = (AWS, ALIYUN, GCP, AZURE)
TOKEN_DIALECTS: tuple[TokenDialect, ...] = (
    TokenDialect(AWS, AWS_TOKEN, rejected=(401,), foreign_ttl_header=ALIYUN_TOKEN.ttl_header),
    TokenDialect(ALIYUN, ALIYUN_TOKEN, rejected=(401, 403), foreign_ttl_header=AWS_TOKEN.ttl_header),
)


def token_rejections() -> list[Any]:
    """``(token_dialect, status)`` params: each status a token dialect takes as "rejected"."""
    return [pytest.param(t, s, id=f"{t}-{s}") for t in TOKEN_DIALECTS for s in t.rejected]


def dialects(*, having: str | None = None) -> list[Any]:
    """``pytest.param``s of the dialects (those whose attribute ``having`` is truthy)."""
    return [pytest.param(d, id=d.name) for d in DIALECTS if having is None or getattr(d, having)]


def with_each(attr: str) -> list[Any]:
    """``(dialect, value)`` params for every value of each dialect's tuple ``attr``."""
    return [pytest.param(d, v, id=f"{d.name}-{i}") for d in DIALECTS for i, v in enumerate(getattr(d, attr))]


@pytest.fixture
def fake_clock() -> Clock:
    return Clock()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def fake(dialect: Dialect, fake_clock: Clock) -> AsyncIterator[Any]:
    """The dialect's fake, started on ``fake_clock``."""
    async with dialect.fake(fake_clock) as endpoint:
        yield endpoint


@pytest.fixture
async def client(dialect: Dialect, fake: Any) -> AsyncIterator[Any]:
    """The dialect's client on ``fake`` (its own session, real clock). Its timeout is not
    what these tests test (``test_timeout_is_unavailable_then_recovers`` has its own): it
    is set far above a loopback request's time, which exceeded 2 s on a clean clone's
    loaded 2-core run (the Aliyun dialect's token request)."""
    async with dialect.client(fake.url, timeout_s=30.0) as dialect_client:
        yield dialect_client


def free_port() -> int:
    """A port that was free a moment ago and has no listener."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def statuses(fake: Any, method: str) -> list[int]:
    """Statuses of the requests of ``method`` the fake answered, oldest first."""
    return [entry[2] for entry in fake.request_log if entry[0] == method]


class MetadataContract:
    """What every dialect and its fake do alike. Subclasses provide a ``dialect`` fixture
    (a :class:`Dialect`), ``fake`` (started on ``fake_clock``) and ``client`` (on the fake)."""

    # -- notices ---------------------------------------------------------------------------

    async def test_no_notice_is_none_over_many_polls(self, dialect: Dialect, fake: Any, client: Any) -> None:
        for _ in range(20):
            assert await client.poll() is None
        notice_gets = [s for m, p, s, *_ in fake.request_log if m == "GET" and p.startswith(dialect.notice_path)]
        assert len(notice_gets) == 20 and set(notice_gets) <= {200, 404}
        assert fake.published_at is None

    async def test_published_interruption_is_a_notice(self, dialect: Dialect, fake: Any, client: Any) -> None:
        assert await client.poll() is None
        before = datetime.now(timezone.utc)
        fake.publish_interruption(dialect.published_action, DEADLINE)
        assert fake.published_at is not None
        first = await client.poll()
        after = datetime.now(timezone.utc)  # GCP: the deadline counts from the first sighting
        assert first is not None
        assert first.provider == dialect.name
        assert first.kind is NoticeKind.INTERRUPTION
        assert first.action == (dialect.expected_action or dialect.published_action)
        assert first.deadline is not None and first.deadline.tzinfo is not None
        if dialect.exact_deadline:
            assert first.deadline == DEADLINE
        else:
            assert before + timedelta(seconds=dialect.lead_s) <= first.deadline <= after + timedelta(seconds=dialect.lead_s)
        raw = dialect.raw_of(fake, DEADLINE)
        if raw is not None:
            assert first.raw == raw
        key = dialect.id_key(fake) if dialect.id_key is not None else first.raw
        assert first.id == notice_id(dialect.name, NoticeKind.INTERRUPTION, key)
        assert len(first.id) == 16 and int(first.id, 16) >= 0
        assert Notice.from_dict(json.loads(json.dumps(first.to_dict()))) == first

        for _ in range(5):
            again = await client.poll()
            assert again == first and again is not None and again.id == first.id

        fake.clear()
        assert fake.published_at is None
        assert await client.poll() is None

    async def test_default_interruption_has_the_documented_lead(self, dialect: Dialect, fake: Any,
                                                                client: Any) -> None:
        before = datetime.now(timezone.utc).replace(microsecond=0)
        fake.publish_interruption()
        notice = await client.poll()
        assert notice is not None and notice.action == (dialect.expected_action or "terminate")
        assert notice.deadline is not None
        lead = timedelta(seconds=dialect.lead_s)
        assert lead - timedelta(seconds=1) <= notice.deadline - before <= lead + timedelta(seconds=2)

    @pytest.mark.parametrize("dialect", dialects(having="distinct_ids"))
    async def test_a_new_notice_has_a_new_id(self, dialect: Dialect, fake: Any, client: Any) -> None:
        fake.publish_interruption(time=DEADLINE)
        a = await client.poll()
        fake.publish_interruption(time=DEADLINE + timedelta(seconds=1))
        b = await client.poll()
        assert a is not None and b is not None and a.id != b.id

    @pytest.mark.parametrize("dialect", dialects(having="static_items"))
    async def test_static_items(self, dialect: Dialect, client: Any) -> None:
        for item, value in dialect.static_items.items():
            assert await client.get_metadata(item) == value
        assert await client.get_metadata(dialect.missing_item) is None

    # -- no answer is never a notice; the next real one is still seen ---------------------

    @pytest.mark.parametrize(("dialect", "status"), with_each("error_statuses"))
    async def test_error_status_is_unavailable_then_recovers(self, dialect: Dialect, fake: Any, client: Any,
                                                             status: int) -> None:
        assert await client.poll() is None
        fake.publish_interruption(time=DEADLINE)
        fake.fail_next(1, status=status, path=dialect.notice_path)
        with pytest.raises(MetadataUnavailable, match=str(status)):
            await client.poll()
        assert await client.poll() is not None  # the fault was one request

    async def test_timeout_is_unavailable_then_recovers(self, dialect: Dialect, fake: Any) -> None:
        async with dialect.client(fake.url, timeout_s=0.2) as client:
            assert await client.poll() is None
            fake.hang_next(1)
            with pytest.raises(MetadataUnavailable, match="timed out"):
                await client.poll()
            fake.publish_interruption(time=DEADLINE)
            assert await client.poll() is not None

    @pytest.mark.parametrize(("dialect", "body"), with_each("garbage"))
    async def test_garbage_is_unavailable_then_recovers(self, dialect: Dialect, fake: Any, client: Any,
                                                        body: str) -> None:
        dialect.publish_garbage(fake, body)
        with pytest.raises(MetadataUnavailable, match=dialect.garbage_match):
            await client.poll()
        fake.publish_interruption(time=DEADLINE)  # a real notice afterwards is still detected
        assert await client.poll() is not None

    async def test_connection_refused_is_unavailable_until_the_endpoint_is_up(self, dialect: Dialect,
                                                                               fake_clock: Clock) -> None:
        port = free_port()
        async with dialect.client(f"http://127.0.0.1:{port}", timeout_s=2.0) as client:
            with pytest.raises(MetadataUnavailable) as info:
                await client.poll()
            assert isinstance(info.value.__cause__, aiohttp.ClientError)
            # The endpoint comes (back) up on that port: the notice is then seen.
            async with dialect.fake(fake_clock, port=port) as fake:
                fake.publish_interruption(time=DEADLINE)
                assert await client.poll() is not None

    # -- construction and lifetime ---------------------------------------------------------

    @pytest.mark.parametrize(("kwargs", "match"), [({"timeout_s": 0}, "timeout_s"),
                                                   ({"timeout_s": -1.0}, "timeout_s"),
                                                   ({"base_url": ""}, "base_url")])
    def test_constructor_checks(self, dialect: Dialect, kwargs: dict[str, Any], match: str) -> None:
        kwargs = dict(kwargs)
        url = kwargs.pop("base_url", DEFAULT_URLS[dialect.name])
        with pytest.raises(ValueError, match=match):
            dialect.client(url, **kwargs)

    async def test_conforms_to_the_dialect_and_does_no_io_before_use(self, dialect: Dialect) -> None:
        client = dialect.client(DEFAULT_URLS[dialect.name])
        assert isinstance(client, MetadataDialect)
        assert client.provider == dialect.name and client.base_url == DEFAULT_URLS[dialect.name]
        assert client.has_rebalance is (dialect.name == "aws")
        await client.aclose()  # never used: nothing to close, no I/O

    async def test_a_borrowed_session_is_not_closed(self, dialect: Dialect, fake: Any,
                                                    http: aiohttp.ClientSession) -> None:
        client = dialect.client(fake.url, session=http)
        assert await client.poll() is None
        await client.aclose()
        await client.aclose()  # idempotent
        assert not http.closed
        with pytest.raises(RuntimeError, match="closed"):
            await client.poll()

    async def test_its_own_session_is_closed(self, dialect: Dialect, fake: Any) -> None:
        client = dialect.client(fake.url)
        assert await client.poll() is None
        session = client._session  # noqa: SLF001 - checking ownership
        assert session is not None and not session.closed
        await client.aclose()
        assert session.closed

    # -- the fake ----------------------------------------------------------------------------

    async def test_fake_lifecycle_releases_a_held_request(self, dialect: Dialect, fake_clock: Clock) -> None:
        fake = dialect.fake(fake_clock)
        with pytest.raises(RuntimeError, match="start"):
            _ = fake.url
        await fake.aclose()  # before start: fine
        await fake.start()
        assert fake.url.startswith("http://127.0.0.1:")
        with pytest.raises(RuntimeError, match="already started"):
            await fake.start()
        fake.hang_next(1)
        async with dialect.client(fake.url, timeout_s=5.0) as client:
            pending = asyncio.create_task(client.poll())
            await asyncio.wait_for(fake.wait_hanging(), timeout=5)  # the first request is held
            loop = asyncio.get_running_loop()
            started = loop.time()
            await fake.aclose()  # releases the held request, then stops
            assert loop.time() - started < 0.9  # did not wait out the 1 s shutdown timeout
            await fake.aclose()
            with pytest.raises(MetadataUnavailable):
                await pending

    def test_fake_refuses_bad_input(self, dialect: Dialect, fake_clock: Clock) -> None:
        fake = dialect.fake(fake_clock)
        with pytest.raises(ValueError, match="aware"):
            fake.publish_interruption(time=datetime(2017, 9, 18, 8, 22))
        with pytest.raises(ValueError):
            fake.fail_next(1, status=200)
        with pytest.raises(ValueError):
            fake.hang_next(-1)

    def test_fake_publish_signature_is_uniform(self, dialect: Dialect, fake_clock: Clock) -> None:
        ours = inspect.signature(type(dialect.fake(fake_clock)).publish_interruption)
        assert list(ours.parameters) == ["self", "action", "time"]
        assert str(ours) == "(self, action: 'str' = 'terminate', time: 'datetime | None' = None) -> 'None'"

    @pytest.mark.parametrize("dialect", dialects(having="static_items"))
    async def test_fake_fail_next_by_path(self, dialect: Dialect, fake: Any, client: Any) -> None:
        item, value = next(iter(dialect.static_items.items()))
        fake.fail_next(1, status=503, path=dialect.item_prefix + item)
        assert await client.poll() is None  # the notice item is unaffected
        with pytest.raises(MetadataUnavailable, match="503"):
            await client.get_metadata(item)
        assert await client.get_metadata(item) == value


class TokenContract:
    """The IMDS-style session token (AWS IMDSv2, Alibaba ECS hardened mode), client and
    fake. Subclasses provide ``token_dialect`` (a :class:`TokenDialect`), ``fake``
    (tokens required, on ``fake_clock``) and ``client`` (sending tokens, real clock)."""

    async def test_an_expired_token_is_refreshed_not_an_error(self, fake: Any, fake_clock: Clock,
                                                              client: Any) -> None:
        """Only the fake's clock moves: the client still believes in its token -> 401 -> new PUT."""
        fake.publish_interruption(time=DEADLINE)
        assert await client.poll() is not None
        fake_clock.advance(21600)
        notice = await client.poll()
        assert notice is not None and notice.deadline == DEADLINE
        assert fake.token_puts == 2
        assert statuses(fake, "GET") == [200, 401, 200]

    async def test_the_token_is_refreshed_before_it_expires(self, token_dialect: TokenDialect, fake: Any,
                                                            fake_clock: Clock) -> None:
        """Client and fake share a clock: the client renews ahead of expiry, never sees 401."""
        fake.publish_interruption(time=DEADLINE)
        async with token_dialect.dialect.client(fake.url, token_ttl_s=100, clock=fake_clock) as client:
            first = await client.poll()
            assert first is not None
            fake_clock.advance(80)  # < 85 s (the earlier of 90 % and TTL - 15 s): keep it
            assert await client.poll() == first
            assert fake.token_puts == 1
            fake_clock.advance(6)  # 86 s: renew before the fake expires it at 100 s
            assert await client.poll() == first
            assert fake.token_puts == 2
            fake_clock.advance(84)  # within the second token's refresh window
            assert await client.poll() == first
            assert fake.token_puts == 2
            fake_clock.advance(2)  # past it: a third token, still no 401
            assert await client.poll() == first
        assert statuses(fake, "PUT") == [200, 200, 200]
        assert 401 not in statuses(fake, "GET")

    async def test_forgotten_tokens_are_fetched_again_once(self, fake: Any, client: Any) -> None:
        fake.publish_interruption(time=DEADLINE)
        assert await client.poll() is not None
        fake.forget_tokens()  # the metadata server restarted
        notice = await client.poll()
        assert notice is not None and notice.deadline == DEADLINE
        assert statuses(fake, "PUT") == [200, 200]
        assert statuses(fake, "GET") == [200, 401, 200]

    @pytest.mark.parametrize(("token_dialect", "status"), token_rejections())
    async def test_a_persistent_rejection_is_unavailable_after_one_retry(self, token_dialect: TokenDialect,
                                                                         fake: Any, client: Any,
                                                                         status: int) -> None:
        assert await client.poll() is None  # holds a token
        fake.fail_next(2, status=status, path=token_dialect.dialect.notice_path)
        with pytest.raises(MetadataUnavailable, match=f"{status} again"):
            await client.poll()
        assert statuses(fake, "PUT") == [200, 200]  # exactly one re-fetch
        assert await client.poll() is None  # recovers on the next tick

    async def test_a_failed_token_put_is_unavailable(self, fake: Any, client: Any) -> None:
        fake.fail_next(1, status=500)  # the very first request: the token PUT
        with pytest.raises(MetadataUnavailable, match="PUT"):
            await client.poll()
        assert await client.poll() is None

    async def test_concurrent_polls_share_one_token(self, fake: Any, client: Any) -> None:
        results = await asyncio.gather(*(client.poll() for _ in range(5)))
        assert results == [None] * 5
        assert fake.token_puts == 1

    @pytest.mark.parametrize("ttl", [0, -1, 21601, 1.5, True])
    def test_token_ttl_bounds(self, token_dialect: TokenDialect, ttl: object) -> None:
        with pytest.raises(ValueError, match="token_ttl_s"):
            token_dialect.dialect.client(DEFAULT_URLS[token_dialect.dialect.name], token_ttl_s=ttl)
        for ok in (1, 21600):  # inclusive
            token_dialect.dialect.client(DEFAULT_URLS[token_dialect.dialect.name], token_ttl_s=ok)

    # -- the fake ----------------------------------------------------------------------------

    async def test_fake_refuses_a_missing_forged_or_expired_token(self, token_dialect: TokenDialect, fake: Any,
                                                                  fake_clock: Clock,
                                                                  http: aiohttp.ClientSession) -> None:
        p = token_dialect.protocol
        url = fake.url + META_DATA_PREFIX + "instance-id"
        async with http.get(url) as resp:
            assert resp.status == 401
        async with http.get(url, headers={p.token_header: "forged"}) as resp:
            assert resp.status == 401
        token = await _token(http, fake, p, "60")
        async with http.get(url, headers={p.token_header: token}) as resp:
            assert resp.status == 200 and resp.content_type == "text/plain"
            assert await resp.text() == token_dialect.dialect.static_items["instance-id"]
        fake_clock.advance(60)  # the TTL has run out
        async with http.get(url, headers={p.token_header: token}) as resp:
            assert resp.status == 401

    @pytest.mark.parametrize("ttl", [None, "", "0", "21601", "-5", "abc", "1.5"])
    async def test_fake_token_put_needs_a_valid_ttl(self, token_dialect: TokenDialect, fake: Any,
                                                    http: aiohttp.ClientSession, ttl: str | None) -> None:
        p = token_dialect.protocol
        headers = {} if ttl is None else {p.ttl_header: ttl}
        async with http.put(fake.url + p.path, headers=headers) as resp:
            assert resp.status == 400
        assert fake.token_puts == 0

    async def test_fake_token_rules(self, token_dialect: TokenDialect, fake: Any,
                                    http: aiohttp.ClientSession) -> None:
        p = token_dialect.protocol
        for ttl in ("1", "21600"):
            assert await _token(http, fake, p, ttl)
        assert fake.token_puts == 2
        async with http.put(fake.url + p.path, headers={token_dialect.foreign_ttl_header: "60"}) as resp:
            assert resp.status == 400  # the other cloud's header is not this one's
        async with http.get(fake.url + p.path) as resp:
            assert resp.status == 405


async def _token(http: aiohttp.ClientSession, fake: Any, protocol: TokenProtocol, ttl: str) -> str:
    async with http.put(fake.url + protocol.path, headers={protocol.ttl_header: ttl}) as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        return await resp.text()
