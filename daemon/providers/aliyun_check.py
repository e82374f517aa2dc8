"""The Alibaba Cloud half of the cloud check (``spotvisord check``, and the daemon at
start): live, read-only ECS calls with the control node's own credentials, through the
provider's own client (:meth:`AliyunProvider._call`: its credential chain, endpoint and
error translation). Documents followed:

- DescribeImages (https://www.alibabacloud.com/help/en/ecs/developer-reference/api-ecs-2014-05-26-describeimages):
  ``ImageId`` in the region; an image that is not there is an empty ``Images.Image``
  (``TotalCount`` 0), not an error. The first call also proves the credentials.
- DescribeSecurityGroups (api-ecs-2014-05-26-describesecuritygroups): ``SecurityGroupIds``
  (a JSON array string); absent = empty ``SecurityGroups.SecurityGroup``.
- DescribeAvailableResource (api-ecs-2014-05-26-describeavailableresource):
  ``DestinationResource=InstanceType`` with the offer's ``ZoneId``, ``InstanceType``,
  ``InstanceChargeType=PostPaid`` and spot strategy; the type is buyable when it is
  listed under ``AvailableZones.AvailableZone[].AvailableResources.AvailableResource[]
  .SupportedResources.SupportedResource[]`` with ``Status: Available``.
- RunInstances with ``DryRun=true`` (api-ecs-2014-05-26-runinstances): "the system
  checks the request for potential issues, including missing parameter values,
  incorrect request syntax, service limits, and unavailable ECS resources ... If the
  request passes the dry run, the ``DryRunOperation`` error code is returned." The
  request is the provider's own (:meth:`AliyunProvider.run_instances_request`), so the
  dry run covers what a launch carries (image, vSwitch, security group, RAM role once the
  request names one). RAM denial: ``Forbidden.RAM`` / ``Forbidden``.

Errors: none raised; every failure is a failed result (the caller bounds the time).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from aliyunsdkcore.request import RpcRequest
from aliyunsdkecs.request.v20140526.DescribeImagesRequest import DescribeImagesRequest
from aliyunsdkecs.request.v20140526.DescribeSecurityGroupsRequest import DescribeSecurityGroupsRequest

from daemon.config import Config
from daemon.control.pool import Offer
from daemon.controlnode.cloud_check import CheckResult, failed, passed, unchecked
from daemon.providers.aliyun import AliyunProvider, available_request, stock_item
from daemon.providers.base import AuthError, NodeSpec, ProviderError

__all__ = ["check_aliyun"]

_CREDENTIALS_FIX = ("give the control node Alibaba Cloud credentials (ALIBABA_CLOUD_ACCESS_KEY_ID / "
                    "ALIBABA_CLOUD_ACCESS_KEY_SECRET, a ~/.alibabacloud/credentials profile, or its RAM role); "
                    "never in the config")


def _ram_fix(action: str) -> str:
    return (f"grant the control node's RAM user or role ecs:{action} (e.g. a policy with "
            f'"Action": ["ecs:{action}"]; ecs:RunInstances also needs ram:PassRole for an instance RAM role)')


def _denied(exc: ProviderError) -> bool:
    code = str(getattr(exc, "code", ""))
    return code.startswith("Forbidden")


def _failure(name: str, exc: ProviderError, action: str, offers: list[int]) -> CheckResult:
    """A failed ECS call as a result: credentials, RAM permission, or anything else."""
    code = str(getattr(exc, "code", "") or type(exc).__name__)
    if _denied(exc):
        return failed(name, f"{code}: the control node may not call {action}", _ram_fix(action), offers)
    if isinstance(exc, AuthError):
        return failed(name, f"{code}: credentials refused", _CREDENTIALS_FIX, offers)
    return failed(name, str(exc)[:300], "see the ECS error code in the API reference of " + action, offers)


async def check_aliyun(config: Config, provider: AliyunProvider, offers: list[Offer],
                       node: NodeSpec) -> list[CheckResult]:
    """Every Alibaba Cloud check for ``offers`` (``index``: their place in
    ``config.offers``); ``node``: the node a launch would carry (a dummy token)."""
    if not offers:
        return []
    builds: list[tuple[Offer, Any, str]] = []
    for o in offers:
        try:
            builds.append((o, provider.run_instances_request(o, node), ""))
        except ValueError as exc:
            builds.append((o, None, str(exc)))
    images: dict[tuple[str, str], list[int]] = defaultdict(list)
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for o, build, _ in builds:
        if build is not None:
            params = build().get_query_params()
            images[(o.region, str(params.get("ImageId")))].append(o.index)
            groups[(o.region, str(params.get("SecurityGroupId")))].append(o.index)
    out: list[CheckResult] = []
    by_index = {o.index: o for o in offers}
    for (region, image), idx in sorted(images.items()):
        r = await _image(provider, region, image, idx, config.launch_field(by_index[idx[0]], "image_id"))
        out.append(r)
        if not r.ok and "credentials" in r.detail:
            return out  # nothing else can pass
    for (region, group), idx in sorted(groups.items()):
        out.append(await _security_group(provider, region, group, idx,
                                         config.launch_field(by_index[idx[0]], "security_group_id")))
    done = {i for r in out if not r.ok for i in r.offers}  # already failed: a dry run would only repeat it
    for o, build, problem in builds:
        name = f"aliyun {o.region}: offers.{o.index} ({o.instance_type} in {o.zone or o.region})"
        if o.index in done:
            out.append(unchecked(name, "its image or security group failed above; it is tried once those pass"))
            continue
        if build is None:
            out.append(failed(name, problem, f"{config.launch_field(o, 'vswitch_ids')}: a vSwitch for the offer's zone",
                              [o.index]))
            continue
        out.append(await _available(provider, o, name))
        out.append(await _dry_run(config, provider, o, build, name))
    return out


async def _image(provider: AliyunProvider, region: str, image: str, offers: list[int], field: str) -> CheckResult:
    def build() -> RpcRequest:
        req = DescribeImagesRequest()
        req.set_ImageId(image)
        return req

    return await _exists(provider, region, f"aliyun {region}: image {image}", build, ("Images", "Image"),
                         f"{field}: an image that exists in {region} (images are per region: copy "
                         "it there with CopyImage, or share it with this account)", offers)


async def _security_group(provider: AliyunProvider, region: str, group: str, offers: list[int],
                          field: str) -> CheckResult:
    def build() -> RpcRequest:
        req = DescribeSecurityGroupsRequest()
        req.set_SecurityGroupIds(json.dumps([group]))
        return req

    return await _exists(provider, region, f"aliyun {region}: security group {group}", build,
                         ("SecurityGroups", "SecurityGroup"),
                         f"{field}: a security group of the vSwitches' VPC in {region}", offers)


async def _exists(provider: AliyunProvider, region: str, name: str, build: Callable[[], RpcRequest],
                  items: tuple[str, str], fix: str, offers: list[int]) -> CheckResult:
    """Passed when the Describe call ``build`` makes lists something under ``items`` (the
    answer's ``{"Images": {"Image": [...]}}`` nesting); failed naming ``fix`` when not."""
    try:
        body = await provider.api.call(region, build)
    except ProviderError as exc:
        return _failure(name, exc, build().get_action_name(), offers)
    if not body.get(items[0], {}).get(items[1]):
        return failed(name, f"not found in {region}", fix, offers)
    return passed(name, "exists")


async def _available(provider: AliyunProvider, offer: Offer, name: str) -> CheckResult:
    zone = offer.zone or ""
    strategy = "NoSpot" if offer.on_demand else provider.spec.spot_strategy

    try:
        body = await provider.api.call(offer.region, lambda: available_request(offer, strategy))
    except ProviderError as exc:
        return _failure(f"{name}: available", exc, "DescribeAvailableResource", [offer.index])
    item = stock_item(body, zone, offer.instance_type)
    if item is not None and item.get("Status") == "Available":
        return passed(f"{name}: available", item.get("StatusCategory", "Available"))
    return failed(f"{name}: available", f"{offer.instance_type} is not sold as {strategy} in {zone or offer.region}",
                  f"offers.{offer.index}.instance_type / offers.{offer.index}.zone: a type and zone "
                  "DescribeAvailableResource lists", [offer.index])


async def _dry_run(config: Config, provider: AliyunProvider, offer: Offer, build: Any, name: str) -> CheckResult:
    def dry() -> RpcRequest:
        req = build()
        req.set_DryRun(True)
        return req

    try:
        await provider.api.call(offer.region, dry)
    except ProviderError as exc:
        code = str(getattr(exc, "code", ""))
        if code == "DryRunOperation":
            return passed(f"{name}: dry-run RunInstances", "DryRunOperation")
        if code.startswith("InvalidImageId"):
            return failed(f"{name}: dry-run RunInstances", f"{code} in {offer.region}",
                          f"{config.launch_field(offer, 'image_id')}: an image that exists in {offer.region}", [offer.index])
        if code.startswith(("InvalidVSwitchId", "InvalidVSwitch")):
            return failed(f"{name}: dry-run RunInstances", code,
                          f"{config.launch_field(offer, 'vswitch_ids')}.{offer.zone}: a vSwitch of that zone", [offer.index])
        if code.startswith(("InvalidSecurityGroupId", "InvalidSecurityGroup")):
            return failed(f"{name}: dry-run RunInstances", code,
                          f"{config.launch_field(offer, 'security_group_id')}: a security group of the vSwitch's VPC",
                          [offer.index])
        if code.startswith("InvalidRamRole"):
            return failed(f"{name}: dry-run RunInstances", code,
                          f"{config.launch_field(offer, 'ram_role')}: an instance RAM role that exists (trusted by "
                          "ecs.aliyuncs.com)", [offer.index])
        return _failure(f"{name}: dry-run RunInstances", exc, "RunInstances", [offer.index])
    return failed(f"{name}: dry-run RunInstances", "ECS answered a DryRun request with success",
                  "check providers.aliyun.endpoint points at ECS", [offer.index])
