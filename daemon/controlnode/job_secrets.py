"""A job's secrets: read once when the daemon starts, handed to the trainers only.

``job.secrets: {NAME: SOURCE}`` (the syntax: :mod:`daemon.secretref`). Where a value goes,
and where it never does:

1. **Read** by :func:`resolve_secrets` before the daemon buys anything
   (:func:`daemon.interfaces.cli.running_daemon`): each source in a thread under
   ``timeout_s``. A file must be the daemon's own and owner-only (:func:`read_secret_file`);
   the clouds' stores through their SDKs (:mod:`daemon.providers.cloud_secrets`). Any
   failure is a :class:`SecretError`: one line naming the secret and its source, and the
   daemon exits (2, or 1 for an outage a restart may get past) with no instance bought.
2. **Masked**: the daemon registers every value with its redactor
   (:meth:`daemon.feed.redaction.Redactor.add_values`, in
   :func:`daemon.interfaces.cli.running_daemon`), so a log line, a record of the stdlib's
   logging, a structlog field (:func:`daemon.logs.configure_logging`) or a node's log
   (:class:`daemon.controlnode.node_logs.NodeLogs`) that held one anyway reads ``***``.
3. **Kept in memory** by the supervisor, and put in each node's job spec under its own key
   ``"secrets"`` (:func:`daemon.controlnode.jobspec.job_spec`): in the agent's
   registration reply and a stalled job's ``restart`` command, nowhere else. Not in the
   store, an event, the feed, ``spotctl status``, ``/metrics``, the user data or the
   agent's env file.
4. **Sent** only over TLS or to a loopback peer: :func:`check_channel` refuses a daemon
   whose agent URL is plain HTTP off loopback (at start), and the agent port answers 403 to
   a request of a node that came over plain HTTP from another address
   (:func:`private_channel`, :mod:`daemon.interfaces.api`).
5. **Used** by the agent: the trainer's environment only
   (:meth:`daemon.gpunode.trainer_process.TrainerProcess.job_env`).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import stat
from typing import Callable, Mapping
from urllib.parse import urlsplit

import structlog

from daemon.config import Config
from daemon.hosts import is_loopback
from daemon.secretref import MAX_SECRET_BYTES, SecretRef, parse_secret_ref

__all__ = ["SecretError", "resolve_secrets", "read_secret_file", "check_channel", "private_channel",
           "RESOLVE_TIMEOUT_S", "MAX_SECRET_FILE_BYTES"]

log = structlog.get_logger("spotvisor.secrets")

RESOLVE_TIMEOUT_S = 30.0  # one secret's read, all its retries included (seconds)
MAX_SECRET_FILE_BYTES = 1 << 20  # a secrets file larger than this is not one

Fetch = Callable[[SecretRef, str | None], str]  # (source, region) -> the raw value; blocks; raises FetchError


class SecretError(Exception):
    """A job secret that cannot be had or sent: one line, ``job.secrets.NAME: SOURCE: what
    (fix)``, never the value. ``exit_code``: 2 (the operator must fix it), 1 (an outage,
    a timeout: a restart may get past it)."""

    def __init__(self, message: str, *, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def read_secret_file(path: str, key: str | None) -> str:
    """The value in file ``path``: with ``key`` its ``KEY=value`` line (systemd
    EnvironmentFile syntax: ``#`` comments, an optional ``export``, one pair of matching
    quotes taken off), else the whole file less one trailing newline. Blocks.

    The file must be a regular file (not a symbolic link) owned by this process's uid with
    no group or world access (``chmod 600``), as ssh judges a private key: a secret anyone
    else can read or replace is not the job's.

    Raises:
        FetchError: refused, missing, unreadable, over :data:`MAX_SECRET_FILE_BYTES`, or
            ``key`` not in it.
    """
    from daemon.providers.cloud_secrets import FetchError

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FetchError(f"{path} is a symbolic link (give the file itself)") from None
        raise FetchError(f"{path}: {exc.strerror} (create it, owner-only: install -m 600 /dev/null {path})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise FetchError(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise FetchError(f"{path} is owned by uid {st.st_uid}, not by the daemon's uid {os.geteuid()} "
                             f"(chown it to the daemon's user)")
        if st.st_mode & 0o077:
            raise FetchError(f"{path} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):04o}; "
                             f"chmod 600 {path})")
        raw = f.read(MAX_SECRET_FILE_BYTES + 1)
    if len(raw) > MAX_SECRET_FILE_BYTES:
        raise FetchError(f"{path} is over {MAX_SECRET_FILE_BYTES} bytes (a secrets file holds a few lines)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FetchError(f"{path} is not UTF-8 text") from None
    if key is None:
        return text[:-1] if text.endswith("\n") else text
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        name, eq, value = line.partition("=")
        if eq and name.strip() == key:
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            return value
    raise FetchError(f"{path} has no {key}= line (add one)")


def _json_field(text: str, key: str) -> str:
    from daemon.providers.cloud_secrets import FetchError

    try:
        doc = json.loads(text)
    except ValueError:
        raise FetchError(f"#{key}: the secret is not JSON (drop #{key} to take it whole)") from None
    if not isinstance(doc, dict) or key not in doc:
        raise FetchError(f"#{key}: no such field in the secret's JSON")
    if not isinstance(doc[key], str):
        raise FetchError(f"#{key}: the field is not a string")
    return doc[key]


#: KMS's endpoint, ``host:port`` over plain HTTP: a local fake of KMS standing in for the cloud's
#: (boto3 reads AWS_ENDPOINT_URL for SSM and Secrets Manager; Alibaba's SDK has no such setting)
KMS_ENDPOINT_ENV = "SPOTVISOR_KMS_ENDPOINT"


def fetcher(endpoints: Mapping[str, str] | None = None, *, timeout_s: float = RESOLVE_TIMEOUT_S) -> Fetch:
    """The blocking reader of every source scheme. ``endpoints``: scheme → endpoint
    (``ssm``, ``secretsmanager``: a URL; ``kms``: ``host:port`` over plain HTTP), for tests;
    absent: ``$SPOTVISOR_KMS_ENDPOINT`` for ``kms``, else the SDK's own."""
    from daemon.providers import cloud_secrets as cloud

    ends = dict(endpoints or {})
    if "kms" not in ends and os.environ.get(KMS_ENDPOINT_ENV):  # a local fake of KMS (the walkthrough's test)
        ends["kms"] = os.environ[KMS_ENDPOINT_ENV]
    call_s = max(1.0, timeout_s / 3)  # each SDK call's connect / read timeout, within the whole

    def fetch(ref: SecretRef, region: str | None) -> str:
        if ref.scheme == "file":
            return read_secret_file(ref.ref, ref.key)
        assert region is not None  # Config._secret_regions
        if ref.scheme == "ssm":
            return cloud.ssm_parameter(ref.ref, region=region, endpoint_url=ends.get("ssm"), timeout_s=call_s)
        if ref.scheme == "secretsmanager":
            value = cloud.secretsmanager_value(ref.ref, region=region, endpoint_url=ends.get("secretsmanager"),
                                               timeout_s=call_s)
        else:
            value = cloud.kms_secret_value(ref.ref, region=region, endpoint=ends.get("kms"), timeout_s=call_s)
        return value if ref.key is None else _json_field(value, ref.key)

    return fetch


async def resolve_secrets(config: Config, *, timeout_s: float = RESOLVE_TIMEOUT_S, fetch: Fetch | None = None,
                          endpoints: Mapping[str, str] | None = None) -> dict[str, str]:
    """Read every ``job.secrets`` value, concurrently, each in a thread within ``timeout_s``.
    Returns ``{NAME: value}`` (empty without secrets); the caller registers the values with
    its redactor (the module docstring).

    Raises:
        SecretError: the first secret (in config order) that could not be read, or whose
            value is empty, holds a NUL or is over :data:`~daemon.secretref.MAX_SECRET_BYTES`.
    """
    from daemon.providers.cloud_secrets import FetchError

    if not config.job.secrets:
        return {}
    read = fetch or fetcher(endpoints, timeout_s=timeout_s)
    refs = {name: parse_secret_ref(source) for name, source in config.job.secrets.items()}

    async def one(name: str, ref: SecretRef) -> str:
        where = f"job.secrets.{name}: {ref}"
        try:
            async with asyncio.timeout(timeout_s):
                value = await asyncio.to_thread(read, ref, config.secret_region(ref))
        except TimeoutError:
            raise SecretError(f"{where}: no answer within {timeout_s:g} s (check the network and the region)",
                              exit_code=1) from None
        except FetchError as exc:
            raise SecretError(f"{where}: {exc}", exit_code=1 if exc.transient else 2) from None
        problem = ("is empty" if not value else "holds a NUL character" if "\0" in value
                   else f"is over {MAX_SECRET_BYTES} bytes" if len(value.encode("utf-8", "surrogatepass")) >
                   MAX_SECRET_BYTES else None)
        if problem is not None:
            raise SecretError(f"{where}: the value {problem} (an environment variable cannot carry it)")
        return value

    tasks = {name: asyncio.ensure_future(one(name, ref)) for name, ref in refs.items()}
    try:
        await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks.values():
            t.cancel()
    for t in tasks.values():  # the first failure in config order (a value is never in an error)
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    values = {name: t.result() for name, t in tasks.items()}
    log.info("job_secrets_resolved", names=sorted(values), sources=sorted({r.scheme for r in refs.values()}))
    return values


def check_channel(agent_url: str) -> None:
    """Refuse to hand secrets to agents reached at ``agent_url`` over plain HTTP anywhere but
    loopback (the config refuses that too, :class:`daemon.config.DaemonSpec`; this is the
    daemon's own word at start). Raises SecretError."""
    u = urlsplit(agent_url)
    if u.scheme != "https" and not is_loopback(u.hostname or ""):
        raise SecretError(f"job.secrets: the agent port {agent_url} is plain HTTP on a non-loopback address; the "
                          "secrets would cross the network readable (set daemon.agent_tls: on)")


def private_channel(*, secure: bool, peer: str | None) -> bool:
    """Whether a reply to an agent's request may carry secrets: it came over TLS, or from a
    loopback address (the local provider's agents)."""
    return secure or (peer is not None and is_loopback(peer))
