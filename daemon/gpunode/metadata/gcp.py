"""GCP Compute Engine metadata dialect: preemption of preemptible and Spot VMs, read by
the node agent.

Protocol, from the Compute Engine documentation:

- https://cloud.google.com/compute/docs/metadata/querying-metadata ("View and query VM
  metadata"): every request to ``http://metadata.google.internal/computeMetadata/v1/``
  must carry ``Metadata-Flavor: Google`` (a request without it is refused with 403,
  and so is one carrying ``X-Forwarded-For``). Values are plain text. Each answer has
  an ``ETag`` header. ``?wait_for_change=true`` makes the GET *hang* until the value
  changes; ``last_etag=<etag>`` makes it return at once if the current ETag already
  differs (so no change between two requests is missed), and ``timeout_sec=<n>``
  makes it return the current value after ``n`` seconds if nothing changed. The
  server may answer 503 while it is itself under maintenance; clients retry later.
- https://cloud.google.com/compute/docs/instances/create-use-preemptible#detecting_if_an_instance_was_preempted
  and https://cloud.google.com/compute/docs/instances/create-use-spot (detect
  preemption): ``instance/preempted`` is ``FALSE`` until Compute Engine starts to
  preempt the VM, then ``TRUE``. Preemption gives the guest a 30 s notice (ACPI G2
  soft off follows; then the VM is stopped or deleted). Spot VMs may be given a
  longer, configured notice (up to 120 s); this dialect always assumes the documented
  30 s, which is never later than the real deadline.
- https://cloud.google.com/compute/docs/instances/host-maintenance-overview (and the
  default metadata keys): ``instance/maintenance-event`` is ``NONE``,
  ``MIGRATE_ON_HOST_MAINTENANCE`` or ``TERMINATE_ON_HOST_MAINTENANCE``.

There is no token and no session: each poll is one GET. With ``wait_s > 0`` the
dialect uses hanging GETs, so a preemption is seen the moment the server flips the
value instead of on the next poll tick (see :class:`GcpMetadata`).

Example::

    async with GcpMetadata(wait_s=30) as md:   # http://metadata.google.internal
        notice = await md.poll()                # None, or Notice(kind=INTERRUPTION, ...)
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import aiohttp

from daemon.gpunode.metadata.base import MetadataUnavailable, Notice, NoticeKind
from daemon.gpunode.metadata.http import HttpDialect

__all__ = [
    "GcpMetadata",
    "DEFAULT_BASE_URL",
    "METADATA_PREFIX",
    "PREEMPTED_PATH",
    "MAINTENANCE_EVENT_PATH",
    "FLAVOR_HEADER",
    "FLAVOR_VALUE",
    "PREEMPTION_NOTICE",
    "MAINTENANCE_EVENTS",
]

DEFAULT_BASE_URL = "http://metadata.google.internal"
METADATA_PREFIX = "/computeMetadata/v1/"
PREEMPTED_PATH = METADATA_PREFIX + "instance/preempted"
MAINTENANCE_EVENT_PATH = METADATA_PREFIX + "instance/maintenance-event"
FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR_VALUE = "Google"

#: Documented preemption notice of preemptible and Spot VMs (Spot VMs may configure
#: more; assuming 30 s is never late).
PREEMPTION_NOTICE = timedelta(seconds=30)

#: Values of ``instance/maintenance-event`` the documents list.
MAINTENANCE_EVENTS = frozenset(
    {"NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE"}
)

_TOKEN = re.compile(r"[A-Z][A-Z0-9_]*")


class GcpMetadata(HttpDialect):
    """Compute Engine metadata client implementing the dialect (``provider = "gcp"``).

    Polling modes:

    - ``wait_s == 0`` (default): every :meth:`poll` is a plain GET of
      ``instance/preempted`` and returns at once, like the AWS dialect.
    - ``wait_s > 0``: the first poll is a plain GET that learns the current value and
      its ETag; later polls are hanging GETs
      (``?wait_for_change=true&last_etag=<etag>&timeout_sec=<wait_s>``) that return as
      soon as the value changes, or with the unchanged value after ``wait_s``
      (then ``poll`` returns ``None``). ``timeout_sec`` is sent as whole seconds
      (``wait_s`` is rounded up), and each hanging request is bounded by
      ``timeout_sec + timeout_s``. Once ``TRUE`` was seen, polls are plain GETs again:
      the notice is already pending and the caller's loop should get it back at its
      own pace, not after a ``wait_s`` hang. An answer without an ``ETag`` header
      also falls back to a plain GET next time.

    A notice's ``deadline`` is the wall-clock time at which ``TRUE`` was first seen
    plus the documented 30 s; ``raw`` is ``"TRUE"``, so its ``id`` is the same on
    every poll of the same preemption (a VM is preempted once; ``FALSE`` again resets
    the first-seen time).

    The constructor does no I/O. An HTTP session is created on first use unless one
    is passed in; :meth:`aclose` closes only a session this object created.

    Args:
        base_url: endpoint root, default ``http://metadata.google.internal``; tests
            pass a :class:`daemon.providers.local_metadata.gcp.FakeGcpMetadata` URL.
        timeout_s: bound on each plain request, seconds, > 0 (and the slack added to
            ``timeout_sec`` for hanging requests).
        wait_s: hanging-GET wait, seconds, >= 0; 0 disables hanging GETs.
        session: an existing ``aiohttp.ClientSession`` to use (not closed by us).
        clock: monotonic clock in seconds; stamps :attr:`preempted_seen_at`.

    Raises:
        ValueError: empty ``base_url``, ``timeout_s`` <= 0 or ``wait_s`` < 0.
    """

    __slots__ = (
        "_timeout_s",
        "_wait_s",
        "_timeout_sec",
        "_etag",
        "_last_value",
        "_seen_wall",
        "_seen_at",
    )

    provider = "gcp"

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        timeout_s: float = 2.0,
        wait_s: float = 0.0,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(base_url, example_url=DEFAULT_BASE_URL, timeout_s=timeout_s, session=session, clock=clock)
        if not wait_s >= 0 or math.isinf(wait_s):
            raise ValueError(f"wait_s must be a finite number of seconds >= 0, got {wait_s!r}")
        self._timeout_s = float(timeout_s)
        self._wait_s = float(wait_s)
        self._timeout_sec = math.ceil(wait_s)  # what the server is told, whole seconds
        self._etag: str | None = None
        self._last_value: str | None = None
        self._seen_wall: datetime | None = None
        self._seen_at: float | None = None

    @property
    def wait_s(self) -> float:
        return self._wait_s

    @property
    def preempted_seen_at(self) -> float | None:
        """``clock()`` when ``TRUE`` was first seen (None while not preempted)."""
        return self._seen_at

    # -- the dialect ---------------------------------------------------------------

    async def poll(self) -> Notice | None:
        """Read ``instance/preempted`` once (a hanging read when ``wait_s > 0``).

        Blocks up to ``timeout_s`` (plain GET) or ``ceil(wait_s) + timeout_s``
        (hanging GET). Cancellation is safe: the ETag is only updated by a complete
        answer.

        Returns:
            ``None`` while the value is ``FALSE`` (including a hanging GET that
            expired without a change); an interruption :class:`Notice` (action
            ``"terminate"``, deadline first-seen + 30 s, raw ``"TRUE"``) while it is
            ``TRUE``.

        Raises:
            MetadataUnavailable: transport error, timeout, a status other than 200,
                or a body other than ``TRUE``/``FALSE``. No retry inside.
            RuntimeError: called after :meth:`aclose`.
        """
        hanging = self._wait_s > 0 and self._etag is not None and self._last_value != "TRUE"
        if hanging:
            params = {
                "wait_for_change": "true",
                "last_etag": self._etag or "",
                "timeout_sec": str(self._timeout_sec),
            }
            timeout = self._timeout_sec + self._timeout_s
        else:
            params = {}
            timeout = self._timeout_s
        body, etag = await self._get(PREEMPTED_PATH, params=params, timeout_s=timeout)
        value = body.strip()
        if value not in ("TRUE", "FALSE"):
            raise MetadataUnavailable(f"instance/preempted: expected TRUE or FALSE, got {body[:200]!r}")
        self._etag = etag
        self._last_value = value
        if value == "FALSE":
            self._seen_wall = None
            self._seen_at = None
            return None
        if self._seen_wall is None:
            self._seen_wall = datetime.now(timezone.utc)
            self._seen_at = self._clock()
        return Notice.build(
            provider=self.provider,
            kind=NoticeKind.INTERRUPTION,
            action="terminate",
            deadline=self._seen_wall + PREEMPTION_NOTICE,
            raw="TRUE",
        )

    async def poll_maintenance(self) -> str:
        """Read ``instance/maintenance-event`` once (plain GET).

        Returns:
            ``"NONE"``, ``"MIGRATE_ON_HOST_MAINTENANCE"`` or
            ``"TERMINATE_ON_HOST_MAINTENANCE"``; another upper-case token is returned
            as is (a value added after these documents), never turned into a notice.

        Raises:
            MetadataUnavailable: as :meth:`poll`, or a body that is not an
                upper-case token.
            RuntimeError: called after :meth:`aclose`.
        """
        body, _ = await self._get(MAINTENANCE_EVENT_PATH, params={}, timeout_s=self._timeout_s)
        value = body.strip()
        if not _TOKEN.fullmatch(value):
            raise MetadataUnavailable(f"instance/maintenance-event: unexpected body {body[:200]!r}")
        return value

    async def get_metadata(self, item: str) -> str | None:
        """Read one item under ``/computeMetadata/v1/`` (e.g. ``"instance/id"``,
        ``"instance/zone"`` -> ``projects/<number>/zones/<zone>``).

        Returns:
            The text value, or ``None`` if the item does not exist (404).

        Raises:
            MetadataUnavailable: as :meth:`poll`.
            RuntimeError: called after :meth:`aclose`.
        """
        try:
            body, _ = await self._get(
                METADATA_PREFIX + item.lstrip("/"), params={}, timeout_s=self._timeout_s, allow_404=True
            )
        except _NotFound:
            return None
        return body

    # -- HTTP ----------------------------------------------------------------------

    async def _get(
        self, path: str, *, params: dict[str, str], timeout_s: float, allow_404: bool = False
    ) -> tuple[str, str | None]:
        """One GET with ``Metadata-Flavor: Google``: ``(body, ETag or None)`` on 200.

        Transport failures and any other status become :class:`MetadataUnavailable`
        (404 becomes ``_NotFound`` when ``allow_404``).
        """
        status, body, headers = await self._request(
            "GET", path, headers={FLAVOR_HEADER: FLAVOR_VALUE}, params=params, timeout_s=timeout_s
        )
        if status == 200:
            return body, headers.get("ETag") or None
        if status == 404 and allow_404:
            raise _NotFound(path)
        raise MetadataUnavailable(f"GET {path}: HTTP {status}: {body[:200]!r}")


class _NotFound(Exception):
    """Internal: the item does not exist (404)."""
