"""Who holds rank 0 of a trainer attempt: the rule behind every status line that changes the job.

An agent's token vouches for its own node, not for the job. A trainer attempt (one
torchrun incarnation, or one in-process resize) is led by the node whose workers hold
global rank 0; only that node's lines (``started``, ``checkpoint_committed``,
``completed``) and heartbeat step change the job. Every node's agent forwards the
``started`` line of its own workers (its LOCAL_RANK 0: ``rank`` is that worker's global
rank), so a claim to rank 0 can be checked against the other nodes' word.

A node's claim to lead attempt ``A`` at world size ``W`` (its ``started`` line with
``rank: 0``) is accepted (:func:`claim_verdict`) when

1. it leads the running attempt (rank 0 stays on its node: an in-process grow or a
   shrink that keeps rank 0, a restart that lands rank 0 on the same node), or
2. it is the only node admitted to the job (every other member is leaving or gone: the
   survivor of a shrink), or
3. another node reported its own workers in ``A`` at world size ``W`` with a rank other
   than 0 (a second node's word: one token cannot forge it): the running attempt's
   leader, while it is admitted (rank 0 moved to another node in a restart: only the
   node that held it can hand it over, so no number of other tokens can take the job
   from a leader that is still there), else any admitted node;

provided no other admitted node claims rank 0 of ``A`` too (then neither is taken: one
of them lies, and the daemon cannot tell which; the running attempt's leader is never
blocked this way, by rule 1). A claimant that is leaving (noticed, draining) may lead
by rule 3: two notices at once put rank 0 of the survivors' attempt on the second
noticed node, and its commit answering its own notice is that attempt's; a leaving
node's own word (rule 2) never suffices. Otherwise the claim waits for its
corroboration (a later line, or a node leaving) and changes nothing.

What one token can still do: withhold its own workers' ``started`` line, so a leader
change that only it could corroborate waits (the job trains on, the daemon's view of it
lags); and before any attempt is recorded (the job's first start, no leader yet) two
tokens that agree can claim the first attempt.

Example: n1 n2 n3 train attempt ``a1`` led by n1. n3's token sends ``started`` of
``evil`` at rank 0, world size 1: rule 1 fails (n1 leads), rule 2 fails (three admitted
nodes), rule 3 fails (nobody else reported ``evil``): nothing recorded. n1 is noticed
and leaves; n2 and n3 shrink in-process to attempt ``a2``, rank 0 on n2: n2's claim waits
until n3's ``started`` of ``a2`` (rank 1, world size 2) arrives, then is taken (n1, the
old leader, is leaving: any admitted node may vouch).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

__all__ = ["StartReport", "Verdict", "claim_verdict", "leaders_claimed"]


@dataclass(frozen=True, slots=True)
class StartReport:
    """One node's ``started`` line, as the rule needs it: ``rank`` is the global rank of
    the node's LOCAL_RANK 0 worker, ``world_size`` the attempt's."""

    node: str
    attempt: str
    rank: int | None
    world_size: int | None


class Verdict(str, Enum):
    """What :func:`claim_verdict` says of a claim to rank 0."""

    ACCEPT = "accept"  # the claimant leads the attempt
    WAIT = "wait"  # not corroborated yet: keep it, decide again later
    CONFLICT = "conflict"  # another admitted node claims rank 0 of the same attempt


def leaders_claimed(attempt: str, reports: Iterable[StartReport], admitted: frozenset[str]) -> set[str]:
    """The admitted nodes that claim rank 0 of ``attempt``."""
    return {r.node for r in reports if r.attempt == attempt and r.rank == 0 and r.node in admitted}


def claim_verdict(claim: StartReport, *, running_leader: str | None, admitted: frozenset[str],
                  reports: Iterable[StartReport]) -> Verdict:
    """Whether ``claim`` (a ``started`` line with rank 0) makes its node the attempt's leader.

    Args:
        claim: the claim; its ``node`` must be a member of the job (the caller drops
            lines of other nodes before this).
        running_leader: the node that leads the attempt the job runs now (None: none
            recorded yet).
        admitted: the nodes admitted to the job and not leaving (``NodeState.RUNNING``);
            the claimant may be leaving (a member draining).
        reports: the other ``started`` lines the daemon kept (any node, any attempt;
            the claim itself may be among them).

    Returns:
        :class:`Verdict` (see the module docstring for the rules, in order).
    """
    if claim.node == running_leader:
        return Verdict.ACCEPT
    reports = list(reports)
    if leaders_claimed(claim.attempt, reports, admitted) - {claim.node}:
        return Verdict.CONFLICT
    if admitted == {claim.node}:
        return Verdict.ACCEPT
    vouching = {running_leader} if running_leader in admitted else admitted
    for r in reports:
        if (r.node != claim.node and r.node in vouching and r.attempt == claim.attempt and r.rank != 0
                and r.world_size == claim.world_size):
            return Verdict.ACCEPT
    return Verdict.WAIT
