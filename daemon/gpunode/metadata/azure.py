"""Azure Scheduled Events dialect: Spot VM eviction (``Preempt``) notices, read by the
node agent, and the early approval (``StartRequests``) it sends once the checkpoint
is committed.

Protocol, from the Azure documentation:

- https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events:
  ``GET http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01``
  with the header ``Metadata: true`` (required for every Scheduled Events request;
  without it the service answers "Bad Request"). The answer is
  ``{"DocumentIncarnation": <int>, "Events": [...]}``; ``DocumentIncarnation``
  increases whenever the events array changes, and an empty array means nothing is
  scheduled. Each event carries ``EventId`` (a GUID), ``EventType``
  (``Freeze``/``Reboot``/``Redeploy``/``Preempt``/``Terminate``), ``ResourceType``
  (``VirtualMachine``), ``Resources`` (the VM names affected: events for a whole
  availability set or scale-set placement group reach every VM in it, so check this
  field), ``EventStatus`` (``Scheduled``/``Started``; an event that finished is
  simply removed), ``NotBefore`` (RFC 1123, e.g. ``Mon, 11 Apr 2022 22:26:58 GMT``;
  blank once the event has started), ``Description``, ``EventSource``
  (``Platform``/``User``, since 2019-08-01) and ``DurationInSeconds`` (-1 if
  unknown, since 2020-07-01). ``Preempt`` means the Spot VM is being deleted; it is
  best effort and gives at least 30 s notice. The page recommends polling once a
  second.
- Same page, "Start an event": ``POST`` to the same URL with
  ``{"StartRequests": [{"EventId": "<id>"}]}`` approves the event so Azure may act
  before ``NotBefore``. A valid event id always gets 200 (even if another VM
  approved it already); 400 means a malformed header or payload. Approval lets the
  event proceed for every VM in its ``Resources``.
- https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service:
  requests must carry ``Metadata: true`` and must not carry ``X-Forwarded-For``;
  clients must bypass proxies (aiohttp does unless ``trust_env=True``). Errors:
  400 (missing header or parameter), 404, 405, 410 (retry within 70 s), 429 (more
  than 5 requests/s), 500.

What the dialect does with it: the first ``Preempt`` event that names this VM (or any
``Preempt`` event when no ``resource_name`` is given) becomes an interruption
:class:`~daemon.gpunode.metadata.base.Notice` with ``action="preempt"``, its ``NotBefore`` as
the deadline, the event's JSON as ``raw`` and an id derived from its ``EventId`` (so
``Scheduled`` -> ``Started`` is the same notice). Other event types are logged at
debug level and otherwise ignored for now. :meth:`AzureScheduledEvents.acknowledge`
sends the ``StartRequests`` approval; the agent calls it only after the checkpoint is
committed, because approval lets the platform take the VM at once.

Example::

    async with AzureScheduledEvents(resource_name="vm-spot-0") as events:
        notice = await events.poll()        # None, or Notice(kind=INTERRUPTION, ...)
        ...                                 # commit the checkpoint
        await events.acknowledge(notice)    # let Azure evict now
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import structlog

from daemon.gpunode.metadata.base import MetadataUnavailable, Notice, NoticeKind, notice_id
from daemon.gpunode.metadata.http import HttpDialect, Reply, json_object

__all__ = [
    "AzureScheduledEvents",
    "DEFAULT_BASE_URL",
    "DEFAULT_API_VERSION",
    "SCHEDULED_EVENTS_PATH",
    "METADATA_HEADER",
    "PREEMPT",
    "PREEMPT_MIN_NOTICE",
    "parse_rfc1123",
]

log = structlog.get_logger("spotvisor.metadata.azure")

DEFAULT_BASE_URL = "http://169.254.169.254"
SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents"
DEFAULT_API_VERSION = "2020-07-01"
#: Header every IMDS request must carry (name, value).
METADATA_HEADER = ("Metadata", "true")
#: ``EventType`` of a Spot VM eviction.
PREEMPT = "Preempt"
#: Minimum notice of a ``Preempt`` event; also the assumed lead when ``NotBefore`` is blank.
PREEMPT_MIN_NOTICE = timedelta(seconds=30)


def parse_rfc1123(text: str) -> datetime:
    """Parse a ``NotBefore`` such as ``Mon, 11 Apr 2022 22:26:58 GMT``.

    Returns:
        An aware datetime in UTC.

    Raises:
        ValueError: not a string, does not parse, or carries no zone (``-0000``
            means "zone unknown" in RFC 2822 and is refused like a naive time).
    """
    if not isinstance(text, str):
        raise ValueError(f"NotBefore must be a string, got {type(text).__name__}")
    try:
        parsed = parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"NotBefore {text!r} is not an RFC 1123 date") from exc
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise ValueError(f"NotBefore {text!r} has no zone")
    return parsed.astimezone(timezone.utc)


class AzureScheduledEvents(HttpDialect):
    """Scheduled Events client implementing the metadata dialect (``provider = "azure"``).

    The constructor does no I/O. An HTTP session is created on first use unless one
    is passed in; :meth:`aclose` closes only a session this object created. Every
    request is bounded by ``timeout_s``; nothing blocks the event loop; nothing is
    retried inside a call.

    Args:
        base_url: endpoint root, default ``http://169.254.169.254``; tests pass a
            :class:`daemon.providers.local_metadata.azure.FakeAzureScheduledEvents` URL.
        resource_name: this VM's name as it appears in ``Resources`` (compared
            case-insensitively: Azure resource names are); None = every ``Preempt``
            event in the document counts (a standalone VM only sees its own).
        api_version: the ``api-version`` query value; ``2020-07-01`` is the newest
            Scheduled Events version.
        timeout_s: bound on each HTTP request, seconds, > 0.
        session: an existing ``aiohttp.ClientSession`` to use (not closed by us).
        clock: monotonic clock in seconds; stamps when each event was first seen
            (``first_seen_s``), injectable for tests.

    Raises:
        ValueError: empty ``base_url`` or ``api_version``, empty ``resource_name``,
            or ``timeout_s`` <= 0.
    """

    __slots__ = (
        "_resource_name",
        "_api_version",
        "_deadlines",
        "_first_seen",
        "_logged",
        "last_incarnation",
    )

    provider = "azure"

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        resource_name: str | None = None,
        api_version: str = DEFAULT_API_VERSION,
        timeout_s: float = 2.0,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            base_url,
            example_url=DEFAULT_BASE_URL,
            timeout_s=timeout_s,
            session=session,
            clock=clock,
            validate=lambda: _check_args(api_version, resource_name),
        )
        self._resource_name = resource_name
        self._api_version = api_version
        # Per EventId still in the document: the deadline last derived for it (kept
        # when NotBefore goes blank on Started) and when it was first seen (clock s).
        self._deadlines: dict[str, datetime] = {}
        self._first_seen: dict[str, float] = {}
        self._logged: set[tuple[str, str, str]] = set()  # ignored events already logged
        self.last_incarnation: int | None = None
        """``DocumentIncarnation`` of the last document parsed (None before the first)."""

    @property
    def url(self) -> str:
        """The Scheduled Events URL polled, query included."""
        return f"{self._base_url}{SCHEDULED_EVENTS_PATH}?api-version={self._api_version}"

    def first_seen_s(self, event_id: str) -> float | None:
        """``clock`` reading when ``event_id`` was first seen; None once it left the document."""
        return self._first_seen.get(event_id)

    # -- the dialect ---------------------------------------------------------------

    async def poll(self) -> Notice | None:
        """Read the Scheduled Events document once.

        Returns:
            ``None`` when no ``Preempt`` event concerns this VM; else an interruption
            :class:`Notice` with ``action="preempt"`` and ``deadline`` = the event's
            ``NotBefore`` (blank ``NotBefore``, i.e. already started: the deadline
            seen before for that event, or first-seen wall time + 30 s). With several
            ``Preempt`` events the earliest deadline wins. ``raw`` is the event's
            JSON; ``id`` is ``notice_id("azure", "interruption", EventId)``, equal
            across polls and across ``Scheduled`` -> ``Started``.

        Raises:
            MetadataUnavailable: transport error, timeout, any status but 200 (400
                included), a body that is not the documented JSON, or a ``Preempt``
                event without a usable ``EventId``/``NotBefore``/``Resources``.
            RuntimeError: called after :meth:`aclose`.

        Cancellation: safe at any await; nothing is left half-done.
        """
        status, body, _ = await self._send("GET")
        if status != 200:
            raise MetadataUnavailable(f"GET {SCHEDULED_EVENTS_PATH}: HTTP {status}: {body[:200]!r}")
        return self._parse_document(body)

    async def acknowledge(self, notice: Notice) -> None:
        """Approve the notice's event (``StartRequests``) so Azure may act before ``NotBefore``.

        Call only once the checkpoint is committed: after approval the platform may
        evict the VM at once, and the approval applies to every VM in the event's
        ``Resources``.

        Raises:
            ValueError: ``notice`` is not an Azure notice whose ``raw`` holds an ``EventId``.
            MetadataUnavailable: transport error, timeout, or any status but 200.
            RuntimeError: called after :meth:`aclose`.
        """
        event_id = _event_id_of(notice)
        payload = json.dumps({"StartRequests": [{"EventId": event_id}]})
        status, body, _ = await self._send("POST", data=payload)
        if status != 200:
            raise MetadataUnavailable(
                f"POST {SCHEDULED_EVENTS_PATH} (EventId {event_id}): HTTP {status}: {body[:200]!r}"
            )
        log.info("azure_event_approved", event_id=event_id)

    # -- HTTP ----------------------------------------------------------------------

    async def _send(self, method: str, *, data: str | None = None) -> Reply:
        """One exchange with the Scheduled Events URL (``Metadata: true``, ``api-version``)."""
        headers = {METADATA_HEADER[0]: METADATA_HEADER[1]}
        if data is not None:
            headers["Content-Type"] = "application/json"
        return await self._request(
            method,
            SCHEDULED_EVENTS_PATH,
            headers=headers,
            params={"api-version": self._api_version},
            data=data,
        )

    # -- parsing -------------------------------------------------------------------

    def _parse_document(self, body: str) -> Notice | None:
        what = "scheduledevents"
        doc = json_object(body, what)
        events = doc.get("Events")
        if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
            raise MetadataUnavailable(f"{what}: 'Events' is not a list of objects: {body[:200]!r}")
        for event in events:
            if not isinstance(event.get("EventId"), str) or not event["EventId"]:
                raise MetadataUnavailable(f"{what}: event without an 'EventId' string: {event!r:.200}")
            if not isinstance(event.get("EventType"), str):
                raise MetadataUnavailable(f"{what}: event without an 'EventType' string: {event!r:.200}")
        incarnation = doc.get("DocumentIncarnation")
        self.last_incarnation = incarnation if isinstance(incarnation, int) else None

        # Forget events that left the document (bounded memory; an id that comes back
        # is a new sighting).
        present = {e["EventId"] for e in events}
        now_s = self._clock()
        for gone in set(self._first_seen) - present:
            del self._first_seen[gone]
            self._deadlines.pop(gone, None)
        self._logged = {key for key in self._logged if key[0] in present}
        for event_id in present:
            self._first_seen.setdefault(event_id, now_s)

        best: Notice | None = None
        for event in events:
            notice = self._event_notice(event)
            if notice is not None and (
                best is None or notice.deadline < best.deadline  # type: ignore[operator]
            ):
                best = notice
        return best

    def _event_notice(self, event: dict[str, Any]) -> Notice | None:
        """One event -> a notice if it is a Preempt for this VM, else None (logged once)."""
        event_id: str = event["EventId"]
        event_type: str = event["EventType"]
        status = str(event.get("EventStatus", ""))
        if event_type != PREEMPT:
            self._log_ignored(event, "not_preempt")
            return None
        resources = event.get("Resources")
        if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
            raise MetadataUnavailable(f"Preempt {event_id}: 'Resources' is not a list of names")
        if self._resource_name is not None:
            mine = self._resource_name.casefold()
            if all(r.casefold() != mine for r in resources):
                self._log_ignored(event, "other_resource")
                return None
        not_before = event.get("NotBefore", "")
        if not isinstance(not_before, str):
            raise MetadataUnavailable(f"Preempt {event_id}: 'NotBefore' is not a string")
        if not_before.strip():
            try:
                deadline = parse_rfc1123(not_before)
            except ValueError as exc:
                raise MetadataUnavailable(f"Preempt {event_id}: bad 'NotBefore' {not_before!r}") from exc
        else:
            # Blank NotBefore: the event has started. Keep the deadline seen earlier,
            # or assume the documented minimum notice from now.
            deadline = self._deadlines.get(event_id) or (
                datetime.now(timezone.utc).replace(microsecond=0) + PREEMPT_MIN_NOTICE
            )
        self._deadlines[event_id] = deadline
        if (event_id, status, "preempt") not in self._logged:
            self._logged.add((event_id, status, "preempt"))
            log.info("azure_preempt_seen", event_id=event_id, event_status=status, not_before=not_before)
        return Notice(
            provider=self.provider,
            kind=NoticeKind.INTERRUPTION,
            action="preempt",
            deadline=deadline,
            raw=json.dumps(event),
            id=notice_id(self.provider, NoticeKind.INTERRUPTION, event_id),
        )

    def _log_ignored(self, event: dict[str, Any], reason: str) -> None:
        key = (event["EventId"], str(event.get("EventStatus", "")), reason)
        if key in self._logged:
            return
        self._logged.add(key)
        log.debug(
            "azure_event_ignored",
            reason=reason,
            event_id=event["EventId"],
            event_type=event["EventType"],
            event_status=event.get("EventStatus"),
            resources=event.get("Resources"),
            not_before=event.get("NotBefore"),
        )


def _check_args(api_version: str, resource_name: str | None) -> None:
    if not isinstance(api_version, str) or not api_version:
        raise ValueError(f"api_version must be a non-empty string, got {api_version!r}")
    if resource_name is not None and (not isinstance(resource_name, str) or not resource_name):
        raise ValueError(f"resource_name must be None or a non-empty string, got {resource_name!r}")


def _event_id_of(notice: Notice) -> str:
    if notice.provider != AzureScheduledEvents.provider:
        raise ValueError(f"not an Azure notice (provider {notice.provider!r})")
    try:
        event = json.loads(notice.raw)
    except ValueError as exc:
        raise ValueError(f"notice raw is not JSON: {notice.raw[:200]!r}") from exc
    event_id = event.get("EventId") if isinstance(event, dict) else None
    if not isinstance(event_id, str) or not event_id:
        raise ValueError(f"notice raw has no 'EventId': {notice.raw[:200]!r}")
    return event_id
