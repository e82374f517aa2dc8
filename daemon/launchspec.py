"""Launch specs: what a cloud instance is launched with, per placement domain.

AMIs, security groups, subnets and (on Alibaba Cloud) custom images and security groups
are region-scoped, so one image id for every region cannot launch in a second region.
Each ``domains[]`` entry may carry a ``launch:`` block that overrides the provider-level
defaults (``providers.aws`` / ``providers.aliyun``) for that domain's region:

- AWS (:class:`AwsDomainLaunch`): ``image_id``, ``subnet_ids`` (zone → subnet),
  ``security_group_ids``, ``key_name``, ``iam_instance_profile``, ``root_volume_gib``,
  ``root_volume_type``, ``efa``, ``instance_store_scratch``.
- Alibaba (:class:`AliyunDomainLaunch`): ``image_id``, ``security_group_id``,
  ``vswitch_ids`` (zone → vSwitch), ``ram_role``, ``key_pair_name``,
  ``system_disk_gib``, ``system_disk_category``.

A field left out (or the whole block) takes the provider section's value. The result is
one frozen value per domain, :class:`AwsLaunchSpec` / :class:`AliyunLaunchSpec`, built by
the pure resolvers :func:`resolve_aws` / :func:`resolve_aliyun`;
``Config.launch_spec(offer_or_domain)`` is how the rest of the code asks for it, and the
providers get it per offer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "AwsDomainLaunch",
    "AliyunDomainLaunch",
    "AwsLaunchSpec",
    "AliyunLaunchSpec",
    "resolve_aws",
    "resolve_aliyun",
    "AWS_ROOT_VOLUME_TYPES",
    "ALIYUN_DISK_CATEGORIES",
    "MAX_ROOT_VOLUME_GIB",
    "ALIYUN_SYSTEM_DISK_GIB",
]

# EBS volume types a root volume may have; gp3 is the default (20 % cheaper per GiB than
# gp2, 3,000 IOPS and 125 MiB/s whatever its size:
# https://docs.aws.amazon.com/ebs/latest/userguide/general-purpose.html)
AWS_ROOT_VOLUME_TYPES = ("gp3", "gp2", "io1", "io2")
# gp3 / gp2 volumes are at most 16 TiB (https://docs.aws.amazon.com/ebs/latest/userguide/ebs-volume-types.html)
MAX_ROOT_VOLUME_GIB = 16384
# Alibaba RunInstances SystemDisk.Category / SystemDisk.Size (GiB)
# (https://www.alibabacloud.com/help/en/ecs/developer-reference/api-ecs-2014-05-26-runinstances)
ALIYUN_DISK_CATEGORIES = ("cloud_efficiency", "cloud_ssd", "cloud_essd", "cloud_auto", "cloud_essd_entry", "cloud")
ALIYUN_SYSTEM_DISK_GIB = (20, 2048)

# AWS ids are the prefix and 8 or 17 hex digits; any length is accepted, as providers.aws always did
_AMI = re.compile(r"^ami-[0-9a-f]+$")
_SG = re.compile(r"^sg-[0-9a-f]+$")
_SUBNET = re.compile(r"^subnet-[0-9a-f]+$")


class _Launch(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @classmethod
    def keys(cls) -> str:
        return ", ".join(cls.model_fields)


def check_ami(value: str | None) -> str | None:
    if value is not None and not _AMI.match(value):
        raise ValueError(f"{value!r} is not an AMI id (ami- and hex digits; find the image's id in this "
                         "region: aws ec2 describe-images --region REGION --owners amazon --filters Name=name,Values=...)")
    return value


def check_sgs(value: list[str] | None) -> list[str] | None:
    for sg in value or ():
        if not _SG.match(sg):
            raise ValueError(f"{sg!r} is not a security group id (sg- and hex digits: aws ec2 describe-security-groups)")
    return value


def check_subnets(value: dict[str, str] | None) -> dict[str, str] | None:
    for zone, subnet in (value or {}).items():
        if not _SUBNET.match(subnet):
            raise ValueError(f"{zone}: {subnet!r} is not a subnet id (subnet- and hex digits: aws ec2 describe-subnets)")
    return value


class AwsDomainLaunch(_Launch):
    """An AWS domain's ``launch:`` block; every field is optional (absent: ``providers.aws``'s).

    ``subnet_ids``: availability zone → subnet id (an offer's zone picks its subnet).
    ``root_volume_gib``: the root EBS volume's size in GiB (absent: the AMI's own);
    ``root_volume_type``: its EBS type (default gp3). ``efa``: attach Elastic Fabric
    Adapter interfaces, one per network card, where the instance type supports them.
    ``instance_store_scratch``: format and mount the type's instance-store NVMe disks
    (RAID 0 when several) as the node's checkpoint scratch directory.
    """

    image_id: str | None = None
    subnet_ids: dict[str, str] | None = None
    security_group_ids: list[str] | None = None
    key_name: str | None = Field(None, min_length=1, max_length=255)
    iam_instance_profile: str | None = Field(None, min_length=1)
    root_volume_gib: int | None = Field(None, ge=1, le=MAX_ROOT_VOLUME_GIB)
    root_volume_type: Literal["gp3", "gp2", "io1", "io2"] | None = None
    efa: bool | None = None
    instance_store_scratch: bool | None = None

    _ami = field_validator("image_id")(classmethod(lambda cls, v: check_ami(v)))
    _sgs = field_validator("security_group_ids")(classmethod(lambda cls, v: check_sgs(v)))
    _subnets = field_validator("subnet_ids")(classmethod(lambda cls, v: check_subnets(v)))


class AliyunDomainLaunch(_Launch):
    """An Alibaba Cloud domain's ``launch:`` block; every field optional (absent: ``providers.aliyun``'s).

    ``vswitch_ids``: zone id → vSwitch id. ``ram_role``: the instance RAM role
    (RunInstances ``RamRoleName``). ``system_disk_gib`` / ``system_disk_category``:
    RunInstances ``SystemDisk.Size`` (GiB, 20..2048, at least the image's size) and
    ``SystemDisk.Category`` (absent: ECS's default for the type).
    """

    image_id: str | None = Field(None, min_length=1)
    security_group_id: str | None = Field(None, pattern=r"^sg-[0-9a-z]+$")
    vswitch_ids: dict[str, str] | None = None
    ram_role: str | None = Field(None, pattern=r"^[A-Za-z0-9.-]{1,64}$")
    key_pair_name: str | None = Field(None, min_length=2, max_length=128)
    system_disk_gib: int | None = Field(None, ge=ALIYUN_SYSTEM_DISK_GIB[0], le=ALIYUN_SYSTEM_DISK_GIB[1])
    system_disk_category: Literal["cloud_efficiency", "cloud_ssd", "cloud_essd", "cloud_auto", "cloud_essd_entry",
                                  "cloud"] | None = None


@dataclass(frozen=True, slots=True)
class AwsLaunchSpec:
    """What an AWS instance of one domain is launched with (resolved: no field is "inherit").

    ``subnet_ids``: zone → subnet id; ``root_volume_gib`` None: the AMI's own size.
    """

    domain: str
    region: str
    image_id: str
    subnet_ids: Mapping[str, str] = field(default_factory=dict)
    security_group_ids: tuple[str, ...] = ()
    key_name: str | None = None
    iam_instance_profile: str | None = None
    root_volume_gib: int | None = None
    root_volume_type: str = "gp3"
    efa: bool = True
    instance_store_scratch: bool = True

    def subnet(self, zone: str | None) -> str | None:
        """The subnet of ``zone`` (None: no zone, or none configured for it: EC2 picks the default VPC's)."""
        return self.subnet_ids.get(zone) if zone else None


@dataclass(frozen=True, slots=True)
class AliyunLaunchSpec:
    """What an ECS instance of one domain is launched with (resolved).

    ``vswitch_ids``: zone → vSwitch id; ``system_disk_*`` None: ECS's defaults.
    """

    domain: str
    region: str
    image_id: str
    security_group_id: str
    vswitch_ids: Mapping[str, str] = field(default_factory=dict)
    ram_role: str | None = None
    key_pair_name: str | None = None
    system_disk_gib: int | None = None
    system_disk_category: str | None = None


def _pick(launch: Any, provider: Any, name: str) -> Any:
    value = None if launch is None else getattr(launch, name, None)
    return getattr(provider, name, None) if value is None else value


def resolve_aws(provider: Any, launch: AwsDomainLaunch | None, *, domain: str, region: str,
                where: str = "providers.aws") -> AwsLaunchSpec:
    """The launch spec of an AWS domain: ``launch``'s fields over ``provider``'s
    (an ``AwsProviderSpec``). Pure.

    Raises:
        ValueError: no image id at either level; the message names ``where`` (the
            domain's ``launch`` path) and the fix.
    """
    image = _pick(launch, provider, "image_id")
    if not image:
        raise ValueError(f"{where}.image_id: domain {domain!r} ({region}) has no AMI (AMI ids are per region: set "
                         f"{where}.image_id to the image's id in {region}, or providers.aws.image_id)")
    return AwsLaunchSpec(
        domain=domain, region=region, image_id=image,
        subnet_ids=dict(_pick(launch, provider, "subnet_ids") or {}),
        security_group_ids=tuple(_pick(launch, provider, "security_group_ids") or ()),
        key_name=_pick(launch, provider, "key_name"),
        iam_instance_profile=_pick(launch, provider, "iam_instance_profile"),
        root_volume_gib=_pick(launch, provider, "root_volume_gib"),
        root_volume_type=_pick(launch, provider, "root_volume_type") or "gp3",
        efa=_pick(launch, provider, "efa") is not False,  # absent at both levels: on
        instance_store_scratch=_pick(launch, provider, "instance_store_scratch") is not False,
    )


def resolve_aliyun(provider: Any, launch: AliyunDomainLaunch | None, *, domain: str, region: str,
                   where: str = "providers.aliyun") -> AliyunLaunchSpec:
    """The launch spec of an Alibaba Cloud domain: ``launch``'s fields over ``provider``'s
    (an ``AliyunProviderSpec``). Pure.

    Raises:
        ValueError: no image or no security group at either level (message: field and fix).
    """
    image = _pick(launch, provider, "image_id")
    if not image:
        raise ValueError(f"{where}.image_id: domain {domain!r} ({region}) has no image (custom images are per "
                         f"region: set {where}.image_id to an image in {region}, or providers.aliyun.image_id)")
    group = _pick(launch, provider, "security_group_id")
    if not group:
        raise ValueError(f"{where}.security_group_id: domain {domain!r} ({region}) has no security group (set "
                         f"{where}.security_group_id to a group of {region}'s VPC, or providers.aliyun.security_group_id)")
    return AliyunLaunchSpec(
        domain=domain, region=region, image_id=image, security_group_id=group,
        vswitch_ids=dict(_pick(launch, provider, "vswitch_ids") or {}),
        ram_role=_pick(launch, provider, "ram_role"),
        key_pair_name=_pick(launch, provider, "key_pair_name"),
        system_disk_gib=_pick(launch, provider, "system_disk_gib"),
        system_disk_category=_pick(launch, provider, "system_disk_category"),
    )
