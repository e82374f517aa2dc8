"""A local fake of Azure Scheduled Events (the ``/metadata/scheduledevents`` part of the
Azure Instance Metadata Service), for tests and for the local provider (the chaos
schedule publishes Spot evictions on it, as it does on the AWS fake).

It follows the documents the real client follows:

- https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events:
  ``GET /metadata/scheduledevents?api-version=...`` with ``Metadata: true`` answers
  ``{"DocumentIncarnation": N, "Events": [...]}`` (``application/json``);
  ``DocumentIncarnation`` goes up whenever the events array changes. Events carry
  ``EventId`` (an upper-case GUID, as in the page's examples), ``EventType``,
  ``ResourceType`` ``"VirtualMachine"``, ``Resources``, ``EventStatus``
  (``Scheduled``/``Started``), ``NotBefore`` (RFC 1123, blank once started),
  ``Description`` (api-version >= 2019-04-01), ``EventSource`` (>= 2019-08-01) and
  ``DurationInSeconds`` (>= 2020-07-01); older api-versions are served without the
  newer fields. A ``Preempt`` (Spot eviction, >= 2017-11-01) is scheduled at least
  30 s ahead. ``POST`` to the same URL with ``{"StartRequests": [{"EventId": ...}]}``
  approves events: a valid event id always gets 200, even if already approved; a
  malformed header or payload gets 400. The fake then marks the event ``Started``
  with a blank ``NotBefore`` (what the page shows after approval) and bumps the
  incarnation.
- https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service:
  a request without ``Metadata: true`` is 400 (FAQ: "Required metadata header not
  specified"); without ``api-version`` it is 400 with the documented body
  ``{"error": "Bad request. api-version was not specified in the request. ...",
  "newest-versions": [...]}``; duplicate query parameter names are rejected; a
  request carrying ``X-Forwarded-For`` is rejected; an unsupported verb is 405.

UNCONFIRMED (the documents do not say; the fake picks a plausible answer):

- the status for ``X-Forwarded-For``: the documents only say "rejected"; the fake
  answers 400 like the other malformed requests;
- the exact JSON error body for a missing ``Metadata`` header and for an unknown
  ``api-version`` (the fake answers 400 with an ``error`` string);
- the answer to a ``StartRequests`` naming an unknown ``EventId``: the page only
  promises 200 for a *valid* id; the fake answers 400 and approves nothing;
- the body of a successful ``POST`` (the fake answers 200 with an empty body);
- the status for a duplicate query parameter (the fake answers 400);
- the ``Description`` of a ``Preempt`` event (the fake leaves it blank).

Test hooks (not part of IMDS): :meth:`FakeAzureScheduledEvents.publish_event` (any
event type, any resources), :meth:`~FakeAzureScheduledEvents.fail_next`,
:meth:`~FakeAzureScheduledEvents.hang_next`, :meth:`~FakeAzureScheduledEvents.publish_raw`
(serve an arbitrary body), and the records ``acknowledged``, ``published_at`` and
``request_log``.

Example::

    async with FakeAzureScheduledEvents(vm_name="vm-spot-0") as azure:
        azure.publish_interruption()                   # Preempt, NotBefore now + 30 s
        client = AzureScheduledEvents(azure.url, resource_name="vm-spot-0")
"""

from __future__ import annotations

import copy
import json
import time
import uuid

from datetime import datetime, timezone
from email.utils import format_datetime
from typing import Any

from aiohttp import web

from daemon.gpunode.metadata.azure import METADATA_HEADER, PREEMPT, PREEMPT_MIN_NOTICE, SCHEDULED_EVENTS_PATH
from daemon.providers.local_metadata.endpoint import FakeEndpoint

__all__ = ["FakeAzureScheduledEvents", "SUPPORTED_API_VERSIONS", "EVENT_TYPES", "format_rfc1123"]

#: Scheduled Events api-versions (release table of the scheduled-events page), oldest first.
SUPPORTED_API_VERSIONS = (
    "2017-03-01",
    "2017-08-01",
    "2017-11-01",
    "2019-01-01",
    "2019-04-01",
    "2019-08-01",
    "2020-07-01",
)
#: Event types the page lists.
EVENT_TYPES = frozenset({"Freeze", "Reboot", "Redeploy", PREEMPT, "Terminate"})
_EVENT_STATUSES = frozenset({"Scheduled", "Started"})
#: Fields added after the first release: field -> api-version that introduced it.
_FIELD_SINCE = {"Description": "2019-04-01", "EventSource": "2019-08-01", "DurationInSeconds": "2020-07-01"}
_JSON = "application/json"


def format_rfc1123(when: datetime) -> str:
    """``Mon, 11 Apr 2022 22:26:58 GMT`` (UTC, whole seconds) from an aware datetime."""
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"time must be timezone-aware (UTC), got {when!r}")
    return format_datetime(when.astimezone(timezone.utc).replace(microsecond=0), usegmt=True)


class FakeAzureScheduledEvents(FakeEndpoint):
    """An aiohttp server on ``host`` speaking Azure Scheduled Events.

    Lifecycle and test hooks: see :class:`~daemon.providers.local_metadata.endpoint.FakeEndpoint`.

    Args:
        vm_name: this VM's name, put in ``Resources`` of published interruptions.
        host, port: where to listen; port 0 = ephemeral.
        clock: monotonic seconds; stamps ``request_log`` entries. Wall times
            (``NotBefore``, ``published_at``) use the real clock.

    ``request_log`` holds ``(method, path, status, clock())`` of every answered request;
    injected faults answer a JSON ``{"error": ...}`` body.
    """

    def __init__(
        self,
        *,
        vm_name: str = "vm-spot-0",
        **endpoint: Any,
    ) -> None:
        if not isinstance(vm_name, str) or not vm_name:
            raise ValueError(f"vm_name must be a non-empty string, got {vm_name!r}")
        super().__init__(**endpoint)
        self.vm_name = vm_name
        self._events: list[dict[str, Any]] = []
        self._incarnation = 1
        self._raw: str | None = None  # publish_raw body, served instead of the document
        self.acknowledged: list[str] = []
        """EventIds approved by a successful ``StartRequests`` POST, in order (repeats kept)."""

    def _setup(self, app: web.Application) -> None:
        app.router.add_route("*", SCHEDULED_EVENTS_PATH, self._handle_events)
        app.router.add_route("*", "/{tail:.*}", self._handle_other)

    # -- what the "cloud" publishes --------------------------------------------------------

    @property
    def incarnation(self) -> int:
        """Current ``DocumentIncarnation``."""
        return self._incarnation

    @property
    def events(self) -> list[dict[str, Any]]:
        """A copy of the events currently served (newest api-version fields included)."""
        return copy.deepcopy(self._events)

    def publish_interruption(self, action: str = "terminate", time: datetime | None = None) -> None:
        """Schedule a Spot eviction of this VM: a ``Preempt`` event replacing any earlier one.

        The event: ``EventStatus`` ``Scheduled``, ``Resources`` ``[vm_name]``,
        ``EventSource`` ``Platform``, ``DurationInSeconds`` -1, ``NotBefore`` = ``time``.

        Args:
            action: accepted for uniformity with the AWS fake; Azure's ``Preempt``
                does not say whether the VM is deleted or deallocated, so it is not
                served. Must be a non-empty string.
            time: aware time after which Azure may evict; default now + 30 s (the
                documented minimum notice).

        Raises:
            ValueError: empty action or naive time.
        """
        if not isinstance(action, str) or not action:
            raise ValueError(f"action must be a non-empty string, got {action!r}")
        self._events = [
            e for e in self._events if not (e["EventType"] == PREEMPT and self.vm_name in e["Resources"])
        ]
        self.publish_event(PREEMPT, not_before=time if time is not None else _now() + PREEMPT_MIN_NOTICE)

    def publish_event(
        self,
        event_type: str,
        *,
        resources: list[str] | None = None,
        not_before: datetime | None = None,
        status: str = "Scheduled",
        source: str = "Platform",
        duration_s: int = -1,
        description: str = "",
    ) -> str:
        """Add one event (any type, any resources) and bump the incarnation.

        Args:
            event_type: ``Freeze``, ``Reboot``, ``Redeploy``, ``Preempt`` or ``Terminate``.
            resources: VM names affected; default ``[vm_name]``.
            not_before: aware time; default now + 30 s; ignored (blank) when
                ``status="Started"``.
            status: ``Scheduled`` or ``Started``.
            source: ``Platform`` or ``User``.
            duration_s: ``DurationInSeconds`` (-1 = unknown).
            description: ``Description``.

        Returns:
            The new event's ``EventId``.

        Raises:
            ValueError: unknown type or status, or a naive time.
        """
        if event_type not in EVENT_TYPES:
            raise ValueError(f"event_type must be one of {sorted(EVENT_TYPES)}, got {event_type!r}")
        if status not in _EVENT_STATUSES:
            raise ValueError(f"status must be one of {sorted(_EVENT_STATUSES)}, got {status!r}")
        when = not_before if not_before is not None else _now() + PREEMPT_MIN_NOTICE
        stamp = format_rfc1123(when)  # validates awareness even when blanked below
        event_id = str(uuid.uuid4()).upper()
        self._events.append(
            {
                "EventId": event_id,
                "EventType": event_type,
                "ResourceType": "VirtualMachine",
                "Resources": list(resources) if resources is not None else [self.vm_name],
                "EventStatus": status,
                "NotBefore": "" if status == "Started" else stamp,
                "Description": description,
                "EventSource": source,
                "DurationInSeconds": duration_s,
            }
        )
        self._raw = None
        self._incarnation += 1
        self.published_at = time.time()
        return event_id

    def publish_raw(self, body: str) -> None:
        """Test hook: serve ``body`` verbatim to every GET until :meth:`clear` or the next publish."""
        self._raw = body
        self.published_at = time.time()

    def clear(self) -> None:
        """Remove every event and any raw body; bump the incarnation if the array changed."""
        if self._events:
            self._incarnation += 1
        self._events = []
        self._raw = None
        self.published_at = None

    # -- handlers --------------------------------------------------------------------

    def _answer(self, request: web.Request, status: int, body: Any = None) -> web.Response:
        self.request_log.append((request.method, request.path, status, self._clock()))
        if body is None:
            return web.Response(status=status)
        text = body if isinstance(body, str) else json.dumps(body)
        return web.Response(status=status, text=text, content_type=_JSON)

    def _error_body(self, message: str) -> Any:
        return {"error": message}

    def _reject(self, request: web.Request) -> web.Response | None:
        """The checks every IMDS request passes: proxy header, Metadata header, query."""
        if "X-Forwarded-For" in request.headers:
            return self._answer(request, 400, {"error": "Bad request. X-Forwarded-For header is not allowed"})
        if request.headers.get(METADATA_HEADER[0], "").strip().lower() != METADATA_HEADER[1]:
            return self._answer(request, 400, {"error": "Bad request. Required metadata header not specified"})
        query = request.query
        if len(set(query.keys())) != len(query):
            return self._answer(request, 400, {"error": "Bad request. Duplicate query parameter names"})
        version = query.get("api-version")
        newest = list(reversed(SUPPORTED_API_VERSIONS[-3:]))
        if not version:
            return self._answer(
                request,
                400,
                {
                    "error": "Bad request. api-version was not specified in the request. "
                    "For more information refer to aka.ms/azureimds",
                    "newest-versions": newest,
                },
            )
        if version not in SUPPORTED_API_VERSIONS:
            return self._answer(
                request,
                400,
                {"error": f"Bad request. api-version {version} is invalid", "newest-versions": newest},
            )
        return None

    async def _handle_events(self, request: web.Request) -> web.Response:
        rejected = self._reject(request)
        if rejected is not None:
            return rejected
        if request.method == "GET":
            return self._get(request)
        if request.method == "POST":
            return await self._post(request)
        return self._answer(request, 405, {"error": "Method not allowed"})

    def _get(self, request: web.Request) -> web.Response:
        if self._raw is not None:
            return self._answer(request, 200, self._raw)
        version = request.query["api-version"]
        events = []
        for event in self._events:
            if event["EventType"] == PREEMPT and version < "2017-11-01":
                continue  # Preempt exists since 2017-11-01
            events.append({k: v for k, v in event.items() if version >= _FIELD_SINCE.get(k, "")})
        return self._answer(request, 200, {"DocumentIncarnation": self._incarnation, "Events": events})

    async def _post(self, request: web.Request) -> web.Response:
        bad = {"error": "Bad request. The request payload is malformed"}
        try:
            payload = json.loads(await request.text())
        except ValueError:
            return self._answer(request, 400, bad)
        starts = payload.get("StartRequests") if isinstance(payload, dict) else None
        if not isinstance(starts, list) or not starts:
            return self._answer(request, 400, bad)
        ids: list[str] = []
        for item in starts:
            event_id = item.get("EventId") if isinstance(item, dict) else None
            if not isinstance(event_id, str) or not event_id:
                return self._answer(request, 400, bad)
            ids.append(event_id)
        by_id = {e["EventId"].upper(): e for e in self._events}
        unknown = [i for i in ids if i.upper() not in by_id]
        if unknown:  # UNCONFIRMED: the page promises 200 only for a valid id
            return self._answer(request, 400, {"error": f"Bad request. Unknown EventId {unknown[0]}"})
        changed = False
        for event_id in ids:
            event = by_id[event_id.upper()]
            if event["EventStatus"] != "Started":
                event["EventStatus"] = "Started"
                event["NotBefore"] = ""
                changed = True
            self.acknowledged.append(event["EventId"])
        if changed:
            self._incarnation += 1
        return self._answer(request, 200)

    async def _handle_other(self, request: web.Request) -> web.Response:
        rejected = self._reject(request)
        if rejected is not None:
            return rejected
        return self._answer(request, 404, {"error": "Not found"})


def _now() -> datetime:
    return datetime.now(timezone.utc)
