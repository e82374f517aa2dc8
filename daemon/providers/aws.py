"""AWS EC2 spot capacity behind the Provider contract (boto3).

Every boto3 call runs in a worker thread (``asyncio.to_thread``) on a client made
with botocore's own retries switched off (``total_max_attempts=1``): retries belong to
this module's tenacity layer, which retries :class:`TransientError` only, with
exponential jitter, then gives up with :class:`TransientError`.

Launch is idempotent per node. ``RunInstances`` / ``CreateFleet`` carry a
``ClientToken`` derived from ``node.node_id``
(https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-idempotency.html), so a
retry after a timeout returns the instance the first request created instead of
a second one. Fakes do not all honour it (moto 5 ignores ``ClientToken``), and a
token outlives the instance, so before each *retry* the provider also looks the
node up by its ``spotvisor-node`` tag and returns the instance it finds.

SDK errors are translated here, at the edge (``from exc``) — see
:func:`map_client_error` and https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html:

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
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import structlog
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from daemon.config import AwsProviderSpec
from daemon.launchspec import AwsLaunchSpec, resolve_aws
from daemon.control.pool import Offer
from daemon.providers.base import (
    AuthError,
    NODE_TAG,
    POOL_TAG,
    CapacityError,
    Instance,
    NodeSpec,
    PriceError,
    Provider,
    ProviderError,
    QuotaError,
    TransientError,
    register_provider,
)
from daemon.providers.aws_launch import (
    ImageFacts,
    LaunchFacts,
    TypeFacts,
    build_run_instances,
    efa_interfaces,
    facts_from,
    image_facts,
    launch_template_data,
    type_facts,
)

__all__ = ["AwsProvider", "PriceError", "client_token", "map_client_error", "LaunchFacts", "ImageFacts",
           "TypeFacts", "efa_interfaces", "launch_template_data"]

log = structlog.get_logger("spotvisor.provider.aws")

T = TypeVar("T")

_LIVE_STATES = ("pending", "running")

_CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientCapacity", "UnfulfillableCapacity",
    "InsufficientHostCapacity",
})
_PRICE_CODES = frozenset({"SpotMaxPriceTooLow"})
_QUOTA_CODES = frozenset({
    "MaxSpotInstanceCountExceeded", "InstanceLimitExceeded", "VcpuLimitExceeded",
    "MaxSpotFleetRequestCountExceeded", "MaxFleetCountExceeded",
})
_AUTH_CODES = frozenset({
    "AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "SignatureDoesNotMatch",
    "ExpiredToken", "RequestExpired", "OptInRequired", "Blocked", "PendingVerification",
})
_TRANSIENT_CODES = frozenset({
    "RequestLimitExceeded", "Throttling", "ThrottlingException", "RequestThrottled",
    "InternalError", "InternalFailure", "Unavailable", "ServiceUnavailable",
})
_NOT_FOUND_CODES = frozenset({"InvalidInstanceID.NotFound"})



def client_token(node_id: str) -> str:
    """The idempotency token of ``node_id``'s launch: deterministic, 64 ASCII chars at most.

    https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-idempotency.html
    """
    return "spotvisor-" + hashlib.sha256(node_id.encode()).hexdigest()[:48]


def _error_code(exc: botocore.exceptions.ClientError) -> str:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    # The Query API may prefix codes with "Client." / "Server." (e.g. Client.UnauthorizedOperation).
    for prefix in ("Client.", "Server."):
        if code.startswith(prefix):
            code = code[len(prefix):]
    return code


def map_client_error(code: str, message: str, *, status: int | None, what: str) -> ProviderError:
    """Translate an EC2 error code (and HTTP status) into the provider error tree.

    Pure; ``what`` names the call for the message (e.g. ``"RunInstances in us-east-1"``).
    Auth errors drop the server's message (it may be long, encoded, or echo request data).
    """
    if code in _PRICE_CODES:
        return PriceError(f"{code}: {what}: {message}")
    if code in _CAPACITY_CODES:
        return CapacityError(f"{code}: {what}: {message}")
    if code in _QUOTA_CODES:
        return QuotaError(f"{code}: {what}: {message}")
    if code in _AUTH_CODES:
        return AuthError(
            f"AWS refused the credentials ({code}) for {what}; check the credential chain "
            "(AWS_PROFILE / environment / instance role) and the IAM policy")
    if code in _TRANSIENT_CODES or (status is not None and status >= 500):
        return TransientError(f"{code or 'HTTP ' + str(status)}: {what}: {message}")
    return ProviderError(f"{code or 'HTTP ' + str(status)}: {what}: {message}")


def _translate(exc: BaseException, what: str) -> ProviderError | None:
    """A provider error for a botocore exception, or None when it is not one of botocore's."""
    if isinstance(exc, botocore.exceptions.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        message = str(exc.response.get("Error", {}).get("Message", ""))[:500]
        return map_client_error(_error_code(exc), message, status=status, what=what)
    if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError,
                        botocore.exceptions.CredentialRetrievalError)):
        return AuthError(f"no usable AWS credentials for {what} ({type(exc).__name__}); "
                         "configure boto3's credential chain (environment, profile or instance role)")
    if isinstance(exc, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)):
        # ReadTimeoutError, ConnectTimeoutError, EndpointConnectionError, ConnectionClosedError, ...
        return TransientError(f"{type(exc).__name__}: {what}")
    return None


def _profile(profile: str) -> dict[str, str]:
    return {"Arn": profile} if profile.startswith("arn:") else {"Name": profile}


def _view(raw: dict[str, Any], provider: str) -> Instance:
    tags = {t["Key"]: t["Value"] for t in raw.get("Tags", [])}
    state = raw.get("State", {}).get("Name", "")
    launched = raw.get("LaunchTime")
    return Instance(
        id=raw["InstanceId"],
        node_id=tags.get(NODE_TAG, ""),
        provider=provider,
        state=state if state in _LIVE_STATES else "gone",
        zone=raw.get("Placement", {}).get("AvailabilityZone"),
        instance_type=raw.get("InstanceType"),
        launched_at=launched.timestamp() if launched is not None else None,
    )


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

    def __init__(self, *, spec: AwsProviderSpec, launch_spec: Callable[[Offer], AwsLaunchSpec] | None = None,
                 region: str | None = None, regions: Iterable[str] = (),
                 retry_attempts: int = 4, retry_initial_s: float = 0.5, retry_max_s: float = 8.0,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0, price_ttl_s: float = 60.0,
                 **_ignored: object) -> None:
        if retry_attempts < 1:
            raise ValueError(f"retry_attempts must be >= 1, got {retry_attempts}")
        for label, value in (("retry_initial_s", retry_initial_s), ("retry_max_s", retry_max_s),
                             ("connect_timeout_s", connect_timeout_s), ("read_timeout_s", read_timeout_s),
                             ("price_ttl_s", price_ttl_s)):
            if value < 0:
                raise ValueError(f"{label} must be >= 0, got {value}")
        self.spec = spec
        self._launch_spec = launch_spec
        self._images: dict[tuple[str, str], ImageFacts] = {}  # (region, image id) -> facts
        self._types: dict[tuple[str, str], TypeFacts] = {}  # (region, instance type) -> facts
        self._default_region = region
        self._regions: set[str] = set(regions) | ({region} if region else set())
        self._retry_attempts = retry_attempts
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._price_ttl_s = price_ttl_s
        self._botocore_config = botocore.config.Config(
            # total_max_attempts=1: no botocore retry at all (its ``max_attempts`` counts
            # *retries*, so max_attempts=1 would still retry once behind our back).
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
        )
        self._session: boto3.session.Session | None = None
        self._clients: dict[str, Any] = {}
        self._client_lock = asyncio.Lock()
        self._instance_region: dict[str, str] = {}
        self._prices: dict[tuple[str, str | None, str], tuple[float, float | None]] = {}
        self._closed = False

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
                    if self.spec.launch_method == "create_fleet" and not offer.on_demand:
                        await self._delete_template(region, client_token(node.node_id))
                    return existing
            if self.spec.launch_method == "create_fleet" and not offer.on_demand:
                return await self._launch_fleet(region, offer, node)
            return await self._run_instances(region, offer, node)

        inst = await self._retrying(once, what=f"launch {node.node_id}")
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
                await self._call(region, "terminate_instances", InstanceIds=[instance_id])
            except ProviderError as exc:
                if isinstance(exc.__cause__, botocore.exceptions.ClientError) and \
                        _error_code(exc.__cause__) in _NOT_FOUND_CODES:
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
                   {"Name": "instance-state-name", "Values": list(_LIVE_STATES)}]
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
        resp = await self._call(offer.region, "describe_spot_price_history", **kwargs)
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
        if self._closed:
            return
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            try:
                await asyncio.to_thread(client.close)
            except Exception as exc:  # closing is best effort; the process may be exiting
                log.warning("aws_client_close_failed", error=type(exc).__name__)

    # -- launch paths ---------------------------------------------------------
    def _tags(self, node: NodeSpec) -> list[dict[str, str]]:
        tags = dict(node.tags)
        tags.setdefault(POOL_TAG, node.pool)
        tags.setdefault(NODE_TAG, node.node_id)
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
            resp = await self._call(region, "describe_images", ImageIds=[launch.image_id])
            self._images[(region, launch.image_id)] = image_facts(resp, region=region, image_id=launch.image_id)
        if (launch.efa or launch.instance_store_scratch) and (region, offer.instance_type) not in self._types:
            self._types[(region, offer.instance_type)] = await self._type_facts(region, offer.instance_type)
        return facts_from(launch, offer, self._images, self._types)  # type: ignore[return-value]  (all cached now)

    async def _type_facts(self, region: str, instance_type: str) -> TypeFacts:
        try:
            return type_facts(await self._call(region, "describe_instance_types", InstanceTypes=[instance_type]))
        except ProviderError as exc:
            if not (isinstance(exc.__cause__, botocore.exceptions.ClientError)
                    and _error_code(exc.__cause__) == "InvalidInstanceType"):
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
                                   tags=self._tags(node), token=client_token(node.node_id))

    async def _run_instances(self, region: str, offer: Offer, node: NodeSpec) -> Instance:
        kwargs = self.run_instances_request(offer, node)
        resp = await self._call_once(region, "run_instances", **kwargs)
        return _view(resp["Instances"][0], self.name)

    async def _launch_fleet(self, region: str, offer: Offer, node: NodeSpec) -> Instance:
        """An instant fleet over a per-node launch template (user-data and tags live in it).

        Capacity failures come back in the response's ``Errors[]``, not as an exception.
        The template is deleted afterwards (best effort); a retry reuses it.
        """
        token = client_token(node.node_id)
        template = token  # valid launch template name: [a-zA-Z0-9().-/_], ≤ 128
        request = self.run_instances_request(offer, node)  # the template carries what RunInstances would
        data = launch_template_data(request)
        try:
            await self._call_once(region, "create_launch_template", LaunchTemplateName=template,
                             LaunchTemplateData=data, ClientToken=token)
        except ProviderError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, botocore.exceptions.ClientError)
                    and _error_code(cause) == "InvalidLaunchTemplateName.AlreadyExistsException"):
                raise
        override: dict[str, Any] = {"InstanceType": offer.instance_type}
        if "SubnetId" in request:
            override["SubnetId"] = request["SubnetId"]  # the subnet fixes the zone
        elif offer.zone:
            override["AvailabilityZone"] = offer.zone
        if offer.max_price_usd_h is not None:
            override["MaxPrice"] = str(offer.max_price_usd_h)
        if offer.placement_group:  # FleetLaunchTemplateOverridesRequest.Placement.GroupName
            override["Placement"] = {"GroupName": offer.placement_group}
        definitive = False
        try:
            resp = await self._call_once(
                region, "create_fleet", Type="instant", ClientToken=token,
                # the request itself carries the instance tags too (an instant fleet tags its
                # instances at launch): the control node's policy allows a launch only of
                # instances tagged with its pool (aws:RequestTag, configs/policies/)
                TagSpecifications=[{"ResourceType": "instance", "Tags": self._tags(node)}],
                SpotOptions={"AllocationStrategy": "price-capacity-optimized",
                             "InstanceInterruptionBehavior": "terminate"},
                LaunchTemplateConfigs=[{
                    "LaunchTemplateSpecification": {"LaunchTemplateName": template, "Version": "$Latest"},
                    "Overrides": [override],
                }],
                TargetCapacitySpecification={"TotalTargetCapacity": 1, "SpotTargetCapacity": 1,
                                             "DefaultTargetCapacityType": "spot"},
            )
            definitive = True
        finally:
            if definitive:
                await self._delete_template(region, template)
        ids = [i for group in resp.get("Instances", []) for i in group.get("InstanceIds", [])]
        if ids:
            found = await self._describe_region(region, [], instance_ids=ids[:1], retry=False)
            if found:
                return found[0]
            return Instance(id=ids[0], node_id=node.node_id, provider=self.name, state="pending",
                            zone=offer.zone, instance_type=offer.instance_type, launched_at=time.time())
        errors = resp.get("Errors", [])
        what = f"CreateFleet in {region}"
        if not errors:
            raise CapacityError(f"{what}: the fleet launched no instance and reported no error")
        # Prefer the most actionable: auth/quota beat capacity beat the rest.
        mapped = [map_client_error(str(e.get("ErrorCode", "")), str(e.get("ErrorMessage", ""))[:500],
                                   status=None, what=what) for e in errors]
        for kind in (AuthError, QuotaError, CapacityError, TransientError):
            for err in mapped:
                if isinstance(err, kind):
                    raise err
        raise mapped[0]

    async def _delete_template(self, region: str, template: str) -> None:
        try:
            await self._call_once(region, "delete_launch_template", LaunchTemplateName=template)
        except ProviderError as exc:
            cause = exc.__cause__
            if isinstance(cause, botocore.exceptions.ClientError) and _error_code(cause) in (
                    "InvalidLaunchTemplateName.NotFoundException", "InvalidLaunchTemplateId.NotFound"):
                return
            log.warning("aws_launch_template_delete_failed", template=template, error=str(exc))

    async def _find_node(self, region: str, node: NodeSpec) -> Instance | None:
        filters = [{"Name": f"tag:{NODE_TAG}", "Values": [node.node_id]},
                   {"Name": f"tag:{POOL_TAG}", "Values": [node.pool]},
                   {"Name": "instance-state-name", "Values": list(_LIVE_STATES)}]
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
                               instance_ids: list[str] | None = None, retry: bool = True) -> list[Instance]:
        out: list[Instance] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {}
            if filters:
                kwargs["Filters"] = filters
            if instance_ids:
                kwargs["InstanceIds"] = instance_ids
            else:
                kwargs["MaxResults"] = 500  # not allowed together with InstanceIds
            if token:
                kwargs["NextToken"] = token
            if retry:
                resp = await self._call(region, "describe_instances", **kwargs)
            else:
                resp = await self._call_once(region, "describe_instances", **kwargs)
            for reservation in resp.get("Reservations", []):
                for raw in reservation.get("Instances", []):
                    inst = _view(raw, self.name)
                    self._instance_region[inst.id] = region
                    out.append(inst)
            token = resp.get("NextToken")
            if not token:
                return out

    async def _client(self, region: str) -> Any:
        if self._closed:
            raise RuntimeError("AwsProvider is closed")
        client = self._clients.get(region)
        if client is not None:
            return client
        async with self._client_lock:
            if region not in self._clients:
                def make() -> Any:
                    if self._session is None:
                        self._session = boto3.session.Session()
                    return self._session.client("ec2", region_name=region, endpoint_url=self.spec.endpoint_url,
                                                config=self._botocore_config)
                self._clients[region] = await asyncio.to_thread(make)
            return self._clients[region]

    async def _call_once(self, region: str, op: str, **kwargs: Any) -> dict[str, Any]:
        """One boto3 call in a worker thread; botocore errors come out translated."""
        client = await self._client(region)
        what = f"{client.meta.method_to_api_mapping.get(op, op)} in {region}"
        try:
            return await asyncio.to_thread(getattr(client, op), **kwargs)
        except Exception as exc:
            mapped = _translate(exc, what)
            if mapped is None:
                raise
            raise mapped from exc

    async def _call(self, region: str, op: str, **kwargs: Any) -> dict[str, Any]:
        return await self._retrying(lambda: self._call_once(region, op, **kwargs), what=op)

    async def _retrying(self, fn: Callable[[], Awaitable[T]], *, what: str) -> T:
        """Run ``fn`` until it succeeds, retrying TransientError only (exponential jitter)."""

        def before_sleep(state: Any) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("aws_call_retry", call=what, attempt=state.attempt_number, error=str(exc))

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TransientError),
            stop=stop_after_attempt(self._retry_attempts),
            wait=wait_exponential_jitter(multiplier=self._retry_initial_s, max=self._retry_max_s,
                                         jitter=self._retry_initial_s),
            before_sleep=before_sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await fn()
        raise TransientError(f"{what}: no attempt ran")  # pragma: no cover  (reraise=True raises the last error)
