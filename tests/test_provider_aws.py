"""AwsProvider against moto's EC2, through a fault-injecting proxy (tests/fakes/aws_faults.py)."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator, Callable

import boto3
import botocore.exceptions
import pytest

from daemon.config import AwsProviderSpec
from daemon.control.pool import Offer
from daemon.providers.aws import AwsProvider, PriceError, client_token, map_client_error
from daemon.providers.base import (
    AuthError,
    NODE_TAG,
    POOL_TAG,
    CapacityError,
    NodeSpec,
    ProviderError,
    QuotaError,
    TransientError,
    create_provider,
)
from fakes.aws_faults import AwsFaultProxy
from provider_contract import ProviderContract

# One of moto's built-in AMIs (present in every region moto serves).
_AMI = "ami-03cf127a"
_TYPE = "g5.xlarge"
_READ_TIMEOUT_S = 0.5
_SECRET = "SVtestSECRETd0n0tl0g9f3a"

_seq = itertools.count(1)


def _offer(index: int = 0, *, region: str = "us-east-1", zone: str | None = "us-east-1a",
           max_price: float | None = 2.5) -> Offer:
    return Offer(index=index, provider="aws", region=region, zone=zone, instance_type=_TYPE,
                 gpus_per_node=1, price_usd_h=None, max_price_usd_h=max_price)


def _make(spec: AwsProviderSpec, **kw: object) -> AwsProvider:
    opts: dict[str, object] = dict(retry_attempts=4, retry_initial_s=0.01, retry_max_s=0.05,
                                   connect_timeout_s=1.0, read_timeout_s=_READ_TIMEOUT_S)
    opts.update(kw)
    return AwsProvider(spec=spec, **opts)  # type: ignore[arg-type]


@pytest.fixture
def spec(faults: AwsFaultProxy) -> AwsProviderSpec:
    return AwsProviderSpec(image_id=_AMI, endpoint_url=faults.url)


@pytest.fixture
async def provider(spec: AwsProviderSpec) -> AsyncIterator[AwsProvider]:
    prov = _make(spec, region="us-east-1")
    try:
        yield prov
    finally:
        await prov.aclose()


@pytest.fixture
def offer() -> Offer:
    return _offer()


@pytest.fixture
def pool() -> str:
    return f"pool-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def node_spec(pool: str) -> Callable[..., NodeSpec]:
    def make(pool_: str | None = None) -> NodeSpec:
        p = pool_ or pool
        node_id = f"n{next(_seq):04d}-{uuid.uuid4().hex[:6]}"
        return NodeSpec(node_id=node_id, pool=p, token=f"tok{uuid.uuid4().hex}",
                        daemon_url="http://10.0.0.5:8470",
                        tags={"spotvisor-pool": p, "spotvisor-node": node_id, "team": "llm"})
    return make


@pytest.fixture
def ec2(ec2_server: str):
    """A plain boto3 client straight to moto (no proxy), for checks the provider does not offer."""
    return boto3.client("ec2", region_name="us-east-1", endpoint_url=ec2_server)


def _live_for_node(ec2, node_id: str) -> list[str]:
    resp = ec2.describe_instances(Filters=[{"Name": "tag:spotvisor-node", "Values": [node_id]},
                                           {"Name": "instance-state-name", "Values": ["pending", "running"]}])
    return [i["InstanceId"] for r in resp["Reservations"] for i in r["Instances"]]


class TestAwsContract(ProviderContract):
    pass


class TestAwsFleetContract(ProviderContract):
    """The same contract with ``launch_method="create_fleet"``."""

    @pytest.fixture
    def spec(self, faults: AwsFaultProxy) -> AwsProviderSpec:
        return AwsProviderSpec(image_id=_AMI, endpoint_url=faults.url, launch_method="create_fleet")

    @pytest.fixture
    def offer(self) -> Offer:
        # moto places fleet instances by the default subnet, ignoring the override's zone.
        return _offer(zone=None)


# -- construction -------------------------------------------------------------------------

def test_registered_and_ignores_daemon_kwargs(tmp_path) -> None:
    prov = create_provider("aws", spec=AwsProviderSpec(image_id=_AMI), state_dir=tmp_path, agent_args=["-v"])
    assert isinstance(prov, AwsProvider)


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="retry_attempts"):
        AwsProvider(spec=AwsProviderSpec(image_id=_AMI), retry_attempts=0)


def test_client_token_is_deterministic_short_and_new_for_a_reused_node_id() -> None:
    def spec(node_id: str, token: str = "t-1") -> NodeSpec:
        return NodeSpec(node_id=node_id, pool="p", token=token, daemon_url="http://d:1")

    tok = client_token(spec("node-0001"))
    assert tok == client_token(spec("node-0001")) != client_token(spec("node-0002"))
    assert len(tok) <= 64 and tok.isascii() and "t-1" not in tok
    # a later run's node with the same id (a new state directory): a new purchase, not
    # the earlier one's token with other parameters (IdempotentParameterMismatch)
    assert client_token(spec("node-0001", token="t-2")) != tok


@pytest.mark.parametrize(("code", "status", "kind"), [
    ("InsufficientInstanceCapacity", 500, CapacityError),
    ("InsufficientCapacity", 500, CapacityError),
    ("UnfulfillableCapacity", 400, CapacityError),
    ("SpotMaxPriceTooLow", 400, PriceError),
    ("MaxSpotInstanceCountExceeded", 400, QuotaError),
    ("InstanceLimitExceeded", 400, QuotaError),
    ("VcpuLimitExceeded", 400, QuotaError),
    ("AuthFailure", 401, AuthError),
    ("UnauthorizedOperation", 403, AuthError),
    ("RequestLimitExceeded", 503, TransientError),
    ("InternalError", 500, TransientError),
    ("Unavailable", 503, TransientError),
    ("SomethingNew", 502, TransientError),
    ("InvalidAMIID.NotFound", 400, ProviderError),
])
def test_error_mapping(code: str, status: int, kind: type) -> None:
    err = map_client_error(code, "msg", status=status, what="RunInstances in us-east-1")
    assert type(err) is kind


# -- launch details -----------------------------------------------------------------------

async def test_launch_sends_spot_options_tags_and_token(provider, faults, node_spec, ec2) -> None:
    node = node_spec()
    inst = await provider.launch(_offer(max_price=3.25), node)
    (req,) = faults.actions("RunInstances")
    p = req.params
    assert p["InstanceMarketOptions.MarketType"] == "spot"
    assert p["InstanceMarketOptions.SpotOptions.MaxPrice"] == "3.25"
    assert p["InstanceMarketOptions.SpotOptions.SpotInstanceType"] == "one-time"
    assert p["InstanceMarketOptions.SpotOptions.InstanceInterruptionBehavior"] == "terminate"
    assert p["ClientToken"] == client_token(node)
    assert p["Placement.AvailabilityZone"] == "us-east-1a"
    raw = ec2.describe_instances(InstanceIds=[inst.id])["Reservations"][0]["Instances"][0]
    tags = {t["Key"]: t["Value"] for t in raw["Tags"]}
    assert tags == node.tags
    assert raw.get("InstanceLifecycle") == "spot"


async def test_launch_goes_into_the_domains_placement_group(provider, faults, node_spec) -> None:
    """A placement domain with a cluster placement group: every node of the job is launched
    into it (RunInstances ``Placement.GroupName``), so the job's nodes share its network."""
    # a region no other test lists: moto's DescribeInstances answers 500 once a region holds an
    # instance in a placement group (a moto defect), so only the request is checked here
    offer = dataclasses.replace(_offer(region="eu-north-1", zone="eu-north-1a"), placement_group="train-pg")
    inst = await provider.launch(offer, node_spec())
    (req,) = faults.actions("RunInstances")
    assert req.params["Placement.GroupName"] == "train-pg"
    assert req.params["Placement.AvailabilityZone"] == "eu-north-1a"
    assert inst.id.startswith("i-")


async def test_launch_uses_the_zones_subnet(faults, node_spec, ec2) -> None:
    subnet = ec2.describe_subnets(Filters=[{"Name": "availability-zone", "Values": ["us-east-1b"]}])["Subnets"][0]
    spec = AwsProviderSpec(image_id=_AMI, endpoint_url=faults.url, subnet_ids={"us-east-1b": subnet["SubnetId"]})
    prov = _make(spec)
    try:
        inst = await prov.launch(_offer(zone="us-east-1b"), node_spec())
        raw = ec2.describe_instances(InstanceIds=[inst.id])["Reservations"][0]["Instances"][0]
        assert raw["SubnetId"] == subnet["SubnetId"]
        assert inst.zone == "us-east-1b"
    finally:
        await prov.aclose()


@pytest.mark.parametrize("method", ["run_instances", "create_fleet"])
async def test_user_data_carries_daemon_url_and_node_id(faults, node_spec, ec2, method) -> None:
    prov = _make(AwsProviderSpec(image_id=_AMI, endpoint_url=faults.url, launch_method=method))
    try:
        node = node_spec()
        inst = await prov.launch(_offer(), node)
        attr = ec2.describe_instance_attribute(InstanceId=inst.id, Attribute="userData")
        script = base64.b64decode(attr["UserData"]["Value"]).decode()
        assert f"SPOTVISOR_DAEMON_URL={node.daemon_url}" in script
        assert f"SPOTVISOR_NODE_ID={node.node_id}" in script
        assert script.startswith("#!/bin/bash")
    finally:
        await prov.aclose()


async def test_fleet_leaves_no_launch_template(faults, node_spec, ec2) -> None:
    prov = _make(AwsProviderSpec(image_id=_AMI, endpoint_url=faults.url, launch_method="create_fleet"))
    try:
        node = node_spec()
        await prov.launch(_offer(), node)
        (req,) = faults.actions("CreateFleet")
        assert req.params["SpotOptions.AllocationStrategy"] == "price-capacity-optimized"
        assert req.params["Type"] == "instant"
        # the request itself names the pool tag: the control node's policy (aws:RequestTag) needs it
        assert req.params["TagSpecification.1.ResourceType"] == "instance"
        tags = {req.params[k]: req.params[k[:-3] + "Value"] for k in req.params
                if k.startswith("TagSpecification.1.Tag.") and k.endswith(".Key")}
        assert tags[POOL_TAG] == node.pool and tags[NODE_TAG] == node.node_id
        with pytest.raises(botocore.exceptions.ClientError):
            ec2.describe_launch_templates(LaunchTemplateNames=[client_token(node)])
    finally:
        await prov.aclose()


# -- a restarted daemon, regions ----------------------------------------------------------

async def test_fresh_provider_finds_instances_by_tag(provider, spec, node_spec) -> None:
    node = node_spec()
    inst = await provider.launch(_offer(), node)
    fresh = _make(spec, region="us-east-1")  # a restarted daemon: no memory of the launch
    try:
        found = await fresh.describe(node.pool)
        assert [(i.id, i.node_id) for i in found] == [(inst.id, node.node_id)]
        await fresh.terminate(inst.id)
        assert await provider.describe(node.pool) == []
    finally:
        await fresh.aclose()


async def test_describe_covers_every_region_launched_in(provider, node_spec) -> None:
    east = await provider.launch(_offer(), node_spec())
    west = await provider.launch(_offer(region="us-west-2", zone="us-west-2b"), node_spec())
    found = {i.id: i.zone for i in await provider.describe(node_spec().pool)}
    assert found == {east.id: "us-east-1a", west.id: "us-west-2b"}
    await provider.terminate(west.id)
    assert [i.id for i in await provider.describe(node_spec().pool)] == [east.id]


# -- faults -------------------------------------------------------------------------------

async def test_capacity_errors_are_typed_and_the_third_offer_launches(provider, faults, node_spec) -> None:
    faults.fail_next("RunInstances", "InsufficientInstanceCapacity", 500, n=2,
                     message="We currently do not have sufficient g5.xlarge capacity in the AZ you requested")
    offers = [_offer(i, zone=z) for i, z in enumerate(["us-east-1a", "us-east-1b", "us-east-1c"])]
    node = node_spec()
    for off in offers[:2]:
        with pytest.raises(CapacityError, match="InsufficientInstanceCapacity") as info:
            await provider.launch(off, node)
        assert not isinstance(info.value, TransientError)
        assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
    inst = await provider.launch(offers[2], node)
    assert inst.zone == "us-east-1c"
    assert len(faults.actions("RunInstances")) == 3  # capacity is not retried in place


async def test_spot_max_price_too_low_is_a_price_error(provider, faults, node_spec) -> None:
    faults.fail_next("RunInstances", "SpotMaxPriceTooLow", 400)
    with pytest.raises(PriceError):
        await provider.launch(_offer(), node_spec())


async def test_fleet_errors_array_maps_to_capacity(faults, node_spec) -> None:
    body = ('<?xml version="1.0" encoding="UTF-8"?>'
            '<CreateFleetResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
            '<requestId>r-1</requestId><fleetId>fleet-1</fleetId>'
            '<errorSet><item><errorCode>InsufficientInstanceCapacity</errorCode>'
            '<errorMessage>no capacity</errorMessage><lifecycle>spot</lifecycle></item></errorSet>'
            '<fleetInstanceSet/></CreateFleetResponse>')
    faults.reply_next("CreateFleet", body)
    prov = _make(AwsProviderSpec(image_id=_AMI, endpoint_url=faults.url, launch_method="create_fleet"))
    try:
        with pytest.raises(CapacityError, match="InsufficientInstanceCapacity"):
            await prov.launch(_offer(), node_spec())
        assert len(faults.actions("DeleteLaunchTemplate")) == 1
    finally:
        await prov.aclose()


async def test_throttling_is_retried(provider, faults, node_spec, ec2) -> None:
    faults.fail_next("RunInstances", "RequestLimitExceeded", 503, n=2, message="Request limit exceeded.")
    node = node_spec()
    inst = await provider.launch(_offer(), node)
    assert [s.fault for s in faults.actions("RunInstances")] == ["fail", "fail", None]
    assert _live_for_node(ec2, node.node_id) == [inst.id]


async def test_throttling_past_the_retry_budget_is_transient(provider, faults, node_spec) -> None:
    faults.fail_next("RunInstances", "RequestLimitExceeded", 503, n=10)
    with pytest.raises(TransientError, match="RequestLimitExceeded"):
        await provider.launch(_offer(), node_spec())
    assert len(faults.actions("RunInstances")) == 4


async def test_timeout_after_the_request_landed_yields_one_instance(provider, faults, node_spec, ec2) -> None:
    faults.delay_next("RunInstances", seconds=_READ_TIMEOUT_S * 4)  # moto creates it, the answer is late
    node = node_spec()
    inst = await provider.launch(_offer(), node)
    # it did not wait for the late answer (a wall-clock bound here failed under load):
    # it gave up at its read timeout and looked the instance up by its node tag
    assert any(s.action == "DescribeInstances" for s in faults.requests)
    assert _live_for_node(ec2, node.node_id) == [inst.id]
    assert inst.node_id == node.node_id
    assert len(faults.actions("RunInstances")) == 1  # the retry found it instead of launching again


async def test_timeout_before_the_request_landed_launches_on_retry(provider, faults, node_spec, ec2) -> None:
    faults.delay_next("RunInstances", seconds=_READ_TIMEOUT_S * 4, after_forward=False)
    node = node_spec()
    inst = await provider.launch(_offer(), node)
    tokens = {s.params["ClientToken"] for s in faults.actions("RunInstances")}
    assert tokens == {client_token(node)}  # the same token on every try
    # The held request reaches moto only when the proxy releases it, after this test: one instance now.
    assert _live_for_node(ec2, node.node_id) == [inst.id]


async def test_auth_failure_is_auth_error_without_the_secret(spec, faults, node_spec, monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", _SECRET)
    prov = _make(spec)
    try:
        faults.fail_next("RunInstances", "AuthFailure", 401,
                         message="AWS was not able to validate the provided access credentials")
        with pytest.raises(AuthError) as info:
            await prov.launch(_offer(), node_spec())
        assert len(faults.actions("RunInstances")) == 1  # not retried
        chain = [info.value, info.value.__cause__]
        assert all(_SECRET not in str(e) and _SECRET not in repr(e) for e in chain)
        assert "AuthFailure" in str(info.value)
    finally:
        await prov.aclose()


async def test_missing_credentials_is_auth_error(spec, node_spec, monkeypatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    prov = _make(spec)
    try:
        with pytest.raises(AuthError, match="no usable AWS credentials"):
            await prov.describe("any-pool")
    finally:
        await prov.aclose()


@pytest.mark.parametrize("code", ["MaxSpotInstanceCountExceeded", "VcpuLimitExceeded"])
async def test_quota_is_quota_error(provider, faults, node_spec, code) -> None:
    faults.fail_next("RunInstances", code, 400)
    with pytest.raises(QuotaError, match=code):
        await provider.launch(_offer(), node_spec())
    assert len(faults.actions("RunInstances")) == 1


async def test_transient_describe_is_retried(provider, faults, node_spec) -> None:
    node = node_spec()
    inst = await provider.launch(_offer(), node)
    faults.fail_next("DescribeInstances", "InternalError", 500)
    assert [i.id for i in await provider.describe(node.pool)] == [inst.id]


async def test_spot_price_is_cached(provider, faults) -> None:
    first = await provider.spot_price(_offer())
    second = await provider.spot_price(_offer())
    assert first is not None and first == second
    assert len(faults.actions("DescribeSpotPriceHistory")) == 1


async def test_spot_price_unknown_type_is_none(provider) -> None:
    off = Offer(index=0, provider="aws", region="us-east-1", zone="us-east-1a", instance_type="zz9.nope",
                gpus_per_node=1)
    assert await provider.spot_price(off) is None


async def test_closed_provider_refuses(spec) -> None:
    prov = _make(spec)
    await prov.aclose()
    await prov.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await prov.describe("p")


async def test_on_demand_fallback_offer_launches_without_spot_options(provider, faults, node_spec, ec2) -> None:
    import dataclasses

    inst = await provider.launch(dataclasses.replace(_offer(), on_demand=True), node_spec())
    (req,) = faults.actions("RunInstances")
    assert not any(k.startswith("InstanceMarketOptions") for k in req.params)
    raw = ec2.describe_instances(InstanceIds=[inst.id])["Reservations"][0]["Instances"][0]
    assert raw.get("InstanceLifecycle") != "spot"
