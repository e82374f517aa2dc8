"""The past a pool starts from: what the other pools of this control node have seen of
each market's spot capacity (issue 31).

The home-zone policy (:class:`daemon.control.policies.HomeZone`) decides from an
availability record (:mod:`daemon.control.availability`): per placement domain, when its
spot capacity was up and down over the last 48 h. A pool builds it from its own events,
so a new pool starts blind in every region: on the V100 trace's five windows it paid
1.254 × the offline optimum with what its own pool saw, 1.138 × had it seen every
region's 48 h before (``python -m bench.replay.skynomad_v100``, bench/README.md).

With ``daemon.market_dir``, each daemon of a control node writes its record there, one
file per pool (``<pool>.json``, 0600, written whole and renamed over: a reader sees the
old or the new), every :data:`SHARE_S` seconds; and takes in the others' records of the
domains it has not observed itself (:func:`daemon.control.availability.seeded`: the
newest wins). Pools name their domains as they like, so a record is keyed by **market**
(:func:`market_key`: provider, region, placement group, and the zones and instance types
of the domain's spot offers): two pools share what they saw of a domain exactly when
they buy the same things there.

A record is the word of a live daemon only while it is rewritten: one not rewritten for
:data:`STALE_S` seconds (its daemon stopped, or the pool ended) is read as watched up to
its last write and unwatched since, so a region's last "up" does not stretch over hours
nobody looked.

What is read is bounded and checked: at most :data:`MAX_FILES` files, each at most
:data:`MAX_FILE_BYTES`, this uid's own regular files only (a planted link is not
followed, :func:`daemon.state_dir.open_private`); a file that does not parse, or a
change that is not ``[unix s, true | false | null]``, is skipped with a warning. Every
method blocks (small files): call it through :func:`asyncio.to_thread`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import structlog

from daemon.config import Config, Domain
from daemon.control.availability import MAX_CHANGES, Availability
from daemon.state_dir import UnsafeStatePath, open_private, prepare_state_dir, write_private

__all__ = ["MAX_FILES", "MAX_FILE_BYTES", "SHARE_S", "STALE_S", "MarketMemory", "market_key"]

log = structlog.get_logger("spotvisor.daemon")

#: how often a daemon writes its record and reads the others' (seconds)
SHARE_S = 60.0
#: a record not rewritten for this long is its pool's word only up to its last write (seconds)
STALE_S = 5 * SHARE_S
#: the most files read from the directory (the newest first), and the most bytes read of one
MAX_FILES = 64
MAX_FILE_BYTES = 1024 * 1024  # a record is at most ~40 KB a domain (1,024 changes)
_VERSION = 1

Changes = list[tuple[float, bool | None]]


def market_key(config: Config, domain: Domain) -> str | None:
    """What a domain buys, as a key other pools' configs share: ``provider/region/placement
    group/zone:type,...`` over its spot offers (sorted; ``*`` for an offer of any zone).
    None: the domain has no spot offer (nothing of spot capacity is seen there)."""
    spot = sorted({f"{o.zone or '*'}:{o.instance_type}" for i in domain.offers
                   if (o := config.offers[i]).market == "spot"})
    if not spot:
        return None
    return f"{domain.provider}/{domain.region}/{domain.placement_group or '-'}/{','.join(spot)}"


def _mtime(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:  # gone since the listing (a pool's rename): read last, and skipped then
        return -math.inf


class MarketMemory:
    """This pool's file in the shared directory, and the others'.

    Args:
        directory: ``daemon.market_dir`` (made, 0700, if missing).
        pool: this pool's name (its file is ``<pool>.json``).
        keys: this pool's domain names to their :func:`market_key` (a domain without one
            is neither written nor read).
    """

    def __init__(self, directory: Path, pool: str, keys: Mapping[str, str | None]) -> None:
        self.directory, self.pool = directory, pool
        self.keys = {d: k for d, k in keys.items() if k is not None}
        self._domains = {k: d for d, k in self.keys.items()}
        self._warned: set[str] = set()

    @classmethod
    def for_config(cls, config: Config) -> MarketMemory | None:
        """The config's (None: no ``daemon.market_dir``)."""
        path = config.daemon.market_path()
        if path is None:
            return None
        return cls(path, config.pool.name, {d.name: market_key(config, d) for d in config.domains_resolved()})

    def write(self, record: Availability, now: float) -> None:
        """Write ``record`` (what this pool observed itself, never what it took from others)
        as of ``now`` (unix s). Raises OSError or UnsafeStatePath: the directory or the file
        cannot be written (the caller logs it; the pool goes on without sharing)."""
        markets = {self.keys[d]: [[t, up] for t, up in changes]
                   for d, changes in sorted(record.changes.items()) if d in self.keys and changes}
        prepare_state_dir(self.directory)
        body = json.dumps({"version": _VERSION, "pool": self.pool, "written_at": now, "markets": markets})
        write_private(self.directory / f"{self.pool}.json", body.encode(), atomic=True)

    def read_others(self, now: float) -> list[dict[str, Changes]]:
        """The other pools' records of this pool's markets, by this pool's domain names;
        a stale one ends unwatched at its last write (module docstring). Never raises for
        what is in the directory: a file it cannot read or parse is skipped (a warning,
        once per file)."""
        try:
            mine = f"{self.pool}.json"
            entries = [e for e in os.scandir(self.directory) if e.name.endswith(".json") and e.name != mine]
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._warn(str(self.directory), repr(exc))
            return []
        # (a link, a FIFO or a directory among them is refused by open_private, never followed)
        out = []
        for entry in sorted(entries, key=_mtime, reverse=True)[:MAX_FILES]:
            try:
                raw = self._read(Path(entry.path))
                record = self._parse(json.loads(raw), now)
            except (OSError, UnsafeStatePath, ValueError) as exc:
                self._warn(entry.name, str(exc)[:200])
                continue
            if record:
                out.append(record)
        return out

    def _read(self, path: Path) -> bytes:
        fd = open_private(path, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"over {MAX_FILE_BYTES} bytes")
        return raw

    def _parse(self, doc: Any, now: float) -> dict[str, Changes]:
        if not isinstance(doc, dict) or doc.get("version") != _VERSION or not isinstance(doc.get("markets"), dict):
            raise ValueError(f"not a version {_VERSION} market record")
        written = doc.get("written_at")
        if not isinstance(written, (int, float)) or not math.isfinite(written):
            raise ValueError("written_at is not a time")
        out: dict[str, Changes] = {}
        for key, changes in doc["markets"].items():
            domain = self._domains.get(key)
            if domain is None:
                continue  # a market this pool does not buy
            if not isinstance(changes, list) or len(changes) > MAX_CHANGES:
                raise ValueError(f"market {key!r}: not a list of at most {MAX_CHANGES} changes")
            seen: Changes = []
            for c in changes:
                if (not isinstance(c, list) or len(c) != 2 or not isinstance(c[0], (int, float))
                        or isinstance(c[0], bool) or not math.isfinite(c[0]) or c[1] not in (True, False, None)):
                    raise ValueError(f"market {key!r}: a change is not [unix s, true | false | null]")
                seen.append((float(c[0]), c[1]))
            if seen and now - written > STALE_S and seen[-1][1] is not None and written >= seen[-1][0]:
                seen.append((float(written), None))  # nobody has looked since its last write
            out[domain] = seen
        return out

    def _warn(self, what: str, error: str) -> None:
        if what not in self._warned and len(self._warned) < MAX_FILES:
            self._warned.add(what)
            log.warning("market_record_skipped", file=what, error=error, directory=str(self.directory))
