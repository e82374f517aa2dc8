"""AWS EC2 spot capacity behind the Provider contract (boto3).

Every boto3 call runs in a worker thread (``asyncio.to_thread``) on a client made
with botocore's own retries switched off (``total_max_attempts=1``): retries belong to
the tenacity layer of :class:`~daemon.providers.aws_api.Ec2Api`, which retries
:class:`TransientError` only, with exponential jitter, then gives up with
:class:`TransientError`. The ``create_fleet`` launch path is
:class:`~daemon.providers.aws_fleet.Ec2Fleet`.

Launch is idempotent per node. ``RunInstances`` / ``CreateFleet`` carry a
``ClientToken`` derived from the node's id and its random token
(https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-idempotency.html), so a
retry after a timeout returns the instance the first request created instead of
a second one. Fakes do not all honour it (moto 5 ignores ``ClientToken``; the tests'
``fakes.aws_faults.AwsFaultProxy`` implements it in front of moto), and a token
outlives the instance, so before each *retry* the provider also looks the node up by
its ``spotvisor-node`` tag and returns the instance it finds. A daemon that finds a node still
``requested`` after its predecessor died in this call (a restart, a new HA leader) sends
the same request again, byte for byte, under the same token, or gives the node up where
it cannot be the same request (``Fleet.settle_unowned``, :mod:`daemon.control.launch_replay`).

SDK errors are translated here, at the edge (``from exc``) — see
:func:`~daemon.providers.aws_api.map_client_error` and https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html:

- capacity: InsufficientInstanceCapacity, InsufficientCapacity, UnfulfillableCapacity,
  InsufficientHostCapacity → :class:`CapacityError`; SpotMaxPriceTooLow → :class:`PriceError`
  (a CapacityError: the next offer may be cheaper or allow a higher cap);
- quota: MaxSpotInstanceCountExceeded, InstanceLimitExceeded, VcpuLimitExceeded → :class:`QuotaError`;
- auth: AuthFailure, UnauthorizedOperation, expired/invalid tokens, no credentials → :class:`AuthError`
  (one message naming the code, the call and the region; never a credential);
- transient: RequestLimitExceeded and other throttling, InternalError, Unavailable, any other
  5xx, read/connect timeouts, connection failures → :class:`TransientError`;
- anything else (a bad AMI id, a bad parameter) → plain :class:`ProviderError`: a
  configuration problem no retry or other offer fixes.

Launch specs (:mod:`daemon.launchspec`): each offer is launched with its placement
domain's :class:`AwsLaunchSpec` (image, subnet of its zone, security groups, key, instance
profile, root volume, EFA, instance-store scratch), from the ``launch_spec`` callable the
daemon passes (``Config.launch_spec``); without one, from ``providers.aws`` alone. Two
facts come from EC2 and are cached per region (:meth:`AwsProvider.launch_facts`):

- the AMI's ``RootDeviceName`` (DescribeImages,
  https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeImages.html), the
  device the root-volume ``BlockDeviceMappings`` entry must name to resize it
  (https://docs.aws.amazon.com/ebs/latest/userguide/block-device-mapping-concepts.html);
  asked only when the spec sets ``root_volume_gib``;
- the instance type's ``NetworkInfo`` (``EfaSupported``, ``MaximumNetworkCards``,
  ``EfaInfo.MaximumEfaInterfaces``) and ``InstanceStorageInfo`` (DescribeInstanceTypes,
  https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeInstanceTypes.html).
  Where EFA is supported the request carries one EFA interface per network card
  (``NetworkInterfaces``: card 0 device 0 ``InterfaceType=efa``, the primary, EFA with
  ENA; cards 1..N-1 device 0 ``efa-only``, which take no IP address; subnet and groups
  move into the interfaces, as RunInstances refuses them at both levels:
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html,
  https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_InstanceNetworkInterfaceSpecification.html).
  A p5.48xlarge gets 32. With several interfaces EC2 assigns no public IP: the subnet
  needs a NAT gateway or VPC endpoints to reach S3. Where the type has instance-store
  disks, the user data makes them the checkpoint scratch (:mod:`daemon.providers.scratch`).

Credentials come from boto3's default chain only and are never logged.

Cancellation: cancelling a call abandons the worker thread's request, which may
still complete cloud-side; ``describe(tag)`` is the source of truth afterwards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import boto3
import structlog

from daemon.config import AwsProviderSpec
from daemon.launchspec import AwsLaunchSpec, resolve_aws
from daemon.control.pool import Offer
from daemon.providers.aws_api import LIVE_STATES, Ec2Api, error_code, instance_view, map_client_error
from daemon.providers.aws_fleet import Ec2Fleet
from daemon.providers.aws_launch import (
    ImageFacts,
    LaunchFacts,
    TypeFacts,
    build_run_instances,
    client_token,
    efa_interfaces,
    facts_from,
    image_facts,
    launch_template_data,
    type_facts,
)
from daemon.providers.base import NODE_TAG, POOL_TAG, Instance, NodeSpec, PriceError, Provider, ProviderError, \
    register_provider

__all__ = ["AwsProvider", "PriceError", "client_token", "map_client_error", "LaunchFacts", "ImageFacts",
           "TypeFacts", "efa_interfaces", "launch_template_data"]

log = structlog.get_logger("spotvisor.provider.aws")

_NOT_FOUND_CODES = frozenset({"InvalidInstanceID.NotFound"})


@register_provider("aws")
class AwsProvider(Provider):
    """EC2 spot instances; see the module docstring.

    Args:
        spec: the ``providers.aws`` section: launch defaults, ``launch_method``
            (``run_instances`` | ``create_fleet``), ``endpoint_url``.
        launch_spec: offer → its domain's :class:`AwsLaunchSpec` (``Config.launch_spec``);
            None: every offer gets ``spec``'s own fields (a config without domain launch blocks).
        region: a region always searched by ``describe`` (besides every region this
            provider launched in). Offers carry their own region for launches.
        regions: more regions to search (e.g. every offer's region, so a restarted
            daemon finds its instances before launching anything).
        retry_attempts: tries per call, first included (TransientError only).
        retry_initial_s, retry_max_s: exponential-jitter wait between tries, seconds.
        connect_timeout_s, read_timeout_s: per HTTP request, seconds.
        price_ttl_s: how long a spot price is cached, seconds.

    Other keywords (``state_dir``, ``agent_args``: the daemon passes them to every
    provider) are ignored. The constructor does no I/O; clients are made on first use.
    """

    name = "aws"
    installs_agent = True
    #: EC2's listing is eventually consistent: a new instance may be missing for up to a few minutes
    #: (https://docs.aws.amazon.com/ec2/latest/devguide/eventual-consistency.html)
    listing_lag_s = 300.0
    idempotent_launch = True  # ClientToken (client_token)

    def __init__(self, *, spec: AwsProviderSpec, launch_spec: Callable[[Offer], AwsLaunchSpec] | None = None,
                 region: str | None = None, regions: Iterable[str] = (),
                 retry_attempts: int = 4, retry_initial_s: float = 0.5, retry_max_s: float = 8.0,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0, price_ttl_s: float = 60.0,
                 **_ignored: object) -> None:
        self.api = Ec2Api(endpoint_url=spec.endpoint_url, retry_attempts=retry_attempts,
                          retry_initial_s=retry_initial_s, retry_max_s=retry_max_s,
                          connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
        if price_ttl_s < 0:
            raise ValueError(f"price_ttl_s must be >= 0, got {price_ttl_s}")
        self.spec = spec
        self._launch_spec = launch_spec
        self._fleet = Ec2Fleet(self.api, provider=self.name)
        self._images: dict[tuple[str, str], ImageFacts] = {}  # (region, image id) -> facts
        self._types: dict[tuple[str, str], TypeFacts] = {}  # (region, instance type) -> facts
        self._default_region = region
        self._regions: set[str] = set(regions) | ({region} if region else set())
        self._price_ttl_s = price_ttl_s
        self._instance_region: dict[str, str] = {}
        self._prices: dict[tuple[str, str | None, str], tuple[float, float | None]] = {}

    # -- contract -------------------------------------------------------------
    async def launch(self, offer: Offer, node: NodeSpec) -> Instance:
        """Start one spot instance (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_RunInstances.html,
        or https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_CreateFleet.html with
        ``launch_method="create_fleet"``), tagged with every ``node.tags`` entry plus the pool
        and node tags. Returns when EC2 accepted it (state ``pending`` usually).

        Raises:
            CapacityError (PriceError for SpotMaxPriceTooLow): try the next offer.
            QuotaError, AuthError: no retry helps.
            TransientError: still failing after ``retry_attempts`` tries.
            ProviderError: a configuration error (bad AMI, subnet, parameter).
            ValueError: a node field cannot go into the user-data (see ``render_user_data``).
        """
        region = offer.region
        self._regions.add(region)
        await self.launch_facts(offer)  # cached; the request below is built from them
        attempt = 0

        async def once() -> Instance:  # one try; its calls are single attempts (no nested retries)
            nonlocal attempt
            attempt += 1
            if attempt > 1:  # the previous try may have created it (timeout after the request landed)
                existing = await self._find_node(region, node)
                if existing is not None:
                    log.info("aws_launch_found_existing", node_id=node.node_id, instance_id=existing.id)
                    if fleet:
                        await self._fleet.delete_template(region, client_token(node))
                    return existing
            request = self.run_instances_request(offer, node)
            if fleet:  # the template carries what RunInstances would
                return await self._fleet.launch(region, offer, node, request, self._tags(node))
            resp = await self.api.call_once(region, "run_instances", **request)
            return instance_view(resp["Instances"][0], self.name)

        fleet = self.spec.launch_method == "create_fleet" and not offer.on_demand
        inst = await self.api.retrying(once, what=f"launch {node.node_id}")
        self._instance_region[inst.id] = region
        log.info("aws_launch_accepted", node_id=node.node_id, instance_id=inst.id, region=region,
                 zone=inst.zone, instance_type=inst.instance_type, method=self.spec.launch_method)
        return inst

    async def terminate(self, instance_id: str) -> None:
        """Terminate (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_TerminateInstances.html).

        Idempotent: an instance unknown in every searched region, or already gone, is fine.
        Raises AuthError, TransientError, ProviderError.
        """
        known = self._instance_region.get(instance_id)
        regions = [known] if known else sorted(self._search_regions())
        for region in regions:
            try:
                await self.api.call(region, "terminate_instances", InstanceIds=[instance_id])
            except ProviderError as exc:
                if error_code(exc) in _NOT_FOUND_CODES:
                    continue
                raise
            log.info("aws_terminate_requested", instance_id=instance_id, region=region)
            return
        log.info("aws_terminate_unknown_instance", instance_id=instance_id, regions=regions)

    async def describe(self, tag: str) -> list[Instance]:
        """Pending or running instances tagged ``spotvisor-pool=tag`` in every searched region
        (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeInstances.html), paginated.

        Raises AuthError, TransientError, ProviderError.
        """
        filters = [{"Name": f"tag:{POOL_TAG}", "Values": [tag]},
                   {"Name": "instance-state-name", "Values": list(LIVE_STATES)}]
        regions = sorted(self._search_regions())
        per_region = await asyncio.gather(*(self._describe_region(r, filters) for r in regions))
        return [inst for found in per_region for inst in found]

    async def spot_price(self, offer: Offer) -> float | None:
        """Newest spot price of the offer's type (and zone, when set) in USD/hour, cached
        ``price_ttl_s`` (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeSpotPriceHistory.html).

        None when EC2 has no price for it. Raises AuthError, TransientError, ProviderError.
        """
        key = (offer.region, offer.zone, offer.instance_type)
        now = time.monotonic()
        cached = self._prices.get(key)
        if cached is not None and now - cached[0] < self._price_ttl_s:
            return cached[1]
        self._regions.add(offer.region)
        kwargs: dict[str, Any] = {"InstanceTypes": [offer.instance_type], "ProductDescriptions": ["Linux/UNIX"],
                                  "StartTime": time.time(), "MaxResults": 20}
        if offer.zone:
            kwargs["AvailabilityZone"] = offer.zone
        resp = await self.api.call(offer.region, "describe_spot_price_history", **kwargs)
        rows = [r for r in resp.get("SpotPriceHistory", [])
                if r.get("InstanceType") == offer.instance_type
                and (not offer.zone or r.get("AvailabilityZone") == offer.zone)]
        price: float | None = None
        if rows:
            newest = max(rows, key=lambda r: r["Timestamp"])
            price = float(newest["SpotPrice"])
        self._prices[key] = (now, price)
        return price

    async def aclose(self) -> None:
        """Close the EC2 clients (idempotent)."""
        await self.api.aclose()

    # -- launch paths ---------------------------------------------------------
    def _tags(self, node: NodeSpec) -> list[dict[str, str]]:
        tags = {POOL_TAG: node.pool, NODE_TAG: node.node_id, **node.tags}  # node.tags wins, as setdefault did
        return [{"Key": k, "Value": v} for k, v in tags.items()]

    def launch_spec_of(self, offer: Offer) -> AwsLaunchSpec:
        """The launch spec of ``offer`` (its domain's; see the constructor). Raises ValueError
        when it has no image."""
        if self._launch_spec is not None:
            return self._launch_spec(offer)
        return resolve_aws(self.spec, None, domain="", region=offer.region)

    async def launch_facts(self, offer: Offer) -> LaunchFacts:
        """The EC2 facts ``offer``'s launch request is built from (see the module docstring),
        cached per region: DescribeImages (only with a root-volume size) and
        DescribeInstanceTypes (only with EFA or instance-store scratch on). An instance type
        EC2 does not know gets no EFA and no scratch (RunInstances then says what is wrong).

        Raises AuthError, TransientError, ProviderError (the image is not in the region).
        """
        launch, region = self.launch_spec_of(offer), offer.region
        if launch.root_volume_gib is not None and (region, launch.image_id) not in self._images:
            resp = await self.api.call(region, "describe_images", ImageIds=[launch.image_id])
            self._images[(region, launch.image_id)] = image_facts(resp, region=region, image_id=launch.image_id)
        if (launch.efa or launch.instance_store_scratch) and (region, offer.instance_type) not in self._types:
            self._types[(region, offer.instance_type)] = await self._type_facts(region, offer.instance_type)
        return facts_from(launch, offer, self._images, self._types)  # type: ignore[return-value]  (all cached now)

    async def _type_facts(self, region: str, instance_type: str) -> TypeFacts:
        try:
            return type_facts(await self.api.call(region, "describe_instance_types", InstanceTypes=[instance_type]))
        except ProviderError as exc:
            if error_code(exc) != "InvalidInstanceType":
                raise
            log.warning("aws_unknown_instance_type", region=region, instance_type=instance_type)
            return TypeFacts()

    def cached_facts(self, offer: Offer) -> LaunchFacts | None:
        """The facts :meth:`launch_facts` found for ``offer``, or None when not all are cached."""
        return facts_from(self.launch_spec_of(offer), offer, self._images, self._types)

    def run_instances_request(self, offer: Offer, node: NodeSpec, facts: LaunchFacts | None = None) -> dict[str, Any]:
        """The exact RunInstances parameters (boto3 keywords) that launch ``node`` for ``offer``.
        Pure (no I/O): :meth:`launch` sends it, and ``spotvisord check`` sends it again with
        ``DryRun=True`` (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_RunInstances.html).
        ``facts``: the EC2 facts it depends on; None: those cached by ``await launch_facts(offer)``.
        Raises RuntimeError (no ``facts`` and none cached), ValueError (a node field cannot go
        into the user-data, or the spec has no image)."""
        launch = self.launch_spec_of(offer)
        if facts is None:
            facts = self.cached_facts(offer)
            if facts is None:
                raise RuntimeError(f"no EC2 facts for {offer.key}: call `await provider.launch_facts(offer)` first")
        return build_run_instances(offer, node, launch, facts, dialect=self.spec.agent_metadata_dialect,
                                   tags=self._tags(node), token=client_token(node))

    async def _find_node(self, region: str, node: NodeSpec) -> Instance | None:
        filters = [{"Name": f"tag:{NODE_TAG}", "Values": [node.node_id]},
                   {"Name": f"tag:{POOL_TAG}", "Values": [node.pool]},
                   {"Name": "instance-state-name", "Values": list(LIVE_STATES)}]
        found = await self._describe_region(region, filters, retry=False)
        return found[0] if found else None

    # -- plumbing -------------------------------------------------------------
    def _search_regions(self) -> set[str]:
        regions = set(self._regions)
        if not regions:
            fallback = self._default_region or boto3.session.Session().region_name
            if fallback:
                regions.add(fallback)
        return regions

    async def _describe_region(self, region: str, filters: list[dict[str, Any]], *,
                               retry: bool = True) -> list[Instance]:
        found = [instance_view(raw, self.name) for raw in await self.api.describe_instances(region, filters,
                                                                                           retry=retry)]
        for inst in found:
            self._instance_region[inst.id] = region
        return found

    async def _call(self, region: str, op: str, **kwargs: Any) -> dict[str, Any]:
        """One EC2 call with retries (:meth:`Ec2Api.call`); kept for subclasses and the policy tests."""
        return await self.api.call(region, op, **kwargs)
