"""The metadata dialects by name: the node-side client of each.

``make_client("aliyun", url)`` builds the poller an agent runs. Imports are lazy so a
node only loads the dialect it uses. (The local fake endpoints, which the local provider
gives its simulated nodes, are :mod:`daemon.providers.local_metadata`.)

``DOCUMENTED_LEAD_S`` is the notice lead each cloud documents (seconds between
the notice appearing and the instance being taken), used to estimate when a
notice was published where the cloud does not say:
AWS 120 s (EC2 User Guide, "Spot Instance interruption notices"), Alibaba 300 s
(ECS, "Query the interruption events of preemptible instances"), GCP 30 s
(Compute Engine, "Preemptible VM instances"), Azure >= 30 s (Scheduled Events, Preempt).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DIALECTS", "DEFAULT_URLS", "DOCUMENTED_LEAD_S", "make_client"]

# name -> client module:class
_TABLE: dict[str, str] = {
    "aws": "daemon.gpunode.metadata.aws:AwsImds",
    "aliyun": "daemon.gpunode.metadata.aliyun:AliyunMetadata",
    "gcp": "daemon.gpunode.metadata.gcp:GcpMetadata",
    "azure": "daemon.gpunode.metadata.azure:AzureScheduledEvents",
}
DIALECTS: tuple[str, ...] = tuple(_TABLE)

DEFAULT_URLS: dict[str, str] = {
    "aws": "http://169.254.169.254",
    "aliyun": "http://100.100.100.200",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}

DOCUMENTED_LEAD_S: dict[str, float] = {"aws": 120.0, "aliyun": 300.0, "gcp": 30.0, "azure": 30.0}


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _check(dialect: str) -> None:
    if dialect not in _TABLE:
        raise ValueError(f"unknown metadata dialect {dialect!r}; known: {', '.join(DIALECTS)}")


def make_client(dialect: str, base_url: str | None = None, **kwargs: Any) -> Any:
    """The poller for ``dialect`` against ``base_url`` (default: the cloud's own endpoint).

    Raises:
        ValueError: unknown dialect.
    """
    _check(dialect)
    return _load(_TABLE[dialect])(base_url or DEFAULT_URLS[dialect], **kwargs)

