"""The node-local contract between the agent (``daemon/gpunode/agent.py``) and the
trainer (:mod:`trainer.guard`, :mod:`trainer.runtime`): the one module both import.

The agent starts ``torchrun`` with these in the environment:

============================  ==============================================================
:data:`NOTICE_FILE_ENV`       the notice file: a JSON list of :class:`NoticeEntry`, replaced
                              atomically by the agent (:class:`NoticeFile`), read by every
                              rank at each step boundary (:func:`read_notice_file`)
:data:`STATUS_FILE_ENV`       JSON lines appended by LOCAL_RANK 0, one per :class:`StatusKind`;
                              the agent tails it (:class:`StatusTail`) and forwards
                              the kinds ``daemon.control.reports.STATUS_EVENTS`` names
:data:`LOG_DIR_ENV`           one JSON-lines step log per rank and attempt (data positions)
:data:`SCRATCH_DIR_ENV`       a node-local directory for framework checkpoints before upload
:data:`NODE_ID_ENV`           this node's id in the pool
:data:`S3_ENDPOINT_ENV`,      the object store's endpoint (``job.s3_endpoint_url``,
:data:`OSS_ENDPOINT_ENV`      ``job.oss_endpoint``)
:data:`RDZV_ENDPOINT_ENV`     ``host:port`` of the rendezvous store on the control node, where
                              the survivors of a notice re-form their group in-process
:data:`RDZV_ENDPOINT_FILE_ENV` a node-local file the agent keeps: one line, ``host:port`` of
                              the store as the daemon that leads says (an HA takeover moves
                              it to the new leader's control node); once it holds one, every
                              new store client uses it instead of :data:`RDZV_ENDPOINT_ENV`
:data:`RUN_ID_ENV`            the job's run id, the same on every node (torchrun's ``--rdzv-id``)
:data:`JOIN_ENV`              ``1``: this node joins the running group in-process
                              (:mod:`trainer.membership`) instead of starting one
:data:`CHECKPOINT_URI_ENV`    with ``job.command`` only: the checkpoint store of the node's
                              domain (the user's script gets no ``--checkpoint-uri`` flag)
:data:`NOTICE_ENV`            with ``job.command`` only: the path of this node's plain notice
                              (:func:`write_plain_notice`); absent until a notice comes, when
                              the workers get SIGTERM (see "The plain notice" below)
:data:`HOLD_TIMEOUT_ENV`      with ``job.command`` only: ``job.hold_timeout_s`` (the HF callback)
:data:`JOIN_CREDENTIAL_ENV`   this node's join credential (:mod:`trainer.credential`), from the
                              daemon when it admitted the node: a secret, read once and
                              removed from the workers' environment
:data:`START_COHORT_ENV`      ``N@UNTIL``: admitted at the job's start with N - 1 other nodes;
                              torchrun's first round waits for theirs until UNTIL (unix s)
                              (:mod:`trainer.rendezvous`); absent: no wait
============================  ==============================================================

The plain notice (``job.command``: the user's own script, unchanged)
--------------------------------------------------------------------
A script run as ``job.command`` reads no notice file at its step boundaries. When this
node gets an interruption notice (or the daemon drains it), the agent first writes the
file named by ``$SPOTVISOR_NOTICE`` (atomically: tmp + fsync + rename), then sends
SIGTERM to torchrun, which forwards it to every worker at once. torchrun waits for its
workers up to ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (the daemon sets it above the longest
documented notice lead) instead of its own 30 s; the agent SIGKILLs what still runs at
the deadline. The file is one JSON object, readable with plain ``json.load``::

    {"id": "n2:9f2c...", "kind": "interruption",   # or "drain" (the daemon's, no deadline of the cloud)
     "time": 1767225600.2,                           # when the agent saw it (unix s)
     "deadline": 1767225720.0,                       # when the node is taken (unix s); null: unknown
     "seconds_left": 119.8}                          # deadline - time (null with the deadline)

A SIGTERM handler that finds no file (torchrun's own restart of the workers, when a
replacement joins) has no deadline of spotvisor's: torchrun SIGKILLs after its timeout.

Importing this module imports neither torch nor the daemon.
"""

from __future__ import annotations

import enum
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "NOTICE_FILE_ENV",
    "STATUS_FILE_ENV",
    "LOG_DIR_ENV",
    "SCRATCH_DIR_ENV",
    "NODE_ID_ENV",
    "S3_ENDPOINT_ENV",
    "OSS_ENDPOINT_ENV",
    "RDZV_ENDPOINT_ENV",
    "RDZV_ENDPOINT_FILE_ENV",
    "RUN_ID_ENV",
    "JOIN_ENV",
    "JOIN_CREDENTIAL_ENV",
    "START_COHORT_ENV",
    "CHECKPOINT_URI_ENV",
    "NOTICE_ENV",
    "SHUTDOWN_TIMEOUT_ENV",
    "HOLD_TIMEOUT_ENV",
    "LOG_INPUTS_ENV",
    "TRAINER_PYTHONPATH_ENV",
    "write_plain_notice",
    "write_endpoint_file",
    "NoticeKind",
    "NoticeEntry",
    "NoticeFileError",
    "parse_notices",
    "read_notice_file",
    "NoticeFile",
    "StatusKind",
    "StatusTail",
]

log = logging.getLogger(__name__)

NOTICE_FILE_ENV = "SPOTVISOR_NOTICE_FILE"
STATUS_FILE_ENV = "SPOTVISOR_STATUS_FILE"
LOG_DIR_ENV = "SPOTVISOR_LOG_DIR"
SCRATCH_DIR_ENV = "SPOTVISOR_SCRATCH_DIR"
NODE_ID_ENV = "SPOTVISOR_NODE_ID"
S3_ENDPOINT_ENV = "SPOTVISOR_S3_ENDPOINT_URL"
OSS_ENDPOINT_ENV = "SPOTVISOR_OSS_ENDPOINT"
RDZV_ENDPOINT_ENV = "SPOTVISOR_RDZV_ENDPOINT"
RDZV_ENDPOINT_FILE_ENV = "SPOTVISOR_RDZV_ENDPOINT_FILE"
RUN_ID_ENV = "SPOTVISOR_RUN_ID"
JOIN_ENV = "SPOTVISOR_JOIN"
JOIN_CREDENTIAL_ENV = "SPOTVISOR_JOIN_CREDENTIAL"
START_COHORT_ENV = "SPOTVISOR_START_COHORT"
# job.command (the user's own script, no flag added): the node's domain's checkpoint
# store (file://, s3://, oss://), where spotvisor's integrations commit (the HF callback)
CHECKPOINT_URI_ENV = "SPOTVISOR_CHECKPOINT_URI"
# job.command: the plain notice's path (module docstring, "The plain notice")
NOTICE_ENV = "SPOTVISOR_NOTICE"
# torchrun's own (torch >= 2.9: torch/distributed/launcher/api.py): how long it waits for its
# workers after it forwards a SIGTERM to them, before it SIGKILLs them (its default: 30 s)
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
# job.command: seconds the HF callback holds after an interruption/rejoin commit (job.hold_timeout_s)
HOLD_TIMEOUT_ENV = "SPOTVISOR_HOLD_TIMEOUT_S"
# "1": the HF callback's step log records a digest of every input_ids row the model was fed (tests)
LOG_INPUTS_ENV = "SPOTVISOR_LOG_INPUTS"
# in the agent's environment (its env file): a directory holding spotvisor's trainer
# package alone, which the agent puts first on PYTHONPATH for a trainer on another
# interpreter than its own (job.python; daemon/providers/bootstrap.py writes it)
TRAINER_PYTHONPATH_ENV = "SPOTVISOR_TRAINER_PYTHONPATH"
# an Alibaba Cloud node's instance RAM role (a domain's launch.ram_role): OSS credentials come
# from the instance metadata service for it when no $OSS_ACCESS_KEY_ID is set (trainer/oss_store.py)
OSS_RAM_ROLE_ENV = "SPOTVISOR_OSS_RAM_ROLE"
# job.preload, comma-separated: modules each node's zygote imports before torchrun's
# workers fork from it (daemon/gpunode/zygote.py)
ZYGOTE_PRELOAD_ENV = "SPOTVISOR_ZYGOTE_PRELOAD"


# --------------------------------------------------------------------------- the notice file


class NoticeKind(str, enum.Enum):
    """What a notice asks of the job."""

    #: This node will be taken: commit, then hold until the restart.
    INTERRUPTION = "interruption"
    #: A new node waits to be admitted: commit, then hold until the restart.
    REJOIN = "rejoin"
    #: Commit and keep training.
    CHECKPOINT = "checkpoint"

    @property
    def needs_hold(self) -> bool:
        return self in (NoticeKind.INTERRUPTION, NoticeKind.REJOIN)


@dataclass(frozen=True, slots=True)
class NoticeEntry:
    """One entry of the notice file: a commit the job is asked for. ``time``/``deadline``
    are unix seconds. (The cloud's interruption notice itself is
    :class:`daemon.gpunode.metadata.base.Notice`; the agent turns it into an entry of
    kind ``interruption``.)"""

    id: str
    kind: NoticeKind
    time: float | None = None
    deadline: float | None = None


class NoticeFileError(ValueError):
    """The notice file's content is not a JSON list."""


def _float_or_none(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def parse_notices(text: str | bytes) -> tuple[list[NoticeEntry], list[str]]:
    """Parse the notice file's content.

    Returns:
        ``(notices, problems)``: the valid notices in file order, and one line per
        entry that was dropped (unknown kind, missing id).

    Raises:
        NoticeFileError: the content is not a JSON list.
    """
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NoticeFileError(f"not JSON: {exc}") from None
    if not isinstance(data, list):
        raise NoticeFileError(f"expected a JSON list, got {type(data).__name__}")
    notices: list[NoticeEntry] = []
    problems: list[str] = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            problems.append(f"entry {i}: not an object")
            continue
        nid = entry.get("id")
        if not isinstance(nid, str) or not nid:
            problems.append(f"entry {i}: missing id")
            continue
        try:
            kind = NoticeKind(entry.get("kind"))
        except ValueError:
            problems.append(f"entry {i} ({nid}): unknown kind {entry.get('kind')!r}")
            continue
        notices.append(
            NoticeEntry(
                id=nid,
                kind=kind,
                time=_float_or_none(entry.get("time")),
                deadline=_float_or_none(entry.get("deadline")),
            )
        )
    return notices, problems


def read_notice_file(path: str | os.PathLike[str]) -> list[NoticeEntry]:
    """The notices in ``path``; a missing file means none.

    Raises:
        NoticeFileError: the file exists but is not a JSON list.
        OSError: the file exists but cannot be read.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return []
    if not raw.strip():
        return []
    notices, _ = parse_notices(raw)
    return notices


class NoticeFile:
    """The agent's side of the notice file: the pending entries, replaced atomically
    (tmp + fsync + ``os.replace``) on every change, so a rank never reads half a file."""

    __slots__ = ("path", "_entries")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, NoticeEntry] = {}
        self._write()

    def add(self, entry: NoticeEntry) -> bool:
        """Add an entry; False if one with the same id is already pending."""
        if entry.id in self._entries:
            return False
        self._entries[entry.id] = entry
        self._write()
        return True

    def remove(self, ids: list[str] | tuple[str, ...]) -> None:
        if any(i in self._entries for i in ids):
            for i in ids:
                self._entries.pop(i, None)
            self._write()

    def pending(self) -> list[NoticeEntry]:
        return list(self._entries.values())

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump([{"id": e.id, "kind": e.kind.value, "time": e.time, "deadline": e.deadline}
                       for e in self._entries.values()], f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def write_plain_notice(path: Path, *, notice_id: str, kind: str, seen_at: float, deadline: float | None) -> dict[str, Any]:
    """Write the plain notice (module docstring) to ``path`` atomically; returns what was written.
    ``kind``: ``interruption`` or ``drain``; times in unix seconds.

    Raises:
        OSError: the file cannot be written.
    """
    body = {"id": notice_id, "kind": kind, "time": seen_at, "deadline": deadline,
            "seconds_left": None if deadline is None else round(deadline - seen_at, 3)}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return body


def write_endpoint_file(path: Path, endpoint: str) -> None:
    """Write the rendezvous store's ``host:port`` to ``path`` (:data:`RDZV_ENDPOINT_FILE_ENV`)
    atomically: a reader sees the old line or the new one, never a part.

    Raises:
        OSError: the file cannot be written.
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(endpoint + "\n", encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the status file


class StatusKind(str, enum.Enum):
    """The ``event`` of a status line (each line also has ``time, attempt, rank,
    world_size, step``)."""

    STARTED = "started"  # an attempt began (``resumed_from``; ``resized: in_process`` for a shrink)
    STEP = "step"  # an optimizer step finished (``loss``; ``tokens``: trained in it, all ranks, optional)
    CHECKPOINT_COMMITTED = "checkpoint_committed"  # ``notice_ids`` it answers, ``seconds``, ``bytes``
    HOLDING = "holding"  # committed for an interruption or rejoin: waiting for the restart
    COMPLETED = "completed"  # the target step is committed



class StatusTail:
    """The agent's side of the status file: reads whole new JSON lines."""

    __slots__ = ("path", "_offset")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self._offset += end + 1
        out = []
        for raw in chunk[: end + 1].splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                log.warning("status line not JSON: %r", raw[:200])
                continue
            if isinstance(line, dict):
                out.append(line)
        return out
