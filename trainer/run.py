"""Reference trainer: ``python -m trainer.run`` on every rank (torchrun) or alone.

Trains a small GPT-2 (transformers) on bytes with DDP, a constant global batch,
notice-driven checkpoint commits and resume at any valid world size. The node
agent starts it under ``torchrun --nnodes=MIN:MAX``; torchrun restarts the workers
on a membership change (a node joining, or lost without notice), and each new
incarnation ("attempt") resumes from the newest committed checkpoint. On an
interruption notice the survivors instead go on in their running workers after the
notice commit (:meth:`Job.shrink`: a new attempt at the same step, no restart).

One step boundary, on every rank alike::

    decision = guard.check()                      # collective: all ranks agree
    commit if notice / periodic / final           # rank 0 writes, barrier, status line
    shrink if interruption (survivors)            # re-form the group in-process, go on
    hold if rejoin (or no in-process shrink)      # keep-alive until restarted
    train one step (grad accumulation, DDP)       # positions = step * G + ...

Node-local outputs: the status file (``$SPOTVISOR_STATUS_FILE``, appended by
LOCAL_RANK 0 only) and per-rank step logs under ``$SPOTVISOR_LOG_DIR``. Exit codes: 0 only when the target step is committed; 2 for
a configuration the job can never run (bad world size, data, checkpoint mismatch);
anything else non-zero for a failure torchrun should restart (a peer left).

The parts a resize touches are kept apart: process-group set-up
(:func:`setup_distributed`, :func:`~trainer.runtime.shrink_process_group`),
model/optimizer state (:class:`TrainState`, :func:`state_to_bytes`,
:func:`load_state`) and the data position (:func:`data_position`,
:class:`~trainer.sampler.ElasticSampler`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.batch import BatchError, BatchPlan, ElasticBatch
from trainer.checkpoint import (
    MANIFEST_NAME,
    CheckpointError,
    CorruptCheckpointError,
    Manifest,
    commit,
    discard,
    gc,
    latest_committed,
    load_shard,
    open_store,
    step_dir,
    write_shard,
)
from trainer.data import VOCAB_SIZE, DataError, TokenDataset, encode, load_corpus
from trainer.guard import Decision, PreemptionGuard
from trainer.contract import LOG_DIR_ENV, S3_ENDPOINT_ENV, STATUS_FILE_ENV
from trainer.runtime import (
    add_job_arguments,
    normalize_uri,
    positive_int,
    DistContext,
    StatusWriter,
    StepLog,
    barrier,
    configure_logging,
    configure_threads,
    data_position,
    env_world,
    new_attempt_id,
    rendezvous_endpoint,
    setup_distributed,
    shrink_process_group,
    teardown_distributed,
)
from trainer.sampler import ElasticSampler

__all__ = ["main", "build_parser", "setup_distributed", "DistContext", "TrainState"]

log = logging.getLogger("trainer.run")

MODEL_SHARD = "model.pt"
PROGRESS_EVERY = 10


class ConfigError(Exception):
    """A configuration this job can never run with; exit 2, one line on stderr."""


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.run",
        description="spotvisor reference trainer: byte-level GPT-2, elastic DDP, committed checkpoints.",
    )
    add_job_arguments(p)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=256)
    p.add_argument("--n-head", type=positive_int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--data", action="append", default=[], metavar="PATH",
                   help=".txt or .jsonl ({\"text\": ...} lines) file; repeatable; default: CPython's help texts")
    p.add_argument("--resize", choices=("in-process", "restart"), default="in-process",
                   help="after a notice commit, the survivors re-form the process group in their running "
                        "workers (in-process, needs $SPOTVISOR_RDZV_ENDPOINT) or hold for torchrun's restart")
    return p


# --------------------------------------------------------------------------- state


@dataclass(slots=True)
class TrainState:
    """What a checkpoint holds: the model, its optimizer and the steps completed."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        vocab_size=VOCAB_SIZE,
        n_positions=args.seq_len,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config)


def build_state(args: argparse.Namespace, device: torch.device) -> TrainState:
    model = build_model(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return TrainState(model=model, optimizer=optimizer, step=0)


def state_to_bytes(state: TrainState) -> bytes:
    buf = io.BytesIO()
    torch.save(
        {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(), "step": state.step},
        buf,
    )
    return buf.getvalue()


def load_state(state: TrainState, data: bytes, device: torch.device) -> None:
    blob = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    state.model.load_state_dict(blob["model"])
    state.optimizer.load_state_dict(blob["optimizer"])
    state.step = int(blob["step"])


# --------------------------------------------------------------------------- the job


class Job:
    """One incarnation of the training job on one rank (built by :func:`main`).

    Extension points for the examples (``trainer/examples/``): ``wrap``, ``resume``,
    ``commit``, ``train_step``; :meth:`run` (the step-boundary loop with the agent's
    status lines and step logs) is shared. ``wrap_before_resume``: load into the
    wrapped model (DCP loads into FSDP2's sharded parameters).
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
        self.state = build_state(args, ctx.device)
        self.last_committed: Manifest | None = None  # rank 0's copy of the newest commit
        self.committed_step: int | None = None  # every rank: the newest step this run committed or resumed from
        self.guard = PreemptionGuard()
        self.ddp: torch.nn.Module = self.state.model

    # -- resume

    def _find_resume_point(self) -> tuple[Manifest | None, bytes | None]:
        """Rank 0: the newest committed checkpoint whose shard verifies (corrupt ones discarded)."""
        while True:
            manifest = latest_committed(self.store)
            if manifest is None:
                return None, None
            try:
                return manifest, load_shard(self.store, manifest, MODEL_SHARD)
            except CorruptCheckpointError as exc:
                log.error("discarding corrupt checkpoint step %d: %s", manifest.step, exc)
                discard(self.store, manifest.step)

    def resume(self) -> None:
        data = None
        manifest = None
        if self.ctx.is_leader:
            manifest, data = self._find_resume_point()
        if self.ctx.initialized and self.ctx.world_size > 1:
            box = [manifest]
            dist.broadcast_object_list(box, src=0)
            manifest = box[0]
            if manifest is not None and not self.ctx.is_leader:
                data = load_shard(self.store, manifest, MODEL_SHARD)
        if manifest is None:
            log.info("no committed checkpoint in %s: starting at step 0", self.store.uri)
        else:
            self._check_compatible(manifest)
            load_state(self.state, data, self.ctx.device)
            if self.state.step != manifest.step:
                raise CheckpointError(f"shard step {self.state.step} != manifest step {manifest.step}")
            self.guard.mark_handled(manifest.extra.get("notice_ids", ()))
            log.info("resumed from step %d (written at world size %d, now %d)",
                     manifest.step, manifest.world_size, self.ctx.world_size)
        self.last_committed = manifest
        self.committed_step = manifest.step if manifest is not None else None
        self.sampler = ElasticSampler(len(self.dataset), self.seed)

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

    # -- commit

    def commit(self, *, reason: str, decision: Decision) -> None:
        """Collective: rank 0 writes shard + manifest; all ranks pass; status line; gc."""
        step = self.state.step
        self.guard.mark_handled(decision.notice_ids)
        barrier(self.ctx)
        t0 = time.time()
        result = torch.zeros(5, dtype=torch.float64)  # ok, bytes, reused, save_s, upload_s
        error: BaseException | None = None
        if self.ctx.is_leader:
            try:
                nbytes, reused, save_s, upload_s = self._write_checkpoint(step, reason)
                result[:] = torch.tensor([1.0, float(nbytes), float(reused), save_s, upload_s],
                                         dtype=torch.float64)
            except Exception as exc:  # re-raised below, after the peers learn of it
                error = exc
        if self.ctx.initialized and self.ctx.world_size > 1:
            t = result.to(self.ctx.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)  # only rank 0 contributes: a broadcast + barrier
            result = t.cpu()
        if error is not None:
            raise error
        ok, nbytes, reused, save_s, upload_s = result.tolist()
        if not ok:
            raise CheckpointError(f"rank 0 failed to commit step {step}; see its log")
        self.committed_step = step
        seconds = time.time() - t0
        self.status.emit(
            "checkpoint_committed",
            step,
            notice_ids=list(decision.notice_ids),
            kinds=list(decision.kinds),
            seconds=round(seconds, 4),
            save_s=round(save_s, 4),  # state -> bytes on rank 0
            upload_s=round(upload_s, 4),  # shard + manifest to the store
            bytes=int(nbytes),
            reason=reason,
            reused=bool(reused),
        )
        if self.ctx.is_leader:
            log.info("committed step %d (%s, %.2f s, %d bytes%s)", step, reason, seconds, int(nbytes),
                     ", already stored" if reused else "")
            try:
                gc(self.store, keep=self.args.keep_checkpoints)
            except CheckpointError as exc:
                log.warning("checkpoint gc failed: %s", exc)

    def _manifest_extra(self, reason: str) -> dict:
        return {"notice_ids": self.guard.handled_ids, "attempt": self.attempt, "reason": reason}

    def _write_checkpoint(self, step: int, reason: str) -> tuple[int, bool, float, float]:
        """Rank 0. Returns (bytes of the checkpoint, whether it was already committed, save s, upload s)."""
        last = self.last_committed
        if (last is None or last.step != step) and self.committed_step == step:
            # This rank became rank 0 after the step was committed (an in-process shrink
            # whose old rank 0 left): the manifest is in the store, not in memory.
            last = self.last_committed = Manifest.from_json(
                self.store.get_bytes(f"{step_dir(step)}/{MANIFEST_NAME}"))
        if last is not None and last.step == step:
            # Already committed (e.g. resumed here, or periodic + notice at one boundary):
            # don't write the state again, but make the manifest record the handled
            # notices, or a worker restarted here would act on them once more.
            known = set(last.extra.get("notice_ids", ()))
            if not set(self.guard.handled_ids) <= known:
                last = dataclasses.replace(last, extra={**last.extra, **self._manifest_extra(reason)},
                                           time=time.time())
                # Same shards, richer extra: replacing manifest.json is one atomic put.
                self.store.put_bytes(f"{step_dir(step)}/{MANIFEST_NAME}", last.to_json().encode())
                self.last_committed = last
            return sum(s.size for s in last.shards), True, 0.0, 0.0
        t0 = time.perf_counter()
        data = state_to_bytes(self.state)
        t1 = time.perf_counter()
        info = write_shard(self.store, step, MODEL_SHARD, data)
        manifest = Manifest(
            step=step,
            world_size=self.ctx.world_size,
            global_batch_size=self.G,
            data_position=data_position(step, self.G, self.seed, len(self.dataset)),
            shards=(info,),
            time=time.time(),
            extra=self._manifest_extra(reason),
        )
        commit(self.store, manifest)
        self.last_committed = manifest
        return info.size, False, t1 - t0, time.perf_counter() - t1

    # -- train

    def wrap(self) -> None:
        if self.ctx.initialized and self.ctx.world_size > 1:
            kwargs = {"device_ids": [self.ctx.device.index]} if self.ctx.device.type == "cuda" else {}
            self.ddp = DDP(self.state.model, **kwargs)
        else:
            self.ddp = self.state.model

    def train_step(self) -> tuple[float, float, list[int]]:
        """One optimizer step. Returns (global mean loss, this rank's mean loss, positions)."""
        step = self.state.step
        micro = self.sampler.positions_for(step, self.plan, self.ctx.rank)
        model, opt = self.ddp, self.state.optimizer
        model.train()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.ctx.device)
        for i, mb in enumerate(micro):
            x, y = self.dataset.batch([self.sampler.index(p) for p in mb])
            x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if (last or not isinstance(model, DDP)) else model.no_sync()
            with sync:
                logits = model(input_ids=x, use_cache=False).logits
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
                (loss / len(micro)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.state.model.parameters(), 1.0)
        opt.step()
        local = total / len(micro)
        glob = local.clone()
        if self.ctx.initialized and self.ctx.world_size > 1:
            dist.all_reduce(glob, op=dist.ReduceOp.SUM)
            glob /= self.ctx.world_size
        self.state.step += 1
        return float(glob.item()), float(local.item()), [p for mb in micro for p in mb]

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


# --------------------------------------------------------------------------- entry point


def main(
    argv: Sequence[str] | None = None,
    *,
    job_cls: type[Job] = Job,
    parser: argparse.ArgumentParser | None = None,
    prepare: Callable[[], None] | None = None,
) -> int:
    """Run the job on this rank; returns the exit code (0 done, 2 bad configuration).

    The examples reuse it: ``job_cls`` is their :class:`Job` subclass, ``parser`` their
    flags (:func:`build_parser` plus their own), ``prepare`` runs before the process
    group is set up (e.g. DeepSpeed's environment).
    """
    args = (parser or build_parser()).parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
