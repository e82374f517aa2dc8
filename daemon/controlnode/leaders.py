"""Which node leads which trainer attempt: the edge of :mod:`daemon.control.attempts`.

Every node's agent forwards its own workers' ``started`` line; :class:`Leaders` keeps
the newest few per node (bounded: :data:`STARTS_KEPT` a node, and a node's lines go
when it leaves the job), which node each recorded attempt is led by, and asks the pure
rule whether a claim to rank 0 is taken. The :class:`~.job_tracker.JobTracker` acts on
the verdict.
"""

from __future__ import annotations

import collections
from typing import Callable

from daemon.control.attempts import StartReport, Verdict, claim_verdict
from daemon.control.lifecycle import ADMITTED, MEMBERS
from daemon.control.reports import StatusLine
from daemon.controlnode.core import Core

__all__ = ["Leaders", "STARTS_KEPT", "UNLED_KEPT"]

# the ``started`` lines kept per node (its newest): the other nodes' word on who leads an attempt
STARTS_KEPT = 4
# completions of an attempt nobody leads yet, kept per node until it is led (the tracker's hold)
UNLED_KEPT = 4

Unled = tuple[str, StatusLine, float]  # (node, line, since: unix s)


class Leaders:
    """The attempts' leaders and the ``started`` lines that vouch for them."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.of: dict[str, str] = {}  # trainer attempt → the node of its rank 0 (taken claims only)
        self._starts: dict[str, collections.deque[StatusLine]] = {}  # node → its newest started lines
        #: node → the attempt its workers last reported starting (any rank): who holds ranks
        #: of the running attempt (daemon.control.reactions.on_loss_without_notice)
        self.node_attempt: dict[str, str] = {}
        self._unled: list[Unled] = []  # lines of attempts nobody leads yet, at most UNLED_KEPT a node

    def hold_unled(self, node_id: str, line: StatusLine, now: float) -> None:
        """Keep ``line`` until its attempt is led; a node's oldest goes first (one token
        pushes out only its own)."""
        mine = [u for u in self._unled if u[0] == node_id]
        if len(mine) >= UNLED_KEPT:
            self._unled.remove(mine[0])
        self._unled.append((node_id, line, now))

    def take_unled(self, which: Callable[[Unled], bool]) -> list[Unled]:
        """The kept lines ``which`` selects, no longer kept."""
        taken = [u for u in self._unled if which(u)]
        for u in taken:
            self._unled.remove(u)
        return taken

    def attempt_of(self, node_id: str) -> str:
        """The trainer attempt ``node_id``'s workers last reported starting ("" if none)."""
        return self.node_attempt.get(node_id, "")

    def running(self) -> str | None:
        """The node that holds rank 0 of the attempt the job runs (None: none recorded)."""
        return self.of.get(self.core.job.attempt or "")

    def heard(self, node_id: str, line: StatusLine) -> None:
        """``node_id``'s workers started ``line.attempt`` (any rank)."""
        self.node_attempt[node_id] = line.attempt
        self._starts.setdefault(node_id, collections.deque(maxlen=STARTS_KEPT)).append(line)

    def verdict(self, node_id: str, line: StatusLine) -> Verdict:
        """What :func:`~daemon.control.attempts.claim_verdict` says of ``node_id``'s claim
        to rank 0 of ``line.attempt``, on the lines kept now."""
        return claim_verdict(
            StartReport(node_id, line.attempt, line.rank, line.world_size), running_leader=self.running(),
            admitted=frozenset(n.id for n in self.core.nodes.values() if n.state in ADMITTED),
            reports=[StartReport(n, s.attempt, s.rank, s.world_size) for n, lines in self._starts.items() for s in lines])

    def waiting(self) -> list[tuple[str, StatusLine]]:
        """The claims to rank 0 nobody has taken yet, as (node, line); the lines of nodes
        no longer in the job are forgotten first."""
        for node_id in [n for n in self._starts if getattr(self.core.nodes.get(n), "state", None) not in MEMBERS]:
            del self._starts[node_id]
        return [(n, s) for n, lines in self._starts.items() for s in lines if s.rank == 0 and s.attempt not in self.of]
