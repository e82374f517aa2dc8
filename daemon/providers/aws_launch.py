"""The pure half of the AWS launch: the EC2 facts a request depends on and the builders of
the exact RunInstances request and its create_fleet launch template (see
:mod:`daemon.providers.aws` for the sources). No I/O here."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

from daemon.control.pool import Offer
from daemon.launchspec import AwsLaunchSpec
from daemon.providers.base import NodeSpec, ProviderError
from daemon.providers.bootstrap import render_user_data

__all__ = ["client_token", "ImageFacts", "TypeFacts", "LaunchFacts", "efa_interfaces", "launch_template_data", "type_facts",
           "image_facts", "facts_from", "build_run_instances"]


def client_token(node: NodeSpec) -> str:
    """The idempotency token of ``node``'s launch (RunInstances, CreateFleet and its launch
    template's name): deterministic, 58 ASCII characters.

    The same node launched again (a retry after a timeout, or a daemon's replay of a launch
    its predecessor died in) gets the same token, so EC2 answers the first call's instance
    (https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-idempotency.html). Node ids
    repeat across daemon runs (``<pool>-<ordinal>``), and EC2 remembers a token past its
    instance's end (the same token with other parameters is refused,
    ``IdempotentParameterMismatch``), so the token also hashes the node's own random token:
    a later node with a reused id is a new purchase. The hash is one-way; the node token
    itself never leaves the user-data.
    """
    return "spotvisor-" + hashlib.sha256(f"{node.node_id}\0{node.token}".encode()).hexdigest()[:48]


@dataclass(frozen=True, slots=True)
class ImageFacts:
    """What a launch needs to know of an AMI (DescribeImages): its root device's name."""

    root_device_name: str


@dataclass(frozen=True, slots=True)
class TypeFacts:
    """What a launch needs to know of an instance type (DescribeInstanceTypes).

    ``efa_interfaces``: EFA interfaces it takes, one per network card (0: no EFA);
    ``instance_store_disks``: its instance-store NVMe disks (0: none).
    """

    efa_interfaces: int = 0
    instance_store_disks: int = 0


@dataclass(frozen=True, slots=True)
class LaunchFacts:
    """The EC2 facts one offer's launch request depends on. ``image`` None: not needed
    (the spec sets no root-volume size)."""

    image: ImageFacts | None
    itype: TypeFacts


def efa_interfaces(cards: int, *, subnet: str | None, groups: tuple[str, ...]) -> list[dict[str, Any]]:
    """RunInstances ``NetworkInterfaces`` for ``cards`` EFA interfaces, one per network card:
    card 0 device 0 ``efa`` (the primary: EFA with ENA, carries the instance's IP), cards
    1..N-1 device 0 ``efa-only`` (no IP address). Pure. Source: "Maximize network
    bandwidth on Amazon EC2 instances with multiple network cards",
    https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html.
    """
    out: list[dict[str, Any]] = []
    for card in range(cards):
        ni: dict[str, Any] = {"NetworkCardIndex": card, "DeviceIndex": 0,
                              "InterfaceType": "efa" if card == 0 else "efa-only", "DeleteOnTermination": True}
        if subnet:
            ni["SubnetId"] = subnet
        if groups:
            ni["Groups"] = list(groups)
        out.append(ni)
    return out


# RunInstances keywords a launch template carries as they are (LaunchTemplateData has the same shapes:
# https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_RequestLaunchTemplateData.html)
_TEMPLATE_KEYS = ("ImageId", "TagSpecifications", "SecurityGroupIds", "IamInstanceProfile", "KeyName",
                  "BlockDeviceMappings", "NetworkInterfaces")


def launch_template_data(request: dict[str, Any]) -> dict[str, Any]:
    """The ``LaunchTemplateData`` of the create_fleet path for a RunInstances request
    (:meth:`AwsProvider.run_instances_request`): the same image, tags, groups, profile,
    key, root volume and EFA interfaces, the user data base64-encoded (templates take it
    encoded). The instance type, zone, subnet (without EFA), spot options and placement go
    into the fleet's overrides instead. Pure."""
    data = {k: request[k] for k in _TEMPLATE_KEYS if k in request}
    data["UserData"] = base64.b64encode(request["UserData"].encode()).decode()
    return data


def image_facts(resp: dict[str, Any], *, region: str, image_id: str) -> ImageFacts:
    """:class:`ImageFacts` of a DescribeImages answer. Raises ProviderError (a configuration
    error: no retry helps) when the image is not there: AMI ids are per region."""
    images = resp.get("Images", [])
    if not images or not images[0].get("RootDeviceName"):
        raise ProviderError(f"DescribeImages in {region}: no image {image_id} (set the domain's launch.image_id "
                            f"to an AMI of {region})")
    return ImageFacts(root_device_name=images[0]["RootDeviceName"])


def facts_from(launch: AwsLaunchSpec, offer: Offer, images: Mapping[tuple[str, str], ImageFacts],
               types: Mapping[tuple[str, str], TypeFacts]) -> LaunchFacts | None:
    """The :class:`LaunchFacts` of ``offer`` from the caches (``(region, image id)`` and
    ``(region, instance type)`` keyed), or None when one it needs is missing: the image only
    with a root-volume size, the type only with EFA or instance-store scratch on."""
    image = None
    if launch.root_volume_gib is not None:
        image = images.get((offer.region, launch.image_id))
        if image is None:
            return None
    itype = TypeFacts()
    if launch.efa or launch.instance_store_scratch:
        found = types.get((offer.region, offer.instance_type))
        if found is None:
            return None
        itype = found
    return LaunchFacts(image=image, itype=itype)


def type_facts(resp: dict[str, Any]) -> TypeFacts:
    """:class:`TypeFacts` of a DescribeInstanceTypes answer for one type: EFA interfaces =
    ``MaximumNetworkCards`` (at most ``EfaInfo.MaximumEfaInterfaces``) when
    ``EfaSupported``; disks = the sum of ``InstanceStorageInfo.Disks[].Count``
    (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_NetworkInfo.html,
    https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_InstanceStorageInfo.html)."""
    types = resp.get("InstanceTypes", [])
    if not types:
        return TypeFacts()
    net = types[0].get("NetworkInfo", {})
    efa = 0
    if net.get("EfaSupported"):
        cards = int(net.get("MaximumNetworkCards") or 1)
        efa = min(cards, int(net.get("EfaInfo", {}).get("MaximumEfaInterfaces") or cards))
    disks = sum(int(d.get("Count", 0)) for d in types[0].get("InstanceStorageInfo", {}).get("Disks", []))
    return TypeFacts(efa_interfaces=efa, instance_store_disks=disks)


def build_run_instances(offer: Offer, node: NodeSpec, launch: AwsLaunchSpec, facts: LaunchFacts, *, dialect: str,
                        tags: list[dict[str, str]], token: str) -> dict[str, Any]:
    """The RunInstances keywords for ``node`` on ``offer`` with its domain's ``launch`` spec
    and the EC2 ``facts``; ``tags``: the instance's tag list, ``token``: its ClientToken.
    Raises ValueError when a node field cannot go into the user-data."""
    spot: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
    if offer.max_price_usd_h is not None:
        spot["MaxPrice"] = str(offer.max_price_usd_h)
    scratch = launch.instance_store_scratch and facts.itype.instance_store_disks > 0
    kwargs: dict[str, Any] = {
        "ImageId": launch.image_id,
        "InstanceType": offer.instance_type,
        "MinCount": 1,
        "MaxCount": 1,
        "UserData": render_user_data(node, dialect=dialect, scratch=scratch),  # boto3 base64-encodes
        "TagSpecifications": [{"ResourceType": "instance", "Tags": tags}],
        "ClientToken": token,
    }
    if not offer.on_demand:  # the on-demand fallback launches without market options
        kwargs["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
    subnet = launch.subnet(offer.zone)
    if offer.zone:
        kwargs["Placement"] = {"AvailabilityZone": offer.zone}
    if offer.placement_group:  # the domain's cluster placement group (RunInstances Placement.GroupName)
        kwargs.setdefault("Placement", {})["GroupName"] = offer.placement_group
    if launch.efa and facts.itype.efa_interfaces > 0:
        # subnet and groups live in the interfaces: RunInstances refuses them at both levels
        kwargs["NetworkInterfaces"] = efa_interfaces(facts.itype.efa_interfaces, subnet=subnet,
                                                     groups=launch.security_group_ids)
    else:
        if subnet:
            kwargs["SubnetId"] = subnet
        if launch.security_group_ids:
            kwargs["SecurityGroupIds"] = list(launch.security_group_ids)
    if launch.root_volume_gib is not None and facts.image is not None:
        kwargs["BlockDeviceMappings"] = [{"DeviceName": facts.image.root_device_name, "Ebs": {
            "VolumeSize": launch.root_volume_gib, "VolumeType": launch.root_volume_type,
            "DeleteOnTermination": True}}]
    if launch.iam_instance_profile:
        kwargs["IamInstanceProfile"] = (
            {"Arn": launch.iam_instance_profile} if launch.iam_instance_profile.startswith("arn:")
            else {"Name": launch.iam_instance_profile})
    if launch.key_name:
        kwargs["KeyName"] = launch.key_name
    return kwargs
