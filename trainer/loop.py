"""The elastic training loop every spotvisor trainer shares, whatever its model.

One step boundary, on every rank alike::

    decision = guard.check()                      # collective: all ranks agree
    commit if notice / periodic / final           # the job's commit, status line
    shrink if interruption (survivors)            # re-form the group in-process, go on
    hold if rejoin (or no in-process shrink)      # keep-alive until restarted
    grow if rank 0 found nodes waiting to join    # re-form the group with them, share the state
    train one step; a peer lost without notice    # survivors re-form the group, redo the step
    train one step (grad accumulation)            # positions = step * G + ...

:class:`ElasticJob` is that loop; a job (the reference trainer's GPT-2 in
:mod:`trainer.run`, the DeepSpeed and DCP examples in ``trainer/examples/``) brings its
model, wrapping, commit and train step. :func:`run_job` runs one on this rank.

Exit codes: 0 only when the target step is committed; 2 for a configuration the job
can never run (bad world size, data, checkpoint mismatch); anything else non-zero
for a failure torchrun should restart (a peer left).

The parts a resize touches are kept apart: process-group set-up
(:func:`~trainer.runtime.setup_distributed`, :func:`~trainer.runtime.shrink_process_group`),
model/optimizer state (the job's) and the data position
(:func:`~trainer.runtime.data_position`, :class:`~trainer.sampler.ElasticSampler`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from trainer.batch import BatchError, BatchPlan, ElasticBatch
from trainer.checkpoint import Manifest, open_store
from trainer.contract import JOIN_CREDENTIAL_ENV, LOG_DIR_ENV, NODE_ID_ENV, S3_ENDPOINT_ENV, STATUS_FILE_ENV
from trainer.credential import CredentialError, NodeCredential
from trainer.data import DataError, MapSamples, as_samples, load_data
from trainer.exchange import all_gather_json, broadcast_json
from trainer.guard import Decision, PreemptionGuard
from trainer.membership import (JobCompleted, JoinQueue, JoinRefused, JoinTimeout, LossWatch, Ticket, joining,
                                run_id, settle_survivors)
from trainer.sampler import ElasticSampler
from trainer.stream import StreamSamples
from trainer.tokens import TokenWindows
from trainer.runtime import (
    DistContext,
    StatusWriter,
    StepLog,
    barrier,
    broadcast_state,
    configure_logging,
    configure_threads,
    data_position,
    env_world,
    joiner_context,
    new_attempt_id,
    normalize_uri,
    regroup,
    rendezvous_endpoint,
    setup_distributed,
    shrink_process_group,
    teardown_distributed,
)

__all__ = ["ConfigError", "ElasticJob", "run_job"]

log = logging.getLogger("trainer.run")

PROGRESS_EVERY = 10


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


#: gloo's messages when a peer's connection is gone (its errors are plain RuntimeErrors)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Read error", "Write error",
              "Timed out waiting", "Broken pipe", "Socket closed")


class ConfigError(Exception):
    """A configuration this job can never run with; exit 2, one line on stderr."""


def _credential() -> NodeCredential | None:
    """This node's join credential, out of the environment (None when the daemon gave none).

    Raises:
        ConfigError: it is malformed, or for another run than ``$SPOTVISOR_RUN_ID``.
    """
    try:
        cred = NodeCredential.from_env()
    except CredentialError as exc:
        raise ConfigError(str(exc)) from None
    if cred is not None and cred.run != run_id():
        raise ConfigError(f"${JOIN_CREDENTIAL_ENV} is for run {cred.run!r}, this worker's run is {run_id()!r}")
    return cred


class ElasticJob:
    """One incarnation of an elastic training job on one rank (built by :func:`run_job`).

    What a job brings, as methods: :meth:`build_state` (its model and optimizer; a
    ``.step`` counter), :meth:`wrap` (DDP, FSDP, an engine), :meth:`resume` (load the
    newest intact commit: :func:`trainer.integrations.common.newest_intact`),
    :meth:`commit` (a collective commit that writes the ``checkpoint_committed`` status
    line) and :meth:`train_step`. What every job shares is here: :meth:`run` (the
    step-boundary loop with the agent's status lines and step logs), the in-process
    shrink, the compatibility check of a checkpoint. ``wrap_before_resume``: load into
    the wrapped model (DCP loads into FSDP2's sharded parameters).
    """

    wrap_before_resume = False
    #: The job resizes in its running processes (:meth:`shrink`, :meth:`grow`, :meth:`recover`):
    #: it implements :meth:`peer_state` (and, when sharded, :meth:`stage_state` and
    #: :meth:`reshard`). A job that cannot rebuild its engine at another world size in the
    #: same process (DeepSpeed, the HF Trainer) sets it False and restarts on every change.
    in_process_resize = True
    #: Every rank holds the whole model and optimizer state (DDP): a resize moves no state
    #: between the ranks that stay, and a peer lost without notice costs no step (the
    #: survivors hold everything). A sharded job (FSDP2) sets it False: its resize gathers
    #: the state before the group changes (:meth:`stage_state`) and spreads it over the new
    #: world after (:meth:`reshard`); a lost peer took its shards with it, so the survivors
    #: reload the last commit, in their running processes.
    state_replicated = True

    def __init__(self, args: argparse.Namespace, ctx: DistContext, plan: BatchPlan, data: Any) -> None:
        #: this node's join credential (trainer.credential), taken out of the environment
        #: first thing: rank 0 checks joiners' tickets with it, a joiner proves itself with it
        self.credential = _credential()
        self.args = args
        self.ctx = ctx
        self.plan = plan
        self.G = plan.global_batch_size
        self.attempt = new_attempt_id(ctx)
        self.store = open_store(args.checkpoint_uri, s3_endpoint_url=os.environ.get(S3_ENDPOINT_ENV) or None)
        self.status = StatusWriter(os.environ.get(STATUS_FILE_ENV), ctx, self.attempt)
        self.steplog = StepLog(os.environ.get(LOG_DIR_ENV), ctx, self.attempt)
        #: the samples (:func:`trainer.data.as_samples` of ``data``: token ids, a map-style
        #: dataset, a resumable stream); read them with :meth:`batch`
        self.dataset: TokenWindows | MapSamples | StreamSamples = as_samples(data, args.seq_len)
        if isinstance(self.dataset, StreamSamples):
            self.dataset.set_mark_every(self.G)  # a step trained again starts from its step's mark
        if getattr(args, "vocab_size", None) is None:  # a model built from scratch sizes its embeddings by it
            args.vocab_size = getattr(self.dataset, "vocab_size", None)
        self.sampler: ElasticSampler | None = None  # map-style data's order: set by start_data
        self.seed = args.seed
        self.state = self.build_state()
        self.last_committed: Manifest | None = None  # rank 0's copy of the newest commit
        self.committed_step: int | None = None  # every rank: the newest step this run committed or resumed from
        self.guard = PreemptionGuard()
        self.ddp: torch.nn.Module = self.state.model
        self.joined_in_process = False  # this worker joined a running group (announced by join_running)
        #: every rank holds the same model state now (set by an in-process resize for
        #: :meth:`wrap`): a wrapper may skip its initial broadcast of the parameters
        self.states_in_sync = False
        self._queue: JoinQueue | None = None
        self._pick: list[Ticket] = []  # rank 0: the joiners this boundary's decision admits
        self._queue_warned = False
        self._step_s = 0.0  # the last step's duration (s): a lost peer's survivors wait about that long for each other
        self._watch: LossWatch | None = None  # unblocks this worker when other survivors re-form without it
        self._stage_s = 0.0  # the last notice's stage_state, before its commit (s): the shrink's started line has it

    # -- what a job brings

    def build_state(self) -> Any:
        """The model and optimizer on ``self.ctx.device``, with a ``step`` counter (0)."""
        raise NotImplementedError

    def wrap(self) -> None:
        """Spread the model over the world (DDP, FSDP, an engine); sets ``self.ddp``."""
        raise NotImplementedError

    def resume(self) -> None:
        """Load the newest intact commit (or start at 0); sets ``last_committed``,
        ``committed_step`` and ``sampler``."""
        raise NotImplementedError

    def commit(self, *, reason: str, decision: Decision) -> None:
        """Collective: commit ``state.step`` (once: a step already committed only records the
        notices it answers, :func:`trainer.checkpoint.record_answered`) and write the
        ``checkpoint_committed`` status line."""
        raise NotImplementedError

    def train_step(self) -> tuple[float, float, list[int]]:
        """One optimizer step. Returns (global mean loss, this rank's mean loss, positions)."""
        raise NotImplementedError

    def step_tokens(self) -> int | None:
        """Tokens one optimizer step trains, all ranks together (the ``step`` line's
        ``tokens``: tokens/s in ``/metrics`` and ``spotctl status``): :attr:`tokens_per_step`;
        None when the dataset has no ``seq_len``. A job whose samples
        differ in length returns the step's own count."""
        return self.tokens_per_step if isinstance(getattr(self.dataset, "seq_len", None), int) else None

    def peer_state(self) -> dict[str, Any]:
        """The whole training state (model, optimizer, step) as a ``state_dict``-like
        tree of tensors, for a peer that joins or fell a step behind
        (:func:`~trainer.runtime.broadcast_state`). Jobs with ``in_process_resize``
        implement it."""
        raise NotImplementedError

    def load_peer_state(self, state: dict[str, Any]) -> None:
        """Load :meth:`peer_state` of a peer into ``self.state``."""
        raise NotImplementedError

    # -- the data position (every job's; a job calls start_data in its resume)

    @property
    def streaming(self) -> bool:
        """The samples come off a stream (no length, no shuffle; the position has a state)."""
        return isinstance(self.dataset, StreamSamples)

    @property
    def tokens_per_step(self) -> int:
        """Token positions one optimizer step trains on, over all ranks: ``G x seq_len``
        (a padded map-style example counts its padding)."""
        return self.G * self.dataset.seq_len

    def start_data(self, position: dict[str, Any] | None = None) -> None:
        """Set the sample order up for ``self.seed`` and put a stream at ``position`` (a
        commit's ``data_position``, or a peer's; None: the start). Called by :meth:`resume`
        and after taking a peer's state."""
        if not self.streaming:
            self.sampler = ElasticSampler(len(self.dataset), self.seed)
            return
        assert isinstance(self.dataset, StreamSamples)
        position = position or {}
        state = position.get("stream")
        if state is None and position.get("consumed_samples"):
            log.warning("the data position has no stream state: reading the stream from its start to sample %d",
                        position["consumed_samples"])
        self.dataset.restore(state if state is not None else self.dataset.initial_state())

    def batch(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of the samples at global ``positions``, int64 ``(len, seq_len)``."""
        if self.streaming:
            return self.dataset.batch(positions)
        if self.sampler is None:  # a resume() that did not call start_data: the order of this seed
            self.start_data()
        return self.dataset.batch([self.sampler.index(p) for p in positions])

    def data_position(self, step: int) -> dict[str, Any]:
        """The manifest's ``data_position`` after ``step`` steps: where the sample stream resumes."""
        consumed = step * self.G
        if self.streaming:
            assert isinstance(self.dataset, StreamSamples)
            return {"consumed_samples": consumed, "seed": self.seed, "stream": self.dataset.state_at(consumed)}
        return data_position(step, self.G, self.seed, len(self.dataset))

    def stage_state(self, keep: list[int]) -> None:
        """Collective over the group about to change, on every rank of it (the leaving ranks
        of a notice too), before it changes: put what :meth:`reshard` needs where it will
        be. ``keep``: the old ranks that stay, ascending (``keep[0]`` becomes rank 0).
        Replicated state needs nothing (the default); a sharded job gathers its shards."""

    def reshard(self, *, from_commit: bool) -> int | None:
        """Spread the state over the new group after it changed (every rank of it, the
        joiners too), and wrap the model for it. ``from_commit``: a peer was lost with its
        shards (never for replicated state): load the newest commit instead.

        Returns:
            the step loaded from a commit, or None when the state came from memory or peers.
        """
        self.wrap()
        return None

    def _check_compatible(self, manifest: Manifest) -> None:
        if manifest.global_batch_size != self.G:
            raise ConfigError(
                f"checkpoint step {manifest.step} in {self.store.uri} was trained with global_batch_size "
                f"{manifest.global_batch_size}, not {self.G}: the data position would not be exact"
            )
        pos = manifest.data_position
        seed = pos.get("seed", self.seed)
        if seed != self.seed:
            log.warning("checkpoint seed %s differs from --seed %s: keeping the checkpoint's", seed, self.seed)
            self.seed = int(seed)
        n = pos.get("dataset_len")
        if self.streaming != ("stream" in pos) and manifest.step > 0:
            raise ConfigError(f"checkpoint step {manifest.step} in {self.store.uri} was trained on "
                              f"{'a stream' if 'stream' in pos else 'a map-style dataset'}, this job reads "
                              f"{'a stream' if self.streaming else 'a map-style dataset'}: the data position would "
                              "not be exact")
        if n is not None and not self.streaming and n != len(self.dataset):
            log.warning("dataset has %d samples, checkpoint was written with %d: the sample order changes",
                        len(self.dataset), n)

    def run(self) -> None:
        args, target = self.args, self.args.target_steps
        resumed_from = self.last_committed.step if self.last_committed else None
        if not self.joined_in_process:  # a joiner's started line is join_running's
            self.status.emit("started", self.state.step, resumed_from=resumed_from,
                             global_batch_size=self.G, micro_batch_size=self.plan.micro_batch_size,
                             grad_accum_steps=self.plan.grad_accum_steps)
        if self.ctx.is_leader:
            log.info("attempt %s: world %d, global batch %d = %d x %d accum x %d ranks, %s samples, step %d/%d",
                     self.attempt, self.ctx.world_size, self.G, self.plan.micro_batch_size,
                     self.plan.grad_accum_steps, self.ctx.world_size,
                     "a stream of" if self.streaming else len(self.dataset), self.state.step, target)
        start_step = self.state.step
        self._follow()
        t_window, n_window = time.perf_counter(), 0
        while True:
            step = self.state.step
            failed = None  # a collective failed because a peer is gone: its first line
            try:
                decision = self.guard.check(self._joiners_waiting() if step < target else 0)
            except RuntimeError as exc:
                if not self._lost_a_peer(exc):
                    raise
                failed = _first_line(exc)
            if failed is not None:  # out of the except clause: its traceback no longer holds the old group
                self.recover(failed)  # a peer lost without notice: the survivors go on without it
                t_window, n_window = time.perf_counter(), 0
                continue
            final = step >= target
            # not a step committed already (the survivors of an in-process shrink are
            # back at the notice's step: committing it again at their world size would
            # be a second, different manifest for one step)
            periodic = (args.checkpoint_interval > 0 and step > start_step and step != self.committed_step
                        and step % args.checkpoint_interval == 0)
            shrinking = not final and decision.hold and self._can_shrink(decision)
            if shrinking:
                # before the commit: its status line lets the leaving nodes' agents stop them,
                # and a sharded job's leaving ranks hold shards the survivors still need
                t_stage = time.perf_counter()
                self.stage_state([r for r in range(self.ctx.world_size) if r not in set(decision.leaving_ranks)])
                self._stage_s = time.perf_counter() - t_stage
            if final or decision.checkpoint or periodic:
                reason = "final" if final else ("notice" if decision.checkpoint else "periodic")
                self.commit(reason=reason, decision=decision)
            if final:
                break
            if shrinking:
                self.shrink(decision)
                t_window, n_window = time.perf_counter(), 0
                continue
            if decision.hold:
                self.status.emit("holding", step, notice_ids=list(decision.notice_ids),
                                 kinds=list(decision.kinds), timeout_s=args.hold_timeout_s)
                if self.ctx.is_leader:
                    log.info("holding at step %d for a restart (notices %s, timeout %.0f s)",
                             step, ",".join(decision.notice_ids), args.hold_timeout_s)
                self.guard.hold_for_restart(args.hold_timeout_s, step)
                if self.ctx.is_leader:
                    log.warning("no restart within %.0f s of holding: training on", args.hold_timeout_s)
                t_window, n_window = time.perf_counter(), 0
            elif decision.joiners:
                self.grow(decision.joiners)
                t_window, n_window = time.perf_counter(), 0
                continue  # the same boundary again, with the joiners (their loop starts there)
            t_step = time.perf_counter()
            try:
                loss, local_loss, positions = self.train_step()
                self._step_s = time.perf_counter() - t_step
            except RuntimeError as exc:
                if not self._lost_a_peer(exc):
                    raise
                failed = _first_line(exc)
            if failed is not None:
                self.recover(failed)  # and the step again, at the smaller world (or the step done, healed)
                t_window, n_window = time.perf_counter(), 0
                continue
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.state.step}")
            self.steplog.write(self.state.step, positions, local_loss)
            self.status.step(self.state.step, loss=loss, tokens=self.step_tokens())
            n_window += 1
            if self.ctx.is_leader and (self.state.step % PROGRESS_EVERY == 0 or self.state.step == target):
                dt = (time.perf_counter() - t_window) / max(n_window, 1)
                log.info("step %d/%d loss %.4f %.3f s/step world %d", self.state.step, target, loss, dt,
                         self.ctx.world_size)
                t_window, n_window = time.perf_counter(), 0
        self.status.emit("completed", self.state.step)
        if self.ctx.is_leader:
            log.info("completed: step %d committed", self.state.step)
            if self._can_grow():  # nobody waits to join a job that has ended
                with contextlib.suppress(Exception):
                    JoinQueue(rendezvous_endpoint(), run_id(), timeout_s=10).complete(self.state.step)

    # -- in-process shrink (DESIGN: "where it is going")

    def _can_shrink(self, decision: Decision) -> bool:
        """Whether the survivors of ``decision`` go on in these processes. The same on
        every rank: it reads only the decision, the job's flags and the environment the
        agent gives every node."""
        leaving = set(decision.leaving_ranks)
        survivors = self.ctx.world_size - len(leaving)
        if not (self.in_process_resize and getattr(self.args, "resize", "restart") == "in-process"
                and self.ctx.initialized and leaving and survivors > 0
                and "rejoin" not in decision.kinds and rendezvous_endpoint() is not None):
            return False
        try:
            ElasticBatch(self.G, self.plan.micro_batch_size).plan(survivors)
        except BatchError as exc:
            if self.ctx.is_leader:
                log.warning("no in-process shrink to world %d (%s): holding for a restart", survivors, exc)
            return False
        return True

    def shrink(self, decision: Decision) -> None:
        """The survivors of a notice go on at the smaller world size without a restart.

        Called on every rank right after the notice commit (and :meth:`stage_state`, before
        it, while the leaving ranks are sure to be there). A leaving rank (its node has
        the notice) waits for its agent to stop it, as a held rank does. A survivor
        re-forms the default process group over the survivors
        (:func:`~trainer.runtime.shrink_process_group`), re-plans the batch (same global
        batch, gradient accumulation recomputed), re-wraps DDP and starts a new attempt at
        the same step: its ``started`` line says ``resized: "in_process"`` and
        ``resumed_from`` the step just committed. The model, the optimizer's state and the
        data position are already in memory and identical on every rank, so nothing is
        loaded. If anything fails here the worker exits non-zero, torchrun restarts the
        group, and it resumes from that same commit.
        """
        step = self.state.step
        leaving = set(decision.leaving_ranks)
        survivors = [r for r in range(self.ctx.world_size) if r not in leaving]
        if self.ctx.rank in leaving:
            self.status.emit("holding", step, notice_ids=list(decision.notice_ids),
                             kinds=list(decision.kinds), timeout_s=self.args.hold_timeout_s)
            time.sleep(self.args.hold_timeout_s)  # the agent stops this node after the commit
            raise RuntimeError(f"rank {self.ctx.rank} was not stopped within {self.args.hold_timeout_s:.0f} s "
                               "of leaving; exiting so torchrun restarts it")
        old_world, t0 = self.ctx.world_size, time.perf_counter()
        endpoint = rendezvous_endpoint()
        assert endpoint is not None  # _can_shrink
        self.ddp = self.state.model  # drop DDP's hooks on the old group before it goes
        # run_id(): the same on a node that joined in-process (its launcher's own torchrun
        # has another TORCHELASTIC_RUN_ID; the first bench run hung here for the pg timeout)
        self.ctx = shrink_process_group(self.ctx, survivors, f"spotvisor/{run_id()}/shrink/{self.attempt}/{step}",
                                        endpoint, self.args.pg_timeout_s)
        self._after_resize(old_world, t0, "shrunk", resumed_from=step,
                           **({} if self.state_replicated else {"stage_s": round(self._stage_s, 4)}))

    def _after_resize(self, old_world: int, t0: float, verb: str, *, resumed_from: int | None,
                      from_commit: bool = False, **fields: Any) -> None:
        """A new attempt in these processes, after the group changed: the batch re-planned,
        new status and step logs, the state spread over the new world and the model
        re-wrapped (:meth:`reshard`), and its ``started`` line (``resized: "in_process"``).
        ``resumed_from``: the commit it goes on from (a shrink: the notice's), None for a
        grow (the state came from a peer, not from a commit). ``from_commit``: the state
        is reloaded from the newest commit (a sharded job that lost a peer's shards)."""
        self.plan = ElasticBatch(self.G, self.plan.micro_batch_size).plan(self.ctx.world_size)
        self.attempt = new_attempt_id(self.ctx)
        self.steplog.close()
        self.status = StatusWriter(os.environ.get(STATUS_FILE_ENV), self.ctx, self.attempt)
        self.steplog = StepLog(os.environ.get(LOG_DIR_ENV), self.ctx, self.attempt)
        self.states_in_sync = True  # the survivors' own, or sent by a peer just now
        try:
            loaded = self.reshard(from_commit=from_commit)
        finally:
            self.states_in_sync = False
        if from_commit:
            resumed_from = loaded
        step = self.state.step
        self._follow()
        seconds = time.perf_counter() - t0
        if self.ctx.is_leader:
            log.info("%s in-process from world %d to %d at step %d in %.3f s (attempt %s)",
                     verb, old_world, self.ctx.world_size, step, seconds, self.attempt)
        self.status.emit("started", step, resumed_from=resumed_from, resized="in_process", old_world_size=old_world,
                         resize_s=round(seconds, 4), global_batch_size=self.G,
                         micro_batch_size=self.plan.micro_batch_size, grad_accum_steps=self.plan.grad_accum_steps,
                         **fields)

    # -- in-process grow (trainer.membership)

    def _can_grow(self) -> bool:
        return bool(self.in_process_resize and getattr(self.args, "resize", "restart") == "in-process"
                    and self.ctx.initialized and rendezvous_endpoint() is not None)

    def _joiners_waiting(self) -> int:
        """Rank 0: how many workers to admit at this boundary (0 on other ranks, and when
        the store cannot be read: training never waits for the queue)."""
        self._pick = []
        if not (self.ctx.is_leader and self._can_grow()):
            return 0
        try:
            if self._queue is None:
                endpoint = rendezvous_endpoint()
                assert endpoint is not None
                self._queue = JoinQueue(endpoint, run_id(), timeout_s=min(10.0, self.args.pg_timeout_s),
                                        verifier=None if self.credential is None else self.credential.verifier())
            batch = ElasticBatch(self.G, self.plan.micro_batch_size)
            self._pick = self._queue.ready(self.ctx.world_size, batch.is_valid)
        except Exception as exc:  # the control node's store unreachable a moment: next boundary
            if not self._queue_warned:
                self._queue_warned = True
                log.warning("cannot read the join queue (%s): no in-process grow until it can", exc)
            self._queue = None
            return 0
        self._queue_warned = False
        return len(self._pick)

    def grow(self, joiners: int) -> None:
        """Admit ``joiners`` waiting workers into the running group at this step boundary,
        without restarting anyone.

        Called on every rank of the group; rank 0 found them (:meth:`_joiners_waiting`)
        and writes their admissions. Every rank joins the new group (old ranks keep
        their numbers, the joiners follow), rank 0 sends the whole state to the joiners
        (:meth:`_send_state`: a broadcast over rank 0 and them only), and a new attempt
        starts at the same step. Nothing is committed or loaded. If anything fails here
        the worker exits non-zero and torchrun restarts the group from the last commit.
        """
        step, old_world, t0 = self.state.step, self.ctx.world_size, time.perf_counter()
        endpoint = rendezvous_endpoint()
        assert endpoint is not None  # _can_grow, on rank 0; the same environment everywhere
        world = old_world + joiners
        prefix = f"spotvisor/{run_id()}/grow/{self.attempt}/{step}"
        self.stage_state(list(range(old_world)))
        if self.ctx.is_leader:
            assert self._queue is not None and len(self._pick) == joiners
            self._queue.admit(self._pick, prefix=prefix, first_rank=old_world, world_size=world)
            log.info("admitting %d joining worker(s) of node(s) %s at step %d", joiners,
                     ",".join(dict.fromkeys(t.node for t in self._pick)), step)
        self.ddp = self.state.model  # drop DDP's hooks on the old group before it goes
        self.ctx = regroup(self.ctx, self.ctx.rank, world, prefix, endpoint, self.args.pg_timeout_s)
        self._send_state(0, list(range(old_world, world)))
        self._after_resize(old_world, t0, "grew", resumed_from=None, joined=joiners)

    def join_running(self) -> None:
        """This worker joins the running group (``SPOTVISOR_JOIN=1``), instead of
        :meth:`resume`: it queues itself (:class:`~trainer.membership.JoinQueue`), waits
        (``--join-timeout-s``) for rank 0 to admit it at a step boundary, joins the new
        group and takes the state from rank 0. The object store is not read.

        Raises:
            ConfigError: no ``$SPOTVISOR_RDZV_ENDPOINT``, or no ``$SPOTVISOR_JOIN_CREDENTIAL``.
            SystemExit(1): nobody admitted it in time, or rank 0 refused its ticket (after
                one warning line).
        """
        if rendezvous_endpoint() is None:
            raise ConfigError("SPOTVISOR_JOIN=1 needs $SPOTVISOR_RDZV_ENDPOINT (host:port of the rendezvous store)")
        if self.credential is None:
            raise ConfigError(f"SPOTVISOR_JOIN=1 needs ${JOIN_CREDENTIAL_ENV}: the daemon gives it to each node it "
                              "admits (a running group admits no ticket without it)")
        node = os.environ.get(NODE_ID_ENV) or socket.gethostname()
        self._queue_and_join(node, self.ctx.local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.joined_in_process = True

    def _queue_and_join(self, node: str, local_rank: int, local_world: int) -> None:
        """Queue as ``local_rank`` of ``local_world`` workers of ``node``, wait to be
        admitted, join the group and take the state from its rank 0 (a collective with it).

        Raises:
            SystemExit(1): nobody admitted it within ``--join-timeout-s``, rank 0 refused
                its ticket, or it has no join credential (one warning line).
        """
        endpoint = rendezvous_endpoint()
        assert endpoint is not None
        if self.credential is None:
            log.warning("node %s has no join credential (%s): no running group would admit it; exiting", node,
                        JOIN_CREDENTIAL_ENV)
            raise SystemExit(1)
        queue = JoinQueue(endpoint, run_id(), timeout_s=self.args.pg_timeout_s)
        ticket = queue.register(node, local_rank, local_world, wait_s=self.args.join_timeout_s,
                                credential=self.credential)
        if self.ctx.is_local_leader or local_world == 1:
            log.warning("node %s waiting to join the running group (ticket %d)", node, ticket.number)
        try:
            admission = queue.wait(ticket)
        except JobCompleted as exc:
            log.warning("%s; exiting", exc)
            raise SystemExit(0) from None
        except (JoinTimeout, JoinRefused) as exc:
            log.warning("%s; exiting", exc)
            raise SystemExit(1) from None
        t0 = time.perf_counter()
        self.ddp = self.state.model
        self.ctx = regroup(self.ctx, admission.rank, admission.world_size, admission.prefix, endpoint,
                           self.args.pg_timeout_s, node_key=f"joined:{node}")
        self._send_state(0, list(range(admission.first_rank, admission.world_size)))
        self._after_resize(admission.first_rank, t0, "joined", resumed_from=None,
                           joined=admission.world_size - admission.first_rank)

    # -- a peer lost without notice, in-process

    def _lost_a_peer(self, exc: RuntimeError) -> bool:
        """Whether ``exc`` is a collective that failed because a peer is gone (and this
        job can go on without it in these processes). torch's distributed errors
        (``DistError``: NCCL's ``DistBackendError`` after an abort, a store's
        ``DistNetworkError``) and gloo's transport errors, which are plain RuntimeErrors."""
        if not self._can_grow():
            return False
        if isinstance(exc, dist.DistError):
            return True
        text = str(exc)
        return any(marker in text for marker in _PEER_GONE)

    def recover(self, failure: str) -> None:
        """The survivors of a peer lost without notice go on in these processes.

        Called on every survivor whose collective failed (they all do: a rank whose peer
        is gone errors, and so does every rank blocked on it once the first ones drop
        the old group). Each drops the old group, agrees on the new membership with the
        others through the rendezvous store (:func:`~trainer.membership.settle_survivors`:
        a settle window of ``--loss-settle-s`` or twice the last step's time, whichever is
        longer: a survivor that was computing when its peers' collective failed arrives up
        to a step later), joins the new group, and the ranks a step
        behind take the state from the most advanced survivor (a rank whose optimizer
        step completed before its last collective failed). Then a new attempt at that
        step: the step that failed is trained again at the smaller world, with the same
        global batch. That is for replicated state (DDP); a sharded job
        (``state_replicated`` False) lost the peer's shards, so its survivors reload the
        newest commit in these processes (:meth:`reshard` ``from_commit``) and train on
        from there: the steps since that commit are lost, no worker restarts.

        Raises:
            SystemExit(1): the survivors' world size cannot take the global batch, or this
                rank's entry in the survivors' round does not verify (no join credential):
                torchrun or the daemon takes over. A rank that arrives after the others
                re-formed joins them through the join queue instead, a boundary later.
        """
        old_rank, old_world, step, t0 = self.ctx.rank, self.ctx.world_size, self.state.step, time.perf_counter()
        log.warning("a collective failed at step %d (%s): re-forming the group without the lost peer", step, failure)
        endpoint = rendezvous_endpoint()
        assert endpoint is not None  # _lost_a_peer
        if self._watch is not None:
            self._watch.pause()  # before this rank's own entry in the round, and before its sockets go
        self.ddp = self.state.model  # DDP's reducer holds the old group
        if dist.is_initialized():
            # NCCL: abort ends this rank's pending kernels. gloo closes no connection on abort
            # or destroy (a survivor blocked on this rank is woken by its own LossWatch)
            with contextlib.suppress(RuntimeError, NotImplementedError):
                dist.distributed_c10d._get_default_group().abort()
            dist.destroy_process_group()
        gc.collect()  # the failed step's graph, and with it DDP's reducer on the old group
        node = os.environ.get(NODE_ID_ENV) or socket.gethostname()
        try:
            # a survivor that was still computing the step reaches its failed collective up to
            # a step later than one that was waiting in it (seen in make demo: 1.0 s apart)
            settle_s = max(self.args.loss_settle_s, 2.0 * self._step_s)
            rank, world, prefix = settle_survivors(endpoint, run_id(), self.attempt, old_rank, old_world,
                                                   settle_s=settle_s, timeout_s=self.args.pg_timeout_s,
                                                   credential=self.credential, node=node)
        except JoinTimeout as exc2:
            # its collective failed later than the others' (gloo: seconds apart, in a test):
            # they re-formed without it, and it joins them as a newcomer at their next boundary
            log.warning("%s; joining the survivors' group as a newcomer", exc2)
            self._queue_and_join(f"{node}/rank{old_rank}", 0, 1)
            return
        except JoinRefused as exc2:
            log.warning("%s; exiting for a restart", exc2)
            raise SystemExit(1) from None
        if not ElasticBatch(self.G, self.plan.micro_batch_size).is_valid(world):
            log.warning("the global batch %d cannot be split over the %d surviving ranks; exiting for a restart",
                        self.G, world)
            raise SystemExit(1)
        self.ctx = regroup(self.ctx, rank, world, prefix, endpoint, self.args.pg_timeout_s)
        if not self.state_replicated:  # the lost peer's shards are in the newest commit only
            self._after_resize(old_world, t0, "reloaded", resumed_from=None, from_commit=True,
                               lost_ranks=old_world - world, failed_step=step)
            return
        steps = [int(s) for s in all_gather_json(self.state.step)]
        top = max(steps)
        behind = [r for r, s in enumerate(steps) if s != top]
        if behind:
            self._send_state(steps.index(top), behind)
        self._after_resize(old_world, t0, "recovered", resumed_from=None, lost_ranks=old_world - world,
                           failed_step=step)

    def _follow(self) -> None:
        """Point the loss watch at this attempt's group (started on first use)."""
        if not self._can_grow():
            return
        if self._watch is None:
            endpoint = rendezvous_endpoint()
            assert endpoint is not None
            self._watch = LossWatch(endpoint, run_id())
        self._watch.follow(self.attempt, self.ctx.rank, set(self.ctx.group_fds))

    def _send_state(self, src: int, receivers: list[int]) -> None:
        """Collective over the new group: rank ``src`` sends its state and progress to
        ``receivers`` over a group of just them (the joiners of a grow; the survivors a
        step behind after a loss); the other ranks only take part in creating that group."""
        group = dist.new_group([src, *receivers])
        if self.ctx.rank != src and self.ctx.rank not in receivers:
            return
        leader = self.ctx.rank == src
        info = broadcast_json({"step": self.state.step, "seed": self.seed, "committed_step": self.committed_step,
                               "handled_ids": self.guard.handled_ids,
                               "data": self.data_position(self.state.step) if self.streaming else None}
                              if leader else None, src=src, group=group)
        t0 = time.perf_counter()
        state = broadcast_state(self.peer_state() if leader else None, src=src, device=self.ctx.device, group=group)
        dist.destroy_process_group(group)
        if leader:
            return
        self.load_peer_state(state)
        if self.state.step != info["step"]:
            raise RuntimeError(f"the state from rank {src} is at step {self.state.step}, "
                               f"its progress says {info['step']}")
        self.seed = int(info["seed"])
        self.committed_step = info["committed_step"]
        self.guard.mark_handled(info["handled_ids"])
        self.start_data(info["data"])
        if self.ctx.is_local_leader:
            nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, torch.Tensor))
            log.warning("took the state of step %d from rank %d (%d bytes in %.2f s)", self.state.step, src, nbytes,
                        time.perf_counter() - t0)

    def close(self) -> None:
        self.steplog.close()
        if self._watch is not None:
            self._watch.stop()
        # DDP's reducer holds the process group: let teardown_distributed destroy the group
        # (GIL released) rather than the reducer's dealloc at exit, where gloo's worker
        # thread can wait for the GIL that dealloc holds (seen once in tests/test_shrink.py)
        self.ddp = self.state.model


def run_job(
    argv: Sequence[str] | None = None,
    *,
    job_cls: type[ElasticJob],
    parser: argparse.ArgumentParser,
    prepare: Callable[[], None] | None = None,
    data: Callable[[argparse.Namespace], Any] = load_data,
) -> int:
    """Run ``job_cls`` on this rank; returns the exit code (0 done, 2 bad configuration).

    ``parser``: the job's flags (:func:`trainer.runtime.add_job_arguments` plus its own,
    ``--seq-len`` among them); ``prepare`` runs before the process group is set up (e.g.
    DeepSpeed's environment). ``data(args)`` builds what the job trains on, before the
    process group too (a :class:`~trainer.data.DataError` is exit 2): token ids, a map-style
    dataset, a resumable stream, or a source of :func:`trainer.data.as_samples` (wrap texts
    with their tokenizer there: ``StreamSamples(stream, args.seq_len, tokenizer)``); default
    :func:`trainer.data.load_data` (the reference trainer's ``--data`` / ``--tokenizer`` / ...).
    """
    args = parser.parse_args(argv)
    args.checkpoint_uri = normalize_uri(args.checkpoint_uri)
    rank, _, world = env_world()
    configure_logging(rank)
    configure_threads()
    join = joining()
    try:
        # Refuse before joining the group: every rank sees the same WORLD_SIZE (a joiner's
        # is its own node's until it is admitted: the batch is planned again then)
        batch = ElasticBatch(args.global_batch_size, args.micro_batch_size)
        plan = batch.plan(batch.valid_world_sizes()[0] if join else world)
        samples = as_samples(data(args), args.seq_len)
    except (BatchError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if prepare is not None:
        prepare()
    ctx = joiner_context() if join else setup_distributed(args.pg_timeout_s)
    job = None
    try:
        job = job_cls(args, ctx, plan, samples)
        if join:
            if not (job.in_process_resize and getattr(args, "resize", "restart") == "in-process"):
                raise ConfigError(f"{job_cls.__name__} cannot join a running group in-process "
                                  "(SPOTVISOR_JOIN=1): set job.grow: restart in the daemon's config")
            job.join_running()  # wraps the model, as every resize does
        elif job.wrap_before_resume:
            job.wrap()
            job.resume()
        else:
            job.resume()
            job.wrap()
        job.run()
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if job is not None:
            job.close()
    ctx = job.ctx  # after an in-process resize, not the group this process started in
    barrier(ctx)
    teardown_distributed(ctx)
    return 0
