"""Per-domain launch specs (daemon/launchspec.py, Config.launch_spec) and what the AWS and
Alibaba providers send with them: real boto3 against moto's server through the recording
proxy (tests/fakes/aws_faults.py), the real aliyun SDK against tests/fakes/ecs.py."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from daemon.config import ConfigError, Config, load_config
from daemon.control.actions import NodeView
from daemon.control.lifecycle import NodeState
from daemon.control.pool import Desired, History, Offer, Timeouts, plan
from daemon.launchspec import AliyunLaunchSpec, AwsLaunchSpec
from daemon.providers.aliyun import AliyunProvider
from daemon.providers.aws import AwsProvider, launch_template_data
from daemon.providers.base import Instance, NodeSpec
from fakes.ecs import FakeEcs

ROOT = Path(__file__).resolve().parents[1]
# two of moto's built-in AMIs (moto serves the same list in every region): one per region here
AMI_EAST, AMI_WEST = "ami-03cf127a", "ami-12c6146b"
AK_ID, AK_SECRET = "LTAI-test-id", "test-secret-value"


def _node(pool: str) -> NodeSpec:
    node_id = f"n-{uuid.uuid4().hex[:8]}"
    return NodeSpec(node_id=node_id, pool=pool, token=f"tok{uuid.uuid4().hex}", daemon_url="http://10.0.0.5:7480",
                    tags={"spotvisor-pool": pool, "spotvisor-node": node_id})


def _aws_config(endpoint: str, east: dict[str, Any], west: dict[str, Any], **provider: Any) -> Config:
    """Two AWS regions, a p4d offer in us-east-1 and a p5 offer in us-west-2."""
    return Config.model_validate({
        "pool": {"target_nodes": 1, "max_nodes": 2},
        "job": {"global_batch_size": 16, "micro_batch_size": 1, "checkpoint_uri": "s3://b/east"},
        "providers": {"aws": {"endpoint_url": endpoint, **provider}},
        "domains": [
            {"name": "use1", "provider": "aws", "region": "us-east-1", "launch": east},
            {"name": "usw2", "provider": "aws", "region": "us-west-2", "checkpoint_uri": "s3://b/west",
             "rendezvous": {"host": "10.1.0.10"}, "launch": west},
        ],
        "offers": [
            {"provider": "aws", "region": "us-east-1", "zone": "us-east-1a", "instance_type": "p4d.24xlarge",
             "gpus_per_node": 8},
            {"provider": "aws", "region": "us-west-2", "zone": "us-west-2a", "instance_type": "p5.48xlarge",
             "gpus_per_node": 8, "launch_timeout_s": 900},
        ],
    })


def _offer(config: Config, i: int) -> Offer:
    o = config.offers[i]
    return Offer(index=i, provider=o.provider, region=o.region, zone=o.zone, instance_type=o.instance_type,
                 gpus_per_node=o.gpus_per_node, max_price_usd_h=o.max_price_usd_h)


def _network(ec2_server: str, region: str, zone: str) -> tuple[str, str]:
    """The default subnet of ``zone`` and a new security group in ``region`` (moto)."""
    ec2 = boto3.client("ec2", region_name=region, endpoint_url=ec2_server)
    subnet = ec2.describe_subnets(Filters=[{"Name": "availability-zone", "Values": [zone]}])["Subnets"][0]
    group = ec2.create_security_group(GroupName=f"sv-{uuid.uuid4().hex[:8]}", Description="spotvisor test",
                                      VpcId=subnet["VpcId"])["GroupId"]
    return subnet["SubnetId"], group


def _profile(ec2_server: str, name: str = "spotvisor-node") -> str:
    """An instance profile in moto's IAM (moto checks RunInstances' IamInstanceProfile)."""
    iam = boto3.client("iam", region_name="us-east-1", endpoint_url=ec2_server)
    try:
        iam.create_instance_profile(InstanceProfileName=name)
    except iam.exceptions.EntityAlreadyExistsException:
        pass
    return name


@pytest.fixture
def two_regions(ec2_server: str, faults) -> tuple[Config, dict[str, tuple[str, str]]]:
    _profile(ec2_server)
    east = _network(ec2_server, "us-east-1", "us-east-1a")
    west = _network(ec2_server, "us-west-2", "us-west-2a")
    config = _aws_config(
        faults.url,
        {"image_id": AMI_EAST, "subnet_ids": {"us-east-1a": east[0]}, "security_group_ids": [east[1]]},
        {"image_id": AMI_WEST, "subnet_ids": {"us-west-2a": west[0]}, "security_group_ids": [west[1]],
         "key_name": "west-key"},
        root_volume_gib=500, iam_instance_profile="spotvisor-node")
    return config, {"us-east-1": east, "us-west-2": west}


def _provider(config: Config, **kw: Any) -> AwsProvider:
    return AwsProvider(spec=config.providers.aws, launch_spec=config.launch_spec, retry_attempts=2,
                       retry_initial_s=0.01, retry_max_s=0.05, **kw)


# -- AWS: what moto records -------------------------------------------------------------------

async def _launch_one(config: Config, offer: int, faults) -> tuple[Instance, dict[str, str]]:
    """Launch offer ``offer`` for a new pool; the instance and the RunInstances call's parameters."""
    prov = _provider(config)
    try:
        inst = await prov.launch(_offer(config, offer), _node(f"pool-{uuid.uuid4().hex[:8]}"))
    finally:
        await prov.aclose()
    (req,) = faults.actions("RunInstances")
    return inst, req.params


async def test_p5_launch_carries_efa_root_volume_and_the_regions_image(two_regions, faults, ec2_server) -> None:
    """A p5.48xlarge offer in us-west-2: 32 EFA interfaces (one per network card, card 0 the
    primary), the 500 GiB gp3 root volume on the AMI's root device, us-west-2's image,
    subnet, group and key; the instance-store disks become scratch in its user data."""
    config, nets = two_regions
    subnet, group = nets["us-west-2"]
    inst, p = await _launch_one(config, 1, faults)
    assert p["ImageId"] == AMI_WEST and p["KeyName"] == "west-key"
    cards = sorted({k.split(".")[1] for k in p if k.startswith("NetworkInterface.")}, key=int)
    assert len(cards) == 32
    nis = [{f.split(".", 2)[2]: v for f, v in p.items() if f.startswith(f"NetworkInterface.{n}.")} for n in cards]
    assert [(ni["NetworkCardIndex"], ni["DeviceIndex"], ni["InterfaceType"]) for ni in nis[:2]] == [
        ("0", "0", "efa"), ("1", "0", "efa-only")]
    assert {ni["InterfaceType"] for ni in nis[1:]} == {"efa-only"}
    assert all(ni["SubnetId"] == subnet and ni["SecurityGroupId.1"] == group for ni in nis)
    assert "SubnetId" not in p and not any(k.startswith("SecurityGroupId") for k in p)  # only in the interfaces
    assert p["BlockDeviceMapping.1.DeviceName"] == "/dev/sda1"  # moto's AMI's RootDeviceName
    assert (p["BlockDeviceMapping.1.Ebs.VolumeSize"], p["BlockDeviceMapping.1.Ebs.VolumeType"]) == ("500", "gp3")
    assert p["BlockDeviceMapping.1.Ebs.DeleteOnTermination"] == "true"
    assert [r.action for r in faults.requests][:2] == ["DescribeImages", "DescribeInstanceTypes"]
    west = boto3.client("ec2", region_name="us-west-2", endpoint_url=ec2_server)
    raw = west.describe_instances(InstanceIds=[inst.id])["Reservations"][0]["Instances"][0]
    assert raw["ImageId"] == AMI_WEST
    vols = west.describe_volumes(Filters=[{"Name": "attachment.instance-id", "Values": [inst.id]}])["Volumes"]
    assert [(v["Size"], v["VolumeType"]) for v in vols] == [(500, "gp3")]
    import base64
    script = base64.b64decode(west.describe_instance_attribute(InstanceId=inst.id, Attribute="userData")
                              ["UserData"]["Value"]).decode()
    assert "spotvisor_scratch ||" in script  # 8 x 3.8 TB instance-store NVMe as scratch


async def test_two_regions_launch_each_with_its_own_image_group_and_subnet(two_regions, faults,
                                                                         ec2_server) -> None:
    config, nets = two_regions
    prov = _provider(config)
    pool = f"pool-{uuid.uuid4().hex[:8]}"
    try:
        east = await prov.launch(_offer(config, 0), _node(pool))
        west = await prov.launch(_offer(config, 1), _node(pool))
        assert {i.id for i in await prov.describe(pool)} == {east.id, west.id}
    finally:
        await prov.aclose()
    for inst, region, ami in ((east, "us-east-1", AMI_EAST), (west, "us-west-2", AMI_WEST)):
        raw = boto3.client("ec2", region_name=region, endpoint_url=ec2_server).describe_instances(
            InstanceIds=[inst.id])["Reservations"][0]["Instances"][0]
        subnet, group = nets[region]
        assert (raw["ImageId"], raw["SubnetId"]) == (ami, subnet)
        assert raw["Placement"]["AvailabilityZone"] == f"{region}a"
    reqs = faults.actions("RunInstances")
    # p4d: 4 EFA interfaces with us-east-1's group; the requests never mix the regions' ids
    east_p = reqs[0].params
    assert east_p["ImageId"] == AMI_EAST and "KeyName" not in east_p
    assert sum(1 for k in east_p if k.endswith(".InterfaceType")) == 4
    assert {v for k, v in east_p.items() if k.endswith(".SecurityGroupId.1")} == {nets["us-east-1"][1]}
    assert {v for k, v in reqs[1].params.items() if k.endswith(".SecurityGroupId.1")} == {nets["us-west-2"][1]}


async def test_old_single_place_config_loads_and_launches_as_before(faults, ec2_server) -> None:
    """Only providers.aws (no domains, no launch block): the request is the old one: its
    image, top-level SecurityGroupIds and SubnetId, no root-volume mapping."""
    subnet, group = _network(ec2_server, "us-east-1", "us-east-1b")
    _profile(ec2_server)
    config = Config.model_validate({
        "providers": {"aws": {"image_id": AMI_EAST, "endpoint_url": faults.url, "subnet_ids": {"us-east-1b": subnet},
                              "security_group_ids": [group], "iam_instance_profile": "spotvisor-node"}},
        "offers": [{"provider": "aws", "region": "us-east-1", "zone": "us-east-1b", "instance_type": "g5.xlarge"}],
    })
    spec = config.launch_spec(_offer(config, 0))
    assert isinstance(spec, AwsLaunchSpec) and spec.image_id == AMI_EAST and spec.domain == "aws-us-east-1"
    inst, p = await _launch_one(config, 0, faults)
    assert (p["ImageId"], p["SubnetId"], p["SecurityGroupId.1"]) == (AMI_EAST, subnet, group)
    assert p["IamInstanceProfile.Name"] == "spotvisor-node"
    assert not any(k.startswith(("NetworkInterface", "BlockDeviceMapping")) for k in p)  # g5.xlarge: no EFA
    assert not faults.actions("DescribeImages")  # no root-volume size: the AMI is not looked up
    assert inst.zone == "us-east-1b"


async def test_fleet_template_carries_what_run_instances_would(two_regions, faults) -> None:
    """create_fleet: the per-node launch template holds the same image, EFA interfaces and
    root volume as the RunInstances request (the seam ``spotvisord check`` dry-runs)."""
    config, _ = two_regions
    aws = config.providers.aws.model_copy(update={"launch_method": "create_fleet"})
    prov = AwsProvider(spec=aws, launch_spec=config.launch_spec, retry_attempts=1)
    try:
        offer, node = _offer(config, 1), _node("pool-fleet")
        facts = await prov.launch_facts(offer)
        request = prov.run_instances_request(offer, node, facts)
        data = launch_template_data(request)
        assert data["NetworkInterfaces"] == request["NetworkInterfaces"] and len(data["NetworkInterfaces"]) == 32
        assert data["BlockDeviceMappings"] == request["BlockDeviceMappings"]
        assert data["ImageId"] == AMI_WEST
        await prov.launch(offer, node)
    finally:
        await prov.aclose()
    (tpl,) = faults.actions("CreateLaunchTemplate")
    assert tpl.params["LaunchTemplateData.ImageId"] == AMI_WEST
    assert tpl.params["LaunchTemplateData.BlockDeviceMapping.1.Ebs.VolumeSize"] == "500"
    assert tpl.params["LaunchTemplateData.NetworkInterface.32.InterfaceType"] == "efa-only"


def test_request_builder_needs_its_facts(two_regions) -> None:
    config, _ = two_regions
    prov = _provider(config)
    with pytest.raises(RuntimeError, match="launch_facts"):
        prov.run_instances_request(_offer(config, 1), _node("p"))


# -- Alibaba ----------------------------------------------------------------------------------

async def test_aliyun_request_carries_the_domains_launch_fields(monkeypatch) -> None:
    for name in ("ALIBABA_CLOUD_ACCESS_KEY_ID", "ALIBABA_CLOUD_ACCESS_KEY_SECRET", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    async with FakeEcs(access_key_id=AK_ID, access_key_secret=AK_SECRET) as ecs:
        ecs.ram_roles = {"spotvisor-node"}
        config = Config.model_validate({
            "job": {"checkpoint_uri": "oss://b/hz", "oss_endpoint": "https://oss-cn-hangzhou.aliyuncs.com"},
            "providers": {"aliyun": {"endpoint": ecs.endpoint, "system_disk_category": "cloud_essd"}},
            "domains": [{"name": "hz", "provider": "aliyun", "region": "cn-hangzhou", "launch": {
                "image_id": "m-bp1hz", "security_group_id": "sg-bp1hz", "vswitch_ids": {"cn-hangzhou-h": "vsw-hz-h"},
                "ram_role": "spotvisor-node", "key_pair_name": "ops", "system_disk_gib": 300}}],
            "offers": [{"provider": "aliyun", "region": "cn-hangzhou", "zone": "cn-hangzhou-h",
                        "instance_type": "ecs.gn7i-c32g1.8xlarge"}],
        })
        spec = config.launch_spec("hz")
        assert isinstance(spec, AliyunLaunchSpec) and spec.system_disk_category == "cloud_essd"  # the default
        prov = AliyunProvider(spec=config.providers.aliyun, launch_spec=config.launch_spec, access_key_id=AK_ID,
                              access_key_secret=AK_SECRET, retry_attempts=1)
        try:
            inst = await prov.launch(_offer(config, 0), _node("pool-hz"))
        finally:
            await prov.aclose()
        (p,) = ecs.calls("RunInstances")
        assert (p["ImageId"], p["SecurityGroupId"], p["VSwitchId"]) == ("m-bp1hz", "sg-bp1hz", "vsw-hz-h")
        assert (p["RamRoleName"], p["KeyPairName"]) == ("spotvisor-node", "ops")
        assert (p["SystemDisk.Size"], p["SystemDisk.Category"]) == ("300", "cloud_essd")
        kept = ecs.instances[inst.id]
        assert (kept.ram_role, kept.system_disk_gib, kept.system_disk_category) == ("spotvisor-node", 300, "cloud_essd")


async def test_ecs_fake_refuses_an_unknown_ram_role_and_a_bad_disk(monkeypatch) -> None:
    from daemon.providers.base import ProviderError

    async with FakeEcs(access_key_id=AK_ID, access_key_secret=AK_SECRET) as ecs:
        ecs.ram_roles = {"other"}
        base = {"image_id": "m-1", "security_group_id": "sg-1", "vswitch_ids": {"cn-hangzhou-h": "vsw-1"},
                "endpoint": ecs.endpoint}
        for extra, code in (({"ram_role": "missing"}, "InvalidRamRole.NotFound"),
                            ({"system_disk_gib": 600, "system_disk_category": "cloud"},
                             "InvalidSystemDiskSize.ValueNotSupported")):
            from daemon.config import AliyunProviderSpec
            prov = AliyunProvider(spec=AliyunProviderSpec(**base, **extra), access_key_id=AK_ID,
                                  access_key_secret=AK_SECRET, retry_attempts=1)
            off = Offer(index=0, provider="aliyun", region="cn-hangzhou", zone="cn-hangzhou-h",
                        instance_type="ecs.gn7i-c8g1.2xlarge", gpus_per_node=1)
            try:
                with pytest.raises(ProviderError, match=code.replace(".", r"\.")):
                    await prov.launch(off, _node("p"))
            finally:
                await prov.aclose()


# -- config: one-line errors ----------------------------------------------------------------

def _write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _two_aws(east: dict[str, Any], west: dict[str, Any], **aws: Any) -> dict[str, Any]:
    cfg = _aws_config("http://x", east, west, **aws).model_dump(mode="json", exclude_unset=True)
    return cfg


_GOOD_EAST = {"image_id": "ami-0aaaaaaaaaaaaaaaa", "security_group_ids": ["sg-0aaaaaaaaaaaaaaaa"]}
_GOOD_WEST = {"image_id": "ami-0bbbbbbbbbbbbbbbb", "security_group_ids": ["sg-0bbbbbbbbbbbbbbbb"]}


@pytest.mark.parametrize(("west", "aws", "field", "says"), [
    ({}, {"image_id": "ami-0ccccccccccccccc0"}, "domains.1.launch.image_id", "copy-image"),  # one AMI, two regions
    ({"image_id": "ami-0bbbbbbbbbbbbbbbb", "security_group_ids": ["sg-0aaaaaaaaaaaaaaaa"]}, {},
     "domains.1.launch.security_group_ids", "one region's VPC"),
    ({"image_id": "img-west"}, {}, "domains.1.launch.image_id", "not an AMI id"),
    ({"image_id": "ami-0bbbbbbbbbbbbbbbb", "vswitch_ids": {"us-west-2a": "vsw-1"}}, {}, "domains.1.launch",
     "vswitch_ids is not a launch setting of an aws domain"),
    ({"image_id": "ami-0bbbbbbbbbbbbbbbb", "root_volume_gib": 0}, {}, "domains.1.launch.root_volume_gib",
     "greater than or equal to 1"),
    ({"image_id": "ami-0bbbbbbbbbbbbbbbb", "subnet_ids": {"us-west-2a": "sn-1"}}, {},
     "domains.1.launch.subnet_ids", "not a subnet id"),
    ({"security_group_ids": ["sg-0bbbbbbbbbbbbbbbb"]}, {}, "domains.1.launch.image_id", "has no AMI"),
])
def test_bad_domain_launch_fields_are_one_line_errors(tmp_path, west, aws, field, says) -> None:
    east = dict(_GOOD_EAST) if "image_id" not in aws else {"security_group_ids": ["sg-0aaaaaaaaaaaaaaaa"]}
    doc = {
        "job": {"global_batch_size": 16, "micro_batch_size": 1, "checkpoint_uri": "s3://b/east"},
        "providers": {"aws": aws},
        "domains": [
            {"name": "use1", "provider": "aws", "region": "us-east-1", "launch": east},
            {"name": "usw2", "provider": "aws", "region": "us-west-2", "checkpoint_uri": "s3://b/west",
             "rendezvous": {"host": "10.1.0.10"}, "launch": west}],
        "offers": [{"provider": "aws", "region": r, "zone": f"{r}a", "instance_type": "p4d.24xlarge",
                    "gpus_per_node": 8} for r in ("us-east-1", "us-west-2")],
    }
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, doc))
    (line,) = info.value.problems
    assert line.startswith(f"{field}:") and says in line and "\n" not in line


def test_check_config_refuses_one_ami_in_two_regions(tmp_path) -> None:
    """``spotvisord check-config``: exit 2 and one line naming the field to set."""
    doc = yaml.safe_load((ROOT / "configs" / "aws.yaml").read_text())
    doc["domains"][1]["launch"]["image_id"] = doc["domains"][0]["launch"]["image_id"]
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "check-config", str(_write(tmp_path, doc))],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "domains.1.launch.image_id" in ln]
    assert len(lines) == 1 and "us-west-2" in lines[0] and "Traceback" not in r.stderr


def test_launch_on_a_local_domain_is_refused() -> None:
    with pytest.raises(Exception, match="the local provider has no launch settings"):
        Config.model_validate({"domains": [{"name": "here", "launch": {"image_id": "ami-01"}}]})


def test_shipped_aws_config_gives_each_region_its_own_spec() -> None:
    config = load_config(ROOT / "configs" / "aws.yaml")
    east, west = config.launch_spec("use1"), config.launch_spec("usw2")
    assert isinstance(east, AwsLaunchSpec) and isinstance(west, AwsLaunchSpec)
    assert east.image_id != west.image_id and set(east.security_group_ids).isdisjoint(west.security_group_ids)
    assert (west.root_volume_gib, west.root_volume_type, west.efa) == (500, "gp3", True)
    assert west.subnet("us-west-2a") and east.subnet("us-west-2a") is None
    p5 = next(i for i, o in enumerate(config.offers) if o.instance_type == "p5.48xlarge")
    assert config.launch_spec(config.offers[p5]).region == "us-west-2"
    assert config.launch_timeout_s(config.offers[p5].key) == 900
    assert config.launch_timeout_s(config.offers[0].key) == config.daemon.launch_timeout_s == 600


# -- the per-offer launch timeout governs --------------------------------------------------

def test_a_slow_offers_node_outlives_the_default_launch_timeout() -> None:
    """Two nodes launching for 700 s: the one whose offer allows 900 s stays, the one on the
    default (600 s) is terminated as launch_timeout."""
    views = [NodeView(id="fast", state=NodeState.LAUNCHING, gpus=8, created_at=0.0),
             NodeView(id="p5", state=NodeState.LAUNCHING, gpus=8, created_at=0.0, launch_timeout_s=900.0)]
    offer = Offer(index=0, provider="aws", region="us-west-2", zone="us-west-2a", instance_type="p5.48xlarge",
                  gpus_per_node=8, price_usd_h=30.0)
    actions = plan(Desired(2), views, [offer], History(), now=700.0, timeouts=Timeouts(launch_timeout_s=600.0))
    terminated = [a.node_id for a in actions if type(a).__name__ == "Terminate"]
    assert terminated == ["fast"]
    later = plan(Desired(2), views, [offer], History(), now=901.0, timeouts=Timeouts(launch_timeout_s=600.0))
    assert sorted(a.node_id for a in later if type(a).__name__ == "Terminate") == ["fast", "p5"]
