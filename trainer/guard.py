"""Notice-driven checkpoint decisions, taken by all ranks at the same step.

The node agent writes ``$SPOTVISOR_NOTICE_FILE`` (atomic tmp + rename), a JSON
list of notices::

    [{"id": "n-abc", "kind": "interruption", "time": 1700000000.0, "deadline": 1700000120.0}]

Only the ranks on the noticed node can see it, and a collective save entered by
some ranks only hangs. So at every step boundary every rank calls
:meth:`PreemptionGuard.check`, which all-reduces (MAX) the local flags
``[need_checkpoint, need_hold]``; only when something is needed do the ranks
all-gather the notice ids (as JSON: :mod:`trainer.exchange`), so each rank holds the
same union and the commit records it. Example with two nodes::

    step 41: node B's agent writes an interruption notice n-1
    step 42 boundary: B's ranks see n-1 -> flags [1, 1]; A's ranks [0, 0]
                      all-reduce MAX -> [1, 1] on every rank, ids gathered: (n-1,)
                      every rank commits step 42 with notice_ids (n-1,), then holds
    B is taken -> A's next hold all-reduce fails (gloo, ~3 s) -> worker exits non-zero
                -> torchrun re-rendezvous at the smaller world -> resume from step 42

Ids already handled (the committed manifest keeps them in ``extra["notice_ids"]``)
are ignored, so a restarted worker never acts on the same notice twice.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.contract import NOTICE_FILE_ENV, NoticeEntry, NoticeFileError, NoticeKind, parse_notices
from trainer.exchange import all_gather_json

__all__ = [
    "Decision",
    "PreemptionGuard",
    "PeerLeftError",
]

log = logging.getLogger(__name__)

#: How many handled notice ids are remembered (oldest dropped first).
MAX_HANDLED_IDS = 200


@dataclass(frozen=True, slots=True)
class Decision:
    """What all ranks do at this step boundary (identical on every rank).

    ``kinds[i]`` is the kind of ``notice_ids[i]``. ``leaving_ranks``: the ranks whose
    own node has an interruption notice (they read it from their node's notice file),
    ascending; the rest of the world survives the preemption. ``joiners``: how many
    workers rank 0 found waiting to join (:mod:`trainer.membership`); not a reason to
    commit: they get the state from a peer. ``periodic``: some rank's loop is due a
    periodic commit of this step, so every rank commits it (whether to enter a commit's
    collectives is never a rank's own conclusion).
    """

    checkpoint: bool = False
    hold: bool = False
    notice_ids: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    leaving_ranks: tuple[int, ...] = ()
    joiners: int = 0
    periodic: bool = False

    def __bool__(self) -> bool:
        return self.checkpoint or self.hold


class PeerLeftError(RuntimeError):
    """A peer's worker ended while this rank held (its collective failed): torchrun is
    restarting the group (a node joined or was taken). ``str()`` is one line."""


def _dist_world() -> int:
    """World size of the default group, or 1 when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _collective_device() -> torch.device:
    """Where small collective tensors must live for the default group's backend."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PreemptionGuard:
    """Reads the notice file at each step boundary and agrees on a decision.

    Args:
        notice_file: path of the notice file; default ``$SPOTVISOR_NOTICE_FILE``;
            None/empty means no notices ever (still collective: peers may have some).
        handled_ids: notice ids already acted on (from the resumed manifest).
        max_handled: how many handled ids to remember.

    ``check`` and ``hold`` are collective: every rank of the default process group
    must call them at the same point. Without an initialized process group (or at
    world size 1) they act locally.
    """

    __slots__ = ("notice_file", "_handled", "_max_handled", "_warned", "_warned_entries")

    def __init__(
        self,
        notice_file: str | os.PathLike[str] | None = None,
        *,
        handled_ids: Iterable[str] = (),
        max_handled: int = MAX_HANDLED_IDS,
    ) -> None:
        if notice_file is None:
            notice_file = os.environ.get(NOTICE_FILE_ENV) or None
        if max_handled < 1:
            raise ValueError(f"max_handled must be >= 1, got {max_handled}")
        self.notice_file = os.fspath(notice_file) if notice_file else None
        self._max_handled = max_handled
        self._handled: dict[str, None] = {}
        self._warned = False
        self._warned_entries: set[str] = set()
        self.mark_handled(handled_ids)

    @property
    def handled_ids(self) -> list[str]:
        """Handled notice ids, oldest first (at most ``max_handled``)."""
        return list(self._handled)

    def mark_handled(self, ids: Iterable[str]) -> None:
        for nid in ids:
            self._handled.pop(nid, None)
            self._handled[nid] = None
        while len(self._handled) > self._max_handled:
            del self._handled[next(iter(self._handled))]

    def pending(self) -> list[NoticeEntry]:
        """Local unhandled notices (not collective). A bad file counts as none."""
        if not self.notice_file:
            return []
        try:
            with open(self.notice_file, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._warn_once(f"cannot read notice file {self.notice_file}: {exc}")
            return []
        if not raw.strip():
            return []
        try:
            notices, problems = parse_notices(raw)
        except NoticeFileError as exc:
            self._warn_once(f"ignoring notice file {self.notice_file}: {exc}")
            return []
        self._warned = False  # a later bad file is worth a new warning
        for problem in problems:
            if problem not in self._warned_entries:
                self._warned_entries.add(problem)
                log.warning("ignoring notice entry in %s: %s", self.notice_file, problem)
        seen: set[str] = set()
        out = []
        for n in notices:
            if n.id in self._handled or n.id in seen:
                continue
            seen.add(n.id)
            out.append(n)
        return out

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s", message)

    def check(self, joiners: int = 0, periodic: bool = False) -> Decision:
        """Decide, on every rank alike, whether to commit and whether to hold.

        Collective (one all-reduce of four ints; plus an all-gather of the notices,
        as JSON, only when some rank has a notice). Blocks until every rank has called it.
        ``joiners``: rank 0's count of workers waiting to join (0 elsewhere); every rank
        gets it back as ``Decision.joiners``. ``periodic``: this rank's loop is due a
        periodic commit; ``Decision.periodic`` is true on every rank when it is on any.

        Raises:
            RuntimeError: (from torch.distributed) a peer left; let it propagate.
        """
        local = self.pending()
        need_ckpt = int(bool(local))
        need_hold = int(any(n.kind.needs_hold for n in local))
        if _dist_world() <= 1:
            if not local:
                return Decision(joiners=joiners, periodic=periodic)
            return Decision(
                checkpoint=True,
                hold=bool(need_hold),
                notice_ids=tuple(n.id for n in local),
                kinds=tuple(n.kind.value for n in local),
                leaving_ranks=(0,) if any(n.kind is NoticeKind.INTERRUPTION for n in local) else (),
                joiners=joiners,
                periodic=periodic,
            )
        flags = torch.tensor([need_ckpt, need_hold, joiners, int(periodic)], dtype=torch.int64,
                             device=_collective_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        need_ckpt, need_hold, joiners, agreed = (int(v) for v in flags.tolist())
        periodic = bool(agreed)
        if not need_ckpt:
            return Decision(joiners=joiners, periodic=periodic)
        # with the node (torchrun's GROUP_RANK): every local rank of a noticed node leaves,
        # even one that read the notice file a moment before the agent wrote it
        node = os.environ.get("GROUP_RANK", str(dist.get_rank()))
        gathered = all_gather_json([node, [[n.id, n.kind.value] for n in local]])  # parsed, never unpickled
        union: dict[str, str] = {}
        noticed_nodes: set[str] = set()
        for node_id, part in filter(None, gathered):
            for nid, kind in part:
                union.setdefault(nid, kind)
                if kind == NoticeKind.INTERRUPTION.value:
                    noticed_nodes.add(node_id)
        leaving = [rank for rank, g in enumerate(gathered) if g is not None and g[0] in noticed_nodes]
        return Decision(
            checkpoint=True,
            hold=bool(need_hold),
            notice_ids=tuple(union),
            kinds=tuple(union.values()),
            leaving_ranks=tuple(leaving),
            joiners=joiners,
            periodic=periodic,
        )

    def hold_for_restart(self, timeout_s: float, step: int) -> None:
        """:meth:`hold`, as a trainer uses it after committing ``step``: when a peer
        leaves, this worker exits with status 1 (``SystemExit``) after one warning line,
        for torchrun to restart the group from that commit, instead of a traceback that
        reads like a crash in ``spotctl tail``. Returns after ``timeout_s`` with no
        restart."""
        try:
            self.hold(timeout_s)
        except PeerLeftError as exc:
            log.warning("%s at step %d; exiting for torchrun to restart the group from that commit", exc, step)
            raise SystemExit(1) from None

    def hold(self, timeout_s: float, poll_s: float = 0.25) -> None:
        """Stay at this step boundary until the restart comes, or ``timeout_s`` passes.

        Collective keep-alive: each iteration all-reduces (MAX) a "resume" flag that
        rank 0 raises once ``timeout_s`` has elapsed, then sleeps ``poll_s``; all ranks
        return in the same iteration. The usual ends are not a return:

        - a peer leaves (its node was taken, or torchrun stopped it first): the
          all-reduce raises (gloo: ~3 s), as :class:`PeerLeftError`. The worker must
          exit non-zero so torchrun restarts the group (exiting 0 mid-job closes the
          rendezvous for good, pytorch#123678);
        - torchrun restarts the group (a node joined): SIGTERM, default handling.

        Raises:
            ValueError: negative ``timeout_s`` or non-positive ``poll_s``.
            PeerLeftError: a peer left (the collective's error is its ``__cause__``).
        """
        if timeout_s < 0 or poll_s <= 0:
            raise ValueError(f"bad hold timeout_s={timeout_s} / poll_s={poll_s}")
        deadline = time.monotonic() + timeout_s
        if _dist_world() <= 1:
            while (left := deadline - time.monotonic()) > 0:
                time.sleep(min(poll_s, left))
            return
        is_leader = dist.get_rank() == 0
        device = _collective_device()
        while True:
            flag = torch.tensor(
                [1 if is_leader and time.monotonic() >= deadline else 0],
                dtype=torch.int64,
                device=device,
            )
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            except RuntimeError as exc:  # gloo: "Connection closed by peer ..."; NCCL: a DistBackendError
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise PeerLeftError(f"a peer left the hold ({first[:200]})") from exc
            if int(flag.item()):
                return
            time.sleep(poll_s)
