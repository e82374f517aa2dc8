"""The operator's verbs (``spotctl scale / pause / resume``) as pure decisions.

Each ``check_*`` raises ValueError with a one-line reason the CLI prints (the verb is
refused, nothing changes); each decision returns the actions that carry the verb out.

Example (target 3 → 1, nodes n1 n2 n3 running, n4 admitting for a grow): :func:`scale`
returns ``[EndRejoin(n4 back to ready), Drain(n3), Drain(n2)]``: the grow is withdrawn
(the planner then releases n4, surplus), and the two youngest running nodes commit and
leave, so no step is lost.
"""

from __future__ import annotations

from typing import Sequence

from daemon.control.actions import Action, Drain, EndRejoin, PoolState
from daemon.control.lifecycle import ADMITTED, NodeState

__all__ = ["check_scale", "scale", "check_pause", "pause", "check_resume"]


def check_scale(s: PoolState, nodes: int, *, min_nodes: int, max_nodes: int,
                valid_counts: Sequence[int] | None, gpus_per_node: int, global_batch_size: int,
                micro_batch_size: int) -> None:
    """Raises ValueError: ``nodes`` outside ``min_nodes..max_nodes``, a node count whose
    world size the global batch cannot be split over (``valid_counts``; None: mixed
    offers, admission decides), or the job is over."""
    if not min_nodes <= nodes <= max_nodes:
        raise ValueError(f"scale {nodes}: the pool allows {min_nodes}..{max_nodes} nodes "
                         "(pool.min_nodes / pool.max_nodes in the config)")
    if s.job.is_terminal():
        raise ValueError(f"the job is {s.job.value}: there is nothing to scale")
    if valid_counts is not None and nodes not in valid_counts:
        raise ValueError(f"scale {nodes}: world size {nodes * gpus_per_node} cannot share global batch "
                         f"{global_batch_size} in micro batches of {micro_batch_size} "
                         f"(node counts that can: {', '.join(map(str, valid_counts)) or 'none'})")


def scale(s: PoolState, nodes: int, *, old: int) -> list[Action]:
    """A new target of ``nodes`` (was ``old``), not paused: the planner launches or releases
    nodes not in the job; running nodes beyond the target leave by a drain, youngest first;
    a shrink withdraws a grow in flight."""
    out: list[Action] = []
    if nodes < old and s.rejoin is not None:  # no half-done grow
        out.append(_withdraw(s, "scale_in"))
    in_job = sorted((n for n in s.nodes if n.state in ADMITTED and not n.replacing), key=lambda n: -n.ordinal)
    out += [Drain(n.id, "scale_in") for n in in_job[: max(0, len(in_job) - nodes)]]
    return out


def check_pause(s: PoolState) -> None:
    """Raises ValueError: the job is over or already paused."""
    if s.job.is_terminal():
        raise ValueError(f"the job is {s.job.value}: there is nothing to pause")
    if s.paused:
        raise ValueError("the job is already paused (spotctl resume relaunches it)")


def pause(s: PoolState) -> list[Action]:
    """Commit and release everything: a grow in flight is withdrawn and every running
    node drained (its trainer commits at the next step boundary, one commit answering
    all, and leaves); the planner releases nodes not in the job (target 0)."""
    out: list[Action] = [_withdraw(s, "pause")] if s.rejoin is not None else []
    return out + [Drain(n.id, "pause") for n in s.in_state(*ADMITTED)]


def check_resume(s: PoolState) -> None:
    """Raises ValueError: the job is not paused, or the pause still holds nodes (their
    commit may not be written yet)."""
    if s.job.is_terminal() or not s.paused:
        raise ValueError(f"the job is {s.job.value}, not paused: there is nothing to resume")
    live = [n.id for n in sorted(s.nodes, key=lambda n: n.ordinal) if not n.state.is_terminal()]
    if live:
        raise ValueError(f"the pause is still releasing {', '.join(live)}: resume once they are gone "
                         "(spotctl status, or the job_paused event)")


def _withdraw(s: PoolState, reason: str) -> EndRejoin:
    assert s.rejoin is not None
    return EndRejoin(s.rejoin.id, reason, withdraw_from=tuple(n.id for n in s.in_state(*ADMITTED)),
                     back_to_ready=tuple(n.id for n in s.in_state(NodeState.ADMITTING)))
