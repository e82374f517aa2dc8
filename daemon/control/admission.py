"""Admission: which ready nodes join the job, and when. A pure function.

:func:`admit` reads the pool's state (:class:`~daemon.control.actions.PoolState`) and
returns the actions that move nodes into the job. It is the default policy's
(:class:`~daemon.control.policies.Spotvisor`) and walks through three cases:

1. **The job starts** (``pending``): once ``target_nodes`` nodes are ready (or
   ``min_nodes`` are and ``rejoin_timeout_s`` passed since the first was), the largest
   valid prefix of them, oldest first, is admitted together (``job_start``).
2. **A grow** (the job runs): the new nodes must not cost the job a step. With
   ``grow_in_process`` they are admitted at once (``join_running``): their workers join
   the running group at a step boundary (:mod:`trainer.membership`); a ``job.command``
   job's are admitted at once too (``restart``: torchrun restarts every worker with
   them; the script resumes from its own checkpoint). Otherwise the nodes in
   the job are asked for a **rejoin** commit (:class:`RequestRejoin`); the new nodes
   wait in ``admitting`` and are admitted once the commit is answered, or after
   ``rejoin_timeout_s``. Not while a noticed node is still in the job (its workers would
   be counted in torchrun's next round, which then hangs): the request waits until it
   has left, and a request already sent is withdrawn (:class:`EndRejoin`).
3. **No survivors**: the job runs but no node is in it (all left): the new nodes start it
   from its newest commit at once (``no_survivors``).

Example (target 3, one GPU each, valid world sizes {1, 2, 3}): n1 n3 run, n2 left after
its notice, n4 registers → ``RequestRejoin(nodes=(n4,), ask=(n1, n3))``; n1's commit
answers it → ``Admit(n4, "rejoin")``, ``EndRejoin``; torchrun's next round is n1 n3 n4.

Never admits a combination whose world size the global batch cannot be split over
(:func:`largest_valid`), also when the world changed while a grow waited for its
commit. Pure: no I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from daemon.control.actions import (Action, Admit, Drain, EndRejoin, NodeView, NoteFirstReady, PoolState,
                                    RequestRejoin, StartJob)
from daemon.control.lifecycle import ADMITTED, NOT_IN_JOB_YET, JobState, NodeState, TrainerState, leaving

__all__ = ["Rules", "admit", "largest_valid"]


@dataclass(frozen=True, slots=True)
class Rules:
    """What admission must respect (from the config). Seconds for times.

    ``valid_world_sizes``: world sizes the global batch splits over;
    ``rejoin_timeout_s``: how long a pending job waits for its target, and a grow for
    its rejoin commit; ``prewarm_wait_s``: how long a grow waits for a new node's
    torchrun to finish importing before it asks for the rejoin commit anyway;
    ``grow_in_process``: a new node joins the running group in-process
    (``job.grow: in_process``): admitted at once, no rejoin commit, nobody holds;
    ``rejoin_commit``: False for the user's own script (``job.command``), which answers
    no commit request: a new node is admitted at once (``restart``), torchrun restarts
    every worker with it, and the script resumes from its own checkpoint.
    """

    min_nodes: int
    valid_world_sizes: frozenset[int]
    rejoin_timeout_s: float
    prewarm_wait_s: float = 60.0
    grow_in_process: bool = False
    rejoin_commit: bool = True


def largest_valid(candidates: Sequence[NodeView], world: int, valid: frozenset[int]) -> list[NodeView]:
    """The longest prefix of ``candidates`` that, added to ``world`` (GPUs), is a valid world size."""
    best: list[NodeView] = []
    total = world
    for i, n in enumerate(candidates):
        total += n.gpus
        if total in valid:
            best = list(candidates[: i + 1])
    return best


def admit(s: PoolState, rules: Rules, *, now: float) -> list[Action]:
    """The default admission (module docstring). Returns actions; changes nothing.
    Only nodes of the job's placement domain (``s.domain``) are looked at: a node of
    another domain never joins the job (one job, one network)."""
    if s.job.is_terminal() or s.paused:
        return []
    s = s.in_domain()
    ready = s.in_state(NodeState.READY)
    if s.job is JobState.PENDING:
        return _start(s, rules, ready, now)
    running = s.in_state(*ADMITTED)
    drains = _drain_replaced(s, running, ready)
    if drains:
        return drains
    going = [n.id for n in s.nodes if leaving(n)]
    admitting = s.in_state(NodeState.ADMITTING)
    if admitting:
        return _end_grow(s, rules, running, admitting, going, now)
    if not ready or going:
        return []
    return _grow(rules, running, ready, now)


def _drain_replaced(s: PoolState, running: list[NodeView], ready: list[NodeView]) -> list[Action]:
    """Rebalance policy "replace": once the replacement is up, drain the node at risk; and
    when no replacement is coming (none in flight, and the nodes staying already make the
    target: the operator scaled in meanwhile), drain it too, or it stays in the job for good."""
    replacing = [n for n in running if n.replacing]
    if replacing and ready:
        return [Drain(n.id, "rebalance_replaced") for n in replacing]
    in_flight = [n for n in s.nodes if n.state in NOT_IN_JOB_YET]
    if replacing and not in_flight and len(running) - len(replacing) >= s.desired_nodes:
        return [Drain(n.id, "rebalance_not_replaced") for n in replacing]
    return []


def _end_grow(s: PoolState, rules: Rules, running: list[NodeView], admitting: list[NodeView], going: list[str],
              now: float) -> list[Action]:
    """Nodes wait in ``admitting`` for a grow's rejoin commit: withdraw the request while a
    noticed node is still in the job (``going``), wait while the commit is on its way, else
    admit the largest valid prefix and end the grow."""
    rj = s.rejoin
    if going and rj is not None and not rj.answered:
        return [EndRejoin(rj.id, f"rejoin_deferred: {', '.join(going)} still in the job",
                          withdraw_from=_ids(running), back_to_ready=_ids(admitting))]
    timed_out = rj is not None and now - rj.requested_at > rules.rejoin_timeout_s
    if rj is not None and not rj.answered and not timed_out and running:
        return []  # the rejoin commit is on its way
    # the world may have changed since the request (a node lost without notice): admit
    # the largest valid prefix now; the rest go back to ready for the next grow
    world = sum(n.gpus for n in running)
    chosen = largest_valid(admitting, world, rules.valid_world_sizes)
    rest = _ids(admitting[len(chosen):])
    out: list[Action] = []
    if rj is not None and rj.answered:
        out.append(EndRejoin(rj.id, "answered", back_to_ready=rest))
    elif rj is not None and timed_out:
        out.append(EndRejoin(rj.id, "rejoin_checkpoint_timeout", withdraw_from=_ids(running), back_to_ready=rest))
    elif rj is not None:
        out.append(EndRejoin(rj.id, "no_survivors", back_to_ready=rest))  # nobody left in the job to answer it
    elif rest:  # admitting nodes with no grow in flight (a restarted daemon): the rest wait
        out += [EndRejoin("", "no_rejoin", back_to_ready=rest)]
    return out + [Admit(n.id, "rejoin") for n in chosen]


def _grow(rules: Rules, running: list[NodeView], ready: list[NodeView], now: float) -> list[Action]:
    """``ready`` nodes join the running job: at once when they join in-process or the
    job is the user's script; else through a rejoin commit asked of ``running``."""
    if rules.grow_in_process and running:
        # its workers queue and the running group takes them in at a step boundary, with
        # the state from a peer: nobody holds, so nothing waits for its import either
        chosen = largest_valid(ready, sum(n.gpus for n in running), rules.valid_world_sizes)
        return [Admit(n.id, "join_running") for n in chosen]
    if not rules.rejoin_commit and running:
        # nobody would answer the commit request: no hold, so nothing waits for its import either
        chosen = largest_valid(ready, sum(n.gpus for n in running), rules.valid_world_sizes)
        return [Admit(n.id, "restart") for n in chosen]
    # a node whose torchrun is still importing would make the survivors hold, idle,
    # through that import: they train on until it is warm, or prewarm_wait_s after it registered
    ready = [n for n in ready
             if n.trainer is not TrainerState.WARMING or now - (n.ready_at or now) >= rules.prewarm_wait_s]
    world = sum(n.gpus for n in running)
    chosen = largest_valid(ready, world, rules.valid_world_sizes)
    if not chosen:
        return []
    if not running:
        return [Admit(n.id, "no_survivors") for n in chosen]
    return [RequestRejoin(_ids(chosen), _ids(running), "grow")]


def _start(s: PoolState, rules: Rules, ready: list[NodeView], now: float) -> list[Action]:
    if not ready:
        return []
    out: list[Action] = []
    first = s.first_ready_at
    if first is None:
        first = now
        out.append(NoteFirstReady(now))
    enough = len(ready) >= s.target_nodes  # the operator's target (spotctl scale)
    waited = now - first > rules.rejoin_timeout_s
    if enough or (waited and len(ready) >= rules.min_nodes):
        chosen = largest_valid(ready, 0, rules.valid_world_sizes)
        if chosen:
            out += [Admit(n.id, "job_start", len(chosen)) for n in chosen]
            out.append(StartJob("enough nodes" if enough else f"min_nodes after {rules.rejoin_timeout_s:g} s"))
    return out


def _ids(nodes: Sequence[NodeView]) -> tuple[str, ...]:
    return tuple(n.id for n in nodes)
