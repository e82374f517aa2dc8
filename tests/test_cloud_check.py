"""``spotvisord check CONFIG`` against moto's server (behind tests/fakes/aws_faults.py, which
answers Service Quotas, that moto serves for ``vpc`` only, and injects the denials moto
cannot enforce), and against the ECS and OSS fakes: every check passes on a good
two-region config; each broken thing is one ``FAIL`` line naming the field and its fix,
exit 1. The pure parts (rendering, merging, the buy gate, the retry schedule) too."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import boto3
import pytest
import yaml

from daemon.controlnode.cloud_check import (blocked_offers, failed, merge_failures, passed, render,
                                            retry_delay_s)
from daemon.interfaces.cli import main
from fakes.aws_faults import Seen

# ---------------------------------------------------------------------------- the pure parts


def test_render_is_one_line_naming_the_fix() -> None:
    assert render(passed("aws: credentials resolve", "arn:x")) == "ok   aws: credentials resolve (arn:x)"
    line = render(failed("aws us-west-2: image ami-1", "InvalidAMIID.NotFound\nin us-west-2",
                         "providers.aws.image_id: an AMI in us-west-2"))
    assert line == ("FAIL aws us-west-2: image ami-1: InvalidAMIID.NotFound in us-west-2; "
                    "fix: providers.aws.image_id: an AMI in us-west-2")


def test_same_failure_of_many_offers_is_one_line_blocking_them_all() -> None:
    results = [passed("creds"),
               failed("dry-run of offers.0", "UnauthorizedOperation", "grant ec2:RunInstances", [0]),
               failed("dry-run of offers.2", "UnauthorizedOperation", "grant ec2:RunInstances", [2]),
               failed("image", "not found", "providers.aws.image_id", [1])]
    merged = merge_failures(results)
    assert [r.name for r in merged] == ["creds", "dry-run of offers.0, dry-run of offers.2", "image"]
    blocked = blocked_offers(results, 4)
    assert sorted(blocked) == [0, 1, 2]  # offer 3 concerned by no failure: it may be bought
    assert "grant ec2:RunInstances" in blocked[0] and blocked[0] == blocked[2]


def test_no_result_yet_blocks_everything_and_an_unscoped_failure_too() -> None:
    assert sorted(blocked_offers(None, 3)) == [0, 1, 2]
    assert sorted(blocked_offers([failed("store", "denied", "job.checkpoint_uri")], 2)) == [0, 1]
    assert blocked_offers([passed("store")], 2) == {}


def test_retry_schedule_doubles_to_ten_minutes() -> None:
    assert [retry_delay_s(n) for n in (1, 2, 3, 4, 5, 6, 10**6)] == [60, 120, 240, 480, 600, 600, 600]


# ---------------------------------------------------------------------------- AWS, against moto


@pytest.fixture
def aws(faults, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Moto behind the fault proxy for every AWS service the check calls; two buckets; a
    Service Quotas answer per (region, code) in ``quotas`` (vCPUs); yields a helper."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", faults.url)  # STS and Service Quotas (boto3's own setting)
    quotas: dict[tuple[str, str], float] = {}

    def respond(seen: Seen) -> tuple[int, str, str] | None:
        if seen.action in ("GetServiceQuota", "GetAWSDefaultServiceQuota"):
            value = quotas.get((seen.region, seen.params["QuotaCode"]), 10_000.0)
            body = {"Quota": {"ServiceCode": "ec2", "QuotaCode": seen.params["QuotaCode"], "Value": value}}
            return 200, json.dumps(body), "application/x-amz-json-1.1"
        return None

    faults.answer(respond)
    suffix = uuid.uuid4().hex[:8]
    buckets = {"us-east-1": f"ckpt-use1-{suffix}", "us-west-2": f"ckpt-usw2-{suffix}"}
    s3 = boto3.client("s3", endpoint_url=faults.upstream, region_name="us-east-1")
    for b in buckets.values():
        s3.create_bucket(Bucket=b)
    east, west = _image_ids("us-east-1", faults.upstream), _image_ids("us-west-2", faults.upstream)

    class Aws:
        proxy = faults
        quota = quotas
        # each region its own image (AMI ids are per region; a few of moto's stock images are
        # in both, which a config may not send to two regions)
        east_images = east - west
        east_only = sorted(east - west)[0]
        west_only = sorted(west - east)[0]

        def config(self, *, west_image: str | None = None, **aws_spec: object) -> Path:
            return _aws_config(tmp_path, faults.url, buckets, self.east_only, west_image or self.west_only,
                               **aws_spec)

    yield Aws()


_STOCK_IMAGES: dict[str, frozenset[str]] = {}


def _image_ids(region: str, url: str) -> frozenset[str]:
    """The ids of moto's stock images in ``region``: the same in every moto server of this
    version, so asked once per run (the list is thousands of images: seconds a test)."""
    if region not in _STOCK_IMAGES:
        _STOCK_IMAGES[region] = frozenset(i["ImageId"] for i in _images(region, url))
    return _STOCK_IMAGES[region]


def _images(region: str, url: str) -> list[dict]:
    return boto3.client("ec2", region_name=region, endpoint_url=url).describe_images(Owners=["amazon"])["Images"]


def _aws_config(tmp: Path, url: str, buckets: dict[str, str], east_image: str, west_image: str,
                **aws_spec: object) -> Path:
    """Two placement domains (us-east-1, us-west-2), each with its own bucket and image
    (``domains[].launch.image_id``): a P and a G offer in us-east-1, a P offer in
    us-west-2; at most 2 nodes."""
    cfg = {
        "pool": {"name": f"chk-{uuid.uuid4().hex[:6]}", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "chk", "target_steps": 10, "global_batch_size": 64, "micro_batch_size": 1,
                "checkpoint_uri": f"s3://{buckets['us-east-1']}/spotvisor/chk", "s3_endpoint_url": url},
        "rendezvous": {"host": "10.0.0.10"},
        "daemon": {"state_dir": str(tmp / "state"), "agent_host": "10.0.0.10"},
        "providers": {"local": None, "aws": {"endpoint_url": url, **aws_spec}},
        "domains": [
            {"name": "use1", "provider": "aws", "region": "us-east-1", "launch": {"image_id": east_image}},
            {"name": "usw2", "provider": "aws", "region": "us-west-2", "s3_endpoint_url": url,
             "launch": {"image_id": west_image},
             "checkpoint_uri": f"s3://{buckets['us-west-2']}/spotvisor/chk",
             "rendezvous": {"host": "10.1.0.10"}},
        ],
        "offers": [
            {"provider": "aws", "region": "us-east-1", "zone": "us-east-1a", "instance_type": "p5.48xlarge",
             "gpus_per_node": 8},
            {"provider": "aws", "region": "us-east-1", "zone": "us-east-1a", "instance_type": "g5.12xlarge",
             "gpus_per_node": 4},
            {"provider": "aws", "region": "us-west-2", "zone": "us-west-2a", "instance_type": "p4d.24xlarge",
             "gpus_per_node": 8},
        ],
    }
    path = tmp / "aws.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _check(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    rc = main(["check", str(path), "--timeout-s", "30"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, [line for line in out.splitlines() if line.startswith(("ok", "skip", "FAIL"))]


def _fails(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("FAIL")]


@pytest.mark.parametrize("method", ["run_instances", "create_fleet"])
def test_two_region_config_passes(aws, capsys, method: str) -> None:
    rc, lines = _check(aws.config(launch_method=method), capsys)
    assert rc == 0, "\n".join(lines)
    assert _fails(lines) == []
    text = "\n".join(lines)
    for what in ("credentials resolve", "us-east-1: image", "us-west-2: image", "L-7212CCBC", "L-3819A6DF",
                 "ckpt-use1", "ckpt-usw2"):
        assert what in text
    runs = aws.proxy.actions("RunInstances", dry_run=True)
    assert len(runs) == 3 and all(r.params["DryRun"] == "true" for r in runs)  # the exact requests, dry
    assert {r.region for r in runs} == {"us-east-1", "us-west-2"}
    assert {(r.region, r.params["ImageId"]) for r in runs} == {("us-east-1", aws.east_only),
                                                                ("us-west-2", aws.west_only)}
    if method == "create_fleet":
        assert len(aws.proxy.actions("CreateFleet", dry_run=True)) == 3
        assert len(aws.proxy.actions("CreateLaunchTemplate", dry_run=True)) == 3
    for region in ("us-east-1", "us-west-2"):  # nothing was bought
        ec2 = boto3.client("ec2", region_name=region, endpoint_url=aws.proxy.upstream)
        found = ec2.describe_instances(Filters=[{"Name": "tag:spotvisor-node", "Values": ["*-check"]}])
        assert found["Reservations"] == []


def test_wrong_image_in_one_region(aws, capsys) -> None:
    rc, lines = _check(aws.config(west_image=sorted(aws.east_images - {aws.east_only})[0]), capsys)
    assert rc == 1
    (line,) = _fails(lines)
    assert "us-west-2" in line and "InvalidAMIID" in line and "fix: domains.1.launch.image_id" in line
    assert any(ln.startswith("ok") and "us-east-1: image" in ln for ln in lines)
    # the wrong image's offer is not dry-run (it would only repeat the failure), and a line says so
    assert [ln for ln in lines if ln.startswith("skip")] == [
        "skip aws us-west-2: dry-run launch of offers.2 (p4d.24xlarge in us-west-2a) (not checked: its image "
        "failed above; it is tried once that passes)"], lines


def test_missing_iam_permission(aws, capsys) -> None:
    from fakes.aws_faults import ec2_error_xml

    outer = aws.proxy._responder
    denied = ec2_error_xml("UnauthorizedOperation", "You are not authorized to perform this operation. "
                           "Encoded authorization failure message: abc")

    def respond(seen: Seen) -> tuple[int, str, str] | None:  # the role lacks ec2:RunInstances (moto enforces no IAM)
        return (403, denied, "text/xml") if seen.action == "RunInstances" else outer(seen)

    aws.proxy.answer(respond)
    rc, lines = _check(aws.config(), capsys)
    assert rc == 1
    (line,) = _fails(lines)  # three offers denied alike: one line
    assert "UnauthorizedOperation" in line and "fix: grant the control node's IAM role ec2:RunInstances" in line
    assert "offers.0" in line and "offers.1" in line and "offers.2" in line
    assert "PassRole" not in line  # no instance profile: the launch passes no role
    rc, lines = _check(aws.config(iam_instance_profile="spotvisor-node"), capsys)
    (line,) = _fails(lines)
    assert "and iam:PassRole on the role of providers.aws.iam_instance_profile (spotvisor-node)" in line, line


def test_spot_quota_below_the_need(aws, capsys) -> None:
    aws.quota[("us-east-1", "L-7212CCBC")] = 192.0  # one p5.48xlarge; max_nodes 2 needs 384
    rc, lines = _check(aws.config(), capsys)
    assert rc == 1
    (line,) = _fails(lines)
    assert "us-east-1: quota L-7212CCBC" in line and "192 vCPUs, the pool needs 384" in line
    assert "--quota-code L-7212CCBC --desired-value 384" in line and "pool.max_nodes" in line


def test_a_quota_service_quotas_has_no_value_for_is_not_checked_and_not_shown_passed(aws, capsys) -> None:
    """Service Quotas answers NoSuchResourceException for a quota it holds neither an
    applied nor a default value of (seen in newer regions): nothing to check against, so
    the line says ``skip``, not ``ok``, and the count says so; it blocks no offer."""
    outer = aws.proxy._responder

    def respond(seen: Seen) -> tuple[int, str, str] | None:
        if seen.action in ("GetServiceQuota", "GetAWSDefaultServiceQuota") and seen.region == "us-east-1" \
                and seen.params["QuotaCode"] == "L-7212CCBC":
            return 400, json.dumps({"__type": "NoSuchResourceException", "message": "The request failed because "
                                    "the specified service quota does not exist."}), "application/x-amz-json-1.1"
        return outer(seen)

    aws.proxy.answer(respond)
    rc = main(["check", str(aws.config()), "--timeout-s", "30"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in out + err
    (line,) = [x for x in out.splitlines() if "quota L-7212CCBC" in x and "us-east-1" in x]
    assert line.startswith("skip aws us-east-1: quota L-7212CCBC") and line.endswith(
        "(not checked: Service Quotas has no value for it in us-east-1; the pool needs 384 vCPUs)"), line
    n = sum(x.startswith(("ok", "skip", "FAIL")) for x in out.splitlines())
    assert out.splitlines()[-1] == f"{n - 1} checks ok, 1 not checked"


def test_a_misspelled_instance_type_is_named_not_taken_for_a_missing_permission(aws, capsys) -> None:
    cfg = yaml.safe_load(aws.config().read_text())
    cfg["offers"][2]["instance_type"] = "p4d.24xlarg"
    path = aws.config().with_name("typo.yaml")
    path.write_text(yaml.safe_dump(cfg))
    rc = main(["check", str(path), "--timeout-s", "30"])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in out + err
    assert "aws_unknown_instance_type" not in out  # no log line among the check's lines
    quota = [line for line in out.splitlines() if line.startswith("FAIL aws us-west-2: quota")]
    assert len(quota) == 1 and "p4d.24xlarg" in quota[0], out
    assert quota[0].endswith("fix: offers.2.instance_type: a type EC2 offers in us-west-2 "
                             "(aws ec2 describe-instance-types)")
    assert "ec2:DescribeInstanceTypes" not in out


def test_unwritable_bucket(aws, capsys) -> None:
    denied = '<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
    outer = aws.proxy._responder

    def respond(seen: Seen) -> tuple[int, str, str] | None:
        if seen.method == "PUT" and seen.path.startswith("/ckpt-usw2-"):
            return 403, denied, "application/xml"
        return outer(seen)

    aws.proxy.answer(respond)
    rc, lines = _check(aws.config(), capsys)
    assert rc == 1
    (line,) = _fails(lines)
    assert "ckpt-usw2" in line and "put failed" in line and "AccessDenied" in line
    assert "fix: domains.1.checkpoint_uri" in line and "s3:PutObject" in line


def test_no_credentials_is_one_line_not_a_traceback(aws, capsys, monkeypatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    rc, lines = _check(aws.config(), capsys)
    assert rc == 1
    creds = [ln for ln in _fails(lines) if "aws: credentials" in ln]
    assert len(creds) == 1 and "NoCredentialsError" in creds[0] and "never in the config" in creds[0]


async def test_a_store_probe_without_credentials_asks_for_credentials_not_a_grant(monkeypatch, tmp_path) -> None:
    """Nothing signed the probe: "grant s3:PutObject" would send the operator to IAM for a
    missing instance role or env file."""
    import botocore.exceptions

    from daemon.config import Config
    from daemon.controlnode import cloud_probe

    def unsigned(uri: str, **_: object) -> None:
        try:
            raise botocore.exceptions.NoCredentialsError()
        except botocore.exceptions.NoCredentialsError as exc:
            raise RuntimeError("put failed") from exc  # as a store wraps what botocore raised

    monkeypatch.setattr(cloud_probe, "probe_store", unsigned)
    config = Config.model_validate({"job": {"checkpoint_uri": "s3://ckpt/job"}, "daemon": {"state_dir": str(tmp_path)}})
    (result,) = await cloud_probe.run_checks(config, lambda name: None, timeout_s=10)
    line = render(result)
    assert line.startswith("FAIL store s3://ckpt/job (domain ") and "s3:PutObject" not in line
    assert line.endswith("fix: the control node's credentials (its instance role, AWS_PROFILE, or AWS_ACCESS_KEY_ID "
                         "and AWS_SECRET_ACCESS_KEY in /etc/spotvisor/spotvisord.env); never in the config")


# ---------------------------------------------------------------------------- Alibaba, against the fakes

AK_ID, AK_SECRET = "LTAI-check-id", "check-secret-value"


@pytest.fixture
async def ecs(monkeypatch: pytest.MonkeyPatch):
    from fakes.ecs import FakeEcs

    for name in ("ALIBABA_CLOUD_SECURITY_TOKEN", "ALIYUN_ACCESS_KEY_ID", "ALIBABA_CLOUD_ECS_METADATA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_ID", AK_ID)
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_SECRET", AK_SECRET)
    monkeypatch.setenv("SPOTVISOR_OSS_REGION", "cn-hangzhou")  # the fake OSS is on 127.0.0.1
    async with FakeEcs(access_key_id=AK_ID, access_key_secret=AK_SECRET) as fake:
        fake.images["cn-hangzhou"] = {"m-good"}
        fake.security_groups["cn-hangzhou"] = {"sg-good"}
        fake.available = {("cn-hangzhou-h", "ecs.gn7i-c32g1.8xlarge"), ("cn-hangzhou-i", "ecs.gn7i-c32g1.8xlarge")}
        yield fake


def _aliyun_config(tmp: Path, ecs_endpoint: str, oss_endpoint: str, bucket: str, image: str = "m-good") -> Path:
    cfg = {
        "pool": {"name": f"chk-{uuid.uuid4().hex[:6]}", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "chk", "target_steps": 10, "global_batch_size": 8, "micro_batch_size": 1,
                "checkpoint_uri": f"oss://{bucket}/spotvisor/chk", "oss_endpoint": oss_endpoint},
        "rendezvous": {"host": "172.16.0.10"},
        "daemon": {"state_dir": str(tmp / "state"), "agent_host": "172.16.0.10"},
        "providers": {"local": None, "aliyun": {
            "image_id": image, "security_group_id": "sg-good", "endpoint": ecs_endpoint,
            "vswitch_ids": {"cn-hangzhou-h": "vsw-h", "cn-hangzhou-i": "vsw-i"}}},
        "offers": [{"provider": "aliyun", "region": "cn-hangzhou", "zone": z, "instance_type": "ecs.gn7i-c32g1.8xlarge",
                    "max_price_usd_h": 1.2} for z in ("cn-hangzhou-h", "cn-hangzhou-i")],
    }
    path = tmp / "aliyun.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def _acheck(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    import asyncio

    rc = await asyncio.to_thread(main, ["check", str(path), "--timeout-s", "30"])  # the fake serves on this loop
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, [line for line in out.splitlines() if line.startswith(("ok", "skip", "FAIL"))]


@pytest.fixture
def bucket(oss_server) -> str:
    name = f"chk-{uuid.uuid4().hex[:8]}"
    oss_server.create_bucket(name)
    yield name
    oss_server.reset_faults()


async def test_aliyun_config_passes(ecs, oss_server, bucket, tmp_path, capsys) -> None:
    rc, lines = await _acheck(_aliyun_config(tmp_path, ecs.endpoint, oss_server.endpoint, bucket), capsys)
    assert rc == 0, "\n".join(lines)
    assert len(lines) == 1 + 1 + 2 * 2 + 1  # image, security group, 2 x (available, dry run), store
    dry = ecs.calls("RunInstances", dry_run=True)
    assert len(dry) == 2 and all(p["DryRun"].lower() == "true" and p["ImageId"] == "m-good" for p in dry)
    assert ecs.instances == {}  # nothing bought


async def test_aliyun_wrong_image(ecs, oss_server, bucket, tmp_path, capsys) -> None:
    rc, lines = await _acheck(_aliyun_config(tmp_path, ecs.endpoint, oss_server.endpoint, bucket,
                                             image="m-elsewhere"), capsys)
    assert rc == 1
    (line,) = _fails(lines)
    assert "image m-elsewhere" in line and "not found in cn-hangzhou" in line and "fix: providers.aliyun.image_id" in line
    skipped = [ln for ln in lines if ln.startswith("skip")]  # its two offers, not dry-run, each said
    assert len(skipped) == 2 and all("not checked: its image or security group failed above" in ln for ln in skipped)


async def test_aliyun_missing_permission(ecs, oss_server, bucket, tmp_path, capsys) -> None:
    ecs.denied.add("RunInstances")
    rc, lines = await _acheck(_aliyun_config(tmp_path, ecs.endpoint, oss_server.endpoint, bucket), capsys)
    assert rc == 1
    (line,) = _fails(lines)  # both offers denied alike: one line
    assert "Forbidden.RAM" in line and "fix: grant the control node's RAM user or role ecs:RunInstances" in line


async def test_aliyun_unwritable_bucket(ecs, oss_server, bucket, tmp_path, capsys) -> None:
    oss_server.fail_next(1, 403, op="PutObject", code="AccessDenied")
    rc, lines = await _acheck(_aliyun_config(tmp_path, ecs.endpoint, oss_server.endpoint, bucket), capsys)
    assert rc == 1
    (line,) = _fails(lines)
    assert f"oss://{bucket}" in line and "put failed" in line and "AccessDenied" in line
    assert "fix: job.checkpoint_uri" in line and "oss:PutObject" in line
