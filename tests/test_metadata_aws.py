"""What only the AWS IMDSv2 dialect (daemon/gpunode/metadata/aws.py) and its local fake
(daemon/providers/local_metadata/aws.py) do: rebalance recommendations, the action field,
the legacy ``spot/termination-time`` item, ``HttpTokens=optional``, and IMDS's refusal of
a forwarded token PUT. What every dialect does alike (notices, faults, tokens, lifetime)
is the contract in tests/metadata_contract.py, run by tests/test_metadata_dialects.py.

No sleeps: token expiry is driven by an injected clock.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import aiohttp
import pytest

from daemon.gpunode.metadata import MetadataUnavailable, NoticeKind, notice_id
from daemon.gpunode.metadata.aws import (
    INSTANCE_ACTION_PATH,
    TOKEN_HEADER,
    TOKEN_PATH,
    TTL_HEADER,
    AwsImds,
)
from daemon.providers.local_metadata.aws import FakeImds
from conftest import ManualClock as Clock
from metadata_contract import AWS, Dialect
import metadata_contract

DEADLINE = datetime(2017, 9, 18, 8, 22, tzinfo=timezone.utc)


# the contract's fixtures, under their own names (pytest finds fixtures by module attribute)
client, fake, fake_clock, http = (metadata_contract.client, metadata_contract.fake,
                                  metadata_contract.fake_clock, metadata_contract.http)


@pytest.fixture
def dialect() -> Dialect:
    return AWS


# -- the dialect -------------------------------------------------------------------


async def test_no_notice_is_none(fake: FakeImds, client: AwsImds) -> None:
    assert await client.poll() is None
    assert await client.poll_rebalance() is None
    assert fake.request_log[0] == ("PUT", TOKEN_PATH, 200)
    assert ("GET", INSTANCE_ACTION_PATH, 404) in fake.request_log


async def test_rebalance_recommendation(fake: FakeImds, client: AwsImds) -> None:
    fake.publish_rebalance(datetime(2020, 10, 27, 8, 22, tzinfo=timezone.utc))
    notice = await client.poll_rebalance()
    assert notice is not None
    assert notice.kind is NoticeKind.REBALANCE
    assert notice.action is None and notice.deadline is None
    assert json.loads(notice.raw) == {"noticeTime": "2020-10-27T08:22:00Z"}
    assert notice.id == notice_id("aws", NoticeKind.REBALANCE, notice.raw)
    assert await client.poll() is None  # a recommendation is not an interruption


async def test_concurrent_polls_and_rebalance_share_one_token(fake: FakeImds, client: AwsImds) -> None:
    fake.publish_rebalance()
    results = await asyncio.gather(client.poll(), client.poll_rebalance(), client.poll())
    assert results[0] is None and results[2] is None
    assert results[1] is not None and results[1].kind is NoticeKind.REBALANCE
    assert fake.token_puts == 1


@pytest.mark.parametrize("body", ["{}", '{"noticeTime": 5}', "<html>"])
async def test_garbage_rebalance_is_unavailable(fake: FakeImds, client: AwsImds, body: str) -> None:
    fake.publish_raw("events/recommendations/rebalance", body)
    with pytest.raises(MetadataUnavailable):
        await client.poll_rebalance()


async def test_unknown_action_is_still_an_interruption(fake: FakeImds, client: AwsImds) -> None:
    fake.publish_raw("spot/instance-action", '{"action": "evict", "time": "2017-09-18T08:22:00Z"}')
    notice = await client.poll()
    assert notice is not None and notice.action == "evict" and notice.deadline == DEADLINE


# -- the fake, checked directly ---------------------------------------------------------


async def _token(http: aiohttp.ClientSession, fake: FakeImds, ttl: str = "60") -> str:
    async with http.put(fake.url + TOKEN_PATH, headers={TTL_HEADER: ttl}) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        return await resp.text()


async def test_fake_token_put_rules(fake: FakeImds, http: aiohttp.ClientSession) -> None:
    async with http.put(fake.url + TOKEN_PATH, headers={TTL_HEADER: "60"}) as resp:
        assert resp.status == 200 and resp.headers[TTL_HEADER] == "60"  # the TTL is echoed
    async with http.put(
        fake.url + TOKEN_PATH, headers={TTL_HEADER: "60", "X-Forwarded-For": "10.0.0.1"}
    ) as resp:
        assert resp.status == 403
    assert fake.token_puts == 1


async def test_fake_serves_documents(
    fake: FakeImds, fake_clock: Clock, http: aiohttp.ClientSession
) -> None:
    token = await _token(http, fake, "60")
    h = {TOKEN_HEADER: token}

    async def get(item: str) -> tuple[int, str, str]:
        async with http.get(fake.url + "/latest/meta-data/" + item, headers=h) as resp:
            return resp.status, resp.content_type, await resp.text()

    assert await get("instance-id") == (200, "text/plain", "i-0abc")
    assert (await get("spot/instance-action"))[0] == 404
    assert (await get("spot/termination-time"))[0] == 404
    assert (await get("instance-action-typo"))[0] == 404
    async with http.get(fake.url + "/nowhere", headers=h) as resp:
        assert resp.status == 404

    fake.publish_interruption(action="terminate", time=DEADLINE)
    assert await get("spot/instance-action") == (
        200,
        "text/plain",
        '{"action": "terminate", "time": "2017-09-18T08:22:00Z"}',
    )
    assert await get("spot/termination-time") == (200, "text/plain", "2017-09-18T08:22:00Z")
    fake.publish_interruption(action="hibernate", time=DEADLINE)
    assert (await get("spot/termination-time"))[0] == 404

    fake_clock.advance(60)  # the token's TTL has run out
    assert (await get("instance-id"))[0] == 401


async def test_fake_optional_tokens_allows_v1_reads(http: aiohttp.ClientSession) -> None:
    async with FakeImds(http_tokens="optional") as fake:
        async with http.get(fake.url + "/latest/meta-data/instance-id") as resp:
            assert resp.status == 200
        async with http.get(
            fake.url + "/latest/meta-data/instance-id", headers={TOKEN_HEADER: "bad"}
        ) as resp:
            assert resp.status == 401


def test_fake_rejects_bad_publish() -> None:
    with pytest.raises(ValueError, match="action"):
        FakeImds().publish_interruption(action="explode")
