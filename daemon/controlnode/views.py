"""What ``spotctl status`` and the final bill read: pure functions of the supervisor's state."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from daemon.config import Config
from daemon.control.state import JobView
from daemon.model import Node

__all__ = ["spot_cost", "status"]


def spot_cost(nodes: Iterable[Node], now: float) -> dict[str, Any]:
    """What the pool's instances cost so far: ``cost_usd`` = Σ over nodes of
    ``price_usd_h`` (the spot price at launch, USD/hour) × hours held
    (:meth:`Node.hours_held`: launch request → terminal state, or ``now``, unix s);
    ``node_hours``; ``instances`` (nodes that got an instance)."""
    held = [n for n in nodes if n.instance_id is not None]
    return {
        "cost_usd": round(sum(n.price_usd_h * n.hours_held(now) for n in held), 6),
        "node_hours": round(sum(n.hours_held(now) for n in held), 6),
        "instances": len(held),
    }


def status(config: Config, job: JobView, nodes: Iterable[Node], *, target_nodes: int, desired_nodes: int,
           paused: bool, now: float, placement: dict[str, Any] | None = None,
           domain_of: Callable[[Node], str] | None = None, checks: dict[str, Any] | None = None,
           code: dict[str, Any] | None = None, rendezvous: dict[str, Any] | None = None) -> dict[str, Any]:
    """``GET /v1/status``: the pool, the job, every node (oldest first, with its placement
    domain and the ``job.workdir`` version it runs), ``placement``: the job's domain, the
    migration in flight, the counts, ``checks``: the cloud check
    (:meth:`daemon.controlnode.check_gate.CheckGate.status`), and ``code``: the version this
    daemon run pins, and the line saying the buying halted over ``job.setup`` failures ("" while it buys),
    ``rendezvous``: the job's rendezvous store not answering, while it does not
    (:meth:`daemon.controlnode.rendezvous_watch.RendezvousWatch.status`; ``{}`` otherwise)."""
    return {
        "pool": {"name": config.pool.name, "target_nodes": target_nodes, "desired_nodes": desired_nodes,
                 "min_nodes": config.pool.min_nodes, "max_nodes": config.pool.max_nodes, "paused": paused},
        "job": {
            # the newest step heard: a commit's report can come before the heartbeat that carries its step
            "id": config.job.id, "state": job.state.value, "step": _newest_step(job.step, job.last_commit_step),
            "target_steps": config.job.target_steps, "world_size": job.world_size,
            "last_commit_step": job.last_commit_step, "last_commit_time": job.last_commit_time,
            "restarts": max(0, len(job.attempts) - 1 - job.resizes_in_process),
            "resizes_in_process": job.resizes_in_process,
            "why": job.end_reason,  # failed or cancelled: why (daemon/controlnode/job_life.py)
        },
        "nodes": [
            {
                "id": n.id, "provider": n.provider, "zone": n.zone, "instance_type": n.instance_type,
                "gpus": n.gpus, "state": n.state.value, "instance_id": n.instance_id,
                "uptime_s": None if n.ready_at is None or n.state.is_terminal() else round(now - n.ready_at, 1),
                "price_usd_h": n.price_usd_h, "step": n.step, "detail": n.detail,
                "domain": domain_of(n) if domain_of is not None else None,
                "code_version": n.code_version or None,
            }
            for n in sorted(nodes, key=lambda n: n.ordinal)
        ],
        "placement": placement or {},
        "checks": checks or {},
        "code": code or {},
        "rendezvous": rendezvous or {},
    }


def _newest_step(step: int | None, committed: int | None) -> int | None:
    """The job's step for ``spotctl status``: the newest heartbeat's, or the newest commit's
    when that is ahead (the commit's report came first: status showed ``STEP 582`` beside
    ``LAST COMMIT step 600``). A resumed job starts at its newest commit, so no step below it
    is ever current."""
    if step is None or committed is None:
        return step if committed is None else committed
    return max(step, committed)
