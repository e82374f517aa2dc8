"""AliyunProvider against FakeEcs (tests/fakes/ecs.py): the Provider contract, plus the
ECS-specific paths -- signature checking, error mapping, idempotent retries, paging,
user-data, price history."""

from __future__ import annotations

import base64
import itertools
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from daemon.config import AliyunProviderSpec
from daemon.control.pool import Offer
from daemon.providers import aliyun as aliyun_mod
from daemon.providers.aliyun import AliyunProvider, PriceError, client_token, region_of_zone
from daemon.providers.base import (
    AuthError,
    CapacityError,
    NodeSpec,
    ProviderError,
    QuotaError,
    TransientError,
    create_provider,
)
from fakes.ecs import FakeEcs
from provider_contract import ProviderContract

AK_ID, AK_SECRET = "LTAI-test-id", "test-secret-value"
ZONES = {"cn-hangzhou-g": "vsw-g", "cn-hangzhou-h": "vsw-h", "cn-hangzhou-i": "vsw-i", "cn-shanghai-b": "vsw-sb"}
_CRED_ENV = ("ALIBABA_CLOUD_ACCESS_KEY_ID", "ALIBABA_CLOUD_ACCESS_KEY_SECRET", "ALIBABA_CLOUD_SECURITY_TOKEN",
             "ALIYUN_ACCESS_KEY_ID", "ALIYUN_ACCESS_KEY_SECRET", "ALIBABA_CLOUD_ECS_METADATA", "ALIBABA_CLOUD_PROFILE",
             "HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ambient credentials or proxies: every provider here gets its keys explicitly."""
    for name in _CRED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ALIBABA_CLOUD_CREDENTIALS_FILE", "/nonexistent/credentials")


@pytest.fixture
async def fake() -> AsyncIterator[FakeEcs]:
    async with FakeEcs(access_key_id=AK_ID, access_key_secret=AK_SECRET) as ecs:
        yield ecs


@pytest.fixture
async def make_provider(fake: FakeEcs) -> AsyncIterator[Callable[..., AliyunProvider]]:
    made: list[AliyunProvider] = []

    def make(*, strategy: str = "SpotWithPriceLimit", secret: str = AK_SECRET, key_id: str = AK_ID,
             **kwargs: object) -> AliyunProvider:
        spec = AliyunProviderSpec(image_id="m-test", security_group_id="sg-test", vswitch_ids=ZONES,
                                  spot_strategy=strategy, endpoint=fake.endpoint)
        kwargs.setdefault("retry_wait_s", 0.0)
        creds = {} if key_id is None else {"access_key_id": key_id, "access_key_secret": secret}
        p = AliyunProvider(spec=spec, **creds, **kwargs)  # type: ignore[arg-type]
        made.append(p)
        return p

    yield make
    for p in made:
        await p.aclose()


def _offer(zone: str = "cn-hangzhou-g", index: int = 0, max_price: float | None = 2.5,
           itype: str = "ecs.gn7i-c8g1.2xlarge") -> Offer:
    return Offer(index=index, provider="aliyun", region=region_of_zone(zone), zone=zone, instance_type=itype,
                 gpus_per_node=1, max_price_usd_h=max_price)


@pytest.fixture
def pool_name() -> str:
    return f"pool-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def node_spec(pool_name: str) -> Callable[..., NodeSpec]:
    seq = itertools.count(1)

    def make(pool: str | None = None) -> NodeSpec:
        pool = pool or pool_name
        node_id = f"{pool}-{next(seq)}"
        return NodeSpec(node_id=node_id, pool=pool, token=uuid.uuid4().hex, daemon_url="http://10.0.0.5:8471",
                        tags={"spotvisor-pool": pool, "spotvisor-node": node_id})

    return make


class TestAliyunContract(ProviderContract):
    unknown_instance_id = "i-fakeffffffffffff"

    @pytest.fixture
    def provider(self, make_provider: Callable[..., AliyunProvider]) -> AliyunProvider:
        return make_provider()

    @pytest.fixture
    def offer(self, fake: FakeEcs) -> Offer:
        fake.prices[("ecs.gn7i-c8g1.2xlarge", "cn-hangzhou-g")] = [("2026-11-30T10:00:00Z", 0.8)]
        return _offer()


# -- credentials and signatures ---------------------------------------------------------------
async def test_wrong_secret_is_auth_error_and_right_one_passes(fake, make_provider, node_spec) -> None:
    bad = make_provider(secret="not-the-secret")
    with pytest.raises(AuthError) as info:
        await bad.launch(_offer(), node_spec())
    assert "not-the-secret" not in str(info.value) and AK_SECRET not in str(info.value)
    assert fake.auth_failures == 1          # refused once by the fake's HMAC check, not retried
    assert fake.instances == {} and fake.calls("RunInstances") == []

    inst = await make_provider().launch(_offer(), node_spec())
    assert list(fake.instances) == [inst.id]
    assert fake.auth_failures == 1


async def test_unknown_key_id_is_auth_error(fake, make_provider, node_spec) -> None:
    with pytest.raises(AuthError, match="InvalidAccessKeyId.NotFound"):
        await make_provider(key_id="LTAI-unknown").describe("p")


async def test_missing_credentials_is_auth_error(make_provider) -> None:
    with pytest.raises(AuthError, match="no credentials"):
        await make_provider(key_id=None).describe("p")


async def test_env_credentials_are_used(fake, make_provider, monkeypatch) -> None:
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_ID", AK_ID)
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_SECRET", AK_SECRET)
    assert await make_provider(key_id=None).describe("p") == []
    assert fake.auth_failures == 0


def test_repr_and_errors_hide_the_secret() -> None:
    spec = AliyunProviderSpec(image_id="m", security_group_id="sg", vswitch_ids=ZONES)
    p = AliyunProvider(spec=spec, access_key_id=AK_ID, access_key_secret=AK_SECRET, state_dir="/tmp", agent_args=[])
    assert AK_SECRET not in repr(p)
    with pytest.raises(ValueError):
        AliyunProvider(spec=spec, access_key_id=AK_ID)


def test_registered_by_name() -> None:
    spec = AliyunProviderSpec(image_id="m", security_group_id="sg")
    assert isinstance(create_provider("aliyun", spec=spec, state_dir="/tmp", agent_args=[]), AliyunProvider)


# -- launch -------------------------------------------------------------------------------------
async def test_launch_request_and_user_data(fake, make_provider, node_spec) -> None:
    node = node_spec()
    inst = await make_provider().launch(_offer(max_price=1.25), node)
    (params,) = fake.calls("RunInstances")
    assert params["InstanceChargeType"] == "PostPaid"
    assert params["SpotStrategy"] == "SpotWithPriceLimit" and float(params["SpotPriceLimit"]) == 1.25
    assert params["SpotDuration"] == "0" and params["SpotInterruptionBehavior"] == "Terminate"
    assert (params["ImageId"], params["SecurityGroupId"], params["VSwitchId"]) == ("m-test", "sg-test", "vsw-g")
    assert params["ZoneId"] == "cn-hangzhou-g" and params["Amount"] == "1" and params["RegionId"] == "cn-hangzhou"
    assert params["ClientToken"] == client_token(node)
    stored = fake.instances[inst.id]
    assert stored.tags == {"spotvisor-pool": node.pool, "spotvisor-node": node.node_id}
    assert base64.b64decode(params["UserData"]).decode() == stored.user_data
    assert "SPOTVISOR_DAEMON_URL=http://10.0.0.5:8471" in stored.user_data
    assert f"SPOTVISOR_NODE_ID={node.node_id}" in stored.user_data
    assert "SPOTVISOR_METADATA_DIALECT=aliyun" in stored.user_data


async def test_price_go_when_no_cap_or_configured(fake, make_provider, node_spec) -> None:
    await make_provider().launch(_offer(max_price=None), node_spec())
    await make_provider(strategy="SpotAsPriceGo").launch(_offer(max_price=3.0), node_spec())
    for params in fake.calls("RunInstances"):
        assert params["SpotStrategy"] == "SpotAsPriceGo" and "SpotPriceLimit" not in params


async def test_price_limit_below_market_is_price_error(fake, make_provider, node_spec) -> None:
    fake.prices[("ecs.gn7i-c8g1.2xlarge", "cn-hangzhou-g")] = [("2026-11-30T10:00:00Z", 1.9)]
    with pytest.raises(PriceError) as info:
        await make_provider().launch(_offer(max_price=1.0), node_spec())
    assert isinstance(info.value, CapacityError) and "LowerThanPublicPrice" in str(info.value)
    assert fake.instances == {}


async def test_no_stock_on_first_two_offers_then_third_launches(fake, make_provider, node_spec) -> None:
    fake.fail_next("RunInstances", "OperationDenied.NoStock", match={"ZoneId": "cn-hangzhou-g"})
    fake.fail_next("RunInstances", "OperationDenied.NoStock", match={"ZoneId": "cn-hangzhou-h"})
    provider = make_provider()
    offers = [_offer("cn-hangzhou-g", 0), _offer("cn-hangzhou-h", 1), _offer("cn-hangzhou-i", 2)]
    for offer in offers[:2]:
        with pytest.raises(CapacityError, match="OperationDenied.NoStock"):
            await provider.launch(offer, node_spec())
    inst = await provider.launch(offers[2], node_spec())
    assert inst.zone == "cn-hangzhou-i" and list(fake.instances) == [inst.id]
    assert len(fake.calls("RunInstances")) == 3  # capacity errors are not retried


async def test_throttling_is_retried_with_the_same_token(fake, make_provider, node_spec) -> None:
    fake.fail_next("RunInstances", "Throttling", n=2)
    inst = await make_provider().launch(_offer(), node_spec())
    calls = fake.calls("RunInstances")
    assert len(calls) == 3 and len({c["ClientToken"] for c in calls}) == 1
    assert len({c["SignatureNonce"] for c in calls}) == 3  # each try is signed anew
    assert list(fake.instances) == [inst.id]


async def test_timeout_after_the_request_was_applied_buys_one_instance(fake, make_provider, node_spec) -> None:
    fake.delay_next("RunInstances", 30.0, after_apply=True)
    inst = await make_provider(read_timeout_s=0.3).launch(_offer(), node_spec())
    assert list(fake.instances) == [inst.id]
    calls = fake.calls("RunInstances")
    assert len(calls) == 2 and calls[0]["ClientToken"] == calls[1]["ClientToken"]


async def test_unreachable_endpoint_is_transient_without_key_in_message(make_provider, node_spec) -> None:
    provider = make_provider(retry_attempts=2, connect_timeout_s=0.5)
    provider.api.endpoint = "127.0.0.1:1"  # nothing listens there
    with pytest.raises(TransientError, match="SDK.HttpError") as info:
        await provider.launch(_offer(), node_spec())
    assert AK_ID not in str(info.value) and "Signature" not in str(info.value)


async def test_transient_errors_exhaust_retries(fake, make_provider, node_spec) -> None:
    fake.fail_next("RunInstances", "InternalError", n=10)
    with pytest.raises(TransientError, match="InternalError"):
        await make_provider(retry_attempts=3).launch(_offer(), node_spec())
    assert len(fake.calls("RunInstances")) == 3


@pytest.mark.parametrize(("code", "expected"), [
    ("Zone.NotOnSale", CapacityError),
    ("InvalidInstanceType.ZoneNotSupported", CapacityError),
    ("InvalidResourceType.NotSupported", CapacityError),
    ("QuotaExceed.PostPaidInstance", QuotaError),
    ("QuotaExceed.ElasticQuota", QuotaError),
    ("Forbidden.RAM", AuthError),
    ("Throttling.User", TransientError),
    ("ServiceUnavailable", TransientError),
    ("InvalidParameter", ProviderError),
])
async def test_error_mapping(fake, make_provider, node_spec, code, expected) -> None:
    fake.fail_next("RunInstances", code, n=5)
    with pytest.raises(expected) as info:
        await make_provider(retry_attempts=2).launch(_offer(), node_spec())
    assert type(info.value) is expected and info.value.__cause__ is not None
    assert len(fake.calls("RunInstances")) == (2 if expected is TransientError else 1)


def test_client_token_is_deterministic_ascii_and_short() -> None:
    node = NodeSpec(node_id="p" * 100 + "-é", pool="p", token="t", daemon_url="http://d:1")
    token = client_token(node)
    assert token == client_token(node) and token.isascii() and len(token) <= 64
    assert client_token(NodeSpec(node_id=node.node_id, pool="p", token="other", daemon_url="http://d:1")) != token


# -- describe / terminate -----------------------------------------------------------------------
async def test_fresh_provider_finds_instances_by_tag_in_every_region(fake, make_provider, node_spec,
                                                                      pool_name) -> None:
    first = make_provider()
    a = await first.launch(_offer("cn-hangzhou-g"), node_spec())
    b = await first.launch(_offer("cn-shanghai-b"), node_spec())
    await first.launch(_offer("cn-hangzhou-h"), node_spec(pool="someone-else"))

    fresh = make_provider()  # as after a daemon restart: nothing known but the config
    found = {i.id: i for i in await fresh.describe(pool_name)}
    assert set(found) == {a.id, b.id}
    assert found[a.id].node_id == a.node_id and found[b.id].node_id == b.node_id
    assert found[b.id].zone == "cn-shanghai-b" and found[a.id].state == "running"
    assert found[a.id].launched_at is not None
    await fresh.terminate(b.id)  # the region was learned from describe
    assert [i.id for i in await fresh.describe(pool_name)] == [a.id]


async def test_describe_pages_and_skips_stopped(fake, make_provider, node_spec, pool_name, monkeypatch) -> None:
    monkeypatch.setattr(aliyun_mod, "_PAGE_SIZE", 2)
    provider = make_provider()
    ids = [(await provider.launch(_offer(), node_spec())).id for _ in range(5)]
    fake.instances[ids[0]].status = "Stopped"
    fake.instances[ids[1]].status = "Stopping"
    fake.instances[ids[2]].status = "Starting"
    found = {i.id: i.state for i in await provider.describe(pool_name)}
    assert found == {ids[2]: "pending", ids[3]: "running", ids[4]: "running"}
    assert len(fake.calls("DescribeInstances")) >= 3


async def test_terminate_of_released_instance_is_fine(fake, make_provider, node_spec) -> None:
    provider = make_provider()
    inst = await provider.launch(_offer(), node_spec())
    fake.reclaim(inst.id)
    await provider.terminate(inst.id)
    fake.fail_next("DeleteInstances", "Throttling")
    inst2 = await provider.launch(_offer(), node_spec())
    await provider.terminate(inst2.id)  # throttled once, retried
    assert fake.instances == {}
    assert all(c["Force"].lower() == "true" for c in fake.calls("DeleteInstances"))


# -- prices -------------------------------------------------------------------------------------
async def test_spot_price_newest_cached_and_none_when_empty(fake, make_provider) -> None:
    now = [1000.0]
    provider = make_provider(clock=lambda: now[0], price_cache_s=60.0)
    offer = _offer()
    fake.prices[(offer.instance_type, "cn-hangzhou-g")] = [
        ("2026-11-30T08:00:00Z", 0.70), ("2026-11-30T10:00:00Z", 0.93), ("2026-11-30T09:00:00Z", 0.81)]
    fake.prices[(offer.instance_type, "cn-hangzhou-h")] = [("2026-11-30T11:00:00Z", 0.10)]
    assert await provider.spot_price(offer) == pytest.approx(0.93)
    params = fake.calls("DescribeSpotPriceHistory")[0]
    assert (params["NetworkType"], params["ZoneId"], params["InstanceType"]) == ("vpc", "cn-hangzhou-g",
                                                                                offer.instance_type)
    fake.prices[(offer.instance_type, "cn-hangzhou-g")].append(("2026-11-30T12:00:00Z", 1.10))
    assert await provider.spot_price(offer) == pytest.approx(0.93)  # cached
    assert len(fake.calls("DescribeSpotPriceHistory")) == 1
    now[0] += 61
    assert await provider.spot_price(offer) == pytest.approx(1.10)
    assert await provider.spot_price(_offer(itype="ecs.unknown")) is None


async def test_spot_stock_reads_the_zones_stock_and_agrees_with_the_launch(fake, make_provider, node_spec) -> None:
    """DescribeAvailableResource for the offer's zone and type with the spot strategy:
    in stock, True; sold out, False (and a spot launch there is refused for capacity);
    an offer without a zone, None (its region's zones may differ)."""
    import dataclasses

    from daemon.providers.base import CapacityError

    provider, offer = make_provider(), _offer()
    assert await provider.spot_stock(offer) is True
    params = fake.calls("DescribeAvailableResource")[0]
    assert (params["DestinationResource"], params["ZoneId"], params["InstanceType"], params["InstanceChargeType"],
            params["SpotStrategy"]) == ("InstanceType", "cn-hangzhou-g", offer.instance_type, "PostPaid",
                                        provider.spec.spot_strategy)
    fake.spot_sold_out.add(("cn-hangzhou-g", offer.instance_type))
    assert await provider.spot_stock(offer) is False
    with pytest.raises(CapacityError):
        await provider.launch(offer, node_spec())
    fake.available = set()  # not sold in the zone at all
    assert await provider.spot_stock(offer) is False
    assert await provider.spot_stock(dataclasses.replace(offer, zone="")) is None


async def test_spot_price_in_cny_is_returned_as_is(fake, make_provider) -> None:
    fake.currency = "CNY"
    fake.prices[("ecs.gn7i-c8g1.2xlarge", "cn-hangzhou-g")] = [("2026-11-30T10:00:00Z", 6.5)]
    assert await make_provider().spot_price(_offer()) == pytest.approx(6.5)


async def test_aclose_is_idempotent(make_provider) -> None:
    provider = make_provider()
    await provider.describe("p")
    await provider.aclose()
    await provider.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await provider.describe("p")


async def test_on_demand_fallback_offer_is_no_spot(fake, make_provider, node_spec) -> None:
    import dataclasses

    await make_provider().launch(dataclasses.replace(_offer(max_price=1.25), on_demand=True), node_spec())
    (params,) = fake.calls("RunInstances")
    assert params["SpotStrategy"] == "NoSpot"
    assert not {"SpotPriceLimit", "SpotDuration", "SpotInterruptionBehavior"} & set(params)
