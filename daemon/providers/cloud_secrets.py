"""A job's secrets read from the clouds' secret stores: blocking SDK calls, for a thread.

The daemon reads each ``job.secrets`` value once, at start
(:mod:`daemon.controlnode.job_secrets` runs these in a thread under a timeout). Each
function returns the secret's text or raises :class:`FetchError` whose message never holds
a value (the SDKs' error messages name the secret and the code, never its value).

- **AWS SSM Parameter Store**: ``GetParameter(Name, WithDecryption=True)`` →
  ``Parameter.Value`` (https://docs.aws.amazon.com/systems-manager/latest/APIReference/API_GetParameter.html);
  a SecureString is decrypted with its KMS key (the caller needs ``ssm:GetParameter`` and
  ``kms:Decrypt`` on it). Not found: ``ParameterNotFound``.
- **AWS Secrets Manager**: ``GetSecretValue(SecretId)`` → ``SecretString``, or
  ``SecretBinary`` (bytes; read here as UTF-8 text)
  (https://docs.aws.amazon.com/secretsmanager/latest/apireference/API_GetSecretValue.html).
  Not found: ``ResourceNotFoundException``. Both take a name or an ARN. Credentials: boto3's
  standard chain (environment, profile, instance role); ``endpoint_url`` (tests, VPC
  endpoints) or boto3's ``AWS_ENDPOINT_URL_SSM`` / ``AWS_ENDPOINT_URL_SECRETS_MANAGER``.
- **Alibaba Cloud KMS secrets**: ``GetSecretValue`` of the KMS API 2016-01-20 (RPC style,
  aliyun-python-sdk-kms) with ``SecretName`` (a name or ARN) → ``SecretData``, with
  ``SecretDataType`` ``text`` or ``binary`` (base64)
  (https://www.alibabacloud.com/help/en/kms/key-management-service/developer-reference/api-kms-2016-01-20-getsecretvalue).
  Not found: ``Forbidden.ResourceNotFound`` (404). Credentials: the aliyun provider's chain
  (:func:`daemon.providers.aliyun_api.credential_kwargs`); ``endpoint`` (tests:
  ``127.0.0.1:PORT``, plain HTTP), else the SDK's regional ``kms.<region>.aliyuncs.com``.

Transient errors (throttling, a 5xx, a connection or read timeout) are ``transient``: a
restart of the daemon may succeed; the rest (not found, access denied, no credentials) need
the operator.
"""

from __future__ import annotations

import base64
import json
from typing import Any

__all__ = ["FetchError", "ssm_parameter", "secretsmanager_value", "kms_secret_value"]

_AWS_TRANSIENT = {"ThrottlingException", "Throttling", "RequestLimitExceeded", "InternalServerError",
                  "InternalServiceError", "InternalFailure", "ServiceUnavailable"}
_ALIYUN_TRANSIENT_PREFIXES = ("Throttling", "InternalError", "ServiceUnavailable", "SDK.HttpError",
                              "SDK.ServerUnreachable", "Rejected.Throttling")


class FetchError(Exception):
    """A secret store did not give the value: one line (never the value). ``transient``: an
    outage or throttling, which a retry later may get past."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def _aws_client(service: str, region: str, endpoint_url: str | None, timeout_s: float) -> Any:
    import boto3
    from botocore.config import Config as BotoConfig

    cfg = BotoConfig(connect_timeout=timeout_s, read_timeout=timeout_s,
                     retries={"mode": "standard", "max_attempts": 2})
    return boto3.client(service, region_name=region, endpoint_url=endpoint_url, config=cfg)


def _aws_call(call: Any, what: str) -> Any:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    try:
        return call()
    except NoCredentialsError:
        raise FetchError(f"no AWS credentials for {what} (give the control node an instance role, or "
                         "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in /etc/spotvisor/spotvisord.env)") from None
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("ParameterNotFound", "ResourceNotFoundException"):
            raise FetchError(f"{what}: not found ({code}; check the name and the region)") from None
        if code in ("AccessDeniedException", "AccessDenied", "UnrecognizedClientException"):
            raise FetchError(f"{what}: access denied ({code}; grant the control node's role "
                             "ssm:GetParameter / secretsmanager:GetSecretValue and kms:Decrypt on its key)") from None
        raise FetchError(f"{what}: {code}", transient=code in _AWS_TRANSIENT or status >= 500) from None
    except BotoCoreError as exc:  # connection, read timeout, bad endpoint: the message names the URL, no value
        raise FetchError(f"{what}: {type(exc).__name__}: {exc}", transient=True) from None


def ssm_parameter(name: str, *, region: str, endpoint_url: str | None = None, timeout_s: float = 10.0) -> str:
    """The decrypted value of SSM parameter ``name``. Blocks. Raises FetchError."""
    client = _aws_client("ssm", region, endpoint_url, timeout_s)
    body = _aws_call(lambda: client.get_parameter(Name=name, WithDecryption=True), f"SSM GetParameter in {region}")
    return str(body["Parameter"]["Value"])


def secretsmanager_value(secret_id: str, *, region: str, endpoint_url: str | None = None,
                         timeout_s: float = 10.0) -> str:
    """The current value of Secrets Manager secret ``secret_id``. Blocks. Raises FetchError."""
    client = _aws_client("secretsmanager", region, endpoint_url, timeout_s)
    body = _aws_call(lambda: client.get_secret_value(SecretId=secret_id),
                     f"Secrets Manager GetSecretValue in {region}")
    if body.get("SecretString") is not None:
        return str(body["SecretString"])
    try:
        return bytes(body["SecretBinary"]).decode("utf-8")
    except (KeyError, TypeError, UnicodeDecodeError):
        raise FetchError("Secrets Manager GetSecretValue: the secret is binary, not UTF-8 text") from None


def kms_secret_value(name: str, *, region: str, endpoint: str | None = None, timeout_s: float = 10.0) -> str:
    """The current (``ACSCurrent``) value of Alibaba Cloud KMS secret ``name``. Blocks. Raises FetchError."""
    from aliyunsdkcore.acs_exception.exceptions import ClientException, ServerException
    from aliyunsdkcore.client import AcsClient
    from aliyunsdkkms.request.v20160120.GetSecretValueRequest import GetSecretValueRequest

    from daemon.providers.aliyun_api import credential_kwargs
    from daemon.providers.base import AuthError

    what = f"KMS GetSecretValue in {region}"
    try:
        client = AcsClient(region_id=region, auto_retry=False, timeout=int(max(1, timeout_s)),
                           connect_timeout=int(max(1, timeout_s)), **credential_kwargs())
    except AuthError as exc:
        raise FetchError(f"{what}: {exc}") from None
    except ClientException as exc:
        raise FetchError(f"{what}: {exc.get_error_code()}") from None
    req = GetSecretValueRequest()
    req.set_SecretName(name)
    req.set_accept_format("JSON")
    if endpoint:
        req.set_endpoint(endpoint)
        req.set_protocol_type("http")
    try:
        raw = client.do_action_with_exception(req)
    except ServerException as exc:
        code = exc.get_error_code()
        if code == "Forbidden.ResourceNotFound":
            raise FetchError(f"{what}: not found ({code}; check the name and the region)") from None
        if code.startswith(("Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidAccessKeySecret")):
            raise FetchError(f"{what}: access denied ({code}; grant the control node's RAM role "
                             "kms:GetSecretValue, or check its AccessKey)") from None
        raise FetchError(f"{what}: {code}", transient=code.startswith(_ALIYUN_TRANSIENT_PREFIXES)
                         or (exc.get_http_status() or 0) >= 500) from None
    except ClientException as exc:
        code = exc.get_error_code()
        raise FetchError(f"{what}: {code}", transient=code.startswith(_ALIYUN_TRANSIENT_PREFIXES)) from None
    except OSError as exc:
        raise FetchError(f"{what}: {type(exc).__name__}", transient=True) from None
    try:
        body = json.loads(raw)
        data = body["SecretData"]
        if body.get("SecretDataType") == "binary":
            return base64.b64decode(data, validate=True).decode("utf-8")
        return str(data)
    except (ValueError, KeyError, TypeError):
        raise FetchError(f"{what}: an answer without a text SecretData") from None
