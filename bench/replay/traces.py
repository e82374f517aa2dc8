"""Public spot-market traces, read into one shape: capacity (and price) per zone over time.

A replay (issue 16) needs, for each zone of a market, how many spot instances could be
held at each moment, and what they cost. The public traces say it in five formats; this
module recognises each from its content (not its name) and returns a :class:`Trace`.

=====================  ======================================================================
format                 content (source; see ``shared/traces/README.md`` for licences)
=====================  ======================================================================
``events``             ``t_ms,add|remove,nodeN`` lines: a group capped at N nodes gains and
                       loses instances (Bamboo's ``p3-trace.csv`` / ``g4dn-trace.csv``, Bamboo,
                       NSDI'23, MIT; Oobleck's ``every-*.csv`` / ``scale_*.csv``, SOSP'23, MIT)
``alive``              ``t_ms,alive_count`` lines (Parcae's ``p3-alive.csv``, NSDI'24, MIT)
``parcae-window``      JSON lines ``[t_ms, "add"|"remove"|"no-op"|"migration", {"nodes": [...],
                       ...}]``, a one-hour window starting with every node added (Parcae's
                       ``gpt-6.7b/trace_*.txt``; ``migration`` is Parcae's own planner acting:
                       no change of the market)
``gcloud``             ``YYYY-MM-DD, HH:MM:SS, n_instances`` lines (Bamboo's ``gcloud/*.txt``)
``zones``              a folder of ``<zone>_*.csv`` files ``date,availability`` (0/1: a spot
                       instance could be had) and ``spot_prices.json`` ``{file stem: [USD/h per
                       row]}`` (SkyNomad's ``v100-9zone``, Apache-2.0; the data of Can't Be Late,
                       NSDI'24)
=====================  ======================================================================

Times become seconds from the trace's start. A capacity of ``None`` means "not limited by
the trace" (a ``zones`` row with availability 1: one instance type that could be had, in
the amount a job asks, as SkyNomad's simulator reads it); 0 means none can be had. Pure
parsing: no clock, no network.
"""

from __future__ import annotations

import bisect
import csv
import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["TraceError", "ZoneSeries", "Trace", "load_trace", "parse_events", "parse_alive",
           "parse_parcae_window", "parse_gcloud", "load_zones"]


class TraceError(ValueError):
    """A trace that cannot be read: the message names the file, the line and what is wrong."""


@dataclass(frozen=True)
class ZoneSeries:
    """One zone's market as steps: from ``times[i]`` (seconds from the trace start, ascending,
    ``times[0] == 0``) until the next time, ``capacity[i]`` spot instances can be held
    (None: not limited by the trace) at ``price[i]`` USD/hour each (None: the trace has no
    prices)."""

    zone: str
    times: tuple[float, ...]
    capacity: tuple[int | None, ...]
    price: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.times or self.times[0] != 0.0:
            raise TraceError(f"zone {self.zone}: a series starts at t=0")
        if len(self.times) != len(self.capacity) or (self.price is not None and len(self.price) != len(self.times)):
            raise TraceError(f"zone {self.zone}: times, capacity and price differ in length")
        if any(b < a for a, b in zip(self.times, self.times[1:])):
            raise TraceError(f"zone {self.zone}: times go backwards")

    def index_at(self, t: float) -> int:
        """The step in force at ``t`` seconds (the last one at or before it)."""
        return max(0, bisect.bisect_right(self.times, t) - 1)

    def capacity_at(self, t: float) -> int | None:
        return self.capacity[self.index_at(t)]

    def price_at(self, t: float) -> float | None:
        return None if self.price is None else self.price[self.index_at(t)]

    def changes(self) -> list[float]:
        """The times (s) at which capacity or price changes, t=0 included."""
        out = [0.0]
        for i in range(1, len(self.times)):
            if self.capacity[i] != self.capacity[i - 1] or (
                    self.price is not None and self.price[i] != self.price[i - 1]):
                out.append(self.times[i])
        return out


@dataclass(frozen=True)
class Trace:
    """A market: its zones' series over ``duration_s`` seconds, the ``format`` it was read
    from and its ``source`` (the path), ``max_nodes`` (a group's cap, when the trace has one)."""

    zones: dict[str, ZoneSeries]
    duration_s: float
    format: str
    source: str
    max_nodes: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def window(self, start_s: float, end_s: float) -> Trace:
        """The part of this trace from ``start_s`` to ``end_s``, re-based to start at 0."""
        if not 0 <= start_s < end_s:
            raise ValueError(f"a window needs 0 <= start < end, got {start_s}..{end_s}")
        zones = {}
        for name, z in self.zones.items():
            i0 = z.index_at(start_s)
            keep = [i0] + [i for i in range(i0 + 1, len(z.times)) if z.times[i] < end_s]
            zones[name] = ZoneSeries(name, tuple(max(0.0, z.times[i] - start_s) for i in keep),
                                     tuple(z.capacity[i] for i in keep),
                                     None if z.price is None else tuple(z.price[i] for i in keep))
        return Trace(zones, min(end_s, self.duration_s) - start_s, self.format, self.source, self.max_nodes,
                     self.notes + (f"window {start_s:g}..{end_s:g} s",))


# -- the formats ---------------------------------------------------------------------------------

def _lines(path: Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read it ({exc})") from None


def parse_events(lines: Sequence[str], *, zone: str = "trace", source: str = "") -> Trace:
    """``t_ms,add|remove,node`` lines → the group's alive count over time (one zone).

    The cap (``max_nodes``) is the most nodes ever alive at once. Raises TraceError: a
    line that is not three fields, a time that is not a number or goes backwards, an
    action other than add/remove, a node removed that was not added."""
    alive: set[str] = set()
    times: list[float] = []
    counts: list[int | None] = []
    last = 0.0
    peak = 0
    for n, line in enumerate(lines, 1):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise TraceError(f"{source}:{n}: expected t_ms,add|remove,node, got {line!r}")
        t = _ms(parts[0], source, n) / 1000.0
        if t < last:
            raise TraceError(f"{source}:{n}: time {t:g} s goes backwards (after {last:g} s)")
        last = t
        action, node = parts[1], parts[2]
        if action == "add":
            alive.add(node)
        elif action == "remove":
            if node not in alive:
                raise TraceError(f"{source}:{n}: {node} is removed but was never added")
            alive.discard(node)
        else:
            raise TraceError(f"{source}:{n}: action {action!r} is neither add nor remove")
        peak = max(peak, len(alive))
        if times and times[-1] == t:
            counts[-1] = len(alive)
        else:
            times.append(t)
            counts.append(len(alive))
    return _one_zone(zone, times, counts, "events", source, max_nodes=peak)


def parse_alive(lines: Sequence[str], *, zone: str = "trace", source: str = "") -> Trace:
    """``t_ms,alive_count`` lines → the alive count over time (one zone)."""
    times: list[float] = []
    counts: list[int | None] = []
    for n, line in enumerate(lines, 1):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            raise TraceError(f"{source}:{n}: expected t_ms,alive_count, got {line!r}")
        t = _ms(parts[0], source, n) / 1000.0
        count = _count(parts[1], source, n)
        if times and t < times[-1]:
            raise TraceError(f"{source}:{n}: time {t:g} s goes backwards")
        if times and times[-1] == t:
            counts[-1] = count
        else:
            times.append(t)
            counts.append(count)
    return _one_zone(zone, times, counts, "alive", source, max_nodes=max((c or 0) for c in counts) if counts else 0)


def parse_parcae_window(lines: Sequence[str], *, zone: str = "trace", source: str = "") -> Trace:
    """Parcae's JSON lines ``[t_ms, "add"|"remove"|"no-op", {"nodes": [...], "duration": ms}]``
    → the alive count over the window (one zone); the window ends at the last line's time
    plus its ``duration``."""
    alive: set[str] = set()
    times: list[float] = []
    counts: list[int | None] = []
    end = 0.0
    for n, line in enumerate(lines, 1):
        try:
            t_ms, action, body = json.loads(line)
            nodes = list(body.get("nodes") or [])
            duration = float(body.get("duration") or 0)
        except (ValueError, TypeError, AttributeError) as exc:
            raise TraceError(f"{source}:{n}: not a Parcae trace line ({exc})") from None
        t = float(t_ms) / 1000.0
        if action == "add":
            alive.update(nodes)
        elif action == "remove":
            alive.difference_update(nodes)
        elif action not in ("no-op", "migration"):  # "migration": Parcae's own planner moved, the market did not
            raise TraceError(f"{source}:{n}: action {action!r} is not add, remove, no-op or migration")
        if times and t < times[-1]:
            raise TraceError(f"{source}:{n}: time {t:g} s goes backwards")
        if times and times[-1] == t:
            counts[-1] = len(alive)
        else:
            times.append(t)
            counts.append(len(alive))
        end = max(end, t + duration / 1000.0)
    trace = _one_zone(zone, times, counts, "parcae-window", source,
                      max_nodes=max((c or 0) for c in counts) if counts else 0)
    return Trace(trace.zones, max(trace.duration_s, end), trace.format, source, trace.max_nodes)


_GCLOUD = re.compile(r"^(\d{4}-\d{2}-\d{2}),\s*(\d{1,2}:\d{2}:\d{2}),\s*(\d+)$")


def parse_gcloud(lines: Sequence[str], *, zone: str = "trace", source: str = "") -> Trace:
    """``YYYY-MM-DD, HH:MM:SS, n`` lines → the instance count over time (one zone). A time
    that goes backwards starts another concatenated run (Bamboo's V100 file has some): the
    runs are laid end to end, each keeping its own spacing."""
    times: list[float] = []
    counts: list[int | None] = []
    offset = 0.0
    prev: datetime | None = None
    runs = 1
    for n, line in enumerate(lines, 1):
        m = _GCLOUD.match(line)
        if m is None:
            raise TraceError(f"{source}:{n}: expected 'YYYY-MM-DD, HH:MM:SS, n', got {line!r}")
        at = datetime.fromisoformat(f"{m.group(1)}T{m.group(2).zfill(8)}").replace(tzinfo=timezone.utc)
        if prev is None:
            t = 0.0
        elif at < prev:  # a new run: continue after the last sample's spacing
            runs += 1
            offset = times[-1] + (times[-1] - times[-2] if len(times) > 1 else 60.0)
            t = offset
        else:
            t = times[-1] + (at - prev).total_seconds()
        prev = at
        times.append(t)
        counts.append(int(m.group(3)))
    trace = _one_zone(zone, times, counts, "gcloud", source, max_nodes=max((c or 0) for c in counts) if counts else 0)
    notes = (f"{runs} concatenated runs laid end to end",) if runs > 1 else ()
    return Trace(trace.zones, trace.duration_s, trace.format, source, trace.max_nodes, notes)


def load_zones(folder: Path) -> Trace:
    """A folder of ``<zone>_<anything>.csv`` (``date,availability`` rows, the same dates in
    every file) and optionally ``spot_prices.json`` (``{file stem: [USD/h per row]}``) →
    one series per zone: capacity None (available) or 0, and the row's price."""
    files = sorted(folder.glob("*.csv"))
    if not files:
        raise TraceError(f"{folder}: no <zone>_*.csv files")
    prices: dict[str, list[float]] = {}
    pfile = folder / "spot_prices.json"
    if pfile.exists():
        try:
            prices = {str(k): [float(x) for x in v] for k, v in json.loads(pfile.read_text()).items()}
        except (ValueError, TypeError, AttributeError) as exc:
            raise TraceError(f"{pfile}: not {{zone: [USD/h, ...]}} ({exc})") from None
    zones: dict[str, ZoneSeries] = {}
    start: datetime | None = None
    duration = 0.0
    for f in files:
        rows = list(csv.reader(_lines(f)))
        if not rows or [c.strip() for c in rows[0]] != ["date", "availability"]:
            raise TraceError(f"{f}: expected a 'date,availability' header")
        times, caps = [], []
        for n, row in enumerate(rows[1:], 2):
            if len(row) != 2 or row[1].strip() not in ("0", "1"):
                raise TraceError(f"{f}:{n}: expected 'date,0|1', got {','.join(row)!r}")
            try:
                at = datetime.fromisoformat(row[0].strip()).replace(tzinfo=timezone.utc)
            except ValueError:
                raise TraceError(f"{f}:{n}: {row[0]!r} is not a date") from None
            start = start or at
            times.append((at - start).total_seconds())
            caps.append(None if row[1].strip() == "1" else 0)
        if not times or times[0] != 0.0:
            raise TraceError(f"{f}: its first row is not at the trace's start ({start})")
        step = times[-1] - times[-2] if len(times) > 1 else 0.0
        duration = max(duration, times[-1] + step)
        zone = f.stem.split("_")[0]
        price = prices.get(f.stem)
        if price is not None and len(price) != len(times):
            raise TraceError(f"{pfile}: {f.stem} has {len(price)} prices for {len(times)} rows")
        zones[zone] = ZoneSeries(zone, tuple(times), tuple(caps), None if price is None else tuple(price))
    return Trace(zones, duration, "zones", str(folder))


def load_trace(path: str | Path) -> Trace:
    """The trace at ``path`` (a file, or a folder of per-zone files), its format recognised
    from its content. Raises TraceError (one line naming the file and the problem)."""
    p = Path(path)
    if p.is_dir():
        return load_zones(p)
    if not p.exists():
        raise TraceError(f"{p}: no such file or folder")
    lines = _lines(p)
    if not lines:
        raise TraceError(f"{p}: empty")
    first = lines[0]
    zone = p.stem
    if first.startswith("["):
        return parse_parcae_window(lines, zone=zone, source=str(p))
    if _GCLOUD.match(first):
        return parse_gcloud(lines, zone=zone, source=str(p))
    fields = [x.strip() for x in first.split(",")]
    if len(fields) == 3 and fields[1] in ("add", "remove"):
        return parse_events(lines, zone=zone, source=str(p))
    if len(fields) == 2 and all(re.fullmatch(r"\d+(\.\d+)?", x) for x in fields):
        return parse_alive(lines, zone=zone, source=str(p))
    raise TraceError(f"{p}: not a trace this reads (events t_ms,add|remove,node; alive t_ms,count; "
                     "Parcae JSON lines; gcloud 'date, time, n'; or a folder of <zone>_*.csv)")


# -- helpers ---------------------------------------------------------------------------------------

def _ms(text: str, source: str, n: int) -> float:
    try:
        v = float(text)
    except ValueError:
        raise TraceError(f"{source}:{n}: time {text!r} is not a number of milliseconds") from None
    if v < 0 or v != v:
        raise TraceError(f"{source}:{n}: time {text!r} is negative or not a number")
    return v


def _count(text: str, source: str, n: int) -> int:
    if not text.isdigit():
        raise TraceError(f"{source}:{n}: count {text!r} is not a whole number >= 0")
    return int(text)


def _one_zone(zone: str, times: list[float], counts: list[int | None], fmt: str, source: str, *,
              max_nodes: int) -> Trace:
    if not times:
        raise TraceError(f"{source}: no rows")
    if times[0] != 0.0:  # nothing could be held before the first event
        times, counts = [0.0, *times], [0, *counts]
    return Trace({zone: ZoneSeries(zone, tuple(times), tuple(counts))}, times[-1], fmt, source, max_nodes)


def zones_of(traces: Iterable[Trace]) -> list[str]:
    return sorted({z for t in traces for z in t.zones})
