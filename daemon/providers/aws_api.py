"""The EC2 edge of :mod:`daemon.providers.aws`: boto3 clients, one call, retries, and the
translation of botocore's errors into the provider error tree.

Every boto3 call runs in a worker thread (``asyncio.to_thread``) on a client made with
botocore's own retries switched off (``total_max_attempts=1``): retries belong to
:meth:`Ec2Api.call`, which retries :class:`TransientError` only, with exponential
jitter, then gives up with the last :class:`TransientError`.

SDK errors are translated here (``from exc``): :func:`map_client_error`, following
https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html (the
classes are listed in :mod:`daemon.providers.aws`). Credentials come from boto3's
default chain only and are never logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import structlog
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from daemon.providers.base import (NODE_TAG, AuthError, CapacityError, Instance, PriceError, ProviderError,
                                   QuotaError, TransientError)

__all__ = ["Ec2Api", "LIVE_STATES", "error_code", "instance_view", "map_client_error", "translate"]

log = structlog.get_logger("spotvisor.provider.aws")

T = TypeVar("T")

#: EC2 instance states the Provider contract counts as live.
LIVE_STATES = ("pending", "running")

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


def error_code(exc: BaseException | None) -> str | None:
    """The EC2 error code behind ``exc`` (a ``ClientError``, or a provider error raised
    ``from`` one), without the Query API's ``Client.``/``Server.`` prefix; None otherwise."""
    if isinstance(exc, ProviderError):
        exc = exc.__cause__
    if not isinstance(exc, botocore.exceptions.ClientError):
        return None
    code = str(exc.response.get("Error", {}).get("Code", ""))
    for prefix in ("Client.", "Server."):  # e.g. Client.UnauthorizedOperation
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


def translate(exc: BaseException, what: str) -> ProviderError | None:
    """A provider error for a botocore exception, or None when it is not one of botocore's."""
    if isinstance(exc, botocore.exceptions.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        message = str(exc.response.get("Error", {}).get("Message", ""))[:500]
        return map_client_error(error_code(exc) or "", message, status=status, what=what)
    if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError,
                        botocore.exceptions.CredentialRetrievalError)):
        return AuthError(f"no usable AWS credentials for {what} ({type(exc).__name__}); "
                         "configure boto3's credential chain (environment, profile or instance role)")
    if isinstance(exc, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)):
        # ReadTimeoutError, ConnectTimeoutError, EndpointConnectionError, ConnectionClosedError, ...
        return TransientError(f"{type(exc).__name__}: {what}")
    return None


def instance_view(raw: dict[str, Any], provider: str) -> Instance:
    """The contract's :class:`Instance` of one DescribeInstances/RunInstances item."""
    tags = {t["Key"]: t["Value"] for t in raw.get("Tags", [])}
    state = raw.get("State", {}).get("Name", "")
    launched = raw.get("LaunchTime")
    return Instance(
        id=raw["InstanceId"],
        node_id=tags.get(NODE_TAG, ""),
        provider=provider,
        state=state if state in LIVE_STATES else "gone",
        zone=raw.get("Placement", {}).get("AvailabilityZone"),
        instance_type=raw.get("InstanceType"),
        launched_at=launched.timestamp() if launched is not None else None,
    )


class Ec2Api:
    """EC2 clients per region, and calls on them (see the module docstring).

    Args:
        endpoint_url: EC2 endpoint (tests: moto); None: AWS's own.
        retry_attempts: tries per :meth:`call`, first included (TransientError only).
        retry_initial_s, retry_max_s: exponential-jitter wait between tries, seconds.
        connect_timeout_s, read_timeout_s: per HTTP request, seconds.

    Raises:
        ValueError: ``retry_attempts`` < 1 or a negative time.

    The constructor does no I/O; a region's client is made on its first call.
    """

    def __init__(self, *, endpoint_url: str | None, retry_attempts: int = 4, retry_initial_s: float = 0.5,
                 retry_max_s: float = 8.0, connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0) -> None:
        if retry_attempts < 1:
            raise ValueError(f"retry_attempts must be >= 1, got {retry_attempts}")
        for label, value in (("retry_initial_s", retry_initial_s), ("retry_max_s", retry_max_s),
                             ("connect_timeout_s", connect_timeout_s), ("read_timeout_s", read_timeout_s)):
            if value < 0:
                raise ValueError(f"{label} must be >= 0, got {value}")
        self._endpoint_url = endpoint_url
        self._retry_attempts = retry_attempts
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
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
        self._closed = False

    async def call_once(self, region: str, op: str, **kwargs: Any) -> dict[str, Any]:
        """One boto3 call (``op``, e.g. ``"run_instances"``) in a worker thread.

        Raises:
            ProviderError (a leaf where known): botocore's error, translated ``from`` it.
            RuntimeError: after :meth:`aclose`.
        """
        client = await self._client(region)
        what = f"{client.meta.method_to_api_mapping.get(op, op)} in {region}"
        try:
            return await asyncio.to_thread(getattr(client, op), **kwargs)
        except Exception as exc:
            mapped = translate(exc, what)
            if mapped is None:
                raise
            raise mapped from exc

    async def call(self, region: str, op: str, **kwargs: Any) -> dict[str, Any]:
        """:meth:`call_once`, retried on TransientError (:meth:`retrying`)."""
        return await self.retrying(lambda: self.call_once(region, op, **kwargs), what=op)

    async def retrying(self, fn: Callable[[], Awaitable[T]], *, what: str) -> T:
        """Run ``fn`` until it succeeds, retrying TransientError only (exponential jitter),
        at most ``retry_attempts`` tries; then the last error is raised."""

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

    async def describe_instances(self, region: str, filters: list[dict[str, Any]], *,
                                 instance_ids: list[str] | None = None, retry: bool = True) -> list[dict[str, Any]]:
        """Every DescribeInstances item matching ``filters`` (and ``instance_ids``), all pages
        (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeInstances.html).
        ``retry``: each page through :meth:`call` (else :meth:`call_once`)."""
        out: list[dict[str, Any]] = []
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
            call = self.call if retry else self.call_once
            resp = await call(region, "describe_instances", **kwargs)
            out += [raw for reservation in resp.get("Reservations", []) for raw in reservation.get("Instances", [])]
            token = resp.get("NextToken")
            if not token:
                return out

    async def aclose(self) -> None:
        """Close every client (best effort; idempotent). Later calls raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            try:
                await asyncio.to_thread(client.close)
            except Exception as exc:  # closing is best effort; the process may be exiting
                log.warning("aws_client_close_failed", error=type(exc).__name__)

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
                    return self._session.client("ec2", region_name=region, endpoint_url=self._endpoint_url,
                                                config=self._botocore_config)
                self._clients[region] = await asyncio.to_thread(make)
            return self._clients[region]
