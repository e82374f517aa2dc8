"""The cloud check's I/O: every check of a config, run concurrently, each within its
timeout (the verdicts: :mod:`daemon.controlnode.cloud_check`).

- each cloud provider the offers name: :func:`daemon.providers.aws_check.check_aws`,
  :func:`daemon.providers.aliyun_check.check_aliyun` (credentials, images, the exact
  launch request dry-run, quotas, availability);
- ``job.secrets``, for ``spotvisord check`` only (:func:`check_secrets`);
- each placement domain's checkpoint store (``config.checkpoint_uri(domain)``): put a
  small probe object, get it back and compare the bytes, delete it
  (:func:`probe_store`); the ``local`` provider has only this check.

A provider this module does not know (a test's stand-in) gets the store probe only.
A check that runs past ``timeout_s`` or raises is a failed result, never an exception.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Awaitable, Callable, Mapping

import structlog

from daemon.config import Config
from daemon.control.offers import Offer
from daemon.controlnode.cloud_check import CheckResult, failed, passed
from daemon.providers.base import NODE_TAG, POOL_TAG, NodeSpec, Provider

__all__ = ["run_checks", "check_secrets", "probe_store", "check_node", "CHECK_TIMEOUT_S"]

log = structlog.get_logger("spotvisor.check")

#: seconds one check (a provider's, or one store probe) may take
CHECK_TIMEOUT_S = 60.0


def check_node(config: Config) -> NodeSpec:
    """The node a dry-run launch carries: the pool's tags, the daemon's agent address, a
    dummy token (nothing is launched; the token is never a real node's)."""
    node_id = f"{config.pool.name}-check"
    scheme = "https" if config.daemon.agent_tls_on() else "http"
    return NodeSpec(node_id=node_id, pool=config.pool.name, token="spotvisor-check-" + "0" * 32,
                    daemon_url=f"{scheme}://{config.daemon.agent_host}:{config.daemon.agent_port}",
                    tags={POOL_TAG: config.pool.name, NODE_TAG: node_id})


def _store_field(config: Config, index: int) -> str:
    """The config field that names domain ``index``'s checkpoint store."""
    if index < len(config.domains) and config.domains[index].checkpoint_uri is not None:
        return f"domains.{index}.checkpoint_uri"
    return "job.checkpoint_uri"


def probe_store(uri: str, *, s3_endpoint_url: str | None, oss_endpoint: str | None) -> None:
    """Put, get (same bytes) and delete one probe object under ``uri``. Blocking.

    Raises:
        Exception: the step that failed, as the store raised it (``StorageError`` and
            its kin), or ``ValueError`` for the bytes read back differing.
    """
    from trainer.checkpoint import open_store

    store = open_store(uri, s3_endpoint_url=s3_endpoint_url, oss_endpoint=oss_endpoint)
    key = f"spotvisor-check-{secrets.token_hex(8)}"
    data = secrets.token_bytes(64)
    step = "put"
    try:
        store.put_bytes(key, data)
        step = "get"
        if store.get_bytes(key) != data:
            raise ValueError("the object read back differs from the one written")
        step = "delete"
        store.delete([key])
    except Exception as exc:
        exc.add_note(step)
        raise


async def _store_check(config: Config, index: int, timeout_s: float) -> list[CheckResult]:
    domain = config.domains_resolved()[index]
    uri = config.checkpoint_uri(domain.name)
    name = f"store {uri} (domain {domain.name}): put, get, delete"
    field = _store_field(config, index)
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.to_thread(probe_store, uri, s3_endpoint_url=domain.s3_endpoint_url,
                                    oss_endpoint=domain.oss_endpoint)
    except TimeoutError:
        return [failed(name, f"no answer within {timeout_s:g} s",
                       f"{field}: a store reachable from the control node (its endpoint, network path)",
                       domain.offers)]
    except Exception as exc:  # noqa: BLE001 - every failure is a result
        step = (getattr(exc, "__notes__", None) or ["open"])[-1]
        scheme = uri.split("://", 1)[0]
        grant = {"s3": "s3:PutObject, s3:GetObject and s3:DeleteObject", "oss": "oss:PutObject, oss:GetObject and "
                 "oss:DeleteObject", "file": "write access"}.get(scheme, "access")
        if _no_credentials(exc):  # not a permission: nothing signed the request
            return [failed(name, f"{step} failed: {type(exc).__name__}: {str(exc)[:300]}",
                           "the control node's credentials (its instance role, AWS_PROFILE, or AWS_ACCESS_KEY_ID "
                           "and AWS_SECRET_ACCESS_KEY in /etc/spotvisor/spotvisord.env); never in the config",
                           domain.offers)]
        return [failed(name, f"{step} failed: {type(exc).__name__}: {str(exc)[:300]}",
                       f"{field}: a bucket and prefix the control node can write, or grant it {grant} there",
                       domain.offers)]
    return [passed(name)]


#: botocore's errors for a request nothing could sign (botocore.exceptions)
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}


def _no_credentials(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is botocore's for missing credentials."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if type(e).__name__ in _NO_CREDENTIALS:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


async def check_secrets(config: Config, timeout_s: float = CHECK_TIMEOUT_S) -> list[CheckResult]:
    """Each ``job.secrets`` value read as the daemon's start reads it
    (:func:`daemon.controlnode.job_secrets.resolve_secrets`), one result per secret; the
    value is dropped at once, never shown. Run by ``spotvisord check``, not by the
    daemon's own check (its start has read them already, and refuses to start without)."""
    from daemon.controlnode.job_secrets import SecretError, resolve_secrets

    async def one(name: str, source: str) -> CheckResult:
        what = f"job.secrets.{name} ({source}): read"
        single = config.model_copy(update={"job": config.job.model_copy(update={"secrets": {name: source}})})
        try:
            await resolve_secrets(single, timeout_s=timeout_s)
        except SecretError as exc:
            detail = str(exc).removeprefix(f"job.secrets.{name}: {source}: ")
            return failed(what, detail, f"job.secrets.{name}: a source that exists, and the control node's "
                                        "permission to read it")
        return passed(what, "its value is not shown")

    return list(await asyncio.gather(*(one(n, s) for n, s in config.job.secrets.items())))


def _offers(config: Config, provider: str) -> list[Offer]:
    groups = {i: d.placement_group for d in config.domains_resolved() for i in d.offers}
    return [Offer(index=i, provider=o.provider, region=o.region, zone=o.zone, instance_type=o.instance_type,
                  gpus_per_node=o.gpus_per_node, max_price_usd_h=o.max_price_usd_h, on_demand=o.market == "on_demand",
                  placement_group=groups.get(i))
            for i, o in enumerate(config.offers) if o.provider == provider]


def _provider_check(config: Config, name: str, provider: Provider) -> Callable[[], Awaitable[list[CheckResult]]] | None:
    offers, node = _offers(config, name), check_node(config)
    kind = getattr(provider, "name", None)
    if kind == "aws" and hasattr(provider, "run_instances_request"):
        from daemon.providers.aws_check import check_aws

        return lambda: check_aws(config, provider, offers, node)  # type: ignore[arg-type]
    if kind == "aliyun" and hasattr(provider, "run_instances_request"):
        from daemon.providers.aliyun_check import check_aliyun

        return lambda: check_aliyun(config, provider, offers, node)  # type: ignore[arg-type]
    return None


async def _bounded(what: str, run: Callable[[], Awaitable[list[CheckResult]]], offers: list[int],
                   timeout_s: float) -> list[CheckResult]:
    try:
        async with asyncio.timeout(timeout_s):
            return await run()
    except TimeoutError:
        return [failed(f"{what}: checks", f"no answer within {timeout_s:g} s",
                       "check the control node's network path to the cloud's API endpoints", offers)]
    except Exception as exc:  # noqa: BLE001
        log.error("cloud_check_error", check=what, error=repr(exc), exc_info=exc)
        return [failed(f"{what}: checks", f"{type(exc).__name__}: {str(exc)[:300]}",
                       "see the daemon's log", offers)]


async def run_checks(config: Config, providers: Mapping[str, Provider] | Callable[[str], Provider], *,
                     timeout_s: float = CHECK_TIMEOUT_S) -> list[CheckResult]:
    """Every check of ``config``, concurrently: the providers' (in the order of their
    first offer), then each domain's store. ``providers``: by name, or a lookup by name.
    Never raises for a failed check; each part is bounded by ``timeout_s`` seconds."""
    lookup: Callable[[str], Any] = providers.__getitem__ if isinstance(providers, Mapping) else providers
    parts: list[Awaitable[list[CheckResult]]] = []
    for name in dict.fromkeys(o.provider for o in config.offers):
        run = _provider_check(config, name, lookup(name))
        if run is not None:
            idx = [i for i, o in enumerate(config.offers) if o.provider == name]
            parts.append(_bounded(name, run, idx, timeout_s))
    parts += [_store_check(config, i, timeout_s) for i in range(len(config.domains_resolved()))]
    return [r for rs in await asyncio.gather(*parts) for r in rs]
