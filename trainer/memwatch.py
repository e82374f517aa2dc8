"""How much host memory a stretch of work in this process took at its peak (Linux).

``/proc/self/status`` gives the resident set now (``VmRSS``) and its high-water mark
(``VmHWM``); writing ``5`` to ``/proc/self/clear_refs`` resets the mark to the resident set
now (proc(5), "clear_refs", Linux 4.0+). :class:`PeakRss` resets the mark at the start of
each stretch it tracks and keeps the highest mark seen above the resident set at the
first one: what an in-process resize (its stage, its exchange, its rebuild) cost at its
peak on top of what the process held before it. Elsewhere (no ``/proc``) it measures
nothing and says None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PeakRss", "rss_bytes"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def rss_bytes() -> tuple[int, int] | None:
    """``(resident now, high-water mark)`` of this process in bytes, or None without ``/proc``."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return (int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024)
    except (KeyError, ValueError, IndexError):
        return None


def _reset_mark() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class PeakRss:
    """The peak resident memory above a baseline over one or more tracked stretches.

    Example::

        peak = PeakRss()
        with peak.track():
            stage()
        commit()                 # not tracked: its memory is not the resize's
        with peak.track():
            rebuild()
        extra = peak.take()      # bytes above the resident set before stage(), or None
    """

    def __init__(self) -> None:
        self._base: int | None = None
        self._peak: int | None = None

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Track the body: the mark reset before it, read after it."""
        now = rss_bytes()
        ok = now is not None and _reset_mark()
        if ok and self._base is None:
            self._base = now[0]  # type: ignore[index]
        try:
            yield
        finally:
            after = rss_bytes() if ok else None
            if after is not None and self._base is not None:
                self._peak = max(self._peak or 0, after[1] - self._base)

    def take(self) -> int | None:
        """Bytes of the highest mark above the first stretch's starting resident set
        (None when nothing could be measured), and start over."""
        out, self._base, self._peak = self._peak, None, None
        return None if out is None else max(0, out)
