"""Node-side metadata dialects: read a cloud's instance metadata endpoint and turn an
interruption notice or rebalance recommendation into a typed :class:`Notice`.

One module per cloud (``aws`` = IMDSv2); each takes a base URL so tests and the local
provider point it at a fake (:mod:`daemon.providers.local_metadata`). See ``base`` for the contract.
"""

from daemon.gpunode.metadata.base import (
    MetadataDialect,
    MetadataError,
    MetadataUnavailable,
    Notice,
    NoticeKind,
    format_utc,
    notice_id,
    parse_utc,
)

__all__ = [
    "MetadataDialect",
    "MetadataError",
    "MetadataUnavailable",
    "Notice",
    "NoticeKind",
    "format_utc",
    "notice_id",
    "parse_utc",
]
