"""The daemon's copy of each node's trainer log, fed by the heartbeats' chunks.

The protocol and its limits are :mod:`daemon.gpunode.nodelog`'s (the agent's side).
Every line is held with the job's secret values masked (``***``,
:meth:`NodeLogs.mask`, which the supervisor calls with them at start): a ``job.setup`` or a trainer that prints one
(a token in a URL, a ``set -x``) does not carry it into ``spotctl tail``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import structlog

from daemon.feed.redaction import Redactor
from daemon.gpunode.nodelog import BUFFER_MAX_BYTES

__all__ = ["NodeLogs", "LogLine"]

log = structlog.get_logger("spotvisor.nodelog")


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
    grows (for ``spotctl tail -f``). The values given to :meth:`mask` (the job's secrets)
    read ``***`` in every line that arrives after.
    """

    __slots__ = ("max_bytes", "max_nodes", "_buffers", "_grew", "_redactor")

    def __init__(self, *, max_bytes: int = BUFFER_MAX_BYTES, max_nodes: int = 64) -> None:
        if max_bytes <= 0 or max_nodes <= 0:
            raise ValueError(f"max_bytes and max_nodes must be > 0, got {max_bytes} and {max_nodes}")
        self.max_bytes = max_bytes
        self.max_nodes = max_nodes
        self._buffers: dict[str, _Buffer] = {}
        self._grew = asyncio.Event()
        self._redactor = Redactor()  # the job's secret values, from mask()

    def mask(self, values: Iterable[str]) -> None:
        """From now on each of ``values`` (of at least
        :data:`~daemon.feed.redaction.MIN_MASKED_CHARS` characters) reads ``***`` in the lines taken."""
        self._redactor.add_values(values)

    def redact(self, text: str) -> str:
        """``text`` with the values given to :meth:`mask` reading ``***`` (a line a report carries)."""
        return self._redactor.redact(text)

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
        text = self._redactor.redact(text)  # the job's secrets (a no-op while none is registered)
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
