"""What only the Alibaba Cloud ECS metadata dialect (daemon/gpunode/metadata/aliyun.py) and
its local fake (daemon/providers/local_metadata/aliyun.py) do: normal mode (no token),
a normal client against a hardened-only instance, and a time with another offset. What
every dialect does alike (notices, faults, hardened-mode tokens, lifetime) is the
contract in tests/metadata_contract.py, run by tests/test_metadata_dialects.py.
"""

from __future__ import annotations

from datetime import datetime, timezone

import aiohttp
import pytest

from daemon.gpunode.metadata import MetadataUnavailable
from daemon.gpunode.metadata.aliyun import TOKEN_HEADER, AliyunMetadata
from daemon.providers.local_metadata.aliyun import FakeAliyunMetadata
from metadata_contract import ALIYUN, Dialect
import metadata_contract

DEADLINE = datetime(2015, 1, 5, 18, 2, tzinfo=timezone.utc)
STAMP = "2015-01-05T18:02:00Z"


# the contract's fixtures, under their own names (pytest finds fixtures by module attribute)
fake, fake_clock, http = (metadata_contract.fake, metadata_contract.fake_clock, metadata_contract.http)


@pytest.fixture
def dialect() -> Dialect:
    return ALIYUN  # its fake is hardened-only (tokens required)


def gets(fake: FakeAliyunMetadata) -> list[int]:
    return [status for method, _, status in fake.request_log if method == "GET"]


@pytest.mark.parametrize("hardened", [False, True])
async def test_no_notice_is_none_over_many_polls(hardened: bool) -> None:
    async with FakeAliyunMetadata(hardened=hardened) as fake:
        async with AliyunMetadata(fake.url, hardened=hardened) as client:
            for _ in range(25):
                assert await client.poll() is None
        assert gets(fake) == [404] * 25
        assert fake.token_puts == (1 if hardened else 0)
        assert fake.published_at is None


async def test_offset_timestamp_is_normalised(fake: FakeAliyunMetadata) -> None:
    fake.publish_raw("instance/spot/termination-time", "2015-01-06T02:02:00+08:00")
    async with AliyunMetadata(fake.url, hardened=True) as client:
        notice = await client.poll()
    assert notice is not None and notice.deadline == DEADLINE
    assert notice.raw == "2015-01-06T02:02:00+08:00"


async def test_normal_client_against_hardened_only_instance(fake: FakeAliyunMetadata) -> None:
    async with AliyunMetadata(fake.url) as client:
        with pytest.raises(MetadataUnavailable, match="hardening"):
            await client.poll()
    assert fake.token_puts == 0


async def test_fake_normal_mode_serves_without_token(http: aiohttp.ClientSession) -> None:
    async with FakeAliyunMetadata() as fake:
        base = fake.url + "/latest/meta-data/"
        async with http.get(base + "instance/spot/termination-time") as resp:
            assert resp.status == 404
        fake.publish_interruption(time=DEADLINE)
        async with http.get(base + "instance/spot/termination-time") as resp:
            assert (resp.status, resp.content_type, await resp.text()) == (200, "text/plain", STAMP)
        async with http.get(base + "instance-id") as resp:
            assert (await resp.text()).startswith("i-bp1")
        async with http.get(base + "instance-id", headers={TOKEN_HEADER: "bad"}) as resp:
            assert resp.status == 401
        async with http.get(fake.url + "/nowhere") as resp:
            assert resp.status == 404
