"""Types shared by every metadata dialect: the typed notice, the error tree, the contract.

A *metadata dialect* is the node-side client of one cloud's instance metadata
endpoint (AWS IMDSv2, Alibaba ECS, GCP, Azure Scheduled Events). The node agent
polls it about once a second; what comes back is either ``None`` (nothing pending)
or a frozen :class:`Notice` that carries its :class:`NoticeKind`. Deciding what to
do about a notice is someone else's job (a pure ``action_for(notice)``); a dialect
only parses.

Errors: everything a dialect cannot turn into an answer (transport errors, timeouts,
5xx, 403, a body that does not parse) is :class:`MetadataUnavailable`. It is never
a notice and never ``None``: the caller's poll loop logs it and tries again on its
next tick. Dialects do not retry inside ``poll``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "NoticeKind",
    "Notice",
    "MetadataError",
    "MetadataUnavailable",
    "MetadataDialect",
    "notice_id",
    "parse_utc",
    "format_utc",
]


class NoticeKind(str, Enum):
    """What a cloud announced about this node.

    Members:
        INTERRUPTION: the cloud will take the instance away at ``Notice.deadline``
            (AWS ``spot/instance-action``, ~120 s ahead; hibernate has no lead).
        REBALANCE: the instance is at elevated risk of interruption; no deadline.
            Advisory: it may arrive before, together with, or without an interruption.
    """

    INTERRUPTION = "interruption"
    REBALANCE = "rebalance"


def notice_id(provider: str, kind: NoticeKind | str, raw: str) -> str:
    """Stable de-duplication id of a notice: 16 hex digits of sha256.

    Clouds give metadata notices no id (AWS Node Termination Handler de-duplicates by
    a hash of the payload, and so do we). The hash covers ``provider``, ``kind`` and
    the raw body, separated by NUL bytes, so the same body seen on repeated polls (or
    by a restarted agent) yields the same id, and a changed body a new one.
    """
    kind_value = kind.value if isinstance(kind, NoticeKind) else str(kind)
    digest = hashlib.sha256(f"{provider}\0{kind_value}\0{raw}".encode("utf-8"))
    return digest.hexdigest()[:16]


def parse_utc(text: str) -> datetime:
    """Parse an ISO-8601 timestamp with an explicit offset (``2017-09-18T08:22:00Z``).

    Returns:
        An aware datetime in UTC.

    Raises:
        ValueError: ``text`` is not a string, does not parse, or has no offset
            (a naive time from a cloud is a malformed body, not "local time").
    """
    if not isinstance(text, str):
        raise ValueError(f"timestamp must be a string, got {type(text).__name__}")
    s = text.strip()
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"  # Python 3.10's fromisoformat does not take 'Z'.
    parsed = datetime.fromisoformat(s)
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise ValueError(f"timestamp {text!r} has no UTC offset")
    return parsed.astimezone(timezone.utc)


def format_utc(when: datetime) -> str:
    """Format an aware datetime as ISO-8601 UTC with a ``Z`` suffix, no fraction if zero."""
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"datetime {when!r} is naive; pass an aware (UTC) datetime")
    utc = when.astimezone(timezone.utc)
    spec = "seconds" if utc.microsecond == 0 else "microseconds"
    return utc.replace(tzinfo=None).isoformat(timespec=spec) + "Z"


@dataclass(frozen=True, slots=True)
class Notice:
    """One notice as read from a metadata endpoint. Immutable; compare by ``id``.

    Attributes:
        provider: dialect name, e.g. ``"aws"``.
        kind: interruption or rebalance recommendation.
        action: what the cloud will do (AWS: ``"terminate"``, ``"stop"``,
            ``"hibernate"``); ``None`` for a rebalance recommendation.
        deadline: aware UTC time at which the cloud acts; ``None`` when there is none
            (a rebalance recommendation).
        raw: the body exactly as served (text).
        id: :func:`notice_id` of ``(provider, kind, raw)``; computed by
            :meth:`build`. Equal bodies give equal ids across polls and restarts.
    """

    provider: str
    kind: NoticeKind
    action: str | None
    deadline: datetime | None
    raw: str
    id: str = field(default="")

    def __post_init__(self) -> None:
        if not isinstance(self.kind, NoticeKind):
            object.__setattr__(self, "kind", NoticeKind(self.kind))
        if self.deadline is not None and (
            self.deadline.tzinfo is None or self.deadline.utcoffset() is None
        ):
            raise ValueError(f"Notice.deadline must be timezone-aware, got {self.deadline!r}")
        if not self.id:
            object.__setattr__(self, "id", notice_id(self.provider, self.kind, self.raw))

    @classmethod
    def build(
        cls,
        *,
        provider: str,
        kind: NoticeKind,
        action: str | None,
        deadline: datetime | None,
        raw: str,
    ) -> Notice:
        """Make a notice with its id computed from ``(provider, kind, raw)``."""
        return cls(provider=provider, kind=kind, action=action, deadline=deadline, raw=raw)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the notice file, events): deadline as ISO-8601 ``...Z`` or None."""
        return {
            "id": self.id,
            "provider": self.provider,
            "kind": self.kind.value,
            "action": self.action,
            "deadline": format_utc(self.deadline) if self.deadline is not None else None,
            "raw": self.raw,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Notice:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: a field is missing or malformed.
        """
        try:
            deadline_text = data["deadline"]
            return cls(
                provider=str(data["provider"]),
                kind=NoticeKind(data["kind"]),
                action=data["action"],
                deadline=parse_utc(deadline_text) if deadline_text is not None else None,
                raw=str(data["raw"]),
                id=str(data.get("id") or ""),
            )
        except KeyError as exc:
            raise ValueError(f"notice dict is missing field {exc.args[0]!r}") from exc


class MetadataError(Exception):
    """Base of every error a metadata dialect raises."""


class MetadataUnavailable(MetadataError):
    """The endpoint gave no usable answer this time (transport error, timeout, 5xx,
    403, an unexpected status, or a body that does not parse). Never a notice: the
    poll loop logs it and polls again on its next tick."""


@runtime_checkable
class MetadataDialect(Protocol):
    """The node-side client of one cloud's metadata endpoint.

    Implementations take a base URL (so tests point them at a local fake), do no I/O
    in the constructor, and never block the event loop.
    """

    provider: str
    #: whether :meth:`poll_rebalance` can ever return something (AWS only)
    has_rebalance: bool

    async def poll(self) -> Notice | None:
        """Read the interruption item once.

        Returns:
            The pending interruption notice, or ``None`` when nothing is pending.

        Raises:
            MetadataUnavailable: no usable answer this time; poll again later.

        Cancellation: safe at any await; nothing is left half-done.
        """
        ...

    async def poll_rebalance(self) -> Notice | None:
        """Read the rebalance recommendation once (AWS ``events/recommendations/rebalance``);
        None where the cloud has none. Raises MetadataUnavailable as :meth:`poll` does."""
        ...

    async def acknowledge(self, notice: Notice) -> None:
        """Tell the platform it may act on ``notice`` now (Azure Scheduled Events'
        ``StartRequests``), called once the notice's commit is done; a no-op elsewhere.
        Raises MetadataUnavailable."""
        ...

    async def aclose(self) -> None:
        """Release what the dialect owns (idempotent)."""
        ...
