"""Reactions to a node's own news: an interruption notice, a rebalance recommendation. Pure.

Karpenter's interruption controller is the pattern: the agent's report is parsed once
at the edge (:mod:`daemon.control.reports`), these functions decide, and the
supervisor's actuators act.

Example (the notice → replacement path): n2 (running, trainer running) reports an
interruption notice with deadline T. :func:`on_notice` returns
``[WatchFlush(id, n2, T + 5), Leave(n2), AvoidZone(n2)]``: n2 is ``draining``, which
:data:`daemon.control.lifecycle.COUNTED` leaves out, so the planner's next pass
(:func:`daemon.control.pool.plan`, woken at once) finds the pool one node short and
launches a replacement, ranked away from n2's zone; the flush watch says
``checkpoint_flush_timed_out`` if no commit answers the notice by T + 5 s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from daemon.control.actions import (Action, AvoidZone, Leave, MarkReplacing, NodeView, PoolState, RequestCheckpoint,
                                    WakeSurvivors, WatchFlush)
from daemon.control.lifecycle import ADMITTED, MEMBERS, JobState, NodeState, TrainerState, leaving, training

__all__ = ["FLUSH_GRACE_S", "on_notice", "on_rebalance", "on_trainer_exit", "on_loss_without_notice",
           "WorldSizeMismatch", "world_size_mismatch", "script_completed"]

# a commit reported just before a notice's deadline may still be on its way (the
# agent's report retry backs off up to 5 s): wait this long past it before saying
# the flush timed out
FLUSH_GRACE_S = 5.0


def on_notice(node: NodeView, *, notice_id: str | None, deadline: float | None, lead_s: float,
              now: float, commits: bool = True) -> list[Action]:
    """An interruption notice on ``node``: deadline (unix s, None: unknown, then ``now +
    lead_s``, the cloud's documented lead). ``commits``: False for the user's own script
    (``job.command``), which reports no commit: no flush is watched (its node is SIGTERMed
    by its agent, leaves and is replaced all the same)."""
    out: list[Action] = []
    if training(node) and notice_id is not None and commits:  # its flush must commit before the deadline
        due = deadline if deadline is not None else now + lead_s
        out.append(WatchFlush(notice_id, node.id, due + FLUSH_GRACE_S))
    if not node.state.is_terminal() and node.state is not NodeState.DRAINING:
        out.append(Leave(node.id, "interruption notice"))
    # the replacement prefers another zone (SkyPilot's EAGER_NEXT_REGION, first retry)
    out.append(AvoidZone(node.id, "interruption notice"))
    return out


def on_trainer_exit(node: NodeView, *, exit_code: int, joined_in_process: bool) -> list[Action]:
    """``node``'s trainer exited with ``exit_code``. A node that joined the running group
    in-process (``job.grow: in_process``) and failed (its group failed, or nobody admitted
    it) was never in torchrun's rendezvous, so no torchrun restart will take it back: it
    leaves, is released, and the planner replaces it. Every other exit: nothing here (a
    torchrun node's restarts are torchrun's; exit 0 is the job's end)."""
    if joined_in_process and exit_code != 0 and node.state is NodeState.RUNNING:
        return [Leave(node.id, f"joined in-process, trainer exited {exit_code}")]
    return []


def on_rebalance(node: NodeView, *, policy: str, notice_id: str | None) -> list[Action]:
    """A rebalance recommendation on ``node``, under the pool's ``rebalance_policy``.

    ``checkpoint``: the job commits now and keeps running, so a notice that follows
    finds little to flush. ``replace``: the node stops counting as capacity, a
    replacement launches now, and admission drains the node once the replacement is
    ready. ``ignore``: nothing. Only a running node reacts.
    """
    if node.state is not NodeState.RUNNING or policy == "ignore":
        return []
    if policy == "checkpoint":
        return [RequestCheckpoint(f"rebalance-{notice_id}", (node.id,), "rebalance", about=node.id)]
    return [] if node.replacing else [MarkReplacing(node.id, "rebalance_recommendation")]


def on_loss_without_notice(s: PoolState, lost: Sequence[str]) -> list[Action]:
    """Nodes that were in the job ended (``lost``, ids: heartbeats stopped, or the provider
    lists the instance no more). Those whose workers last reported the attempt the job runs
    now held ranks of it, and their peers may be blocked in a collective on them: an
    instance powered off resets no connection, so the peers would wait for the
    collective's timeout (``--pg-timeout-s``, 120 s by default) before re-forming. Wake
    every rank of that attempt (:class:`WakeSurvivors`): the survivors re-form without
    the lost ranks at once. A node that had left (its notice answered, its attempt over)
    or never reported the running attempt wakes nobody.

    Example: n1 n2 n3 train attempt ``a7`` at world size 3; n2's instance is powered off
    (no notice). 20 s later its heartbeats have stopped for ``heartbeat_timeout_s`` and
    the planner marks it lost: ``[WakeSurvivors("a7", 3, ("n2",))]``; n1's and n3's
    workers leave their blocked all-reduce and go on at world size 2 from the step that
    failed, 100 s before their collective would have timed out.
    """
    if s.job is not JobState.RUNNING or not s.attempt or s.world_size < 2:
        return []
    ids = set(lost)
    held = tuple(sorted(n.id for n in s.nodes if n.id in ids and n.attempt == s.attempt))
    return [WakeSurvivors(s.attempt, s.world_size, held)] if held else []


@dataclass(frozen=True, slots=True)
class WorldSizeMismatch:
    """A trainer attempt with more ranks than the daemon admitted: ``world_size`` ranks
    reported, ``admitted_ranks`` the GPUs of the ``admitted_nodes`` nodes in the job."""

    world_size: int
    admitted_ranks: int
    admitted_nodes: int


def world_size_mismatch(world_size: int, nodes: Iterable[NodeView]) -> WorldSizeMismatch | None:
    """Whether a ``started`` line's ``world_size`` (rank 0's word) disagrees with the daemon:
    more ranks than the GPUs of the nodes in the job (:data:`~daemon.control.lifecycle.MEMBERS`:
    running or draining; each runs ``gpus`` ranks). Ranks the daemon never admitted are
    training: an outsider that reached the rendezvous store, or a node the daemon counts as
    lost whose workers still run. A world *smaller* than that is normal for a while and is
    not flagged: an in-process joiner is ``running`` from its admission but joins the group
    only once its workers have imported, and a node lost without notice is ``running``
    until its heartbeats time out, while its survivors re-form at once.

    Example: n1 and n2 run, one GPU each; rank 0 reports attempt ``a3`` at world size 3:
    ``WorldSizeMismatch(3, 2, 2)``, and the daemon records ``world_size_mismatch``.
    """
    members = [n.gpus for n in nodes if n.state in MEMBERS]
    admitted = sum(members)
    return WorldSizeMismatch(world_size, admitted, len(members)) if world_size > admitted else None


def script_completed(s: PoolState, exit_codes: Mapping[str, int]) -> bool:
    """Whether the user's own script (``job.command``, which reports no step and no
    ``completed`` line) has finished: the job runs, at least one node of the job's domain
    is in it, every such node's torchrun has exited 0 (``exit_codes``: node id → its
    trainer's last exit status; torchrun exits 0 only when every local worker did, and a
    SIGTERMed torchrun exits 1), and no noticed node is still in the job. A crash, a
    notice's node or a node lost is never a completion; a node admitted whose trainer has
    not exited yet keeps the job running.

    Example: n1 n3 n4 in the job; n4's, n1's and then n3's torchrun exit 0 → True at
    n3's exit (the daemon then records ``job_completed`` and releases the pool).
    """
    if s.job is not JobState.RUNNING:
        return False
    in_job = s.in_domain().in_state(*ADMITTED)
    return bool(in_job) and not any(leaving(n) for n in s.nodes) and all(
        n.trainer is TrainerState.EXITED and exit_codes.get(n.id) == 0 for n in in_job)
