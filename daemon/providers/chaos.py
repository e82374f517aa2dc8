"""Chaos schedule for the local provider: notices and hard kills from the config.

Each :class:`daemon.config.ChaosEvent` fires once, in config order, when the job
has reached its ``at_step`` (the trainer's reported step) or ``at_s`` seconds
after the job first started, and — with ``wait_full_pool`` — when the job runs at
the pool's target world size with no node joining or leaving. Then it either
publishes an interruption notice on the node's metadata endpoint (the provider
SIGKILLs the node when the notice's time comes) or SIGKILLs it at once; or
(``kill_store``) SIGKILLs the rendezvous store this run started and starts it again,
empty, ``restart_after_s`` later; or (``capacity_out``) answers a domain's launches
with capacity errors for a while; or (``kill_daemon``) records the event and SIGKILLs
the daemon itself, or (``kill_control_node``) SIGKILLs the rendezvous store and then the
daemon, or (``partition_leader``, under ``ha:``) records the event for the outside runner
to cut the daemon off from etcd: an outside runner (:mod:`daemon.interfaces.demo_runner`)
starts them again, and the restarted daemon fires only the events no earlier one
recorded (:func:`events_left`). With
``hold_replacements_for_steps`` the instances launched after the fault do not
boot until the job, resumed after the fault, has trained that many steps (the
schedule waits for it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Coroutine, Iterable

import structlog

from daemon.config import DAEMON_FAULTS, ChaosEvent
from daemon.controlnode.rendezvous import read_pid
from daemon.model import Event, EventKind, NodeState
from daemon.providers.local_instance import STORE_PID_FILE_ENV
from daemon.controlnode.supervisor import Supervisor

if TYPE_CHECKING:
    from daemon.controlnode.rendezvous import RunnerStore, StoreProcess

__all__ = ["run_chaos", "ready_to_fire", "silent_trainer", "events_left", "kills_unanswered"]

log = structlog.get_logger("spotvisor.chaos")

#: seconds after the job started before an ``at_step`` event waiting on a script that
#: reports nothing is said to wait for steps that may never come
SILENT_WARN_S = 60.0


def events_left(stored: Iterable[Event], n: int) -> list[int]:
    """The indices of a schedule of ``n`` events that no daemon of this state fired yet.

    Every fired event, skipped ones included, is recorded as ``chaos_injected`` with its
    ``index`` before anything else happens (a ``kill_daemon`` is recorded before the kill):
    those indices are done. Pure; records of indices outside ``0..n-1`` (a schedule since
    shortened) are ignored.
    """
    done = {e.data.get("index") for e in stored if e.kind == EventKind.CHAOS_INJECTED.value}
    return [i for i in range(n) if i not in done]


def kills_unanswered(stored: Iterable[Event]) -> list[Event]:
    """The daemon kills (``kill_daemon``, ``kill_control_node``, not skipped) no restarted
    daemon has answered yet with its ``daemon_restarted`` record. Pure."""
    chaos = [e for e in stored if e.kind == EventKind.CHAOS_INJECTED.value]
    answered = {e.data.get("index") for e in chaos if e.data.get("action") == "daemon_restarted"}
    return [e for e in chaos if e.data.get("action") in DAEMON_FAULTS and not e.data.get("skipped")
            and e.data.get("index") not in answered]


def silent_trainer(sup: Supervisor) -> bool:
    """Whether the job's trainer has reported nothing: a ``job.command`` script with no
    ``started`` line yet (a plain script never sends one; one with the HF callback or
    the trainer library does). The daemon then knows neither its step, nor its world
    size, nor when it resumed. Pure."""
    return sup.job.world_size is None and sup.job.step is None and sup.config.job.command is not None


def ready_to_fire(ev: ChaosEvent, sup: Supervisor, now: float, *, previous: tuple[float, str] | None = None) -> bool:
    """Pure check of an event's trigger against the supervisor's view.

    ``previous``: (time, node id) of the last event fired. With ``wait_full_pool``
    the next event also waits until that one is absorbed: its node is gone and the
    job resumed after it, so two faults never land in one resize by accident. For a
    trainer that reports nothing (:func:`silent_trainer`) the pool is what can be
    seen: the target number of nodes running, none joining, the previous event's node
    gone; an ``at_step`` event waits for steps it never reports (:func:`_fire_all` says so).
    """
    job = sup.job
    if job.started_at is None or job.state.is_terminal():
        return False
    silent = silent_trainer(sup)
    if ev.wait_full_pool and previous is not None:
        fired_at, node_id = previous
        prev = sup.nodes.get(node_id)
        if (prev is not None and not prev.state.is_terminal()) or (not silent and (job.resumed_at or 0) <= fired_at):
            return False
    if ev.at_step is not None and (job.step is None or job.step < ev.at_step):
        return False
    if ev.at_s is not None and now - job.started_at < ev.at_s:
        return False
    if ev.wait_full_pool:
        # The whole target pool is in the job: every running node counted in the
        # world size (when the trainer reports one), nobody joining, and no node still
        # in the job while draining.
        running = [n for n in sup.nodes.values() if n.state is NodeState.RUNNING]
        if len(running) < sup.config.pool.target_nodes or (
                not silent and job.world_size != sum(n.gpus for n in running)):
            return False
        if any(n.state in (NodeState.READY, NodeState.ADMITTING) for n in sup.nodes.values()):
            return False
    return True


async def run_chaos(sup: Supervisor, events: list[ChaosEvent], *, tick_s: float = 0.25,
                    rendezvous: "StoreProcess | RunnerStore | None" = None) -> None:
    """Fire ``events`` in order, those an earlier daemon of this state fired excepted
    (:func:`events_left`). Needs a provider with ``publish_interruption``/``kill``;
    ``kill_store`` needs the store process this run started, or the outside runner's
    (``rendezvous``; without it the event is recorded as skipped: under ``spotvisord run``
    the store is its own unit);
    ``kill_daemon`` and ``kill_control_node`` need an outside runner (else skipped)."""
    provider = sup.fleet.provider
    if not (hasattr(provider, "publish_interruption") and hasattr(provider, "kill")):
        log.warning("chaos_unsupported", provider=provider.name)
        return
    restarts: list[asyncio.Task[None]] = []  # a killed store's restart: later events may fire during its outage
    try:
        await _fire_all(sup, events, tick_s, rendezvous, restarts)
        await asyncio.gather(*restarts)
    finally:
        for task in restarts:
            task.cancel()


async def _fire_all(sup: Supervisor, events: list[ChaosEvent], tick_s: float,
                    rendezvous: "StoreProcess | RunnerStore | None",
                    restarts: list[asyncio.Task[None]]) -> None:
    provider = sup.fleet.provider
    previous: tuple[float, str] | None = None
    stored = sup.store.events(kinds=[EventKind.CHAOS_INJECTED.value])
    for killed in kills_unanswered(stored):  # this daemon is the restart: the outage's end, in the log
        sup.record(EventKind.CHAOS_INJECTED, None, index=killed.data.get("index"), action="daemon_restarted",
                   down_s=round(time.time() - killed.time, 2), step=sup.job.step)
    left = events_left(stored, len(events))
    if len(left) < len(events):
        log.info("chaos_resumed", fired=len(events) - len(left), left=left)
    for i in left:
        ev = events[i]
        said = False
        while not ready_to_fire(ev, sup, sup.clock(), previous=previous):
            if sup.job.state.is_terminal():
                return
            if not said and ev.at_step is not None and silent_trainer(sup) and sup.job.started_at is not None \
                    and sup.clock() - sup.job.started_at > SILENT_WARN_S:
                said = True  # the schedule is not stuck without a word: it waits for steps nobody reports
                log.warning("chaos_waits_for_steps", index=i, at_step=ev.at_step,
                            reason="the job.command script reports no steps; give this event at_s instead")
            await asyncio.sleep(tick_s)  # polling the job's progress, not synchronising
        if ev.action == "kill_store":
            if (restart := await _kill_store(sup, i, ev, rendezvous)) is not None:
                restarts.append(asyncio.create_task(restart, name=f"chaos:store_restart:{i}"))
            continue
        if ev.action == "partition_leader":
            _partition_leader(sup, i, ev, provider)  # the runner cuts once it reads the event in etcd
            continue
        if ev.action in DAEMON_FAULTS:
            # a store restart in flight ends first: it is this daemon that records it, and a
            # control-node kill reads the store's pid, which would name the dead store (seen
            # under load: overdue events fired 1 s apart, store_restarted was never recorded,
            # and the runner waited 30 s for a restart the control-node kill never caused)
            await asyncio.gather(*restarts)
            _kill_daemon(sup, i, ev, provider)  # returns only when skipped
            continue
        if ev.action == "capacity_out":
            domain = sup.config.domain(ev.domain)
            provider.capacity_out(domain.region, ev.for_s)
            sup.record(EventKind.CHAOS_INJECTED, None, index=i, action="capacity_out", domain=domain.name,
                       for_s=ev.for_s, step=sup.job.step)
            sup.wake()
            continue
        node = next((n for n in sup.nodes.values() if n.ordinal == ev.node), None)
        if node is None or node.instance_id is None or node.state is not NodeState.RUNNING:
            log.warning("chaos_target_not_running", index=i, node_ordinal=ev.node)
            sup.record(EventKind.CHAOS_INJECTED, None, index=i, action=ev.action, skipped=True,
                       reason=f"node #{ev.node} is not running")
            continue
        previous = (sup.clock(), node.id)
        hold = ev.hold_replacements_for_steps is not None and hasattr(provider, "hold_boots")
        if hold:
            provider.hold_boots()
        if ev.action == "notice":
            deadline = await provider.publish_interruption(node.instance_id, lead_s=ev.lead_s)
            sup.record(EventKind.CHAOS_INJECTED, node.id, index=i, action="notice", lead_s=ev.lead_s,
                       deadline=deadline.isoformat(), step=sup.job.step)
        else:
            await provider.kill(node.instance_id)
            sup.record(EventKind.CHAOS_INJECTED, node.id, index=i, action="kill", step=sup.job.step)
            sup.wake()
        if hold:
            fired_at = sup.clock()
            try:
                # polling the job's progress, not synchronising: first the resume after the
                # fault (job_resumed sets job.step to the step it resumed from), then N steps
                while not sup.job.state.is_terminal() and (sup.job.resumed_at or 0) <= fired_at:
                    await asyncio.sleep(tick_s)
                until = (sup.job.step or 0) + (ev.hold_replacements_for_steps or 0)
                while not sup.job.state.is_terminal() and (sup.job.step or 0) < until:
                    await asyncio.sleep(tick_s)
            finally:
                provider.release_boots()
            log.info("chaos_replacements_released", index=i, step=sup.job.step)


async def _kill_store(sup: Supervisor, index: int, ev: ChaosEvent,
                      store: "StoreProcess | RunnerStore | None") -> Coroutine[Any, Any, None] | None:
    """SIGKILL the rendezvous store (recorded as ``chaos_injected``) and return its
    restart, for the caller to run as a task while later events fire: it waits
    ``ev.restart_after_s``, starts the store again (empty) and records it. A store that
    will not start again is logged and recorded: the job goes on training, and what
    needs the store (a resize, a restart) waits for it or, past its bounds, stalls and
    says so (``job_stalled``). None when there is no store to kill (recorded as skipped)."""
    if store is None:
        log.warning("chaos_target_not_running", index=index, target="rendezvous store")
        sup.record(EventKind.CHAOS_INJECTED, None, index=index, action="kill_store", skipped=True,
                   reason="no rendezvous store process here (spotvisord demo runs one; a unit restarts its own)")
        return None
    # recorded before the kill: an outside runner, which restarts its store, reads the
    # event's restart_after_s once it sees the store die (daemon.interfaces.demo_runner)
    sup.record(EventKind.CHAOS_INJECTED, None, index=index, action="kill_store", step=sup.job.step,
               restart_after_s=ev.restart_after_s)
    await asyncio.to_thread(store.kill)
    killed_at = time.monotonic()
    return _restart_store(sup, index, ev, store, killed_at)


async def _restart_store(sup: Supervisor, index: int, ev: ChaosEvent, store: "StoreProcess | RunnerStore",
                         killed_at: float) -> None:
    await asyncio.sleep(ev.restart_after_s)  # the outage itself, not a synchronisation
    try:
        await asyncio.to_thread(store.start)
    except RuntimeError as exc:
        log.error("chaos_store_restart_failed", index=index, error=str(exc))
        sup.record(EventKind.CHAOS_INJECTED, None, index=index, action="store_restart_failed", error=str(exc))
        return
    sup.record(EventKind.CHAOS_INJECTED, None, index=index, action="store_restarted",
               down_s=round(time.monotonic() - killed_at, 2), step=sup.job.step)


def _partition_leader(sup: Supervisor, index: int, ev: ChaosEvent, provider: Any) -> None:
    """``partition_leader``: record the event, with the partition's length. The outside
    runner reads it where the pool's events are, in etcd (so it is durable before the
    cut: a daemon that leads again fires it no more), and cuts this daemon off from
    etcd; this daemon cannot renew its lease and stops fail closed (exit 1), and the
    runner heals the partition ``ev.restart_after_s`` after the cut and starts it again.
    Without a runner (under ``spotvisord run`` nobody holds a partition) the event is
    recorded as skipped."""
    if not getattr(provider, "outlives_daemon", False) or sup.config.ha is None:
        reason = ("no outside runner here to cut this daemon off from etcd (spotvisord demo is one when its "
                  "chaos ends the daemon)")
        log.warning("chaos_target_not_running", index=index, target="leader", reason=reason)
        sup.record(EventKind.CHAOS_INJECTED, None, index=index, action=ev.action, skipped=True, reason=reason)
        return
    sup.record(EventKind.CHAOS_INJECTED, None, index=index, action=ev.action, step=sup.job.step,
               restart_after_s=ev.restart_after_s, pid=os.getpid())
    log.warning("chaos_partitioning_leader", index=index, step=sup.job.step, for_s=ev.restart_after_s)


def _kill_daemon(sup: Supervisor, index: int, ev: ChaosEvent, provider: Any) -> None:
    """``kill_daemon`` / ``kill_control_node``: record the event (the store commits as it
    writes: the restarted daemon reads it and fires it no more), SIGKILL the rendezvous store
    for ``kill_control_node`` (the runner's child, its pid in the file :data:`STORE_PID_FILE_ENV`
    names), then
    SIGKILL this process; the runner restarts what died ``ev.restart_after_s`` later.
    Without a runner (the local instances would die with the daemon; under ``spotvisord
    run`` systemd restarts it, and the store is its own unit) the event is recorded as
    skipped and this returns."""
    pid_file = os.environ.get(STORE_PID_FILE_ENV, "")
    store_pid = read_pid(Path(pid_file)) if pid_file else None
    reason = None
    if not getattr(provider, "outlives_daemon", False):
        reason = ("no outside runner here (spotvisord demo is one when its chaos kills the daemon; "
                  "under spotvisord run systemd restarts the daemon)")
    elif ev.action == "kill_control_node" and store_pid is None:
        reason = f"no rendezvous store pid from the runner ({STORE_PID_FILE_ENV}: {pid_file or 'unset'})"
    if reason is not None:
        log.warning("chaos_target_not_running", index=index, target="daemon", reason=reason)
        sup.record(EventKind.CHAOS_INJECTED, None, index=index, action=ev.action, skipped=True, reason=reason)
        return
    sup.record(EventKind.CHAOS_INJECTED, None, index=index, action=ev.action, step=sup.job.step,
               restart_after_s=ev.restart_after_s, pid=os.getpid())
    log.warning("chaos_killing_daemon", index=index, action=ev.action, step=sup.job.step)
    if ev.action == "kill_control_node":
        try:
            os.kill(store_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)
