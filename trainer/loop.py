"""The elastic training loop every spotvisor trainer shares, whatever its model.

One step boundary, on every rank alike (:meth:`ElasticJob.run`)::

    decision = guard.check()              # collective: all ranks agree        _decide
    stage the state if survivors shrink   # before the commit, leavers there   Resizer.stage
    commit if notice / periodic / final   # the job's commit, status line      commit_if_asked
    shrink | hold | grow                  # re-form the group in-process       resize_if_needed
    train one step (grad accumulation)    # positions = step * G + ...         _train
    a peer lost without notice, anywhere  # survivors re-form, redo the step   recover

:class:`ElasticJob` is that loop; a job (the reference trainer's GPT-2 in
:mod:`trainer.run`, the DeepSpeed and DCP examples in ``trainer/examples/``) brings its
model, wrapping, commit and train step. :func:`run_job` runs one on this rank. The
loop's collaborators each do one thing: :class:`~trainer.resize.Resizer` (shrink, grow,
join), :class:`~trainer.recovery.Recovery` (a peer lost without notice) and
:class:`Progress` (the ``s/step`` log line).

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
import enum
import gc
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from trainer.batch import BatchError, BatchPlan, ElasticBatch
from trainer.checkpoint import Manifest, open_store
from trainer.contract import JOIN_CREDENTIAL_ENV, LOG_DIR_ENV, NODE_ID_ENV, S3_ENDPOINT_ENV, STATUS_FILE_ENV
from trainer.credential import CredentialError, NodeCredential
from trainer.data import DataError, MapSamples, as_samples, load_data
from trainer.guard import Decision, PreemptionGuard
from trainer.membership import joining, run_id
from trainer.recovery import Recovery, first_line, raised_in
from trainer.resize import Resizer, can_shrink
from trainer.sampler import ElasticSampler
from trainer.stream import StreamSamples
from trainer.tokens import TokenWindows
from trainer.runtime import (
    DistContext,
    StatusWriter,
    StepLog,
    barrier,
    configure_logging,
    configure_threads,
    data_position,
    env_world,
    joiner_context,
    new_attempt_id,
    normalize_uri,
    rendezvous_endpoint,
    setup_distributed,
    teardown_distributed,
)

__all__ = ["ConfigError", "ElasticJob", "Boundary", "Progress", "check_compatible", "loaded", "run_job"]

log = logging.getLogger("trainer.run")

PROGRESS_EVERY = 10

T = TypeVar("T")


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


@dataclass(frozen=True, slots=True)
class Boundary:
    """What one step boundary does, decided from the guard's decision alone (the same on
    every rank): ``commit`` is the commit's reason (``"final"``, ``"notice"``,
    ``"periodic"``) or None; ``shrink``: the survivors go on in these processes."""

    decision: Decision
    final: bool
    commit: str | None
    shrink: bool


class Resized(enum.Enum):
    """What :meth:`ElasticJob.resize_if_needed` did at a boundary."""

    NOTHING = "nothing"  # train the step
    HELD = "held"  # held for a restart that did not come: train the step, a new progress window
    REFORMED = "reformed"  # the group changed (shrink, grow): the boundary again


class Progress:
    """Rank 0's ``step N/T loss L S s/step`` line every :data:`PROGRESS_EVERY` steps, the
    seconds a step averaged since the last line (or since :meth:`reset`)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.reset()

    def reset(self) -> None:
        """Start a new window now (after anything that was not training: a resize, a hold)."""
        self.t0, self.n = time.perf_counter(), 0

    def step(self, ctx: DistContext, step: int, loss: float) -> None:
        """Count a step trained; log the window on rank 0 when it ends."""
        self.n += 1
        if ctx.is_leader and (step % PROGRESS_EVERY == 0 or step == self.target):
            dt = (time.perf_counter() - self.t0) / max(self.n, 1)
            log.info("step %d/%d loss %.4f %.3f s/step world %d", step, self.target, loss, dt, ctx.world_size)
            self.reset()


def periodic_due(step: int, every: int, start: int, committed: int | None) -> bool:
    """Whether one rank's loop is due a periodic commit of ``step``: every ``every`` steps
    (0: never) since ``start`` (the step its loop started at: a joiner's is the step it
    joined at), and not ``committed`` already (the survivors of an in-process shrink are
    back at the notice's step: committing it again at their world size would be a second,
    different manifest for one step). Ranks' views can differ (a DeepSpeed grow at a
    commit's step hung on it): the guard agrees on one, ``Decision.periodic``."""
    return every > 0 and step > start and step != committed and step % every == 0


def check_compatible(job: ElasticJob, manifest: Manifest) -> None:
    """Refuse a checkpoint whose data position would not be exact for ``job``; take its seed.

    Raises:
        ConfigError: another global batch size, or a stream where the job reads a
            map-style dataset (or the other way round).
    """
    if manifest.global_batch_size != job.G:
        raise ConfigError(
            f"checkpoint step {manifest.step} in {job.store.uri} was trained with global_batch_size "
            f"{manifest.global_batch_size}, not {job.G}: the data position would not be exact"
        )
    pos = manifest.data_position
    seed = pos.get("seed", job.seed)
    if seed != job.seed:
        log.warning("checkpoint seed %s differs from --seed %s: keeping the checkpoint's", seed, job.seed)
        job.seed = int(seed)
    n = pos.get("dataset_len")
    if job.streaming != ("stream" in pos) and manifest.step > 0:
        raise ConfigError(f"checkpoint step {manifest.step} in {job.store.uri} was trained on "
                          f"{'a stream' if 'stream' in pos else 'a map-style dataset'}, this job reads "
                          f"{'a stream' if job.streaming else 'a map-style dataset'}: the data position would "
                          "not be exact")
    if n is not None and not job.streaming and n != len(job.dataset):
        log.warning("dataset has %d samples, checkpoint was written with %d: the sample order changes",
                    len(job.dataset), n)


def loaded(job: ElasticJob, manifest: Manifest | None, costs: dict[str, Any] | None) -> None:
    """After a framework's resume (DCP, DeepSpeed): ``job`` at ``manifest``'s step, its
    ``checkpoint_loaded`` status line (``costs``: the resume's, e.g. ``fetch_s``), and the
    data position; or at step 0 when nothing is committed (``manifest`` None): also for the
    survivors of a loss that reload with nothing committed yet, whose fresh model is of step
    0 whatever step they had reached (a sharded job's state went with the lost peer)."""
    if manifest is None:
        if job.ctx.is_leader:
            log.info("no committed checkpoint in %s: starting at step 0", job.store.uri)
        job.state.step = 0
    else:
        job.state.step = manifest.step
        job.status.emit("checkpoint_loaded", manifest.step, **{k: v for k, v in (costs or {}).items() if k != "step"})
    job.last_committed = manifest
    job.committed_step = manifest.step if manifest is not None else None
    job.start_data(manifest.data_position if manifest is not None else None)


class ElasticJob:
    """One incarnation of an elastic training job on one rank (built by :func:`run_job`).

    A job brings :meth:`build_state` (model, optimizer, a ``.step`` counter), :meth:`wrap`
    (DDP, FSDP, an engine), :meth:`resume` (:func:`trainer.integrations.common.newest_intact`),
    :meth:`commit` (:class:`trainer.integrations.common.Committer`) and :meth:`train_step`.
    Shared here: :meth:`run` (the step-boundary loop, status lines, step logs), the data
    position, the checkpoint check; resizes are :attr:`resizer`'s and :attr:`recovery`'s.
    ``wrap_before_resume``: load into the wrapped model (DCP into FSDP2's shards).
    """

    wrap_before_resume = False
    #: The job resizes in its running processes: it implements :meth:`peer_state` (sharded:
    #: :meth:`stage_state`, :meth:`reshard` too). False (DeepSpeed, the HF Trainer): restarts.
    in_process_resize = True
    #: Every rank holds the whole state (DDP): a resize moves none, a lost peer costs no step.
    #: False (FSDP2): a resize gathers it first (:meth:`stage_state`) and spreads it after
    #: (:meth:`reshard`); a lost peer took its shards, so the survivors reload the last commit.
    state_replicated = True

    def __init__(self, args: argparse.Namespace, ctx: DistContext, plan: BatchPlan, data: Any) -> None:
        #: this node's join credential (trainer.credential): rank 0 checks joiners' tickets with it
        self.credential = _credential()
        self.args, self.ctx, self.plan, self.G = args, ctx, plan, plan.global_batch_size
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
        self.state = self.first_state()
        self.last_committed: Manifest | None = None  # rank 0's copy of the newest commit
        self.committed_step: int | None = None  # every rank: the newest step this run committed or resumed from
        self.guard = PreemptionGuard()
        self.ddp: torch.nn.Module = self.state.model
        self.joined_in_process = False  # this worker joined a running group (announced by join_running)
        #: every rank holds the same model state now (set by an in-process resize for
        #: :meth:`wrap`): a wrapper may skip its initial broadcast of the parameters
        self.states_in_sync = False
        self.resizer = Resizer(self)  # shrink, grow, join
        self.recovery = Recovery(self)  # a peer lost without notice
        self.progress = Progress(args.target_steps)

    # -- what a job brings

    def build_state(self) -> Any:
        """The model and optimizer on ``self.ctx.device``, with a ``step`` counter (0)."""
        raise NotImplementedError

    def first_state(self) -> Any:
        """This process's first state: :meth:`build_state` (a sharded job's joiner: on meta)."""
        return self.build_state()

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
        """Tokens one step trains, all ranks (the ``step`` line's ``tokens``): :attr:`tokens_per_step`;
        None without a ``seq_len``. A job whose samples differ in length returns its own count."""
        return self.tokens_per_step if isinstance(getattr(self.dataset, "seq_len", None), int) else None

    def peer_state(self) -> dict[str, Any]:
        """The whole training state (model, optimizer, step), a tree of tensors for a peer that
        joins or fell a step behind (:func:`~trainer.runtime.broadcast_state`)."""
        raise NotImplementedError

    def load_peer_state(self, state: dict[str, Any]) -> None:
        """Load :meth:`peer_state` of a peer into ``self.state``."""
        raise NotImplementedError

    def stage_state(self, keep: list[int]) -> None:
        """Collective over the group about to change, on every rank of it (the leaving ranks
        of a notice too), before it changes: put what :meth:`reshard` needs where it will
        be. ``keep``: the old ranks that stay, ascending (``keep[0]`` becomes rank 0).
        Replicated state needs nothing (the default); a sharded job gathers its shards."""

    def reshard(self, *, from_commit: bool) -> int | None:
        """Spread the state over the new group after it changed (every rank of it, the
        joiners too) and wrap the model. ``from_commit``: a peer was lost with its shards
        (never for replicated state): load the newest commit. Returns the step loaded
        from a commit, or None when the state came from memory or peers."""
        self.wrap()
        return None

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

    def _check_compatible(self, manifest: Manifest) -> None:
        check_compatible(self, manifest)

    # -- the loop

    @property
    def resizes_in_process(self) -> bool:
        """The group changes in these processes: the job can (:attr:`in_process_resize`)
        and its flags ask for it (``--resize in-process``)."""
        return self.in_process_resize and getattr(self.args, "resize", "restart") == "in-process"

    def run(self) -> None:
        """Train to ``--target-steps``, one step boundary at a time, and commit the last step."""
        start = self._announce()
        fresh = True  # the progress window starts again before the next step trained
        while True:
            decision = self._collective(lambda: self._decide(start))
            at = None if decision is None else self._boundary(decision)
            if at is not None and at.shrink:
                self.resizer.stage(decision)
            if at is None or not self.commit_if_asked(at):  # a peer lost without notice: the survivors
                fresh = True  # re-formed, and decide this boundary again
                continue
            if at.final:
                break
            resized = self.resize_if_needed(at)
            if resized is Resized.REFORMED:
                fresh = True
                continue
            if fresh or resized is Resized.HELD:
                self.progress.reset()
            fresh = self._collective(self._train) is None
        self._complete()

    def _decide(self, start: int) -> Decision:
        """Collective: the guard's decision at this boundary (rank 0 adds the joiners waiting;
        every rank whether its loop is due a periodic commit, :func:`periodic_due`)."""
        step = self.state.step
        return self.guard.check(self._joiners_waiting() if step < self.args.target_steps else 0,
                                periodic=periodic_due(step, self.args.checkpoint_interval, start, self.committed_step))

    def _boundary(self, decision: Decision) -> Boundary:
        """What this boundary does, from the decision every rank agreed on: commit (the last
        step; a notice; ``decision.periodic``) and whether the survivors shrink."""
        final = self.state.step >= self.args.target_steps
        reason = "final" if final else "notice" if decision.checkpoint else "periodic" if decision.periodic else None
        return Boundary(decision, final, reason, not final and decision.hold and self._can_shrink(decision))

    def commit_if_asked(self, at: Boundary) -> bool:
        """Commit this step when the boundary asks (:meth:`commit`, the job's); False when a peer
        was lost in it: the survivors re-formed, and learnt whether it landed (:meth:`Recovery.learn_commit`).
        The loop records the step committed, whatever the job's ``commit`` does (a grow decides it again)."""
        if at.commit is None:
            return True
        if self._collective(lambda: self.commit(reason=at.commit, decision=at.decision) or 1):
            self.committed_step = self.state.step
            return True
        return self.recovery.learn_commit()

    def resize_if_needed(self, at: Boundary) -> Resized:
        """Shrink (the survivors of a notice), hold for a restart (a notice without an
        in-process shrink, a rejoin), or grow (rank 0 found joiners)."""
        decision = at.decision
        if at.shrink:
            self.resizer.shrink(decision)
            return Resized.REFORMED
        if decision.hold:
            self.resizer.hold(decision)
            return Resized.HELD
        if decision.joiners:
            self.resizer.grow(decision.joiners)
            return Resized.REFORMED  # the same boundary again, with the joiners (their loop starts there)
        return Resized.NOTHING

    def recover(self, failure: str) -> None:
        """A peer is gone (``failure``: the first line of the collective's error): re-form the group."""
        self.recovery.recover(failure)

    def _collective(self, fn: Callable[[], T]) -> T | None:
        """``fn()``; None when a collective in it failed because a peer is gone, after :meth:`recover`."""
        try:
            return fn()
        except RuntimeError as exc:
            if not self.recovery.lost_a_peer(exc):
                raise
            failure = f"{first_line(exc)}; raised in {raised_in(exc)}"
        self.recover(failure)  # out of the except clause: its traceback no longer holds the old group
        return None

    def _train(self) -> bool:
        """One step (:meth:`train_step`), its step log, ``step`` status line and progress."""
        loss, local_loss, positions = self.train_step()
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {self.state.step}")
        self.steplog.write(self.state.step, positions, local_loss)
        self.status.step(self.state.step, loss=loss, tokens=self.step_tokens())
        self.progress.step(self.ctx, self.state.step, loss)
        return True

    def _announce(self) -> int:
        """The attempt's ``started`` line and log line; starts the loss watch. Returns the step."""
        resumed_from = self.last_committed.step if self.last_committed else None
        if not self.joined_in_process:  # a joiner's started line is join_running's
            self.status.emit("started", self.state.step, resumed_from=resumed_from, global_batch_size=self.G,
                             micro_batch_size=self.plan.micro_batch_size, grad_accum_steps=self.plan.grad_accum_steps)
        if self.ctx.is_leader:
            log.info("attempt %s: world %d, global batch %d = %d x %d accum x %d ranks, %s samples, step %d/%d",
                     self.attempt, self.ctx.world_size, self.G, self.plan.micro_batch_size,
                     self.plan.grad_accum_steps, self.ctx.world_size,
                     "a stream of" if self.streaming else len(self.dataset), self.state.step, self.args.target_steps)
        self.recovery.follow()
        return self.state.step

    def _complete(self) -> None:
        """The ``completed`` line; rank 0 tells the join queue nobody need wait any more."""
        self.status.emit("completed", self.state.step)
        if self.ctx.is_leader:
            log.info("completed: step %d committed", self.state.step)
            self.resizer.complete()

    # -- in-process resizes: hooks a test or a job may override (the work is Resizer's)

    def _can_shrink(self, decision: Decision) -> bool:
        return can_shrink(self, decision)

    def _joiners_waiting(self) -> int:
        return self.resizer.joiners_waiting()

    def join_running(self) -> None:
        """This worker joins the running group (``SPOTVISOR_JOIN=1``) instead of :meth:`resume`:
        it queues itself, waits (``--join-timeout-s``) for rank 0 to admit it at a step
        boundary, joins and takes the state from rank 0 (:meth:`Resizer.join`; no commit read).

        Raises:
            ConfigError: no ``$SPOTVISOR_RDZV_ENDPOINT``, or no ``$SPOTVISOR_JOIN_CREDENTIAL``.
            SystemExit(1): nobody admitted it in time, or rank 0 refused its ticket (one warning line).
        """
        _check_can_join(self.credential)
        node = os.environ.get(NODE_ID_ENV) or socket.gethostname()
        self.resizer.join(node, self.ctx.local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.joined_in_process = True

    def close(self) -> None:
        self.steplog.close()
        self.recovery.stop()
        # DDP's reducer holds the process group: let teardown_distributed destroy the group
        # (GIL released) rather than the reducer's dealloc at exit, where gloo's worker
        # thread can wait for the GIL that dealloc holds (seen once in tests/test_shrink.py)
        self.ddp = self.state.model


def _check_can_join(credential: Any) -> None:
    """Raises :class:`ConfigError` when this worker cannot join a running group: no
    ``$SPOTVISOR_RDZV_ENDPOINT``, or no join credential."""
    if rendezvous_endpoint() is None:
        raise ConfigError("SPOTVISOR_JOIN=1 needs $SPOTVISOR_RDZV_ENDPOINT (host:port of the rendezvous store)")
    if credential is None:
        raise ConfigError(f"SPOTVISOR_JOIN=1 needs ${JOIN_CREDENTIAL_ENV}: the daemon gives it to each node it "
                          "admits (a running group admits no ticket without it)")


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
    # What exists now (imports: some 300,000 objects with torch) lives as long as the
    # process; out of the collector's sight, a resize's gc.collect() (the old model's
    # cycles, freed before the new one is allocated) scans only the job's own objects:
    # 0.3 s less per resize on 2 busy cores. The job's first model is built after this.
    gc.freeze()
    job = None
    try:
        job = job_cls(args, ctx, plan, samples)
        _start(job, join=join)
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


def _start(job: ElasticJob, *, join: bool) -> None:
    """Bring ``job`` to its first step: join the running group, or resume and wrap (in the
    order the job loads in).

    Raises:
        ConfigError: a joiner of a job that cannot resize in-process.
    """
    if join:
        if not job.resizes_in_process:
            raise ConfigError(f"{type(job).__name__} cannot join a running group in-process "
                              "(SPOTVISOR_JOIN=1): set job.grow: restart in the daemon's config")
        job.join_running()  # wraps the model, as every resize does
    elif job.wrap_before_resume:
        job.wrap()
        job.resume()
    else:
        job.resume()
        job.wrap()
