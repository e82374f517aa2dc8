"""The in-process resizes of an :class:`~trainer.loop.ElasticJob`: its group changes, its
processes stay.

Three ways the group changes at a step boundary, every rank alike:

- **shrink**: the survivors of an interruption notice re-form the group after the notice
  commit (:meth:`Resizer.shrink`);
- **grow**: rank 0 found workers waiting in the join queue (:mod:`trainer.membership`) and
  admits them (:meth:`Resizer.grow`); a joiner queues and waits (:meth:`Resizer.join`);
- **recovery** of a peer lost without notice is :mod:`trainer.recovery`'s, and ends here
  too (:meth:`Resizer.restart_attempt`, :meth:`Resizer.send_state`).

Each ends in a new attempt in the same processes (:meth:`Resizer.restart_attempt`): the
batch re-planned, new status and step logs, the state spread over the new world by the
job's :meth:`~trainer.loop.ElasticJob.reshard`, and a ``started`` line with
``resized: "in_process"``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from trainer.batch import BatchError, ElasticBatch
from trainer.contract import JOIN_CREDENTIAL_ENV, LOG_DIR_ENV, STATUS_FILE_ENV
from trainer.exchange import broadcast_json
from trainer.guard import Decision
from trainer.membership import JobCompleted, JoinQueue, JoinRefused, JoinTimeout, Ticket, run_id
from trainer.memwatch import PeakRss
from trainer.runtime import (StatusWriter, StepLog, broadcast_state, new_attempt_id, regroup, rendezvous_endpoint,
                             shrink_process_group)
from trainer.store_retry import StoreRetry, store_reachable

__all__ = ["Resizer", "can_shrink"]

log = logging.getLogger("trainer.run")


def can_shrink(job: Any, decision: Decision) -> bool:
    """Whether the survivors of ``decision`` go on in these processes. The same on every
    rank: it reads only the decision, the job's flags (:attr:`~trainer.loop.ElasticJob.resizes_in_process`,
    its batch) and the environment the agent gives every node."""
    leaving = set(decision.leaving_ranks)
    survivors = job.ctx.world_size - len(leaving)
    if not (job.resizes_in_process and job.ctx.initialized and leaving and survivors > 0
            and "rejoin" not in decision.kinds and rendezvous_endpoint() is not None):
        return False
    try:
        ElasticBatch(job.G, job.plan.micro_batch_size).plan(survivors)
    except BatchError as exc:
        if job.ctx.is_leader:
            log.warning("no in-process shrink to world %d (%s): holding for a restart", survivors, exc)
        return False
    return True


class Resizer:
    """The resize path of one job: shrink, grow, join, and the new attempt after each.

    Changes the job's group (``ctx``), batch plan, attempt, status and step logs; calls
    the job's hooks for its state (:meth:`~trainer.loop.ElasticJob.stage_state`,
    :meth:`~trainer.loop.ElasticJob.reshard`, ``peer_state``/``load_peer_state``).
    Every method is collective over the group it names.
    """

    def __init__(self, job: Any) -> None:
        self.job = job
        self._queue: JoinQueue | None = None
        self._pick: list[Ticket] = []  # rank 0: the joiners this boundary's decision admits
        self._retry = StoreRetry()  # rank 0's join check while the store is out of reach
        self.stage_s = 0.0  # the last notice's stage_state, before its commit (s): the shrink's started line has it
        #: the host memory a resize takes above what the process held (its stage and rebuild; not a commit)
        self.memory = PeakRss()

    @property
    def can_grow(self) -> bool:
        """The group can change in these processes (in-process resizes, a rendezvous store)."""
        job = self.job
        return bool(job.resizes_in_process and job.ctx.initialized and rendezvous_endpoint() is not None)

    # -- shrink

    def stage(self, decision: Decision) -> None:
        """Before a notice's commit: its status line lets the leaving nodes' agents stop
        them, and a sharded job's leaving ranks hold shards the survivors still need."""
        t0 = time.perf_counter()
        leaving = set(decision.leaving_ranks)
        with self.memory.track():
            self.job.stage_state([r for r in range(self.job.ctx.world_size) if r not in leaving])
        self.stage_s = time.perf_counter() - t0

    def shrink(self, decision: Decision) -> None:
        """The survivors of a notice go on at the smaller world size without a restart.

        Called on every rank right after the notice commit (and :meth:`stage`, before it,
        while the leaving ranks are sure to be there). A leaving rank (its node has the
        notice) waits for its agent to stop it, as a held rank does. A survivor re-forms
        the default process group over the survivors
        (:func:`~trainer.runtime.shrink_process_group`) and starts a new attempt at the
        same step (:meth:`restart_attempt`): its ``started`` line says ``resumed_from``
        the step just committed. The model, the optimizer's state and the data position
        are already in memory, so nothing is loaded. If anything fails here the worker
        exits non-zero, torchrun restarts the group, and it resumes from that same commit.
        """
        job = self.job
        step = job.state.step
        leaving = set(decision.leaving_ranks)
        survivors = [r for r in range(job.ctx.world_size) if r not in leaving]
        if job.ctx.rank in leaving:
            job.status.emit("holding", step, notice_ids=list(decision.notice_ids),
                            kinds=list(decision.kinds), timeout_s=job.args.hold_timeout_s)
            time.sleep(job.args.hold_timeout_s)  # the agent stops this node after the commit
            raise RuntimeError(f"rank {job.ctx.rank} was not stopped within {job.args.hold_timeout_s:.0f} s "
                               "of leaving; exiting so torchrun restarts it")
        old_world, t0 = job.ctx.world_size, time.perf_counter()
        endpoint = rendezvous_endpoint()
        assert endpoint is not None  # can_shrink
        job.ddp = job.state.model  # drop DDP's hooks on the old group before it goes
        # run_id(): the same on a node that joined in-process (its launcher's own torchrun
        # has another TORCHELASTIC_RUN_ID; the first bench run hung here for the pg timeout)
        job.ctx = shrink_process_group(job.ctx, survivors, f"spotvisor/{run_id()}/shrink/{job.attempt}/{step}",
                                       endpoint, job.args.pg_timeout_s, store_wait_s=job.args.store_wait_s)
        self.restart_attempt(old_world, t0, "shrunk", resumed_from=step,
                             **({} if job.state_replicated else {"stage_s": round(self.stage_s, 4)}))

    # -- hold

    def hold(self, decision: Decision) -> None:
        """No in-process shrink (a rejoin, ``--resize restart``, a batch the survivors cannot
        split): keep alive until restarted (``--hold-timeout-s``), then train on."""
        job = self.job
        step, timeout_s = job.state.step, job.args.hold_timeout_s
        job.status.emit("holding", step, notice_ids=list(decision.notice_ids), kinds=list(decision.kinds),
                        timeout_s=timeout_s)
        if job.ctx.is_leader:
            log.info("holding at step %d for a restart (notices %s, timeout %.0f s)", step,
                     ",".join(decision.notice_ids), timeout_s)
        job.guard.hold_for_restart(timeout_s, step)
        if job.ctx.is_leader:
            log.warning("no restart within %.0f s of holding: training on", timeout_s)

    # -- grow

    def joiners_waiting(self) -> int:
        """Rank 0: how many workers to admit at this boundary (0 on other ranks, and when
        the store cannot be read: training never waits for the queue). While the store is
        out of reach the check is skipped, tried again with backoff (:class:`StoreRetry`),
        each try bounded by a 1 s connect probe; a store back empty starts a new queue."""
        job = self.job
        self._pick = []
        if not (job.ctx.is_leader and self.can_grow):
            return 0
        if not self._retry.due():
            return 0  # the store was out of reach a moment ago: no round trip, no wait, until the next try
        try:
            if self._queue is None:
                endpoint = rendezvous_endpoint()
                assert endpoint is not None
                if not store_reachable(endpoint):  # never wait a client's connect timeout in a step boundary
                    raise ConnectionError(f"{endpoint[0]}:{endpoint[1]} does not answer")
                self._queue = JoinQueue(endpoint, run_id(), timeout_s=min(10.0, job.args.pg_timeout_s),
                                        verifier=None if job.credential is None else job.credential.verifier())
            batch = ElasticBatch(job.G, job.plan.micro_batch_size)
            self._pick = self._queue.ready(job.ctx.world_size, batch.is_valid)
        except Exception as exc:  # the control node's store out of reach (or restarted: a new client)
            self._queue = None
            self._retry.failed(exc, what="rank 0's join check (skipped meanwhile; training goes on)")
            return 0
        self._retry.ok()
        return len(self._pick)

    def grow(self, joiners: int) -> None:
        """Admit ``joiners`` waiting workers into the running group at this step boundary,
        without restarting anyone.

        Called on every rank of the group; rank 0 found them (:meth:`joiners_waiting`)
        and writes their admissions. Every rank joins the new group (old ranks keep their
        numbers and the joiners follow; a sharded job's ``grow_ranks`` may place the
        joiners among them, rank 0 staying 0), rank 0 sends its state (a sharded job's:
        metadata) to the joiners (:meth:`send_state`: a broadcast over rank 0 and them
        only), and a new attempt starts at the same step. Nothing is committed or
        loaded. If anything fails here the worker exits non-zero and torchrun restarts
        the group from the last commit.
        """
        job = self.job
        step, old_world, t0 = job.state.step, job.ctx.world_size, time.perf_counter()
        endpoint = rendezvous_endpoint()
        assert endpoint is not None  # can_grow, on rank 0; the same environment everywhere
        world = old_world + joiners
        prefix = f"spotvisor/{run_id()}/grow/{job.attempt}/{step}"
        with self.memory.track():
            job.stage_state(list(range(old_world)))
        # the new rank of each old rank, then of each joiner: a sharded job places its
        # joiners where the fewest bytes move (the same on every old rank), others append them
        place = getattr(job, "grow_ranks", None)
        ranks = place(joiners) if place is not None else list(range(world))
        if job.ctx.is_leader:
            assert self._queue is not None and len(self._pick) == joiners
            self._queue.admit(self._pick, prefix=prefix, first_rank=old_world, world_size=world,
                              ranks=ranks[old_world:])
            log.info("admitting %d joining worker(s) of node(s) %s at step %d", joiners,
                     ",".join(dict.fromkeys(t.node for t in self._pick)), step)
        job.ddp = job.state.model  # drop DDP's hooks on the old group before it goes
        job.ctx = regroup(job.ctx, ranks[job.ctx.rank], world, prefix, endpoint, job.args.pg_timeout_s,
                          store_wait_s=job.args.store_wait_s)
        self.send_state(0, sorted(ranks[old_world:]))
        self.restart_attempt(old_world, t0, "grew", resumed_from=None, joined=joiners)

    def join(self, node: str, local_rank: int, local_world: int) -> None:
        """Queue as ``local_rank`` of ``local_world`` workers of ``node``, wait to be
        admitted, join the group and take the state from its rank 0 (a collective with it).

        Raises:
            SystemExit(1): nobody admitted it within ``--join-timeout-s``, rank 0 refused
                its ticket, or it has no join credential (one warning line).
            SystemExit(0): the job completed while it waited.
        """
        job = self.job
        endpoint = rendezvous_endpoint()
        assert endpoint is not None
        if job.credential is None:
            log.warning("node %s has no join credential (%s): no running group would admit it; exiting", node,
                        JOIN_CREDENTIAL_ENV)
            raise SystemExit(1)
        queue = JoinQueue(endpoint, run_id(), timeout_s=job.args.pg_timeout_s)
        try:
            ticket = queue.queue_up(node, local_rank, local_world, wait_s=job.args.join_timeout_s,
                                    credential=job.credential)
            if job.ctx.is_local_leader or local_world == 1:
                log.warning("node %s waiting to join the running group (ticket %d)", node, ticket.number)
            admission = queue.wait(ticket)
        except JobCompleted as exc:
            log.warning("%s; exiting", exc)
            raise SystemExit(0) from None
        except (JoinTimeout, JoinRefused) as exc:
            log.warning("%s; exiting", exc)
            raise SystemExit(1) from None
        t0 = time.perf_counter()
        job.ddp = job.state.model
        job.ctx = regroup(job.ctx, admission.rank, admission.world_size, admission.prefix, endpoint,
                          job.args.pg_timeout_s, node_key=f"joined:{node}", store_wait_s=job.args.store_wait_s)
        self.send_state(0, sorted(admission.ranks))
        self.restart_attempt(admission.first_rank, t0, "joined", resumed_from=None, joined=len(admission.ranks))

    def complete(self) -> None:
        """Rank 0, the target step committed: nobody waits to join a job that has ended."""
        if self.can_grow and store_reachable(rendezvous_endpoint()):
            with contextlib.suppress(Exception):
                JoinQueue(rendezvous_endpoint(), run_id(), timeout_s=10).complete(self.job.state.step)

    # -- after any of them

    def restart_attempt(self, old_world: int, t0: float, verb: str, *, resumed_from: int | None,
                        from_commit: bool = False, **fields: Any) -> None:
        """A new attempt in these processes, after the group changed: the batch re-planned,
        new status and step logs, the state spread over the new world and the model
        re-wrapped (the job's ``reshard``), and its ``started`` line (``resized: "in_process"``).
        ``resumed_from``: the commit it goes on from (a shrink: the notice's), None for a
        grow (the state came from a peer, not from a commit). ``from_commit``: the state
        is reloaded from the newest commit (a sharded job that lost a peer's shards)."""
        job = self.job
        job.plan = ElasticBatch(job.G, job.plan.micro_batch_size).plan(job.ctx.world_size)
        job.attempt = new_attempt_id(job.ctx)
        job.steplog.close()
        job.status = StatusWriter(os.environ.get(STATUS_FILE_ENV), job.ctx, job.attempt)
        job.steplog = StepLog(os.environ.get(LOG_DIR_ENV), job.ctx, job.attempt)
        job.states_in_sync = True  # the survivors' own, or sent by a peer just now
        try:
            with self.memory.track():
                loaded = job.reshard(from_commit=from_commit)
        finally:
            job.states_in_sync = False
        peak = self.memory.take()
        if peak is not None:
            fields["peak_extra_bytes"] = peak
        # a job's own figures of the resize (DcpJob: the bytes its peer-to-peer reshard moved)
        fields.update(getattr(job, "resize_report", dict)())
        if from_commit:
            resumed_from = loaded
        step = job.state.step
        job.recovery.follow()
        seconds = time.perf_counter() - t0
        if job.ctx.is_leader:
            log.info("%s in-process from world %d to %d at step %d in %.3f s (attempt %s)",
                     verb, old_world, job.ctx.world_size, step, seconds, job.attempt)
        job.status.emit("started", step, resumed_from=resumed_from, resized="in_process", old_world_size=old_world,
                        resize_s=round(seconds, 4), global_batch_size=job.G,
                        micro_batch_size=job.plan.micro_batch_size, grad_accum_steps=job.plan.grad_accum_steps,
                        **fields)

    def send_state(self, src: int, receivers: list[int]) -> None:
        """Collective over the new group: rank ``src`` sends its state and progress to
        ``receivers`` over a group of just them (the joiners of a grow; the survivors a
        step behind after a loss); the other ranks only take part in creating that group."""
        job = self.job
        group = dist.new_group([src, *receivers])
        if job.ctx.rank != src and job.ctx.rank not in receivers:
            return
        leader = job.ctx.rank == src
        info = broadcast_json({"step": job.state.step, "seed": job.seed, "committed_step": job.committed_step,
                               "handled_ids": job.guard.handled_ids,
                               "data": job.data_position(job.state.step) if job.streaming else None}
                              if leader else None, src=src, group=group)
        t0 = time.perf_counter()
        state = broadcast_state(job.peer_state() if leader else None, src=src, device=job.ctx.device, group=group)
        dist.destroy_process_group(group)
        if leader:
            return
        job.load_peer_state(state)
        if job.state.step != info["step"]:
            raise RuntimeError(f"the state from rank {src} is at step {job.state.step}, "
                               f"its progress says {info['step']}")
        job.seed = int(info["seed"])
        job.committed_step = info["committed_step"]
        job.guard.mark_handled(info["handled_ids"])
        job.start_data(info["data"])
        if job.ctx.is_local_leader:
            nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, torch.Tensor))
            if nbytes:
                log.warning("took the state of step %d from rank %d (%d bytes in %.2f s)", job.state.step, src,
                            nbytes, time.perf_counter() - t0)
            else:  # a sharded job: its shards come in the reshard, peer to peer from their holders
                log.warning("took step %d's progress from rank %d; the shards come from the ranks holding them",
                            job.state.step, src)
