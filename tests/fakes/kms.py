"""A local fake of Alibaba Cloud KMS secrets (RPC API version 2016-01-20), for the tests of
``job.secrets: {NAME: kms:...}``. It speaks to the real ``aliyun-python-sdk-kms`` client
(``GetSecretValueRequest``) through ``aliyun-python-sdk-core``.

It follows the documents:

- Request structure and signature: the RPC v1 mechanism, as :mod:`fakes.ecs` checks it
  (https://www.alibabacloud.com/help/en/sdk/product-overview/rpc-mechanism): every
  parameter in the query (or a form body), the common parameters ``Action``, ``Version``,
  ``Format``, ``AccessKeyId``, ``SignatureMethod`` ``HMAC-SHA1``, ``SignatureVersion``
  ``1.0``, ``SignatureNonce``, ``Timestamp``, ``Signature`` required; the signature is
  recomputed and a mismatch is ``SignatureDoesNotMatch`` (400), an unknown key id
  ``InvalidAccessKeyId.NotFound`` (404). The SDK sends ``GetSecretValue`` as a POST.
- GetSecretValue
  (https://www.alibabacloud.com/help/en/kms/key-management-service/developer-reference/api-kms-2016-01-20-getsecretvalue):
  ``SecretName`` (a name, or an ARN ``acs:kms:${region}:${account}:secret/${name}``)
  required; ``VersionStage`` (default ``ACSCurrent``), ``VersionId`` optional. Response
  ``{"RequestId", "SecretName", "VersionId", "CreateTime", "SecretData", "SecretDataType"
  ("text" | "binary": base64), "VersionStages": {"VersionStage": [...]}, "SecretType"}``.
  A secret that does not exist: ``Forbidden.ResourceNotFound`` with HTTP 404 (the code the
  KMS error center lists and the Alibaba Cloud SDKs test for).

UNCONFIRMED (the documents do not say; the fake picks the plausible behaviour): the exact
``Message`` texts; the code for a ``VersionStage`` no version carries (here
``Forbidden.ResourceNotFound`` too); whether ``RegionId`` is required (the SDK always sends
it; required here, ``MissingParameter``).

Test hooks (not part of KMS): :meth:`FakeKms.put` (create a secret's current version),
:meth:`FakeKms.fail_next` (answer the next call with a documented error code) and the log
:attr:`FakeKms.requests`.

Example::

    async with FakeKms(access_key_id="ak", access_key_secret="sk") as kms:
        kms.put("hf-token", "hf_abc")
        request.set_endpoint(kms.endpoint); request.set_protocol_type("http")
"""

from __future__ import annotations

import base64
import hmac
import uuid
from dataclasses import dataclass

from aiohttp import web

from fakes.ecs import _sign, string_to_sign
from fakes.serving import LocalServer

__all__ = ["FakeKms", "API_VERSION", "ERROR_STATUS"]

API_VERSION = "2016-01-20"

ERROR_STATUS: dict[str, int] = {
    "Forbidden.ResourceNotFound": 404,
    "Forbidden.NoPermission": 403,
    "Rejected.Throttling": 400,
    "InternalFailure": 500,
    "SignatureDoesNotMatch": 400,
    "InvalidAccessKeyId.NotFound": 404,
    "MissingParameter": 400,
    "InvalidParameter": 400,
    "InvalidVersion": 400,
    "InvalidAction.NotFound": 404,
}

_REQUIRED_COMMON = ("Action", "Version", "Format", "AccessKeyId", "SignatureMethod",
                    "SignatureVersion", "SignatureNonce", "Timestamp", "Signature")


@dataclass(slots=True)
class _Secret:
    data: str
    data_type: str  # "text" | "binary" (data is base64 then)
    version_id: str


class _ApiError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(code)
        self.code, self.message, self.status = code, message, ERROR_STATUS.get(code, 400)


class FakeKms(LocalServer):
    """The fake KMS endpoint; see the module docstring. Lifecycle as :class:`fakes.ecs.FakeEcs`:
    the constructor does no I/O, ``await start()`` binds 127.0.0.1 (``endpoint``
    ``"127.0.0.1:PORT"``), ``await aclose()`` stops it (idempotent)."""

    def __init__(self, *, access_key_id: str = "test-ak-id", access_key_secret: str = "test-ak-secret") -> None:
        super().__init__()
        self.access_key_id, self._secret = access_key_id, access_key_secret
        self.secrets: dict[tuple[str, str], _Secret] = {}  # (region, name) -> current version
        self.requests: list[dict[str, str]] = []
        self._faults: list[str] = []

    # -- test hooks ----------------------------------------------------------------------
    def put(self, name: str, value: str | bytes, *, region: str = "cn-hangzhou") -> None:
        """Create (or replace) the ``ACSCurrent`` version of secret ``name`` in ``region``;
        bytes are stored as a ``binary`` secret."""
        if isinstance(value, bytes):
            secret = _Secret(base64.b64encode(value).decode(), "binary", uuid.uuid4().hex)
        else:
            secret = _Secret(value, "text", uuid.uuid4().hex)
        self.secrets[(region, name)] = secret

    def fail_next(self, code: str) -> None:
        """Answer the next signed GetSecretValue with error ``code`` (its documented status)."""
        self._faults.append(code)

    # -- HTTP ----------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.Response:
        request_id = str(uuid.uuid4()).upper()
        params: dict[str, str] = dict(request.query)
        if request.method == "POST" and request.can_read_body:
            form = await request.post()
            params.update({k: v for k, v in form.items() if isinstance(v, str)})
        try:
            self._authenticate(request.method, params)
            self.requests.append(dict(params))
            if params["Action"] != "GetSecretValue":
                raise _ApiError("InvalidAction.NotFound", "Specified api is not found, please check your url and method.")
            if self._faults:
                code = self._faults.pop(0)
                raise _ApiError(code, f"injected {code}")
            return web.json_response({"RequestId": request_id, **self._get_secret_value(params)})
        except _ApiError as err:
            return web.json_response({"RequestId": request_id, "HostId": request.host, "Code": err.code,
                                      "Message": err.message}, status=err.status)

    def _authenticate(self, method: str, params: dict[str, str]) -> None:
        missing = [k for k in _REQUIRED_COMMON if not params.get(k)]
        if missing:
            raise _ApiError("MissingParameter", f"The input parameter \"{missing[0]}\" that is mandatory "
                            "for processing this request is not supplied.")
        if params["AccessKeyId"] != self.access_key_id:
            raise _ApiError("InvalidAccessKeyId.NotFound", "Specified access key is not found.")
        sts = string_to_sign(method, params)
        if not hmac.compare_digest(_sign(self._secret, sts), params["Signature"]):
            raise _ApiError("SignatureDoesNotMatch", "Specified signature does not match our calculation. "
                            f"server string to sign is:{sts}")
        if params["Version"] != API_VERSION:
            raise _ApiError("InvalidVersion", "Specified parameter Version is not valid.")

    def _get_secret_value(self, p: dict[str, str]) -> dict[str, object]:
        for name in ("RegionId", "SecretName"):
            if not p.get(name):
                raise _ApiError("MissingParameter", f"The input parameter \"{name}\" that is mandatory for "
                                "processing this request is not supplied.")
        region, name = p["RegionId"], p["SecretName"]
        if name.startswith("acs:kms:"):  # acs:kms:${region}:${account}:secret/${name}
            parts = name.split(":", 4)
            if len(parts) != 5 or not parts[4].startswith("secret/"):
                raise _ApiError("InvalidParameter", "The specified SecretName is not valid.")
            region, name = parts[2], parts[4][len("secret/"):]
        stage = p.get("VersionStage", "ACSCurrent")
        secret = self.secrets.get((region, name))
        if secret is None or stage != "ACSCurrent" or p.get("VersionId", secret.version_id) != secret.version_id:
            raise _ApiError("Forbidden.ResourceNotFound", "The resource not exists.")
        return {"SecretName": name, "VersionId": secret.version_id, "CreateTime": "2026-11-01T00:00:00Z",
                "SecretData": secret.data, "SecretDataType": secret.data_type,
                "VersionStages": {"VersionStage": ["ACSCurrent"]}, "SecretType": "Generic"}
