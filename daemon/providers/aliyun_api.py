"""The ECS edge of :mod:`daemon.providers.aliyun`: credentials, one ``AcsClient`` per
region, calls with retries, and the translation of the SDK's errors into the provider
error tree.

Every SDK call is blocking and runs in a thread (``asyncio.to_thread``); ``AcsClient`` is
made with ``auto_retry=False``: retries belong to :meth:`EcsApi.call`, which retries
:class:`TransientError` only (jittered exponential wait), building a fresh request per
try (the SDK re-signs it: new nonce and timestamp, same ``ClientToken``).

Error codes: the tables of the ECS API pages (RunInstances, DescribeInstances,
DeleteInstances, DescribeSpotPriceHistory) plus the common ones (``Throttling``,
``InternalError``, ``SignatureDoesNotMatch``, ``InvalidAccessKeyId.NotFound``,
``Forbidden.RAM``). The SDK raises ``ServerException(code, message, http_status,
request_id)`` for an error answer and ``ClientException`` for transport and credential
problems (``SDK.HttpError`` wraps connection errors and read timeouts).

Credentials (never in the config, never logged): :func:`credential_kwargs`.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import re
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import structlog
from aliyunsdkcore.acs_exception.exceptions import ClientException, ServerException
from aliyunsdkcore.auth.credentials import EcsRamRoleCredential, StsTokenCredential
from aliyunsdkcore.client import AcsClient
from aliyunsdkcore.request import RpcRequest
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from daemon.providers.base import AuthError, CapacityError, PriceError, ProviderError, QuotaError, TransientError

__all__ = ["EcsApi", "credential_kwargs", "translate_error"]

log = structlog.get_logger("spotvisor.provider.aliyun")

_CAPACITY_CODES = frozenset({
    "OperationDenied.NoStock", "Zone.NotOnSale", "InvalidInstanceType.ZoneNotSupported",
    "InvalidResourceType.NotSupported", "OperationDenied.NoSpotStock",
})
_AUTH_CODES = frozenset({
    "InvalidAccessKeyId.NotFound", "InvalidAccessKeyId.Inactive", "InvalidAccessKeyId",
    "SignatureDoesNotMatch", "InvalidAccessKeySecret", "IncompleteSignature", "Forbidden.RAM",
    "Forbidden", "Forbidden.AccessKeyDisabled", "InvalidSecurityToken.Expired",
    "InvalidSecurityToken.MismatchWithAccessKey", "SDK.InvalidCredential",
})
_TRANSIENT_CODES = frozenset({
    "InternalError", "ServiceUnavailable", "UnknownError", "ServiceUnavailable.Timeout",
    "IncorrectInstanceStatus.Initializing", "LastTokenProcessing", "SDK.HttpError", "SDK.ServerUnreachable",
})



def translate_error(exc: Exception) -> ProviderError:
    """Map an SDK exception onto the provider error tree (no secret in the message).

    Capacity: ``OperationDenied.NoStock``, ``Zone.NotOnSale``,
    ``InvalidInstanceType.ZoneNotSupported``, ``InvalidResourceType.NotSupported``;
    ``InvalidSpotPriceLimit.LowerThanPublicPrice`` → :class:`PriceError`. Quota:
    ``QuotaExceed.*`` / ``*.QuotaExceed*``. Auth: bad key id or signature, RAM denial,
    missing credentials. Transient: ``Throttling*``, ``InternalError``,
    ``ServiceUnavailable``, any 5xx, transport errors and timeouts. Anything else is a
    plain :class:`ProviderError` (a request the adapter got wrong: no retry helps).
    """
    if isinstance(exc, ServerException):
        code, status = exc.get_error_code() or "", exc.get_http_status() or 0
        what = f"ECS {code} (HTTP {status}, request {exc.get_request_id()}): {exc.get_error_msg()}"
    elif isinstance(exc, ClientException):
        code, status = exc.get_error_code() or "", 0
        # a transport error's text can quote the signed URL (AccessKeyId, Signature): cut the query
        detail = re.sub(r"\?[^\s'\")]*", "?<query>", str(exc.get_error_msg()))
        what = f"ECS client {code}: {detail}"
    else:
        return TransientError(f"ECS call failed: {type(exc).__name__}: {exc}")
    err = _classify(code, status, what)
    err.code = code  # type: ignore[attr-defined]  (the ECS error code, for callers that need it)
    return err


def _classify(code: str, status: int, what: str) -> ProviderError:
    if code == "InvalidSpotPriceLimit.LowerThanPublicPrice":
        return PriceError(what)
    if code in _CAPACITY_CODES:
        return CapacityError(what)
    if code.startswith("QuotaExceed") or ".QuotaExceed" in code or code.startswith("QuotaExceeded"):
        return QuotaError(what)
    if code in _AUTH_CODES or code.startswith("Forbidden.RAM"):
        if code in ("SignatureDoesNotMatch", "InvalidAccessKeySecret"):
            what = f"ECS {code}: the AccessKeySecret does not match the AccessKeyId"
        return AuthError(what)
    if code.startswith("Throttling") or code in _TRANSIENT_CODES or status >= 500:
        return TransientError(what)
    return ProviderError(what)


def credential_kwargs(ak_id: str | None = None, ak_secret: str | None = None) -> dict[str, Any]:
    """AcsClient keyword arguments for the first credential found, in this order: ``ak_id``/
    ``ak_secret``; ``ALIBABA_CLOUD_ACCESS_KEY_ID`` / ``ALIBABA_CLOUD_ACCESS_KEY_SECRET`` (+
    ``ALIBABA_CLOUD_SECURITY_TOKEN`` for STS); ``ALIYUN_ACCESS_KEY_ID`` /
    ``ALIYUN_ACCESS_KEY_SECRET`` (what aliyun-python-sdk-core reads itself); an ``access_key``
    profile in ``~/.alibabacloud/credentials`` (``ALIBABA_CLOUD_CREDENTIALS_FILE``, profile
    ``ALIBABA_CLOUD_PROFILE`` or ``default``); an ECS RAM role named by
    ``ALIBABA_CLOUD_ECS_METADATA``. Raises AuthError when none is found."""
    env = os.environ
    if ak_id is not None:
        return {"ak": ak_id, "secret": ak_secret}
    ak, sk = env.get("ALIBABA_CLOUD_ACCESS_KEY_ID"), env.get("ALIBABA_CLOUD_ACCESS_KEY_SECRET")
    if ak and sk:
        sts = env.get("ALIBABA_CLOUD_SECURITY_TOKEN")
        return {"credential": StsTokenCredential(ak, sk, sts)} if sts else {"ak": ak, "secret": sk}
    ak, sk = env.get("ALIYUN_ACCESS_KEY_ID"), env.get("ALIYUN_ACCESS_KEY_SECRET")
    if ak and sk:
        return {"ak": ak, "secret": sk}
    path = Path(env.get("ALIBABA_CLOUD_CREDENTIALS_FILE") or Path.home() / ".alibabacloud" / "credentials")
    profile = env.get("ALIBABA_CLOUD_PROFILE", "default")
    if path.is_file():
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except configparser.Error as exc:
            raise AuthError(f"aliyun: cannot parse credentials file {path}") from exc
        if parser.has_section(profile) and parser[profile].get("type", "access_key") == "access_key":
            ak, sk = parser[profile].get("access_key_id"), parser[profile].get("access_key_secret")
            if ak and sk:
                return {"ak": ak, "secret": sk}
    role = env.get("ALIBABA_CLOUD_ECS_METADATA")
    if role:
        return {"credential": EcsRamRoleCredential(role)}
    raise AuthError("aliyun: no credentials (set ALIBABA_CLOUD_ACCESS_KEY_ID and "
                    "ALIBABA_CLOUD_ACCESS_KEY_SECRET, a ~/.alibabacloud/credentials profile, "
                    "or ALIBABA_CLOUD_ECS_METADATA)")


@dataclass(eq=False)
class EcsApi:
    """ECS clients per region, and calls on them (see the module docstring).

    Args:
        regions: the provider's set of regions in use; a region a client is made for is
            added to it (so ``describe`` searches it).
        access_key_id, access_key_secret: explicit credentials, or None (the chain).
        endpoint: ``host:port`` of a test endpoint (plain http), or None: ECS's own.
        retry_attempts: tries per call on TransientError (1 = no retry).
        retry_wait_s: base of the jittered exponential wait between tries, seconds.
        read_timeout_s, connect_timeout_s: per HTTP request, seconds.

    The constructor does no I/O; clients are made on first use.
    """

    _: KW_ONLY
    regions: set[str]
    access_key_id: str | None = field(repr=False)
    access_key_secret: str | None = field(repr=False)
    endpoint: str | None
    retry_attempts: int
    retry_wait_s: float
    read_timeout_s: float
    connect_timeout_s: float
    _clients: dict[str, AcsClient] = field(default_factory=dict, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)

    async def call(self, region: str, build: Callable[[], RpcRequest]) -> dict[str, Any]:
        """One API call with retries on TransientError; ``build`` makes a fresh request
        per try (the SDK re-signs it: new nonce and timestamp, same ClientToken).

        Returns:
            The answer's JSON body.

        Raises:
            ProviderError (a leaf where known): the SDK's error, translated ``from`` it.
            RuntimeError: after :meth:`aclose`.
        """
        client = self._client(region)
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TransientError),
            stop=stop_after_attempt(self.retry_attempts),
            wait=wait_random_exponential(multiplier=self.retry_wait_s, max=max(self.retry_wait_s * 8, 0.001)),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                req = build()
                if self.endpoint:
                    req.set_endpoint(self.endpoint)
                    req.set_protocol_type("http")
                try:
                    raw = await asyncio.to_thread(client.do_action_with_exception, req)
                except (ServerException, ClientException) as exc:
                    err = translate_error(exc)
                    log.info("ecs_call_failed", action=req.get_action_name(), region=region,
                             error=type(err).__name__, code=exc.get_error_code(),
                             attempt=attempt.retry_state.attempt_number)
                    raise err from exc
                except OSError as exc:
                    raise TransientError(f"ECS {req.get_action_name()}: {type(exc).__name__}") from exc
                return json.loads(raw)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        """Close every client's HTTP session (idempotent). Later calls raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        clients, self._clients = self._clients, {}
        for client in clients.values():
            session = getattr(client, "session", None)
            if session is not None:
                await asyncio.to_thread(session.close)

    def _client(self, region: str) -> AcsClient:
        if self._closed:
            raise RuntimeError("AliyunProvider is closed")
        client = self._clients.get(region)
        if client is None:
            try:
                client = AcsClient(region_id=region, auto_retry=False, timeout=self.read_timeout_s,
                                   connect_timeout=self.connect_timeout_s,
                                   **credential_kwargs(self.access_key_id, self.access_key_secret))
            except ClientException as exc:
                raise translate_error(exc) from exc
            self._clients[region] = client
            self.regions.add(region)
        return client
