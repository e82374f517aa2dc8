"""A local fake of the Alibaba Cloud ECS RPC API (version 2014-05-26), for the aliyun
provider's tests. It speaks to the real ``aliyun-python-sdk-ecs`` client.

It follows the documents (and the SDK source where the documents are silent):

- Request structure and signature, "Signature method (RPC / V1)"
  (https://www.alibabacloud.com/help/en/sdk/product-overview/rpc-mechanism):
  every parameter travels in the query string (the SDK sends a POST or GET with an
  empty body; parameters put in a form body are signed too, as in
  ``aliyunsdkcore.auth.composer.rpc_signature_composer.get_signed_url``). Common
  parameters ``Action``, ``Version``, ``Format``, ``AccessKeyId``, ``SignatureMethod``
  (``HMAC-SHA1``), ``SignatureVersion`` (``1.0``), ``SignatureNonce``, ``Timestamp``,
  ``Signature`` are required. ``StringToSign = METHOD + "&%2F&" +
  percentEncode(canonicalized query)`` where the canonicalized query is the sorted
  ``percentEncode(k)=percentEncode(v)`` pairs (RFC 3986: ``~`` kept, space = ``%20``,
  ``*`` = ``%2A``) without ``Signature``; ``Signature = base64(HMAC-SHA1(secret + "&",
  StringToSign))``. The fake recomputes it and answers ``SignatureDoesNotMatch`` (400)
  with the message ``... server string to sign is:<StringToSign>`` -- the SDK splits
  that message on ``:`` (``AcsClient._get_server_exception``) and re-labels the error
  ``InvalidAccessKeySecret`` when the strings to sign agree. An unknown key id is
  ``InvalidAccessKeyId.NotFound`` (404).
- Error body ``{"RequestId", "HostId", "Code", "Message"}`` with the HTTP status of the
  code ("API error codes" of each operation, e.g.
  https://www.alibabacloud.com/help/en/ecs/developer-reference/api-runinstances).
- RunInstances (api-runinstances): ``ImageId``, ``InstanceType``, ``ZoneId``,
  ``SecurityGroupId``, ``VSwitchId``, ``InstanceChargeType=PostPaid`` for spot,
  ``SpotStrategy`` (``NoSpot`` | ``SpotAsPriceGo`` | ``SpotWithPriceLimit``),
  ``SpotPriceLimit``, ``SpotDuration`` (0..6), ``SpotInterruptionBehavior``,
  ``UserData`` (base64, at most 32 KB), ``Tag.N.Key`` / ``Tag.N.Value`` (N in 1..20),
  ``Amount`` (1..100), ``ClientToken`` (at most 64 ASCII characters, idempotency: the
  same token answers the same ``InstanceIdSets`` without creating anything),
  ``RamRoleName`` (the instance RAM role; one the account lacks is
  ``InvalidRamRole.NotFound``, 404), ``KeyPairName``, ``SystemDisk.Size`` (GiB: 20..500
  for ``cloud``, 20..2048 for the other categories, else
  ``InvalidSystemDiskSize.ValueNotSupported``, 400) and ``SystemDisk.Category``
  (``cloud``, ``cloud_efficiency``, ``cloud_ssd``, ``cloud_essd``, ``cloud_auto``,
  ``cloud_essd_entry``, else ``InvalidSystemDiskCategory.ValueNotSupported``, 400)
  (https://www.alibabacloud.com/help/en/ecs/developer-reference/api-ecs-2014-05-26-runinstances).
  Response ``{"RequestId", "InstanceIdSets": {"InstanceIdSet": [...]}, "OrderId",
  "TradePrice"}``.
- DescribeInstances (api-describeinstances): ``InstanceIds`` (a JSON array string, at
  most 100), ``Tag.N.Key`` / ``Tag.N.Value``, ``Status``, ``ZoneId``, ``InstanceType``;
  paging by ``PageNumber`` / ``PageSize`` (default 10, at most 100) or by ``NextToken``
  / ``MaxResults``. Response ``{"Instances": {"Instance": [...]}, "TotalCount",
  "PageNumber", "PageSize", "NextToken", "RequestId"}``; an instance has
  ``InstanceId, RegionId, InstanceType, ZoneId, Status, SpotStrategy, SpotPriceLimit,
  InstanceChargeType, ImageId, CreationTime`` (``yyyy-MM-ddTHH:mmZ``), ``Tags: {"Tag":
  [{"TagKey", "TagValue"}]}`` and ``OperationLocks: {"LockReason": []}``.
- DeleteInstances (api-deleteinstances): ``InstanceId.N``, ``Force``. An unknown id is
  ``InvalidInstanceId.NotFound`` (404); a running instance without ``Force=true`` is
  ``IncorrectInstanceStatus`` (403).
- DescribeSpotPriceHistory (api-describespotpricehistory): ``InstanceType`` and
  ``NetworkType`` required, ``ZoneId`` optional. Response ``{"SpotPrices":
  {"SpotPriceType": [{"ZoneId", "InstanceType", "IoOptimized", "NetworkType",
  "SpotPrice", "OriginPrice", "Timestamp"}]}, "Currency", "NextOffset", "RequestId"}``.

- DescribeImages (https://www.alibabacloud.com/help/en/ecs/developer-reference/api-ecs-2014-05-26-describeimages):
  ``ImageId`` (comma-separated); ``{"Images": {"Image": [{"ImageId", "Status", ...}]},
  "TotalCount", "PageNumber", "PageSize"}``; an id not in the region is simply not
  listed. DescribeSecurityGroups (api-ecs-2014-05-26-describesecuritygroups):
  ``SecurityGroupIds`` (a JSON array string); ``{"SecurityGroups": {"SecurityGroup":
  [{"SecurityGroupId", "VpcId", ...}]}, "TotalCount"}``.
  DescribeAvailableResource (api-ecs-2014-05-26-describeavailableresource):
  ``DestinationResource`` required (``InstanceType`` here), ``ZoneId``,
  ``InstanceType``, ``InstanceChargeType``, ``SpotStrategy``; a type listed with
  ``Status`` ``Available`` / ``SoldOut`` and ``StatusCategory`` ``WithStock`` /
  ``ClosedWithStock`` / ``WithoutStock`` ("queries the stock status of resources in a
  zone"); ``{"AvailableZones":
  {"AvailableZone": [{"RegionId", "ZoneId", "Status", "StatusCategory",
  "AvailableResources": {"AvailableResource": [{"Type": "InstanceType",
  "SupportedResources": {"SupportedResource": [{"Value", "Status", "StatusCategory"}]}}]}}]}}``.
- ``DryRun=true`` on RunInstances (api-ecs-2014-05-26-runinstances): the request is
  checked (permission, parameters, image, security group) and answered with the error
  code ``DryRunOperation`` when it would have succeeded; nothing is created.
- A RAM policy that does not grant the action: ``Forbidden.RAM`` (403), "User not
  authorized to operate on the specified resource, or this API doesn't support RAM."
  (the ECS common error codes, https://api.aliyun.com/document/Ecs/2014-05-26/errorCode).

UNCONFIRMED (the documents do not say; the fake picks the plausible behaviour):
the HTTP status of ``InvalidVersion`` / ``InvalidParameter.Format`` / missing common
parameters (400 here); the code for ``SpotWithPriceLimit`` without ``SpotPriceLimit``
(``MissingParameter``, 400); a reused ``ClientToken`` with different parameters
(``IdempotentParameterMismatch``, 400); how long ECS remembers a ``ClientToken``
(forever here); the lower bound of ``SystemDisk.Size`` per ESSD performance level and
the image's own size (20 GiB for every category here); the HTTP status of
``InvalidRamRole.NotFound`` (404, as in AttachInstanceRamRole's table); deleting a ``Pending`` instance (``IncorrectInstanceStatus.Initializing``,
403); the order of ``SpotPriceType`` entries (oldest first here); the HTTP status of
``DryRunOperation`` (400 here); the code for an unknown image or security group in
RunInstances (``InvalidImageId.NotFound`` / ``InvalidSecurityGroupId.NotFound``, 404).

A ``DryRun=true`` call (the daemon's cloud check) never takes an armed fault or delay:
they are for the launches a test means.

Resources (test hooks): :attr:`FakeEcs.images` and :attr:`FakeEcs.security_groups`
(region → ids; a region without an entry has every id asked for, as RunInstances
accepted any before),
:attr:`FakeEcs.available` (``(zone, instance_type)`` pairs for sale; None: every type in
every zone), :attr:`FakeEcs.denied` (actions the caller's RAM policy does not grant).

Test hooks (not part of ECS): :meth:`FakeEcs.fail_next` (answer the next calls of an
action with a documented error), :meth:`FakeEcs.delay_next` (apply the call, then
answer late -- a client timeout after the request reached ECS; :meth:`FakeEcs.release_delays`
answers the held calls at once), :attr:`FakeEcs.prices`
(``(instance_type, zone) -> [(timestamp, price)]``), :attr:`FakeEcs.currency`,
:attr:`FakeEcs.ram_roles` (the account's RAM role names; None: any name exists),
:attr:`FakeEcs.spot_sold_out` (``(zone, instance_type)`` whose spot stock is out:
DescribeAvailableResource lists it ``SoldOut`` for a spot strategy, and a spot
RunInstances there fails ``OperationDenied.NoStock``), :meth:`FakeEcs.reclaim` (ECS
releases a spot instance), and the logs
:attr:`FakeEcs.requests` (every signed request's parameters, by action) and
:attr:`FakeEcs.instances`.

Example::

    async with FakeEcs(access_key_id="ak", access_key_secret="sk") as ecs:
        ecs.fail_next("RunInstances", "OperationDenied.NoStock")
        request.set_endpoint(ecs.endpoint); request.set_protocol_type("http")
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import itertools
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from urllib.parse import quote

from aiohttp import web

from fakes.serving import LocalServer

__all__ = ["FakeEcs", "FakeInstance", "ERROR_STATUS", "string_to_sign"]

API_VERSION = "2014-05-26"

#: HTTP status of each error code, from the operations' error-code tables.
ERROR_STATUS: dict[str, int] = {
    "OperationDenied.NoStock": 403,
    "InvalidResourceType.NotSupported": 403,
    "Zone.NotOnSale": 403,
    "InvalidInstanceType.ZoneNotSupported": 400,
    "InvalidSpotPriceLimit.LowerThanPublicPrice": 400,
    "Throttling": 400,
    "Throttling.User": 400,
    "QuotaExceed.PostPaidInstance": 403,
    "QuotaExceed.ElasticQuota": 403,
    "InternalError": 500,
    "ServiceUnavailable": 503,
    "SignatureDoesNotMatch": 400,
    "InvalidAccessKeyId.NotFound": 404,
    "Forbidden.RAM": 403,
    "MissingParameter": 400,
    "InvalidParameter": 400,
    "InvalidVersion": 400,
    "InvalidInstanceId.NotFound": 404,
    "IncorrectInstanceStatus": 403,
    "IncorrectInstanceStatus.Initializing": 403,
    "IdempotentParameterMismatch": 400,
    "InvalidUserData.SizeExceeded": 400,
    "InvalidUserData.Base64FormatInvalid": 400,
    "InvalidAction.NotFound": 404,
    "InvalidSystemDiskSize.ValueNotSupported": 400,
    "InvalidSystemDiskCategory.ValueNotSupported": 400,
    "InvalidRamRole.NotFound": 404,
    "DryRunOperation": 400,
    "InvalidImageId.NotFound": 404,
    "InvalidSecurityGroupId.NotFound": 404,
}

SYSTEM_DISK_CATEGORIES = ("cloud", "cloud_efficiency", "cloud_ssd", "cloud_essd", "cloud_auto", "cloud_essd_entry")

_REQUIRED_COMMON = ("Action", "Version", "Format", "AccessKeyId", "SignatureMethod",
                    "SignatureVersion", "SignatureNonce", "Timestamp", "Signature")
_ALIVE = ("Pending", "Starting", "Running", "Stopping", "Stopped")


def _pct(value: str) -> str:
    """RFC 3986 percent-encoding as the RPC signature wants it (``~`` kept, space = %20)."""
    return quote(value, safe="-_.~")


def string_to_sign(method: str, params: Mapping[str, str]) -> str:
    """The RPC v1 StringToSign of ``params`` (``Signature`` left out)."""
    canon = "&".join(f"{_pct(k)}={_pct(v)}" for k, v in sorted(params.items()) if k != "Signature")
    return f"{method.upper()}&%2F&{_pct(canon)}"


def _sign(secret: str, sts: str) -> str:
    mac = hmac.new((secret + "&").encode(), sts.encode(), hashlib.sha1)
    return base64.b64encode(mac.digest()).decode()


class _ApiError(Exception):
    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(code)
        self.code, self.message = code, message
        self.status = status or ERROR_STATUS.get(code, 400)


@dataclass(slots=True)
class FakeInstance:
    """One instance as the fake keeps it. ``status`` None = computed (Pending, then Running)."""

    instance_id: str
    region_id: str
    zone_id: str
    instance_type: str
    image_id: str
    security_group_id: str
    vswitch_id: str
    spot_strategy: str
    spot_price_limit: float
    spot_duration: int
    charge_type: str
    user_data: str  # decoded text
    tags: dict[str, str]
    created: float
    status: str | None = None
    lock_reasons: list[str] = field(default_factory=list)
    ram_role: str | None = None
    key_pair_name: str | None = None
    system_disk_gib: int | None = None  # None: ECS's default (max(40, image size))
    system_disk_category: str | None = None


@dataclass(slots=True)
class _Fault:
    code: str
    status: int
    message: str
    left: int
    match: dict[str, str]


@dataclass(slots=True)
class _Delay:
    seconds: float
    after_apply: bool
    left: int


class FakeEcs(LocalServer):
    """The fake ECS endpoint; see the module docstring.

    Lifecycle: the constructor does no I/O; ``await start()`` binds 127.0.0.1 on an
    ephemeral port and sets :attr:`endpoint` (``"127.0.0.1:PORT"``); ``await aclose()``
    stops it (idempotent; cuts pending :meth:`delay_next` waits short).

    Args:
        access_key_id, access_key_secret: the only credentials the fake accepts.
        running_after_s: an instance reads ``Pending`` for this long, then ``Running``.
    """

    def __init__(self, *, access_key_id: str = "test-ak-id", access_key_secret: str = "test-ak-secret",
                 running_after_s: float = 0.0) -> None:
        if not access_key_id or not access_key_secret:
            raise ValueError("FakeEcs needs a non-empty access key id and secret")
        super().__init__()
        self.access_key_id = access_key_id
        self._secret = access_key_secret
        self.running_after_s = running_after_s
        self.instances: dict[str, FakeInstance] = {}
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.prices: dict[tuple[str, str], list[tuple[str, float]]] = {}
        self.currency = "USD"
        self.ram_roles: set[str] | None = None
        self.auth_failures = 0
        self.images: dict[str, set[str]] = {}  # region -> image ids (no entry: any id launches)
        self.security_groups: dict[str, set[str]] = {}  # region -> security group ids (likewise)
        self.available: set[tuple[str, str]] | None = None  # (zone, instance type) for sale; None: all
        self.spot_sold_out: set[tuple[str, str]] = set()  # (zone, instance type) with no spot stock now
        self.denied: set[str] = set()  # actions answered Forbidden.RAM
        self._tokens: dict[tuple[str, str], tuple[str, list[str]]] = {}  # (region, token) -> (digest, ids)
        self._faults: dict[str, list[_Fault]] = {}
        self._delays: dict[str, list[_Delay]] = {}
        self._seq = itertools.count(1)
        self._closing = asyncio.Event()
        self._release = asyncio.Event()

    # -- lifecycle (fakes.serving.LocalServer) -----------------------------------------
    async def aclose(self) -> None:
        self._closing.set()
        await super().aclose()

    # -- test hooks --------------------------------------------------------------------
    def fail_next(self, action: str, code: str, status: int | None = None, *, n: int = 1,
                  message: str | None = None, match: Mapping[str, str] | None = None) -> None:
        """Answer the next ``n`` signed calls of ``action`` (whose parameters include
        ``match``) with error ``code``; ``status`` defaults to the documented one."""
        self._faults.setdefault(action, []).append(
            _Fault(code, status or ERROR_STATUS.get(code, 400), message or f"injected {code}", n, dict(match or {})))

    def delay_next(self, action: str, seconds: float, *, after_apply: bool = True, n: int = 1) -> None:
        """Hold the answer to the next ``n`` calls of ``action`` for ``seconds``; with
        ``after_apply`` the call takes effect first (a timeout after ECS acted)."""
        self._delays.setdefault(action, []).append(_Delay(seconds, after_apply, n))

    def release_delays(self) -> None:
        """Answer every call :meth:`delay_next` holds now, at once."""
        self._release.set()
        self._release.clear()  # the waiting calls are woken already; later delays hold again

    def reclaim(self, instance_id: str) -> None:
        """ECS releases a spot instance (it disappears from DescribeInstances)."""
        self.instances.pop(instance_id, None)

    def calls(self, action: str, *, dry_run: bool = False) -> list[dict[str, str]]:
        """Parameters of every correctly signed call of ``action``, oldest first: those a
        test means (no ``DryRun=true``), or with ``dry_run`` the dry runs only."""
        return [p for a, p in self.requests if a == action and (p.get("DryRun", "").lower() == "true") == dry_run]

    # -- HTTP --------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.Response:
        request_id = str(uuid.uuid4()).upper()
        params: dict[str, str] = dict(request.query)
        if request.method == "POST" and request.can_read_body:
            form = await request.post()
            params.update({k: v for k, v in form.items() if isinstance(v, str)})
        try:
            self._authenticate(request.method, params)
            action = params["Action"]
            self.requests.append((action, dict(params)))
            dry = params.get("DryRun", "").lower() == "true"  # the cloud check's: armed faults are for launches
            fault = None if dry else self._take_fault(action, params)
            if fault is not None:
                raise _ApiError(fault.code, fault.message, fault.status)
            if action in self.denied:
                raise _ApiError("Forbidden.RAM", "User not authorized to operate on the specified resource, "
                                "or this API doesn't support RAM.")
            delay = None if dry else self._take(self._delays, action)
            if delay is not None and not delay.after_apply:
                await self._wait(delay.seconds)
            body = self._dispatch(action, params, request_id)
            if delay is not None and delay.after_apply:
                await self._wait(delay.seconds)
            return web.json_response(body)
        except _ApiError as err:
            return web.json_response(
                {"RequestId": request_id, "HostId": request.host, "Code": err.code, "Message": err.message},
                status=err.status)

    async def _wait(self, seconds: float) -> None:
        waits = [asyncio.ensure_future(self._closing.wait()), asyncio.ensure_future(self._release.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _authenticate(self, method: str, params: dict[str, str]) -> None:
        missing = [k for k in _REQUIRED_COMMON if not params.get(k)]
        if missing:
            raise _ApiError("MissingParameter", f"The input parameter \"{missing[0]}\" that is mandatory "
                            "for processing this request is not supplied.")
        if params["AccessKeyId"] != self.access_key_id:
            self.auth_failures += 1
            raise _ApiError("InvalidAccessKeyId.NotFound", "Specified access key is not found.")
        if params["SignatureMethod"] != "HMAC-SHA1" or params["SignatureVersion"] != "1.0":
            raise _ApiError("InvalidParameter", "SignatureMethod/SignatureVersion not supported by this fake.")
        sts = string_to_sign(method, params)
        if not hmac.compare_digest(_sign(self._secret, sts), params["Signature"]):
            self.auth_failures += 1
            raise _ApiError("SignatureDoesNotMatch", "Specified signature does not match our calculation. "
                            f"server string to sign is:{sts}")
        if params["Version"] != API_VERSION:
            raise _ApiError("InvalidVersion", "Specified parameter Version is not valid.")
        if params["Format"].upper() != "JSON":
            raise _ApiError("InvalidParameter.Format", "This fake answers Format=JSON only.")

    def _take_fault(self, action: str, params: dict[str, str]) -> _Fault | None:
        for fault in self._faults.get(action, []):
            if fault.left > 0 and all(params.get(k) == v for k, v in fault.match.items()):
                fault.left -= 1
                return fault
        return None

    @staticmethod
    def _take(table: dict[str, list[_Delay]], action: str) -> _Delay | None:
        for item in table.get(action, []):
            if item.left > 0:
                item.left -= 1
                return item
        return None

    def _dispatch(self, action: str, params: dict[str, str], request_id: str) -> dict[str, object]:
        handler = {
            "RunInstances": self._run_instances,
            "DescribeInstances": self._describe_instances,
            "DeleteInstances": self._delete_instances,
            "DescribeSpotPriceHistory": self._describe_spot_price_history,
            "DescribeImages": self._describe_images,
            "DescribeSecurityGroups": self._describe_security_groups,
            "DescribeAvailableResource": self._describe_available_resource,
        }.get(action)
        if handler is None:
            raise _ApiError("InvalidAction.NotFound", "Specified api is not found, please check your url and method.")
        if not params.get("RegionId"):
            raise _ApiError("MissingParameter", "The input parameter \"RegionId\" that is mandatory for "
                            "processing this request is not supplied.")
        return {"RequestId": request_id, **handler(params)}

    # -- actions -----------------------------------------------------------------------
    def _status(self, inst: FakeInstance) -> str:
        if inst.status is not None:
            return inst.status
        return "Pending" if time.time() - inst.created < self.running_after_s else "Running"

    def _run_instances(self, p: dict[str, str]) -> dict[str, object]:
        for name in ("ImageId", "InstanceType", "SecurityGroupId", "VSwitchId"):
            if not p.get(name):
                raise _ApiError("MissingParameter", f"The input parameter \"{name}\" that is mandatory for "
                                "processing this request is not supplied.")
        region, zone, itype = p["RegionId"], p.get("ZoneId", ""), p["InstanceType"]
        if region in self.images and p["ImageId"] not in self.images[region]:
            raise _ApiError("InvalidImageId.NotFound", "The specified ImageId does not exist.")
        if region in self.security_groups and p["SecurityGroupId"] not in self.security_groups[region]:
            raise _ApiError("InvalidSecurityGroupId.NotFound", "The specified SecurityGroupId does not exist.")
        if p.get("DryRun", "").lower() == "true":
            raise _ApiError("DryRunOperation", "Request validation has been passed with DryRun flag set.")
        token = p.get("ClientToken")
        if token is not None and (len(token) > 64 or not token.isascii()):
            raise _ApiError("InvalidParameter", "The specified parameter ClientToken is not valid.")
        digest = hashlib.sha256(json.dumps(
            {k: v for k, v in p.items() if k not in _REQUIRED_COMMON}, sort_keys=True).encode()).hexdigest()
        if token and (region, token) in self._tokens:
            seen_digest, ids = self._tokens[(region, token)]
            if seen_digest != digest:
                raise _ApiError("IdempotentParameterMismatch", "The request uses the same client token as "
                                "a previous, but non-identical request.")
            return {"InstanceIdSets": {"InstanceIdSet": list(ids)}, "OrderId": "", "TradePrice": 0.0}
        strategy = p.get("SpotStrategy", "NoSpot")
        if strategy not in ("NoSpot", "SpotAsPriceGo", "SpotWithPriceLimit"):
            raise _ApiError("InvalidSpotStrategy", "The specified SpotStrategy is not valid.", 400)
        charge = p.get("InstanceChargeType", "PostPaid")
        if strategy != "NoSpot" and charge != "PostPaid":
            raise _ApiError("InvalidParameter", "SpotStrategy requires InstanceChargeType=PostPaid.")
        limit = 0.0
        if strategy == "SpotWithPriceLimit":
            if not p.get("SpotPriceLimit"):
                raise _ApiError("MissingParameter", "The input parameter \"SpotPriceLimit\" that is mandatory "
                                "for processing this request is not supplied.")
            limit = float(p["SpotPriceLimit"])
            current = self._current_price(itype, zone)
            if current is not None and limit < current:
                raise _ApiError("InvalidSpotPriceLimit.LowerThanPublicPrice", "The specified parameter "
                                "\"spotPriceLimit\" can't be lower than current public price.")
        duration = int(p.get("SpotDuration", "1"))
        if not 0 <= duration <= 6:
            raise _ApiError("InvalidParameter", "The specified SpotDuration is not valid.")
        if strategy != "NoSpot" and (zone, itype) in self.spot_sold_out:
            raise _ApiError("OperationDenied.NoStock", "The requested resource is sold out in the specified "
                            "zone; try other types of resources or other regions and zones.")
        user_data = ""
        if p.get("UserData"):
            if len(p["UserData"]) > 32 * 1024:
                raise _ApiError("InvalidUserData.SizeExceeded", "The specified parameter UserData exceeds the size.")
            try:
                user_data = base64.b64decode(p["UserData"], validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                raise _ApiError("InvalidUserData.Base64FormatInvalid",
                                "The specified UserData is not valid Base64.") from None
        tags: dict[str, str] = {}
        for n in range(1, 21):
            if f"Tag.{n}.Key" in p:
                tags[p[f"Tag.{n}.Key"]] = p.get(f"Tag.{n}.Value", "")
        disk = self._system_disk(p)
        role = p.get("RamRoleName") or None
        if role is not None and self.ram_roles is not None and role not in self.ram_roles:
            raise _ApiError("InvalidRamRole.NotFound", "The specified RAMRoleName does not exist.")
        amount = int(p.get("Amount", "1"))
        if not 1 <= amount <= 100:
            raise _ApiError("InvalidParameter", "The specified Amount is not valid.")
        ids = []
        for _ in range(amount):
            iid = f"i-fake{next(self._seq):012x}"
            self.instances[iid] = FakeInstance(
                iid, region, zone, itype, p["ImageId"], p["SecurityGroupId"], p["VSwitchId"], strategy, limit,
                duration, charge, user_data, dict(tags), time.time(), ram_role=role,
                key_pair_name=p.get("KeyPairName") or None, system_disk_gib=disk[0], system_disk_category=disk[1])
            ids.append(iid)
        if token:
            self._tokens[(region, token)] = (digest, ids)
        return {"InstanceIdSets": {"InstanceIdSet": ids}, "OrderId": str(next(self._seq)), "TradePrice": 0.0}

    @staticmethod
    def _system_disk(p: dict[str, str]) -> tuple[int | None, str | None]:
        """``SystemDisk.Size`` (GiB) and ``SystemDisk.Category`` as RunInstances checks them."""
        category = p.get("SystemDisk.Category") or None
        if category is not None and category not in SYSTEM_DISK_CATEGORIES:
            raise _ApiError("InvalidSystemDiskCategory.ValueNotSupported",
                            "The specified parameter \"SystemDisk.Category\" is not valid.")
        size = None
        if p.get("SystemDisk.Size"):
            try:
                size = int(p["SystemDisk.Size"])
            except ValueError:
                size = -1
            if not 20 <= size <= (500 if category == "cloud" else 2048):
                raise _ApiError("InvalidSystemDiskSize.ValueNotSupported",
                                "The specified parameter SystemDisk.Size is invalid.")
        return size, category

    def _describe_instances(self, p: dict[str, str]) -> dict[str, object]:
        region = p["RegionId"]
        found = [i for i in self.instances.values() if i.region_id == region]
        if p.get("InstanceIds"):
            try:
                wanted = json.loads(p["InstanceIds"])
            except ValueError:
                raise _ApiError("InvalidParameter", "InstanceIds must be a JSON array string.") from None
            if not isinstance(wanted, list) or len(wanted) > 100:
                raise _ApiError("InvalidParameter", "InstanceIds must be a JSON array of at most 100 ids.")
            found = [i for i in found if i.instance_id in wanted]
        for n in range(1, 21):
            key = p.get(f"Tag.{n}.Key")
            if key is not None:
                value = p.get(f"Tag.{n}.Value")
                found = [i for i in found if key in i.tags and (value is None or i.tags[key] == value)]
        for name, attr in (("ZoneId", "zone_id"), ("InstanceType", "instance_type")):
            if p.get(name):
                found = [i for i in found if getattr(i, attr) == p[name]]
        if p.get("Status"):
            found = [i for i in found if self._status(i) == p["Status"]]
        found.sort(key=lambda i: i.instance_id)
        total = len(found)
        out: dict[str, object] = {"TotalCount": total}
        if "NextToken" in p or "MaxResults" in p:
            size = int(p.get("MaxResults") or 10)
            start = int(p["NextToken"]) if p.get("NextToken") else 0
            page = found[start:start + size]
            out["NextToken"] = str(start + size) if start + size < total else ""
        else:
            size = int(p.get("PageSize") or 10)
            number = int(p.get("PageNumber") or 1)
            if not 1 <= size <= 100 or number < 1:
                raise _ApiError("InvalidParameter", "PageSize must be 1..100 and PageNumber >= 1.")
            page = found[(number - 1) * size:number * size]
            out.update(PageSize=size, PageNumber=number, NextToken="")
        out["Instances"] = {"Instance": [self._view(i) for i in page]}
        return out

    def _view(self, i: FakeInstance) -> dict[str, object]:
        return {
            "InstanceId": i.instance_id, "RegionId": i.region_id, "ZoneId": i.zone_id,
            "InstanceType": i.instance_type, "ImageId": i.image_id, "Status": self._status(i),
            "InstanceChargeType": i.charge_type, "SpotStrategy": i.spot_strategy,
            "SpotPriceLimit": i.spot_price_limit, "SpotDuration": i.spot_duration,
            "CreationTime": datetime.fromtimestamp(i.created, timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "SecurityGroupIds": {"SecurityGroupId": [i.security_group_id]},
            "VpcAttributes": {"VSwitchId": i.vswitch_id},
            "Tags": {"Tag": [{"TagKey": k, "TagValue": v} for k, v in i.tags.items()]},
            "OperationLocks": {"LockReason": [{"LockReason": r} for r in i.lock_reasons]},
        }

    def _delete_instances(self, p: dict[str, str]) -> dict[str, object]:
        ids = [p[f"InstanceId.{n}"] for n in range(1, 101) if f"InstanceId.{n}" in p]
        if not ids:
            raise _ApiError("MissingParameter", "The input parameter \"InstanceId\" that is mandatory for "
                            "processing this request is not supplied.")
        force = p.get("Force", "false").lower() == "true"
        for iid in ids:
            inst = self.instances.get(iid)
            if inst is None or inst.region_id != p["RegionId"]:
                raise _ApiError("InvalidInstanceId.NotFound", "The specified InstanceId does not exist.")
            status = self._status(inst)
            if status == "Pending":
                raise _ApiError("IncorrectInstanceStatus.Initializing", "The specified instance is initializing.")
            if status == "Running" and not force:
                raise _ApiError("IncorrectInstanceStatus", "The current status of the resource does not "
                                "support this operation.")
        for iid in ids:
            del self.instances[iid]
        return {}

    def _current_price(self, itype: str, zone: str) -> float | None:
        history = self.prices.get((itype, zone))
        return max(history)[1] if history else None

    def _describe_spot_price_history(self, p: dict[str, str]) -> dict[str, object]:
        for name in ("InstanceType", "NetworkType"):
            if not p.get(name):
                raise _ApiError("MissingParameter", f"The input parameter \"{name}\" that is mandatory for "
                                "processing this request is not supplied.")
        rows = []
        for (itype, zone), history in self.prices.items():
            if itype != p["InstanceType"] or (p.get("ZoneId") and zone != p["ZoneId"]):
                continue
            for ts, price in sorted(history):
                rows.append({"ZoneId": zone, "InstanceType": itype, "IoOptimized": "optimized",
                             "NetworkType": p["NetworkType"], "SpotPrice": price,
                             "OriginPrice": round(price * 4, 4), "Timestamp": ts})
        return {"SpotPrices": {"SpotPriceType": rows}, "Currency": self.currency, "NextOffset": 0}


    def _describe_images(self, p: dict[str, str]) -> dict[str, object]:
        wanted = [i for i in p.get("ImageId", "").split(",") if i]
        known = self.images.get(p["RegionId"], set(wanted))  # no entry for the region: any id exists
        found = [i for i in sorted(known) if not wanted or i in wanted]
        return {"Images": {"Image": [{"ImageId": i, "Status": "Available", "OSType": "linux"} for i in found]},
                "TotalCount": len(found), "PageNumber": 1, "PageSize": 10, "RegionId": p["RegionId"]}

    def _describe_security_groups(self, p: dict[str, str]) -> dict[str, object]:
        try:
            wanted = json.loads(p.get("SecurityGroupIds") or "[]")
        except json.JSONDecodeError:
            raise _ApiError("InvalidParameter", "The specified parameter SecurityGroupIds is not valid.") from None
        known = self.security_groups.get(p["RegionId"], set(wanted))  # no entry for the region: any id exists
        found = [g for g in sorted(known) if not wanted or g in wanted]
        return {"SecurityGroups": {"SecurityGroup": [{"SecurityGroupId": g, "VpcId": "vpc-fake"} for g in found]},
                "TotalCount": len(found), "PageNumber": 1, "PageSize": 10, "RegionId": p["RegionId"]}

    def _describe_available_resource(self, p: dict[str, str]) -> dict[str, object]:
        if not p.get("DestinationResource"):
            raise _ApiError("MissingParameter", "The input parameter \"DestinationResource\" that is mandatory "
                            "for processing this request is not supplied.")
        zone, itype = p.get("ZoneId", ""), p.get("InstanceType", "")
        ok = self.available is None or (zone, itype) in self.available
        if not ok:
            return {"AvailableZones": {"AvailableZone": []}}
        spot = p.get("SpotStrategy", "NoSpot") != "NoSpot"
        item = ({"Value": itype, "Status": "SoldOut", "StatusCategory": "WithoutStock"}
                if spot and (zone, itype) in self.spot_sold_out else
                {"Value": itype, "Status": "Available", "StatusCategory": "WithStock"})
        return {"AvailableZones": {"AvailableZone": [{
            "RegionId": p["RegionId"], "ZoneId": zone, "Status": "Available", "StatusCategory": "WithStock",
            "AvailableResources": {"AvailableResource": [
                {"Type": "InstanceType", "SupportedResources": {"SupportedResource": [item]}}]}}]}}
