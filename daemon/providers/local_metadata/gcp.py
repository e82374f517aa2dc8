"""A local fake of the GCP Compute Engine metadata server, for tests and for the local
provider (each simulated GCP node gets one on 127.0.0.1; the chaos schedule preempts
it with :meth:`FakeGcpMetadata.publish_interruption`).

It follows the documents the real client follows:

- https://cloud.google.com/compute/docs/metadata/querying-metadata: every request
  needs ``Metadata-Flavor: Google`` (else 403); a request carrying
  ``X-Forwarded-For`` is refused (403). Values are plain text (served as
  ``text/plain``; the real server labels them ``application/text``) with an ``ETag``
  header and a ``Metadata-Flavor: Google`` response header. ``wait_for_change=true``
  hangs until the value's ETag differs from ``last_etag`` (at once if it already
  does; without ``last_etag``, until the value changes from what it was when the
  request arrived) or until ``timeout_sec`` seconds pass, and then answers the current
  value. Unknown items are 404. The fake's ETag is 16 hex digits of a hash of the
  item and its value, like the real ones in form; ``timeout_sec`` must be a
  non-negative integer (the fake answers 400 otherwise; UNCONFIRMED what the real
  server does with a fraction).
- https://cloud.google.com/compute/docs/instances/create-use-preemptible#detecting_if_an_instance_was_preempted
  and https://cloud.google.com/compute/docs/instances/create-use-spot:
  ``instance/preempted`` is ``FALSE`` until preemption starts, then ``TRUE`` (30 s
  before the VM is stopped). It carries no action and no time.
- ``instance/maintenance-event``: ``NONE`` | ``MIGRATE_ON_HOST_MAINTENANCE`` |
  ``TERMINATE_ON_HOST_MAINTENANCE``. ``instance/id`` is numeric;
  ``instance/machine-type`` and ``instance/zone`` are served in the real long form,
  ``projects/<project-number>/machineTypes/<type>`` and
  ``projects/<project-number>/zones/<zone>``.

Test hooks (not part of the metadata server): :meth:`FakeGcpMetadata.fail_next`
(answer the next requests with an error status), :meth:`FakeGcpMetadata.hang_next`
(never answer them, to exercise client timeouts), :meth:`FakeGcpMetadata.publish_raw`
(serve an arbitrary body), :meth:`FakeGcpMetadata.wait_watchers` (until N hanging
GETs are parked), ``request_log``, ``published_at`` (``time.time()``) and
``published_clock`` (``clock()``) of the last publish.

Example::

    async with FakeGcpMetadata() as md:
        client = GcpMetadata(md.url, wait_s=30)
        md.publish_interruption()          # instance/preempted -> TRUE, wakes hanging GETs
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from datetime import datetime
from typing import Any

from aiohttp import web

from daemon.providers.local_metadata.endpoint import FakeEndpoint
from daemon.gpunode.metadata.gcp import FLAVOR_HEADER, FLAVOR_VALUE, MAINTENANCE_EVENTS, METADATA_PREFIX

__all__ = ["FakeGcpMetadata", "PROJECT_NUMBER"]

#: Project number used in the long forms of ``instance/zone`` and ``instance/machine-type``.
PROJECT_NUMBER = "123456789012"

_TEXT = "text/plain"
_PREEMPTED = "instance/preempted"
_MAINTENANCE = "instance/maintenance-event"


def _etag(item: str, value: str) -> str:
    return hashlib.sha256(f"{item}\0{value}".encode("utf-8")).hexdigest()[:16]


class FakeGcpMetadata(FakeEndpoint):
    """An aiohttp server on ``host`` speaking the Compute Engine metadata protocol.

    Lifecycle: the constructor does no I/O; ``await start()`` binds (``port=0`` picks
    a free port) and sets :attr:`url`; ``await aclose()`` answers every parked
    request (hanging GETs and :meth:`hang_next` holds get 503), stops the server, and
    is idempotent and safe after a failed start. Also an async context manager.

    Args:
        instance_id, machine_type, zone: values behind ``instance/id``,
            ``instance/machine-type`` and ``instance/zone`` (short names; served in
            the long ``projects/...`` form).
        host, port: where to listen; port 0 = ephemeral.
        clock: monotonic seconds, stamped into :attr:`published_clock` so tests can
            measure how long a client took to see a publish.

    ``request_log`` holds ``(method, path_qs, status)`` of every answered request.
    """

    def __init__(
        self,
        *,
        instance_id: str = "1234567890",
        machine_type: str = "a2-highgpu-1g",
        zone: str = "us-central1-a",
        **endpoint: Any,
    ) -> None:
        super().__init__(**endpoint)
        self._items: dict[str, str] = {
            "instance/id": instance_id,
            "instance/machine-type": f"projects/{PROJECT_NUMBER}/machineTypes/{machine_type}",
            "instance/zone": f"projects/{PROJECT_NUMBER}/zones/{zone}",
            _PREEMPTED: "FALSE",
            _MAINTENANCE: "NONE",
        }
        self._defaults = dict(self._items)
        self._closing = False
        self._changed = asyncio.Event()  # replaced after every change; set = "look again"
        self._watchers = 0
        self._watchers_changed = asyncio.Event()
        self.published_clock: float | None = None
        """``clock()`` of the last :meth:`publish_interruption`."""
        self.published_action: str | None = None
        """The ``action`` given to the last publish (GCP does not serve it)."""

    # -- lifecycle -------------------------------------------------------------------

    @property
    def watchers(self) -> int:
        """Hanging GETs (``wait_for_change=true``) parked right now."""
        return self._watchers

    def _setup(self, app: web.Application) -> None:
        app.router.add_route("GET", METADATA_PREFIX + "{item:.*}", self._handle_get)
        app.router.add_route("*", "/{tail:.*}", self._handle_other)
        self._closing = False
        self._changed = asyncio.Event()
        self._watchers_changed = asyncio.Event()

    async def aclose(self) -> None:
        """Answer parked requests (503), then stop serving. Idempotent."""
        self._closing = True
        self._changed.set()
        await super().aclose()

    # -- what the "cloud" publishes --------------------------------------------------------

    def publish_interruption(self, action: str = "terminate", time: datetime | None = None) -> None:
        """Preempt: ``instance/preempted`` becomes ``TRUE`` and hanging GETs wake.

        Same signature as the other fakes'. GCP serves neither an action nor a time, so
        both are only checked and recorded (:attr:`published_action`).

        Args:
            action: a non-empty string (e.g. ``"terminate"``); recorded only.
            time: aware time at which the cloud acts, or None; checked only (the
                documented notice is 30 s).

        Raises:
            ValueError: empty action or naive time.
        """
        if not isinstance(action, str) or not action:
            raise ValueError(f"action must be a non-empty string, got {action!r}")
        if time is not None and (time.tzinfo is None or time.utcoffset() is None):
            raise ValueError(f"time must be timezone-aware (UTC), got {time!r}")
        self.published_action = action
        self.published_at = _wall()
        self.published_clock = self._clock()
        self._set(_PREEMPTED, "TRUE")

    def publish_maintenance(self, event: str) -> None:
        """Set ``instance/maintenance-event`` (one of the documented values).

        Raises:
            ValueError: not NONE / MIGRATE_ON_HOST_MAINTENANCE / TERMINATE_ON_HOST_MAINTENANCE.
        """
        if event not in MAINTENANCE_EVENTS:
            raise ValueError(f"event must be one of {sorted(MAINTENANCE_EVENTS)}, got {event!r}")
        self._set(_MAINTENANCE, event)

    def publish_raw(self, item: str, body: str) -> None:
        """Test hook: serve ``body`` verbatim at ``/computeMetadata/v1/<item>``
        (e.g. ``"instance/preempted"``); wakes hanging GETs on it."""
        self._set(item.strip("/"), body)

    def clear(self) -> None:
        """Back to the start: ``preempted`` FALSE, ``maintenance-event`` NONE, raw items
        gone, :attr:`published_at` None. Wakes hanging GETs whose value changed."""
        self._items = dict(self._defaults)
        self.published_at = None
        self.published_clock = None
        self.published_action = None
        self._wake()

    def _set(self, item: str, value: str) -> None:
        self._items[item] = value
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- test hooks --------------------------------------------------------------------

    async def wait_watchers(self, n: int = 1) -> None:
        """Return once at least ``n`` hanging GETs are parked waiting for a change."""
        while self._watchers < n:
            event = self._watchers_changed
            await event.wait()

    def _watchers_moved(self, delta: int) -> None:
        self._watchers += delta
        moved, self._watchers_changed = self._watchers_changed, asyncio.Event()
        moved.set()

    # -- handlers --------------------------------------------------------------------

    def _answer(self, request: web.Request, status: int, body: str, etag: str | None = None) -> web.Response:
        self.request_log.append((request.method, request.path_qs, status))
        resp = web.Response(status=status, text=body, content_type=_TEXT)
        resp.headers[FLAVOR_HEADER] = FLAVOR_VALUE
        if etag is not None:
            resp.headers["ETag"] = etag
        return resp

    async def _intercept(self, request: web.Request) -> web.Response | None:
        refused = await super()._intercept(request)
        if refused is not None:
            return refused
        if "X-Forwarded-For" in request.headers:
            return self._answer(request, 403, "Forbidden: X-Forwarded-For is not allowed")
        if request.headers.get(FLAVOR_HEADER) != FLAVOR_VALUE:
            return self._answer(request, 403, "Forbidden: missing Metadata-Flavor: Google header")
        return None

    async def _handle_get(self, request: web.Request) -> web.Response:
        item = request.match_info["item"].strip("/")
        if item not in self._items:
            return self._answer(request, 404, "Not Found")
        query = request.query
        if query.get("wait_for_change", "false").lower() != "true":
            value = self._items[item]
            return self._answer(request, 200, value, _etag(item, value))
        raw_timeout = query.get("timeout_sec")
        timeout_s: float | None = None
        if raw_timeout is not None:
            if not raw_timeout.isdecimal():
                return self._answer(
                    request, 400, "Bad Request: timeout_sec must be a whole number of seconds"
                )
            timeout_s = float(int(raw_timeout))
        reference = query.get("last_etag") or _etag(item, self._items[item])
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        self._watchers_moved(+1)
        try:
            while not self._closing and item in self._items:
                if _etag(item, self._items[item]) != reference:
                    break
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    break
        finally:
            self._watchers_moved(-1)
        if self._closing:
            return self._answer(request, 503, "shutting down")
        if item not in self._items:
            return self._answer(request, 404, "Not Found")
        value = self._items[item]
        return self._answer(request, 200, value, _etag(item, value))

    async def _handle_other(self, request: web.Request) -> web.Response:
        if request.method != "GET":
            return self._answer(request, 405, "Method Not Allowed")
        return self._answer(request, 404, "Not Found")


def _wall() -> float:
    return time.time()
