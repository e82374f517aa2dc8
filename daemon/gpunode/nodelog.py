"""The node's trainer log (``<workdir>/trainer.log``), shipped to the daemon with
the heartbeat in bounded chunks, so ``spotctl tail NODE`` works for a node on any
cloud: the daemon never reads a node's disk.

**Protocol** (one round per heartbeat: every 1 s by default, longer in a big pool,
whose interval the daemon stretches, :func:`daemon.control.pool.heartbeat_interval_s`):

- the daemon's heartbeat reply carries ``"log": {"offset": N}``: the byte offset in
  the node's ``trainer.log`` up to which it holds the log (``null``: nothing yet);
- the agent's next heartbeat carries ``"log": {"offset": START, "next": END,
  "size": SIZE, "data": TEXT}``: the bytes ``[START, END)`` of the file, whole lines
  only, at most :data:`CHUNK_MAX_BYTES`. START is N, or — when the daemon holds
  nothing (first contact, daemon restarted) or the agent is more than one chunk
  behind — the start of the first whole line within the file's last chunk: the
  agent skips ahead and the daemon marks the gap. A line longer than a chunk is
  shipped cut, in chunk-sized pieces.

**Limits** (what the daemon's copy is, and is not):

- it is the last :data:`BUFFER_MAX_BYTES` (256 KiB) of each node's log, in the
  daemon's memory: a daemon restart loses it, and the next heartbeats bring back
  only the node's last chunk. The node's own ``trainer.log`` is the full record
  (local provider: ``<state_dir>/nodes/<node>/trainer.log``);
- throughput: at most :data:`CHUNK_MAX_BYTES` (16 KiB) per heartbeat (per ~20 s
  at 1,000 nodes). A trainer that writes faster loses lines in the daemon's copy;
  each gap shows as one line ``[spotvisor: N bytes of trainer.log not shipped]``;
- latency: one heartbeat interval (~40 s at 1,000 nodes). A line is shipped once
  it ends with a newline (a line longer than a chunk is shipped cut, in pieces);
- a gone node keeps its last lines in the daemon (until the daemon restarts).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

__all__ = ["CHUNK_MAX_BYTES", "BUFFER_MAX_BYTES", "read_chunk", "NodeLogs", "LogLine"]

log = structlog.get_logger("spotvisor.nodelog")

CHUNK_MAX_BYTES = 16 * 1024
BUFFER_MAX_BYTES = 256 * 1024


def read_chunk(path: Path, want: int | None, *, max_bytes: int = CHUNK_MAX_BYTES) -> dict[str, Any] | None:
    """The agent's side: the next chunk of ``path`` from offset ``want`` (see the module docstring).

    Blocking (one seek and one read of at most ``max_bytes``): call it in a thread.
    Returns None when there is nothing new to ship (no file, no new whole line).
    """
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if want is not None and want > size:  # the file was replaced or truncated
                want = None
            start = want if want is not None and size - want <= max_bytes else max(0, size - max_bytes)
            f.seek(start)
            raw = f.read(min(max_bytes, size - start))
    except FileNotFoundError:
        return None
    if start != want and start > 0:  # skipped ahead: begin at the first whole line, if one starts here
        cut = raw.find(b"\n")
        if 0 <= cut < len(raw) - 1:
            start += cut + 1
            raw = raw[cut + 1:]
    end = raw.rfind(b"\n")
    if end >= 0:
        raw = raw[: end + 1]
    elif len(raw) < max_bytes:
        return None  # only the beginning of a line so far: wait for its newline
    if not raw:
        return None
    return {"offset": start, "next": start + len(raw), "size": size, "data": raw.decode(errors="replace")}


@dataclass(frozen=True, slots=True)
class LogLine:
    """One line of a node's log as the daemon holds it; ``seq`` counts lines per node from 1."""

    seq: int
    line: str

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "line": self.line}


@dataclass(slots=True)
class _Buffer:
    lines: deque[LogLine] = field(default_factory=deque)
    bytes: int = 0
    last_seq: int = 0
    end: int | None = None  # byte offset in the node's file up to which we hold it


class NodeLogs:
    """The daemon's side: the last :data:`BUFFER_MAX_BYTES` of each node's log, in memory,
    for at most ``max_nodes`` nodes (the ones heard from most recently).

    Feed it each heartbeat's ``log`` field (:meth:`feed`), answer with :meth:`ack`;
    read with :meth:`tail` and :meth:`since`; :meth:`wait` returns when a node's log
    grows (for ``spotctl tail -f``).
    """

    __slots__ = ("max_bytes", "max_nodes", "_buffers", "_grew")

    def __init__(self, *, max_bytes: int = BUFFER_MAX_BYTES, max_nodes: int = 64) -> None:
        if max_bytes <= 0 or max_nodes <= 0:
            raise ValueError(f"max_bytes and max_nodes must be > 0, got {max_bytes} and {max_nodes}")
        self.max_bytes = max_bytes
        self.max_nodes = max_nodes
        self._buffers: dict[str, _Buffer] = {}
        self._grew = asyncio.Event()

    def ack(self, node_id: str) -> dict[str, Any]:
        """The heartbeat reply's ``log`` field for ``node_id``."""
        buf = self._buffers.get(node_id)
        return {"offset": None if buf is None else buf.end}

    def feed(self, node_id: str, chunk: object) -> None:
        """Take one heartbeat's ``log`` field (None: nothing new). A malformed chunk is logged and dropped."""
        if chunk is None:
            return
        if not _valid(chunk):
            log.warning("log_chunk_unparsable", node_id=node_id, chunk=repr(chunk)[:200])
            return
        assert isinstance(chunk, dict)
        start, nxt, data = chunk["offset"], chunk["next"], chunk["data"]
        # most recently fed last; beyond max_nodes, the log heard from longest ago (a gone node) goes
        buf = self._buffers.pop(node_id, None) or _Buffer()
        self._buffers[node_id] = buf
        while len(self._buffers) > self.max_nodes:
            del self._buffers[next(iter(self._buffers))]
        if buf.end is not None:
            if chunk["size"] < buf.end:
                self._append(buf, "[spotvisor: trainer.log was replaced; starting over]")
                buf.end = None
            elif nxt <= buf.end:
                return  # already held
            elif start < buf.end:  # overlap (the agent restarted): keep only the new part
                data = data.encode()[buf.end - start:].decode(errors="replace")
            elif start > buf.end:
                self._append(buf, f"[spotvisor: {start - buf.end} bytes of trainer.log not shipped]")
        elif start > 0:
            self._append(buf, f"[spotvisor: the first {start} bytes of trainer.log are only on the node]")
        parts = data.split("\n")  # lines end at newlines only (a progress bar's \r stays in its line)
        if parts[-1] == "":
            parts.pop()
        for line in parts:
            self._append(buf, line)
        buf.end = nxt
        self._grew.set()
        self._grew = asyncio.Event()

    def tail(self, node_id: str, n: int) -> list[LogLine]:
        """The last ``n`` lines held for ``node_id`` (oldest first)."""
        buf = self._buffers.get(node_id)
        if buf is None or n <= 0:
            return []
        return list(buf.lines)[-n:]

    def since(self, node_id: str, seq: int) -> list[LogLine]:
        """Lines held for ``node_id`` with ``seq`` greater than ``seq`` (oldest first)."""
        buf = self._buffers.get(node_id)
        if buf is None:
            return []
        return [ln for ln in buf.lines if ln.seq > seq]

    def last_seq(self, node_id: str) -> int:
        buf = self._buffers.get(node_id)
        return 0 if buf is None else buf.last_seq

    async def wait(self, node_id: str, seq: int, timeout_s: float) -> None:
        """Return when ``node_id`` has a line newer than ``seq``, or after ``timeout_s`` seconds."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.last_seq(node_id) <= seq:
                    await self._grew.wait()
        except TimeoutError:
            return

    def _append(self, buf: _Buffer, text: str) -> None:
        buf.last_seq += 1
        buf.lines.append(LogLine(buf.last_seq, text))
        buf.bytes += len(text) + 1
        while buf.bytes > self.max_bytes and len(buf.lines) > 1:
            buf.bytes -= len(buf.lines.popleft().line) + 1


def _valid(chunk: object) -> bool:
    if not isinstance(chunk, dict):
        return False
    ints = [chunk.get(k) for k in ("offset", "next", "size")]
    return (all(isinstance(v, int) and v >= 0 for v in ints) and isinstance(chunk.get("data"), str)
            and chunk["offset"] <= chunk["next"])
