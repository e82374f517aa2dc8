"""The node's trainer log (``<workdir>/trainer.log``), shipped to the daemon with
the heartbeat in bounded chunks, so ``spotctl tail NODE`` works for a node on any
cloud: the daemon never reads a node's disk. This module is the agent's side
(:func:`read_chunk`); the daemon's copy is :mod:`daemon.controlnode.node_logs`.

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

import os
import re
from pathlib import Path
from typing import Any

import structlog

__all__ = ["CHUNK_MAX_BYTES", "BUFFER_MAX_BYTES", "read_chunk", "read_tail", "error_line", "last_error",
           "mask_secrets"]

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


ERROR_LINE_CHARS = 500
_TAIL_BYTES = 64 * 1024
# a Python exception's last traceback line: "module.SomeError: message" (or a bare name)
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$")
# a log line of torch's own (glog, c10 warnings) or torchrun's: not the message's continuation
_LOGGED = re.compile(r"^\[?[IWEF]\d{4} |^Traceback \(most recent call last\)|^\[rank\d+\]")


def error_line(text: str) -> str:
    """The newest exception in a trainer log's ``text``: its ``Name: message`` line and
    the lines of the message that follow (a multi-line message: NCCL's ``Last error:``
    and its cause), joined with `` | ``, at most :data:`ERROR_LINE_CHARS` characters;
    else the last non-empty line not logged by torch itself, else the last; "" for none. Pure."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    at = next((i for i in range(len(lines) - 1, -1, -1) if _EXCEPTION.match(lines[i])), None)
    if at is None:  # (``python -m`` of a missing module says so in one line, no traceback)
        said = [ln.strip() for ln in lines if ln.strip()]
        own = [ln for ln in said if not _LOGGED.match(ln)]
        return (own or said or [""])[-1][:ERROR_LINE_CHARS]
    out = [lines[at]]
    for ln in lines[at + 1:]:
        if not ln.strip() or _LOGGED.match(ln) or ln.startswith((" ", "\t")):
            break
        out.append(ln)
    return " | ".join(out)[:ERROR_LINE_CHARS]


def read_tail(path: Path, *, since: int = 0, max_bytes: int = _TAIL_BYTES) -> str:
    """The last ``max_bytes`` of the file at ``path`` written after byte ``since``, as text
    ("" when unreadable). Blocking: one read of a local file's tail."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(since, end - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def last_error(path: Path) -> str:
    """:func:`error_line` of the last 64 KiB of the log at ``path`` ("" when unreadable). Blocking."""
    return error_line(read_tail(path))


def mask_secrets(text: str, secrets: Any) -> str:
    """``text`` with each non-empty string of ``secrets`` (the job spec's ``secrets``
    mapping, or None) replaced by ``***``: what a node reports never carries one."""
    for value in (secrets or {}).values():
        if isinstance(value, str) and value:
            text = text.replace(value, "***")
    return text
