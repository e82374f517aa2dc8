"""Local fakes of the clouds' instance metadata endpoints, one per dialect.

The local provider (:mod:`daemon.providers.local`) gives each simulated instance one of
these on 127.0.0.1 and publishes its interruption notices there (the chaos schedule);
tests and ``bench/detection_latency.py`` use them the same way. They live beside the
local provider, not in the node agent's package (:mod:`daemon.gpunode`): a real node
only ever talks to its cloud's endpoint.

Each fake follows its cloud's documented protocol and cites it in its module:
:mod:`~daemon.providers.local_metadata.aws` (EC2 IMDSv2),
:mod:`~daemon.providers.local_metadata.aliyun` (ECS metadata, security hardening mode),
:mod:`~daemon.providers.local_metadata.gcp` (Compute Engine metadata server),
:mod:`~daemon.providers.local_metadata.azure` (Azure Scheduled Events).
What they share (server lifecycle, fault injection, IMDS-style session tokens) is
:mod:`~daemon.providers.local_metadata.endpoint`.

``make_fake("gcp")`` builds the fake of a dialect by name; imports are lazy.
"""

from __future__ import annotations

import importlib
from typing import Any

from daemon.gpunode.metadata.registry import DIALECTS

__all__ = ["FAKES", "make_fake"]

#: dialect -> "module:class" of its fake (the dialects of
#: :data:`daemon.gpunode.metadata.registry.DIALECTS`).
FAKES: dict[str, str] = {
    "aws": "daemon.providers.local_metadata.aws:FakeImds",
    "aliyun": "daemon.providers.local_metadata.aliyun:FakeAliyunMetadata",
    "gcp": "daemon.providers.local_metadata.gcp:FakeGcpMetadata",
    "azure": "daemon.providers.local_metadata.azure:FakeAzureScheduledEvents",
}


def make_fake(dialect: str, **kwargs: Any) -> Any:
    """A local fake endpoint of ``dialect`` (call ``await fake.start()``; then ``fake.url``).

    Raises:
        ValueError: unknown dialect.
    """
    if dialect not in FAKES:
        raise ValueError(f"unknown metadata dialect {dialect!r}; known: {', '.join(DIALECTS)}")
    module, _, name = FAKES[dialect].partition(":")
    return getattr(importlib.import_module(module), name)(**kwargs)
