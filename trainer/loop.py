"""The elastic training loop every spotvisor trainer shares, whatever its model.

One step boundary, on every rank alike::

    decision = guard.check()                      # collective: all ranks agree
    commit if notice / periodic / final           # the job's commit, status line
    shrink if interruption (survivors)            # re-form the group in-process, go on
    hold if rejoin (or no in-process shrink)      # keep-alive until restarted
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
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.batch import BatchError, BatchPlan, ElasticBatch
from trainer.checkpoint import Manifest, open_store
from trainer.contract import LOG_DIR_ENV, S3_ENDPOINT_ENV, STATUS_FILE_ENV
from trainer.data import DataError, TokenDataset, encode, load_corpus
from trainer.guard import Decision, PreemptionGuard
from trainer.runtime import (
    DistContext,
    StatusWriter,
    StepLog,
    barrier,
    configure_logging,
    configure_threads,
    env_world,
    new_attempt_id,
    normalize_uri,
    rendezvous_endpoint,
    setup_distributed,
    shrink_process_group,
    teardown_distributed,
)

__all__ = ["ConfigError", "ElasticJob", "run_job"]

log = logging.getLogger("trainer.run")

PROGRESS_EVERY = 10


class ConfigError(Exception):
    """A configuration this job can never run with; exit 2, one line on stderr."""


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
    #: The survivors of a notice can go on in the same processes (:meth:`shrink`): true when
    #: every rank holds the whole model and optimizer state (DDP). A sharded job (ZeRO,
    #: FSDP) must reload at the new world size, so its subclass sets it False.
    in_process_resize = True

    def __init__(
        self, args: argparse.Namespace, ctx: DistContext, plan: BatchPlan, tokens: torch.Tensor
    ) -> None:
        self.args = args
        self.ctx = ctx
        self.plan = plan
        self.G = plan.global_batch_size
        self.attempt = new_attempt_id(ctx)
        self.store = open_store(args.checkpoint_uri, s3_endpoint_url=os.environ.get(S3_ENDPOINT_ENV) or None)
        self.status = StatusWriter(os.environ.get(STATUS_FILE_ENV), ctx, self.attempt)
        self.steplog = StepLog(os.environ.get(LOG_DIR_ENV), ctx, self.attempt)
        self.dataset = TokenDataset(tokens, args.seq_len)
        self.seed = args.seed
        self.state = self.build_state()
        self.last_committed: Manifest | None = None  # rank 0's copy of the newest commit
        self.committed_step: int | None = None  # every rank: the newest step this run committed or resumed from
        self.guard = PreemptionGuard()
        self.ddp: torch.nn.Module = self.state.model

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
        if n is not None and n != len(self.dataset):
            log.warning("dataset has %d samples, checkpoint was written with %d: the sample order changes",
                        len(self.dataset), n)

    def run(self) -> None:
        args, target = self.args, self.args.target_steps
        resumed_from = self.last_committed.step if self.last_committed else None
        self.status.emit("started", self.state.step, resumed_from=resumed_from,
                         global_batch_size=self.G, micro_batch_size=self.plan.micro_batch_size,
                         grad_accum_steps=self.plan.grad_accum_steps)
        if self.ctx.is_leader:
            log.info("attempt %s: world %d, global batch %d = %d x %d accum x %d ranks, %d samples, step %d/%d",
                     self.attempt, self.ctx.world_size, self.G, self.plan.micro_batch_size,
                     self.plan.grad_accum_steps, self.ctx.world_size, len(self.dataset), self.state.step, target)
        start_step = self.state.step
        t_window, n_window = time.perf_counter(), 0
        while True:
            step = self.state.step
            decision = self.guard.check()
            final = step >= target
            # not a step committed already (the survivors of an in-process shrink are
            # back at the notice's step: committing it again at their world size would
            # be a second, different manifest for one step)
            periodic = (args.checkpoint_interval > 0 and step > start_step and step != self.committed_step
                        and step % args.checkpoint_interval == 0)
            if final or decision.checkpoint or periodic:
                reason = "final" if final else ("notice" if decision.checkpoint else "periodic")
                self.commit(reason=reason, decision=decision)
            if final:
                break
            if decision.hold and self._can_shrink(decision):
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
            loss, local_loss, positions = self.train_step()
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.state.step}")
            self.steplog.write(self.state.step, positions, local_loss)
            self.status.emit("step", self.state.step, loss=loss)
            n_window += 1
            if self.ctx.is_leader and (self.state.step % PROGRESS_EVERY == 0 or self.state.step == target):
                dt = (time.perf_counter() - t_window) / max(n_window, 1)
                log.info("step %d/%d loss %.4f %.3f s/step world %d", self.state.step, target, loss, dt,
                         self.ctx.world_size)
                t_window, n_window = time.perf_counter(), 0
        self.status.emit("completed", self.state.step)
        if self.ctx.is_leader:
            log.info("completed: step %d committed", self.state.step)

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

        Called on every rank right after the notice commit. A leaving rank (its node has
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
        if self.ctx.rank in leaving:
            self.status.emit("holding", step, notice_ids=list(decision.notice_ids),
                             kinds=list(decision.kinds), timeout_s=self.args.hold_timeout_s)
            time.sleep(self.args.hold_timeout_s)  # the agent stops this node after the commit
            raise RuntimeError(f"rank {self.ctx.rank} was not stopped within {self.args.hold_timeout_s:.0f} s "
                               "of leaving; exiting so torchrun restarts it")
        survivors = [r for r in range(self.ctx.world_size) if r not in leaving]
        old_world, t0 = self.ctx.world_size, time.perf_counter()
        endpoint = rendezvous_endpoint()
        assert endpoint is not None  # _can_shrink
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "job")
        self.ddp = self.state.model  # drop DDP's hooks on the old group before it goes
        self.ctx = shrink_process_group(self.ctx, survivors, f"spotvisor/{run_id}/shrink/{self.attempt}/{step}",
                                        endpoint, self.args.pg_timeout_s)
        self.plan = ElasticBatch(self.G, self.plan.micro_batch_size).plan(self.ctx.world_size)
        self.attempt = new_attempt_id(self.ctx)
        self.steplog.close()
        self.status = StatusWriter(os.environ.get(STATUS_FILE_ENV), self.ctx, self.attempt)
        self.steplog = StepLog(os.environ.get(LOG_DIR_ENV), self.ctx, self.attempt)
        self.wrap()
        seconds = time.perf_counter() - t0
        if self.ctx.is_leader:
            log.info("shrunk in-process from world %d to %d at step %d in %.3f s (attempt %s)",
                     old_world, self.ctx.world_size, step, seconds, self.attempt)
        self.status.emit("started", step, resumed_from=step, resized="in_process", old_world_size=old_world,
                         resize_s=round(seconds, 4), global_batch_size=self.G,
                         micro_batch_size=self.plan.micro_batch_size, grad_accum_steps=self.plan.grad_accum_steps)

    def close(self) -> None:
        self.steplog.close()
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
) -> int:
    """Run ``job_cls`` on this rank; returns the exit code (0 done, 2 bad configuration).

    ``parser``: the job's flags (:func:`trainer.runtime.add_job_arguments` plus its own,
    ``--data`` and ``--seq-len`` among them); ``prepare`` runs before the process group
    is set up (e.g. DeepSpeed's environment).
    """
    args = parser.parse_args(argv)
    args.checkpoint_uri = normalize_uri(args.checkpoint_uri)
    rank, _, world = env_world()
    configure_logging(rank)
    configure_threads()
    try:
        # Refuse before joining the group: every rank sees the same WORLD_SIZE.
        plan = ElasticBatch(args.global_batch_size, args.micro_batch_size).plan(world)
        tokens = encode(load_corpus(args.data))
        if tokens.numel() < args.seq_len + 1:
            raise DataError(f"corpus has {tokens.numel()} tokens, fewer than seq_len + 1 = {args.seq_len + 1}")
    except (BatchError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if prepare is not None:
        prepare()
    ctx = setup_distributed(args.pg_timeout_s)
    job = None
    try:
        job = job_cls(args, ctx, plan, tokens)
        if job.wrap_before_resume:
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
    barrier(ctx)
    teardown_distributed(ctx)
    return 0
