"""The AWS half of the cloud check (``spotvisord check``, and the daemon at start): live,
read-only calls with the control node's own credentials, each answered by a
:class:`~daemon.controlnode.cloud_check.CheckResult` naming the config field to fix.

1. Credentials: STS GetCallerIdentity
   (https://docs.aws.amazon.com/STS/latest/APIReference/API_GetCallerIdentity.html; no
   permission is needed for it). When it fails nothing else is tried.
2. Per region, the image every offer there launches (taken from the provider's own
   request, :meth:`AwsProvider.run_instances_request`): DescribeImages
   (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeImages.html);
   ``InvalidAMIID.NotFound`` or an empty answer = not in that region (AMI ids are
   per region).
3. Per offer, the exact RunInstances request :meth:`AwsProvider.launch` sends, with
   ``DryRun=True``: "Checks whether you have the required permissions for the action,
   without actually making the request ... If you have the required permissions, the
   error response is ``DryRunOperation``. Otherwise, it is ``UnauthorizedOperation``"
   (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_RunInstances.html); EC2
   also validates the image, subnet, security groups, key pair and instance profile of
   the request (error codes:
   https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html). With
   ``launch_method: create_fleet`` the launch also calls CreateLaunchTemplate and
   CreateFleet: both are dry-run too (the template's data is the request's). A dry-run
   CreateFleet names a template that the dry run did not create, so EC2 may answer it
   ``InvalidLaunchTemplateName.NotFoundException`` after the permission check passed:
   that counts as passed (the permission is what it can prove; the RunInstances dry run
   already proved the image and network, and an instant fleet launches through
   RunInstances' permissions).
4. Per region and spot quota class, Service Quotas GetServiceQuota
   (https://docs.aws.amazon.com/servicequotas/2019-06-24/apireference/API_GetServiceQuota.html;
   ``NoSuchResourceException`` → the default, GetAWSDefaultServiceQuota) against
   ``pool.max_nodes`` × the largest vCPU count (DescribeInstanceTypes
   ``VCpuInfo.DefaultVCpus``) among the class's offers there: the pool may reach
   ``max_nodes`` of that type. Quota codes (vCPUs, per region): All Standard
   (A, C, D, H, I, M, R, T, Z) Spot Instance Requests ``L-34B43A08``, All F
   ``L-88CF9481``, All G and VT ``L-3819A6DF``, All Inf ``L-B5D1601B``, All P
   ``L-7212CCBC``, All X ``L-E3A00192`` (the Service Quotas console's EC2 list; the
   same codes SkyPilot uses). On-demand: Standard ``L-1216C47A``, G and VT
   ``L-DB2E81BA``, P ``L-417A185B``. Other families are not checked (said in the
   line).

Endpoints: ``providers.aws.endpoint_url`` (a test's moto, which serves every service
on one endpoint) when set, for EC2, STS and Service Quotas alike; otherwise boto3's own
resolution (``AWS_ENDPOINT_URL_STS``, ``AWS_ENDPOINT_URL_SERVICE_QUOTAS``, the regional
endpoints). A quota Service Quotas has no value for (``NoSuchResourceException`` for the
applied and the default value) is reported as not checked (a ``skip`` line), neither failed nor passed.
Blocking: every boto3 call runs in a worker thread. Errors: none raised; every failure
is a failed result (the caller bounds the time).
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from typing import Any, Iterable

import boto3
import botocore.config
import botocore.exceptions

from daemon.config import Config
from daemon.control.pool import Offer
from daemon.controlnode.cloud_check import CheckResult, failed, passed, unchecked
from daemon.providers.aws import AwsProvider
from daemon.providers.base import NodeSpec, ProviderError

__all__ = ["check_aws", "spot_quota_code", "quota_class"]

_SPOT_QUOTA = {"standard": "L-34B43A08", "f": "L-88CF9481", "g": "L-3819A6DF", "inf": "L-B5D1601B",
               "p": "L-7212CCBC", "x": "L-E3A00192"}
_ON_DEMAND_QUOTA = {"standard": "L-1216C47A", "g": "L-DB2E81BA", "p": "L-417A185B"}
_CLASS_NAME = {"standard": "Standard (A, C, D, H, I, M, R, T, Z)", "f": "F", "g": "G and VT", "inf": "Inf",
               "p": "P", "x": "X"}
_STANDARD = frozenset("acdhimrtz")
_PROFILE_CODES = ("InvalidIamInstanceProfile", "InvalidParameterValue")


def quota_class(instance_type: str) -> str | None:
    """The EC2 vCPU quota class of an instance type (``p5.48xlarge`` → ``p``, ``vt1.3xlarge``
    → ``g``, ``m7i.large`` → ``standard``); None: a family this check does not know."""
    m = re.match(r"([a-z]+)\d", instance_type)
    if m is None:
        return None
    letters = m.group(1)
    if letters in ("vt", "g"):
        return "g"
    if letters in ("p", "f", "inf", "x"):
        return letters
    if letters[0] == "x":  # x2idn, x2iedn, x8g ...
        return "x"
    if letters[0] in _STANDARD and not letters.startswith(("dl", "trn", "hpc", "inf")):
        return "standard"
    return None


def spot_quota_code(instance_type: str, *, on_demand: bool = False) -> str | None:
    """The Service Quotas code of the instance type's vCPU quota (see the module docstring)."""
    cls = quota_class(instance_type)
    return None if cls is None else (_ON_DEMAND_QUOTA if on_demand else _SPOT_QUOTA).get(cls)


def _code(exc: botocore.exceptions.ClientError) -> str:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code.split(".", 1)[1] if code.startswith(("Client.", "Server.")) else code


def _message(exc: BaseException) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Message", ""))[:300]
    return f"{type(exc).__name__}: {str(exc)[:300]}"


class _Clients:
    """boto3 clients for the check, one per (service, region); calls run in threads."""

    def __init__(self, provider: AwsProvider) -> None:
        self._endpoint = provider.spec.endpoint_url
        self._config = botocore.config.Config(retries={"mode": "standard", "total_max_attempts": 2},
                                              connect_timeout=5, read_timeout=20)
        self._session: boto3.session.Session | None = None
        self._clients: dict[tuple[str, str], Any] = {}

    def _client(self, service: str, region: str) -> Any:
        key = (service, region)
        if key not in self._clients:
            if self._session is None:
                self._session = boto3.session.Session()
            endpoint = self._endpoint  # None: boto3's own resolution, per service
            self._clients[key] = self._session.client(service, region_name=region, endpoint_url=endpoint,
                                                      config=self._config)
        return self._clients[key]

    async def call(self, service: str, region: str, op: str, **kwargs: Any) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            return getattr(self._client(service, region), op)(**kwargs)

        return await asyncio.to_thread(run)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()


async def check_aws(config: Config, provider: AwsProvider, offers: list[Offer], node: NodeSpec) -> list[CheckResult]:
    """Every AWS check for ``offers`` (their ``index`` is their place in ``config.offers``);
    ``node``: the node a launch would carry (a dummy token). Never raises for a cloud
    answer; results in a stable order (credentials, images, dry runs, quotas)."""
    if not offers:
        return []
    clients = _Clients(provider)
    try:
        return await _check(config, provider, offers, node, clients)
    finally:
        await asyncio.to_thread(clients.close)


async def _check(config: Config, provider: AwsProvider, offers: list[Offer], node: NodeSpec,
                 clients: _Clients) -> list[CheckResult]:
    every = [o.index for o in offers]
    first_region = offers[0].region
    try:
        who = await clients.call("sts", first_region, "get_caller_identity")
    except Exception as exc:  # noqa: BLE001 - every failure is a result
        return [failed("aws: credentials", _message(exc) if not isinstance(exc, botocore.exceptions.ClientError)
                       else f"{_code(exc)}: {_message(exc)}",
                       "give the control node AWS credentials through boto3's chain (its instance role, "
                       "AWS_PROFILE, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY); never in the config", every)]
    out = [passed("aws: credentials resolve", str(who.get("Arn", "")))]
    # the image first (AMI ids are per region), from each offer's own launch spec; the request
    # is built from EC2 facts about that image and the instance type, so only past it
    images: dict[tuple[str, str], list[int]] = defaultdict(list)
    unspecified: list[CheckResult] = []
    for o in offers:
        try:
            images[(o.region, provider.launch_spec_of(o).image_id)].append(o.index)
        except ValueError as exc:
            unspecified.append(failed(f"aws {o.region}: image of offers.{o.index}", str(exc),
                                      f"set {config.launch_field(o, 'image_id')} to an AMI of {o.region}", [o.index]))
    checks = [_image(config, offers, clients, region, image, idx) for (region, image), idx in sorted(images.items())]
    out += unspecified + [r for rs in await asyncio.gather(*checks) for r in rs]
    bad_image = {i for r in out if not r.ok for i in r.offers}
    requests: list[tuple[Offer, dict[str, Any] | None, str]] = []
    for o in offers:
        if o.index in bad_image:
            continue
        try:
            facts = await provider.launch_facts(o)
            requests.append((o, provider.run_instances_request(o, node, facts), ""))
        except (ValueError, ProviderError) as exc:
            requests.append((o, None, str(exc)))
    done = {i for r in out if not r.ok for i in r.offers}  # a wrong image: its dry run would only repeat it
    out += [unchecked(f"aws {o.region}: dry-run launch of offers.{o.index} ({o.instance_type} in {o.zone or o.region})",
                      "its image failed above; it is tried once that passes") for o in offers if o.index in done]
    dry_runs = [_dry_run(config, provider, clients, o, req, problem) for o, req, problem in requests
                if o.index not in done]
    quotas = [_quota(config, clients, region, code, group) for (region, code), group in _quota_groups(offers).items()]
    for batch in (dry_runs, quotas):
        out += [r for rs in await asyncio.gather(*batch) for r in rs]
    return out


async def _image(config: Config, every: list[Offer], clients: _Clients, region: str, image: str,
                 offers: list[int]) -> list[CheckResult]:
    name = f"aws {region}: image {image}"
    first = next(o for o in every if o.index == offers[0])
    fix = (f"{config.launch_field(first, 'image_id')}: an AMI that exists in {region} (AMI ids are per region: "
           f"copy it there with `aws ec2 copy-image --source-region ... --region {region}`)")
    try:
        resp = await clients.call("ec2", region, "describe_images", ImageIds=[image])
    except botocore.exceptions.ClientError as exc:
        code = _code(exc)
        if code.startswith("InvalidAMIID"):
            return [failed(name, f"{code} in {region}", fix, offers)]
        if code == "UnauthorizedOperation":
            return [failed(name, f"{code}: ec2:DescribeImages denied in {region}",
                           "grant the control node's IAM role ec2:DescribeImages", offers)]
        return [failed(name, f"{code}: {_message(exc)}", fix, offers)]
    except Exception as exc:  # noqa: BLE001
        return [failed(name, _message(exc), "check the network path to EC2 in that region", offers)]
    if not resp.get("Images"):
        return [failed(name, f"not found in {region}", fix, offers)]
    return [passed(name, "exists")]


def _dry_run_problem(config: Config, code: str, message: str, offer: Offer, what: str) -> tuple[str, str]:
    """(detail, fix) for an EC2 error answering a dry run."""
    zone = offer.zone or "-"
    if code == "UnauthorizedOperation":  # iam:PassRole only where the launch passes a role (an instance profile)
        profile = getattr(config.launch_spec(offer), "iam_instance_profile", None)
        field = config.launch_field(offer, "iam_instance_profile")
        return (f"UnauthorizedOperation: the control node may not call {what}",
                f"grant the control node's IAM role ec2:{what}, ec2:CreateTags"
                + (f" and iam:PassRole on the role of {field} ({profile})" if profile else "")
                + " (decode the reason with `aws sts decode-authorization-message`)")
    if code.startswith("InvalidAMIID"):
        return (f"{code} in {offer.region}", f"{config.launch_field(offer, 'image_id')}: an AMI that exists in {offer.region}")
    if code.startswith(("InvalidSubnetID", "InvalidSubnet")):
        return (f"{code} in {offer.region}: {message}",
                f"{config.launch_field(offer, 'subnet_ids')}.{zone}: a subnet of zone {zone} in {offer.region}")
    if code.startswith(("InvalidGroup", "InvalidSecurityGroupID", "InvalidGroupId")):
        return (f"{code} in {offer.region}: {message}",
                f"{config.launch_field(offer, 'security_group_ids')}: security groups of the subnets' VPC in {offer.region}")
    if code.startswith("InvalidKeyPair"):
        return (f"{code} in {offer.region}", f"{config.launch_field(offer, 'key_name')}: a key pair that exists in {offer.region}")
    if code.startswith("InvalidPlacementGroup"):
        return (f"{code} in {offer.region}", "domains[].placement_group: a cluster placement group in that region")
    if code in _PROFILE_CODES and "profile" in message.lower():
        return (f"{code}: {message}", f"{config.launch_field(offer, 'iam_instance_profile')}: an instance profile that exists "
                "(its role must trust ec2.amazonaws.com)")
    if code in ("Unsupported", "InvalidInstanceType") or code.startswith("InvalidParameterValue") and \
            "instance type" in message.lower():
        return (f"{code}: {message}", f"offers.{offer.index}.instance_type (or its zone): a type offered there")
    if code in ("MaxSpotInstanceCountExceeded", "VcpuLimitExceeded", "InstanceLimitExceeded"):
        return (f"{code}: {message}", "request a higher EC2 vCPU quota in Service Quotas for that region")
    return (f"{code}: {message}", "see the EC2 error code "
            "(https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html)")


async def _dry_run(config: Config, provider: AwsProvider, clients: _Clients, offer: Offer,
                   request: dict[str, Any] | None, problem: str) -> list[CheckResult]:
    name = f"aws {offer.region}: dry-run launch of offers.{offer.index} ({offer.instance_type} in {offer.zone or offer.region})"
    if request is None:
        return [failed(name, problem, "fix the field the message names", [offer.index])]
    calls: list[tuple[str, str, dict[str, Any]]] = [("RunInstances", "run_instances", request)]
    if provider.spec.launch_method == "create_fleet" and not offer.on_demand:
        data = {k: request[k] for k in ("ImageId", "SecurityGroupIds", "IamInstanceProfile", "KeyName")
                if k in request}
        calls.append(("CreateLaunchTemplate", "create_launch_template",
                      {"LaunchTemplateName": "spotvisor-check", "LaunchTemplateData": data}))
        calls.append(("CreateFleet", "create_fleet", {
            "Type": "instant", "TargetCapacitySpecification": {"TotalTargetCapacity": 1, "SpotTargetCapacity": 1,
                                                               "DefaultTargetCapacityType": "spot"},
            "LaunchTemplateConfigs": [{"LaunchTemplateSpecification": {"LaunchTemplateName": "spotvisor-check",
                                                                        "Version": "$Latest"},
                                       "Overrides": [{"InstanceType": offer.instance_type}]}]}))
    out: list[CheckResult] = []
    for what, op, kwargs in calls:
        try:
            await clients.call("ec2", offer.region, op, DryRun=True, **kwargs)
        except botocore.exceptions.ClientError as exc:
            code = _code(exc)
            if code == "DryRunOperation" or (what == "CreateFleet" and code.startswith("InvalidLaunchTemplate")):
                continue
            detail, fix = _dry_run_problem(config, code, _message(exc), offer, what)
            out.append(failed(f"aws {offer.region}: dry-run {what} of offers.{offer.index}", detail, fix,
                              [offer.index]))
            return out
        except Exception as exc:  # noqa: BLE001
            out.append(failed(f"aws {offer.region}: dry-run {what}", _message(exc),
                              "check the network path to EC2 (providers.aws.endpoint_url)", [offer.index]))
            return out
        # a 2xx to a dry run: EC2 ignored DryRun (never documented); say so rather than pass it
        out.append(failed(f"aws {offer.region}: dry-run {what}", "EC2 answered a DryRun request with success",
                          "check providers.aws.endpoint_url points at EC2", [offer.index]))
        return out
    return [passed(name, "DryRunOperation")]


def _quota_groups(offers: Iterable[Offer]) -> dict[tuple[str, str], list[Offer]]:
    groups: dict[tuple[str, str], list[Offer]] = defaultdict(list)
    for o in offers:
        code = spot_quota_code(o.instance_type, on_demand=o.on_demand)
        if code is not None:
            groups[(o.region, code)].append(o)
    return dict(sorted(groups.items()))


async def _quota(config: Config, clients: _Clients, region: str, code: str, group: list[Offer]) -> list[CheckResult]:
    market = "On-Demand" if group[0].on_demand else "Spot"
    cls = _CLASS_NAME.get(quota_class(group[0].instance_type) or "", "?")
    name = f"aws {region}: quota {code} (All {cls} {market} Instance Requests, vCPUs)"
    idx = [o.index for o in group]
    types = sorted({o.instance_type for o in group})
    try:
        described = await clients.call("ec2", region, "describe_instance_types", InstanceTypes=types)
        vcpus = {t["InstanceType"]: int(t["VCpuInfo"]["DefaultVCpus"]) for t in described.get("InstanceTypes", [])}
    except Exception as exc:  # noqa: BLE001
        # a typo (p4d.24xlarg), not a missing permission
        if isinstance(exc, botocore.exceptions.ClientError) and _code(exc) == "InvalidInstanceType":
            fields = ", ".join(f"offers.{o.index}.instance_type" for o in group)
            return [failed(name, f"DescribeInstanceTypes: {_message(exc)}",
                           f"{fields}: a type EC2 offers in {region} (aws ec2 describe-instance-types)", idx)]
        return [failed(name, f"DescribeInstanceTypes: {_message(exc)}",
                       "grant the control node's IAM role ec2:DescribeInstanceTypes", idx)]
    missing = [t for t in types if t not in vcpus]
    if missing:
        return [failed(name, f"instance type {missing[0]} is not offered in {region}",
                       f"offers[].instance_type: a type EC2 offers in {region}", idx)]
    biggest = max(types, key=lambda t: vcpus[t])
    need = config.pool.max_nodes * vcpus[biggest]
    try:
        value = await _quota_value(clients, region, code)
    except botocore.exceptions.ClientError as exc:
        if _code(exc) != "NoSuchResourceException":
            return [failed(name, f"cannot read it: {_message(exc)}",
                           "grant the control node's IAM role servicequotas:GetServiceQuota"
                           if _code(exc) == "AccessDeniedException" else "see the Service Quotas error", idx)]
        return [unchecked(name, f"Service Quotas has no value for it in {region}; the pool needs {need} vCPUs")]
    except Exception as exc:  # noqa: BLE001
        denied = isinstance(exc, botocore.exceptions.ClientError) and _code(exc) == "AccessDeniedException"
        return [failed(name, f"cannot read it: {_message(exc)}",
                       "grant the control node's IAM role servicequotas:GetServiceQuota" if denied
                       else "check the network path to Service Quotas", idx)]
    if value < need:
        return [failed(name, f"{value:g} vCPUs, the pool needs {need} (pool.max_nodes {config.pool.max_nodes} x "
                             f"{vcpus[biggest]} vCPUs of {biggest})",
                       f"request at least {need} vCPUs for {code} in {region} (Service Quotas console, or "
                       f"`aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} "
                       f"--desired-value {need} --region {region}`), or lower pool.max_nodes", idx)]
    return [passed(name, f"{value:g} vCPUs >= {need} needed")]


async def _quota_value(clients: _Clients, region: str, code: str) -> float:
    try:
        resp = await clients.call("service-quotas", region, "get_service_quota", ServiceCode="ec2", QuotaCode=code)
    except botocore.exceptions.ClientError as exc:
        if _code(exc) != "NoSuchResourceException":
            raise
        try:
            resp = await clients.call("service-quotas", region, "get_aws_default_service_quota",
                                      ServiceCode="ec2", QuotaCode=code)
        except botocore.exceptions.ClientError:
            raise exc from None  # no applied value and no default: NoSuchResourceException, not checked
    return float(resp["Quota"]["Value"])
