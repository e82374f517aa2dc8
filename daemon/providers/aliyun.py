"""Alibaba Cloud ECS preemptible (spot) instances behind the Provider contract.

The adapter speaks the ECS RPC API (version 2014-05-26) through
``aliyun-python-sdk-ecs``; every SDK call is blocking and runs in a thread
(``asyncio.to_thread``). Documents followed:

- RunInstances (https://www.alibabacloud.com/help/en/ecs/developer-reference/api-runinstances):
  a spot instance is ``InstanceChargeType=PostPaid`` with ``SpotStrategy``
  ``SpotAsPriceGo`` (pay the market price, capped at the pay-as-you-go price) or
  ``SpotWithPriceLimit`` + ``SpotPriceLimit`` (USD or CNY per hour, the account's
  currency); ``SpotDuration=0`` (no protection period: cheapest, may be reclaimed at
  any time with the 5-minute notice), ``SpotInterruptionBehavior=Terminate``.
  ``ClientToken`` makes the call idempotent: a retry after a timeout returns the
  instance of the first call instead of buying a second one.
- DescribeInstances (api-describeinstances): filter by ``Tag.N.Key/Value``, paged by
  ``PageNumber``/``PageSize`` (at most 100); statuses Pending, Starting, Running,
  Stopping, Stopped (a released instance is no longer listed).
- DeleteInstances (api-deleteinstances): ``Force=true`` releases a running instance.
- DescribeSpotPriceHistory (api-describespotpricehistory): ``SpotPrices.SpotPriceType[]``
  with ``SpotPrice`` per hour in the response's ``Currency``.
- Error codes, their translation, the credential chain, clients and retries: the ECS
  edge, :mod:`daemon.providers.aliyun_api` (:class:`~daemon.providers.aliyun_api.EcsApi`).
  Credentials are never in the config and never logged; none found → :class:`AuthError`.

Example (SkyPilot-style walk-through): offer 1 (cn-hangzhou-g) answers
``OperationDenied.NoStock`` → CapacityError, the pool backs it off; offer 2
(cn-hangzhou-h) answers ``Throttling`` twice → retried with jitter, the third call
returns ``i-...``; the read times out after ECS created the instance → the retry
carries the same ClientToken and ECS returns the same ``i-...``.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import structlog
from aliyunsdkcore.request import RpcRequest
from aliyunsdkecs.request.v20140526.DeleteInstancesRequest import DeleteInstancesRequest
from aliyunsdkecs.request.v20140526.DescribeAvailableResourceRequest import DescribeAvailableResourceRequest
from aliyunsdkecs.request.v20140526.DescribeInstancesRequest import DescribeInstancesRequest
from aliyunsdkecs.request.v20140526.DescribeSpotPriceHistoryRequest import DescribeSpotPriceHistoryRequest
from aliyunsdkecs.request.v20140526.RunInstancesRequest import RunInstancesRequest

from daemon.config import AliyunProviderSpec
from daemon.launchspec import AliyunLaunchSpec, resolve_aliyun
from daemon.control.pool import Offer
from daemon.providers.aliyun_api import EcsApi
from daemon.providers.base import NODE_TAG, POOL_TAG, CapacityError, Instance, NodeSpec, PriceError, Provider, \
    ProviderError, register_provider
from daemon.providers.bootstrap import render_user_data

__all__ = ["AliyunProvider", "PriceError", "client_token", "region_of_zone", "POOL_TAG", "NODE_TAG"]

log = structlog.get_logger("spotvisor.provider.aliyun")

#: DescribeInstances statuses that count as "pending or running" for the contract.
_LIVE_STATUS = {"Pending": "pending", "Starting": "pending", "Running": "running"}
_PAGE_SIZE = 100  # DescribeInstances' maximum
_MAX_TAGS = 20  # RunInstances accepts Tag.1 .. Tag.20

_NOT_FOUND_CODES = frozenset({"InvalidInstanceId.NotFound", "InvalidInstanceIds.NotFound"})



def client_token(node: NodeSpec) -> str:
    """RunInstances' idempotency token for this launch (ASCII, at most 64 characters).

    The same node launched again (a retry after a timeout) gets the same token, so ECS
    answers the first call's instance. Node ids repeat across daemon runs
    (``<pool>-<ordinal>``), so the token also carries a hash of the node's own random
    token: a later node with a reused id is a new purchase. The hash is one-way; the
    node token itself never leaves the user-data.
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node.node_id)[:40]
    digest = hashlib.sha256(f"{node.node_id}\0{node.token}".encode()).hexdigest()[:16]
    return f"sv-{safe}-{digest}"


def region_of_zone(zone: str) -> str:
    """``cn-hangzhou-g`` → ``cn-hangzhou``; ``us-west-1a`` → ``us-west-1`` (naming
    convention of the zone list in "Regions and zones"; a heuristic, UNCONFIRMED for
    every future region)."""
    m = re.fullmatch(r"(.*\d)[a-z]", zone) or re.fullmatch(r"(.*)-[a-z]", zone)
    return m.group(1) if m else zone


def _parse_time(text: str | None) -> float | None:
    """ECS times: ``2017-12-10T04:04Z`` (DescribeInstances) or ``...T04:04:05Z``."""
    if not text:
        return None
    for fmt in ("%Y-%m-%dT%H:%MZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=timezone.utc).timestamp()
        except ValueError:
            continue
    return None


def available_request(offer: Offer, strategy: str) -> RpcRequest:
    """DescribeAvailableResource for ``offer``'s type (in its zone when it has one),
    pay-as-you-go with spot ``strategy`` (``NoSpot`` for on-demand)."""
    req = DescribeAvailableResourceRequest()
    req.set_DestinationResource("InstanceType")
    req.set_InstanceChargeType("PostPaid")
    req.set_SpotStrategy(strategy)
    req.set_InstanceType(offer.instance_type)
    if offer.zone:
        req.set_ZoneId(offer.zone)
    return req


def stock_item(body: dict[str, Any], zone: str, instance_type: str) -> dict[str, Any] | None:
    """The ``SupportedResource`` entry (``Value``, ``Status``: ``Available`` or ``SoldOut``,
    ``StatusCategory``: ``WithStock``, ``ClosedWithStock``, ``WithoutStock``) that
    DescribeAvailableResource's answer ``body`` gives ``instance_type`` in ``zone`` (any
    zone when empty); None: not listed."""
    for z in body.get("AvailableZones", {}).get("AvailableZone", []):
        if zone and z.get("ZoneId") != zone:
            continue
        for res in z.get("AvailableResources", {}).get("AvailableResource", []):
            for item in res.get("SupportedResources", {}).get("SupportedResource", []):
                if item.get("Value") == instance_type:
                    return item
    return None


@register_provider("aliyun")
class AliyunProvider(Provider):
    """ECS spot instances; see the module docstring.

    Args:
        spec: the ``providers.aliyun`` section: launch defaults, spot strategy, test endpoint.
        launch_spec: offer → its domain's :class:`AliyunLaunchSpec` (``Config.launch_spec``:
            image, security group, vSwitches, RAM role, key pair, system disk); None: every
            offer gets ``spec``'s own fields.
        access_key_id, access_key_secret: explicit credentials (both or neither);
            default: the chain of :func:`~daemon.providers.aliyun_api.credential_kwargs`.
        regions: regions ``describe`` searches besides those in use; default: the
            regions of ``spec.vswitch_ids``' zones.
        retry_attempts: tries per call on TransientError (1 = no retry).
        retry_wait_s: base of the jittered exponential wait between tries, seconds.
        read_timeout_s, connect_timeout_s: per HTTP request, seconds.
        price_cache_s: how long a spot price is reused, seconds.

    Blocking: none on the event loop. Cancellation: a cancelled call may still finish
    in its worker thread; ``describe`` is the truth afterwards (instances are tagged).
    """

    name = "aliyun"
    installs_agent = True
    #: ECS's listing is treated like EC2's: a new instance may be missing for a while after
    #: RunInstances (DescribeInstances is asked again; the agent's heartbeats are the other witness)
    listing_lag_s = 300.0
    idempotent_launch = True  # ClientToken (client_token)

    def __init__(self, *, spec: AliyunProviderSpec, launch_spec: Callable[[Offer], AliyunLaunchSpec] | None = None,
                 access_key_id: str | None = None,
                 access_key_secret: str | None = None, regions: list[str] | None = None,
                 retry_attempts: int = 4, retry_wait_s: float = 0.5, read_timeout_s: float = 30.0,
                 connect_timeout_s: float = 5.0, price_cache_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, **_ignored: Any) -> None:
        if (access_key_id is None) != (access_key_secret is None):
            raise ValueError("AliyunProvider: pass both access_key_id and access_key_secret, or neither")
        if retry_attempts < 1:
            raise ValueError(f"retry_attempts must be >= 1, got {retry_attempts}")
        for label, value in (("retry_wait_s", retry_wait_s), ("read_timeout_s", read_timeout_s),
                             ("connect_timeout_s", connect_timeout_s), ("price_cache_s", price_cache_s)):
            if value < 0 or (label.endswith("timeout_s") and value == 0):
                raise ValueError(f"{label} must be positive, got {value}")
        self.spec = spec
        self._launch_spec = launch_spec
        self._regions = set(regions or ()) | {region_of_zone(z) for z in spec.vswitch_ids}
        self.api = EcsApi(regions=self._regions, access_key_id=access_key_id, access_key_secret=access_key_secret,
                          endpoint=spec.endpoint, retry_attempts=retry_attempts, retry_wait_s=retry_wait_s,
                          read_timeout_s=read_timeout_s, connect_timeout_s=connect_timeout_s)
        self._price_cache_s = price_cache_s
        self._clock = clock
        self._instance_region: dict[str, str] = {}
        self._prices: dict[str, tuple[float, float | None]] = {}  # offer key -> (fetched_at, price)
        self._currency_warned = False

    def __repr__(self) -> str:
        return f"AliyunProvider(regions={sorted(self._regions)!r}, endpoint={self.spec.endpoint!r})"

    # -- contract -------------------------------------------------------------------
    def run_instances_request(self, offer: Offer, node: NodeSpec) -> Callable[[], RpcRequest]:
        """A builder of the exact RunInstances request that launches ``node`` for ``offer``
        (https://www.alibabacloud.com/help/en/ecs/developer-reference/api-ecs-2014-05-26-runinstances).

        Pure (no I/O): :meth:`launch` sends it, and ``spotvisord check`` sends it again with
        ``DryRun=true``. The image, security group, vSwitch, ``RamRoleName``, ``KeyPairName``
        and ``SystemDisk.Size`` / ``SystemDisk.Category`` are the offer's domain's
        (:meth:`launch_spec_of`). Raises ValueError when the offer's zone has no vSwitch in
        the spec, the node carries too many tags, or a node field cannot go into the user-data.
        """
        launch = self.launch_spec_of(offer)
        zone = offer.zone or self._default_zone(offer.region, launch)
        vswitch = launch.vswitch_ids.get(zone)
        if vswitch is None:
            raise ValueError(f"aliyun: no vSwitch for zone {zone!r} in the vswitch_ids of domain "
                             f"{launch.domain or offer.region!r} (add {zone}: vsw-... to its launch.vswitch_ids "
                             "or providers.aliyun.vswitch_ids)")
        tags = {**node.tags, POOL_TAG: node.pool, NODE_TAG: node.node_id}
        if len(tags) > _MAX_TAGS:
            raise ValueError(f"aliyun: at most {_MAX_TAGS} tags per instance, got {len(tags)}")
        user_data = base64.b64encode(render_user_data(node, dialect="aliyun").encode()).decode()
        token = client_token(node)

        def build() -> RpcRequest:
            req = RunInstancesRequest()
            req.set_InstanceChargeType("PostPaid")
            strategy = "NoSpot" if offer.on_demand else self.spec.spot_strategy  # NoSpot: pay-as-you-go
            if strategy == "SpotWithPriceLimit" and offer.max_price_usd_h is None:
                strategy = "SpotAsPriceGo"
            req.set_SpotStrategy(strategy)
            if strategy == "SpotWithPriceLimit":
                req.set_SpotPriceLimit(offer.max_price_usd_h)
            if strategy != "NoSpot":
                req.set_SpotDuration(0)
                req.set_SpotInterruptionBehavior("Terminate")
            req.set_ImageId(launch.image_id)
            req.set_InstanceType(offer.instance_type)
            req.set_ZoneId(zone)
            req.set_SecurityGroupId(launch.security_group_id)
            req.set_VSwitchId(vswitch)
            if launch.ram_role:
                req.set_RamRoleName(launch.ram_role)
            if launch.key_pair_name:
                req.set_KeyPairName(launch.key_pair_name)
            if launch.system_disk_gib is not None:
                req.set_SystemDiskSize(launch.system_disk_gib)
            if launch.system_disk_category is not None:
                req.set_SystemDiskCategory(launch.system_disk_category)
            if offer.placement_group:  # the domain's deployment set (RunInstances DeploymentSetId)
                req.set_DeploymentSetId(offer.placement_group)
            req.set_UserData(user_data)
            req.set_Tags([{"Key": k, "Value": v} for k, v in tags.items()])
            req.set_Amount(1)
            req.set_ClientToken(token)
            return req

        return build

    async def launch(self, offer: Offer, node: NodeSpec) -> Instance:
        """RunInstances for one spot instance of ``offer``, tagged with the pool and node.

        Raises CapacityError (PriceError for a price limit under the market price),
        QuotaError, AuthError, TransientError (after ``retry_attempts`` tries; each retry
        reuses the ClientToken, so at most one instance is bought), ValueError when the
        offer's zone has no vSwitch in the spec.
        """
        build = self.run_instances_request(offer, node)
        zone = offer.zone or self._default_zone(offer.region, self.launch_spec_of(offer))
        body = await self.api.call(offer.region, build)
        ids = body.get("InstanceIdSets", {}).get("InstanceIdSet", [])
        if not ids:
            raise CapacityError(f"ECS RunInstances returned no instance for {offer.key}")
        iid = ids[0]
        self._instance_region[iid] = offer.region
        log.info("instance_launch_accepted", instance_id=iid, node_id=node.node_id, offer=offer.key)
        return Instance(id=iid, node_id=node.node_id, provider=self.name, state="pending", zone=zone,
                        instance_type=offer.instance_type, launched_at=time.time())

    async def terminate(self, instance_id: str) -> None:
        """DeleteInstances with ``Force=true``; an unknown or released id is fine.

        The region is the one the instance was launched or described in; an id this
        provider has not seen is tried in every known region. Raises AuthError,
        TransientError.
        """
        regions = [self._instance_region[instance_id]] if instance_id in self._instance_region \
            else sorted(self._regions)

        def build() -> RpcRequest:
            req = DeleteInstancesRequest()
            req.set_InstanceIds([instance_id])
            req.set_Force(True)
            return req

        for region in regions:
            try:
                await self.api.call(region, build)
            except ProviderError as exc:
                if getattr(exc, "code", None) in _NOT_FOUND_CODES:
                    continue
                raise
            log.info("instance_terminated", instance_id=instance_id, region=region)
            break
        self._instance_region.pop(instance_id, None)

    async def describe(self, tag: str) -> list[Instance]:
        """Pending/Starting/Running instances tagged ``spotvisor-pool=tag`` in every
        region in use (paged). Raises AuthError, TransientError."""
        out: list[Instance] = []
        for region in sorted(self._regions):
            page = 1
            while True:
                def build(page: int = page) -> RpcRequest:
                    req = DescribeInstancesRequest()
                    req.set_Tags([{"Key": POOL_TAG, "Value": tag}])
                    req.set_PageSize(_PAGE_SIZE)
                    req.set_PageNumber(page)
                    return req

                body = await self.api.call(region, build)
                items = body.get("Instances", {}).get("Instance", [])
                for item in items:
                    inst = self._instance_from(item)
                    if inst is not None:
                        self._instance_region[inst.id] = region
                        out.append(inst)
                if not items or page * _PAGE_SIZE >= int(body.get("TotalCount", 0)):
                    break
                page += 1
        return out

    async def spot_stock(self, offer: Offer) -> bool | None:
        """The offer's spot stock from DescribeAvailableResource
        (api-ecs-2014-05-26-describeavailableresource, "queries the stock status of
        resources in a zone"): ``DestinationResource=InstanceType``, the offer's zone and
        type, ``InstanceChargeType=PostPaid``, the provider's spot strategy. True when the
        type is listed with ``Status: Available``; False when it is listed ``SoldOut`` or
        not listed (the zone does not sell it now); None for an offer without a zone (a
        region's zones may differ). Raises AuthError, TransientError."""
        if not offer.zone:
            return None
        item = stock_item(await self.api.call(offer.region, lambda: available_request(
            offer, "NoSpot" if offer.on_demand else self.spec.spot_strategy)), offer.zone, offer.instance_type)
        return item is not None and item.get("Status") == "Available"

    async def spot_price(self, offer: Offer) -> float | None:
        """Newest ``SpotPrice`` from DescribeSpotPriceHistory (vpc, SpotDuration 0), cached
        ``price_cache_s``; None when the history is empty.

        The price is per hour in the response's ``Currency``: USD on the international
        site, CNY on the China site (aliyun.com accounts). It is returned as is -- a
        CNY price is NOT converted (no exchange rate here) and a warning is logged once;
        price caps for such accounts must be written in CNY. Raises AuthError,
        TransientError.
        """
        cached = self._prices.get(offer.key)
        now = self._clock()
        if cached is not None and now - cached[0] < self._price_cache_s:
            return cached[1]

        def build() -> RpcRequest:
            req = DescribeSpotPriceHistoryRequest()
            req.set_InstanceType(offer.instance_type)
            req.set_NetworkType("vpc")
            req.set_SpotDuration(0)
            if offer.zone:
                req.set_ZoneId(offer.zone)
            return req

        body = await self.api.call(offer.region, build)
        rows = body.get("SpotPrices", {}).get("SpotPriceType", [])
        price: float | None = None
        if rows:
            newest = max(r.get("Timestamp", "") for r in rows)
            price = min(float(r["SpotPrice"]) for r in rows if r.get("Timestamp", "") == newest)
        currency = body.get("Currency", "USD")
        if currency != "USD" and not self._currency_warned:
            self._currency_warned = True
            log.warning("spot_price_currency_not_usd", currency=currency, offer=offer.key)
        self._prices[offer.key] = (now, price)
        return price

    async def aclose(self) -> None:
        """Close the ECS clients (idempotent)."""
        await self.api.aclose()

    # -- internals --------------------------------------------------------------------
    def launch_spec_of(self, offer: Offer) -> AliyunLaunchSpec:
        """The launch spec of ``offer`` (its domain's; see the constructor). Raises ValueError
        when it has no image or security group."""
        if self._launch_spec is not None:
            return self._launch_spec(offer)
        return resolve_aliyun(self.spec, None, domain="", region=offer.region)

    def _default_zone(self, region: str, launch: AliyunLaunchSpec) -> str:
        zones = sorted(z for z in launch.vswitch_ids if region_of_zone(z) == region)
        if not zones:
            raise ValueError(f"aliyun: offer in {region!r} has no zone and no vSwitch in that region")
        return zones[0]

    def _instance_from(self, item: dict[str, Any]) -> Instance | None:
        state = _LIVE_STATUS.get(item.get("Status", ""))
        if state is None:
            return None
        tags = {t.get("TagKey"): t.get("TagValue") for t in item.get("Tags", {}).get("Tag", [])}
        return Instance(id=item["InstanceId"], node_id=tags.get(NODE_TAG) or "", provider=self.name,
                        state=state, zone=item.get("ZoneId"), instance_type=item.get("InstanceType"),
                        launched_at=_parse_time(item.get("CreationTime")))
