"""The metadata dialects by name: the node-side client and its local fake.

``make_client("aliyun", url)`` builds the poller an agent runs; ``make_fake("gcp")``
builds the fake endpoint the local provider gives a simulated node. Imports are
lazy so a node only loads the dialect it uses.

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

__all__ = ["DIALECTS", "DEFAULT_URLS", "DOCUMENTED_LEAD_S", "make_client", "make_fake"]

# name -> (client module:class, fake module:class)
_TABLE: dict[str, tuple[str, str]] = {
    "aws": ("daemon.gpunode.metadata.aws:AwsImds", "daemon.gpunode.metadata.fake_aws:FakeImds"),
    "aliyun": ("daemon.gpunode.metadata.aliyun:AliyunMetadata", "daemon.gpunode.metadata.fake_aliyun:FakeAliyunMetadata"),
    "gcp": ("daemon.gpunode.metadata.gcp:GcpMetadata", "daemon.gpunode.metadata.fake_gcp:FakeGcpMetadata"),
    "azure": ("daemon.gpunode.metadata.azure:AzureScheduledEvents", "daemon.gpunode.metadata.fake_azure:FakeAzureScheduledEvents"),
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
    return _load(_TABLE[dialect][0])(base_url or DEFAULT_URLS[dialect], **kwargs)


def make_fake(dialect: str, **kwargs: Any) -> Any:
    """A local fake endpoint of ``dialect`` (call ``await fake.start()``; then ``fake.url``)."""
    _check(dialect)
    return _load(_TABLE[dialect][1])(**kwargs)
