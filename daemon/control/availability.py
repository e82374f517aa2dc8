"""What the daemon has seen of each placement domain's spot capacity, and what it predicts.

A domain is **up** from an observation that it has spot capacity (a spot node launched
there, or one is training there) until one that it has none (a spot launch there
failed for capacity, or a spot node there was preempted: its interruption notice, or
its loss), and **down** from then until the next up; **unwatched** once the job has
left it (a move elsewhere) or given a move to it up: the daemon tries nothing there,
so that time counts neither way, and the domain's current state is unknown. The edge observes
(``daemon.controlnode.capacity_record`` from the events it records, ``bench.replay.sim`` from
its simulated cloud); :class:`Availability` keeps the changes, per domain, for the last
:data:`MEMORY_S` seconds; the estimates below read them. A domain the pool has not tried
has no record: nothing is assumed about it.

The estimates are those the home-zone policy needs (``bench/replay/homezone.py`` in
the tick model; :class:`daemon.control.policies.HomeZone` here):

- :func:`progress_rate`: training seconds per wall second a job gets in the domain if
  it starts at the beginning of each up-run and pays one restart (``overhead_s``) in
  each, over the record;
- :func:`rest_of_run`: how much longer the domain's current run (up or down) is
  expected to last: the mean of its past runs of that state longer than the current
  one's age, less that age; the age itself when no past run was longer.

Example: us-east-1 was up 10 h, down 2 h, up 4 h, and has been down 1 h now: the rate
with a 720 s restart and the 6 h prior is (10 h - 0.2 h + 4 h - 0.2 h + 6 h) / (17 h + 6 h)
= 0.85; the rest of the outage is 2 h - 1 h = 1 h.

Bounds: :data:`MAX_CHANGES` per domain (the oldest go first); the caller names only the
domains of its config. Pure: no clock (``now`` is passed in), no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

__all__ = ["MAX_CHANGES", "MEMORY_S", "PRIOR_S", "Availability", "Runs", "progress_rate", "rest_of_run", "seeded"]

#: how far back the record goes (seconds): two days, what the tick model's policy found
#: best on the V100 trace (bench/README.md: 24 h and 96 h did worse)
MEMORY_S = 48 * 3600.0
#: the changes kept per domain (the oldest dropped first)
MAX_CHANGES = 1024
#: the unbroken capacity assumed before a domain's record (seconds): the weight of the
#: benefit of the doubt in :func:`progress_rate`
PRIOR_S = 6 * 3600.0


@dataclass(frozen=True, slots=True)
class Runs:
    """A domain's record as runs: the lengths (seconds) of its completed up-runs and
    down-runs, oldest first; its current state and that state's age (seconds); and the
    span the record covers (seconds, the first change to ``now``)."""

    up: tuple[float, ...]
    down: tuple[float, ...]
    current_up: bool
    age_s: float
    span_s: float


@dataclass(frozen=True, slots=True)
class Availability:
    """Per domain, its changes of state, oldest first: ``(unix s, up)``, each state unlike
    the one before. Frozen; :meth:`observe` returns a new record."""

    changes: Mapping[str, tuple[tuple[float, bool | None], ...]] = field(default_factory=dict)

    def observe(self, domain: str, up: bool | None, now: float, *, memory_s: float = MEMORY_S) -> Availability:
        """The record with ``domain`` seen ``up`` (or down) at ``now`` (unix s); ``None``:
        no longer watched from ``now`` (the job left it: what it does next is unknown, and
        counts neither way). An observation that agrees with the domain's state, or is
        older than its last change, changes nothing; changes older than ``memory_s`` go
        (the last one before that is kept, moved to the cut, so the state there stays
        known)."""
        seen = self.changes.get(domain, ())
        if (seen and (seen[-1][1] == up or now < seen[-1][0])) or (not seen and up is None):
            kept = seen
        else:
            kept = (*seen, (now, up))
        kept = _cut(kept, now - memory_s)
        if kept == seen:
            return self
        return Availability({**self.changes, domain: kept})

    def known(self, domain: str) -> bool:
        """Whether anything was seen of ``domain``."""
        return bool(self.changes.get(domain))

    def is_up(self, domain: str) -> bool | None:
        """The domain's state as last seen (None: never seen, or not watched now)."""
        seen = self.changes.get(domain)
        return seen[-1][1] if seen else None

    def runs(self, domain: str, now: float) -> Runs | None:
        """The domain's record as :class:`Runs` up to ``now``, its unwatched spans left
        out (None: never seen). Not watched now: the current run is a down-run of age 0
        (:func:`rest_of_run` says nothing of it), and the span ends where watching did."""
        seen = self.changes.get(domain)
        if not seen:
            return None
        up: list[float] = []
        down: list[float] = []
        span = 0.0
        for (t0, state), (t1, _) in zip(seen, seen[1:]):
            if state is not None:
                (up if state else down).append(t1 - t0)
                span += t1 - t0
        t, state = seen[-1]
        age = max(0.0, now - t) if state is not None else 0.0
        return Runs(tuple(up), tuple(down), bool(state), age, span + age)


Changes = tuple[tuple[float, bool | None], ...]


def _cut(kept: Changes, cut: float) -> Changes:
    """``kept`` without the changes at or before ``cut`` (unix s) but the last of them,
    moved to the cut (the state there stays known); at most :data:`MAX_CHANGES`."""
    old = [i for i, (t, _) in enumerate(kept) if t <= cut]
    if old:
        last = old[-1]
        kept = ((max(kept[last][0], cut), kept[last][1]), *kept[last + 1:])
    return kept[-MAX_CHANGES:]


def seeded(own: Availability, others: Iterable[Mapping[str, Sequence[tuple[float, bool | None]]]], now: float, *,
           memory_s: float = MEMORY_S) -> Availability:
    """``own`` with the past other pools saw (:mod:`daemon.controlnode.market_memory`):
    for each domain, the one of ``others`` (records by this pool's domain names, changes
    ``(unix s, up)``) whose last change is the newest gives what happened there before this
    pool's own first observation of it; from that observation on, the pool's own record
    stands (others' later word is not taken). Changes read in time order as
    :meth:`Availability.observe` reads them (a repeated state is no change), none after
    ``now``, cut to ``memory_s``. A domain no other record has keeps what ``own`` has. Pure.

    Example: pool A saw west up from 0 h to 6 h, down to 10 h; this pool launched there
    (up) at 9 h: west reads up 0-6 h, down 6-9 h, up from 9 h."""
    best: dict[str, list[tuple[float, bool | None]]] = {}
    for record in others:
        for domain, changes in record.items():
            usable = sorted(((float(t), up) for t, up in changes if t <= now), key=lambda c: c[0])
            if usable and (domain not in best or usable[-1][0] > best[domain][-1][0]):
                best[domain] = usable
    out = dict(own.changes)
    for domain, changes in best.items():
        mine = own.changes.get(domain, ())
        before = [c for c in changes if not mine or c[0] < mine[0][0]]
        if not before or (mine and mine[0][0] <= now - memory_s):
            continue  # (nothing before the pool's own first word, or its own covers the whole memory)
        record = Availability()
        for t, up in (*before, *mine):
            record = record.observe(domain, up, t, memory_s=memory_s)
        kept = _cut(record.changes.get(domain, ()), now - memory_s)
        if kept:  # (a past of nothing but "unwatched" says nothing: what own had stays)
            out[domain] = kept
    return own if out == own.changes else Availability(out)


def progress_rate(record: Availability, domain: str, now: float, overhead_s: float, *,
                  prior_s: float = PRIOR_S) -> float | None:
    """Training seconds per wall second in ``domain`` over its record (0..1), for a job
    that starts at the beginning of each up-run and pays ``overhead_s`` seconds of restart
    in each (the current run counts with its age), as if ``prior_s`` seconds of unbroken
    capacity came before the record: a record of minutes says little, and one capacity
    error at the start must not read as a domain that never trains. None: never seen."""
    r = record.runs(domain, now)
    if r is None:
        return None
    ups = [*r.up, *([r.age_s] if r.current_up else [])]
    return (sum(max(0.0, n - overhead_s) for n in ups) + prior_s) / (r.span_s + prior_s)


def rest_of_run(record: Availability, domain: str, now: float) -> float | None:
    """Seconds the domain's current run (up or down) is expected to last still: the mean
    of its past runs of that state longer than the current age, less the age; the age
    itself when none was longer. None: never seen, or not watched now."""
    r = record.runs(domain, now)
    if r is None or record.is_up(domain) is None:
        return None
    longer = [n for n in (r.up if r.current_up else r.down) if n > r.age_s]
    return sum(longer) / len(longer) - r.age_s if longer else r.age_s
