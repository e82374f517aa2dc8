"""The Hugging Face ``Trainer`` on spotvisor: notice-driven commits, exact elastic resume.

A user's ``transformers.Trainer`` script gets, with three changes (see
:mod:`trainer.examples.hf_finetune` for a whole script):

- ``TrainingArguments(**training_args_kwargs(batch, world_size, ...), learning_rate=...)``:
  ``gradient_accumulation_steps`` recomputed from :class:`~trainer.batch.ElasticBatch`,
  so the global batch (samples per optimizer step) is the same at every world size;
- the training set wrapped in :class:`GlobalPositionDataset` and the Trainer built as
  :class:`SpotvisorTrainer` with a :class:`SpotvisorCallback`;
- ``trainer.train(resume_from_checkpoint=resolve_resume_checkpoint(...)[1])``.

One step boundary, on every rank alike (the contract of :mod:`trainer.run`)::

    on_step_end   step log + "step" status line; guard.check()     collective
                  notice -> control.should_save (+ should_training_stop if it holds)
                  target step -> should_save (the final commit)
    Trainer       _save_checkpoint(): output_dir/checkpoint-N on each node
                  (rank 0: model, optimizer, scheduler, trainer_state.json;
                   every rank r: rng_state_r.pth)
    on_save       DirCheckpointer.commit: each node leader moves its node's
                  checkpoint-N aside and uploads it; rank 0 writes the manifest LAST
                  "checkpoint_committed" status line; gc of old committed ones
                  interruption/rejoin -> "holding", guard.hold(): keep-alive until the
                  restart (a peer leaving raises; the worker exits non-zero)

Why each piece (each a transformers behaviour measured with its issue cited):

- ``get_last_checkpoint`` picks the largest ``checkpoint-N`` with no completeness
  check (transformers#35782), and ``trainer_state.json`` is written last by rank 0
  with no barrier: resume only ever takes the newest *committed* checkpoint
  (:func:`resolve_resume_checkpoint`), downloaded and sha256-checked.
- ``save_total_limit`` rotation runs right after each save and may delete the previous
  good folder before the new one is committed: every ``checkpoint-N`` is moved out of
  ``output_dir`` by its commit, so rotation finds nothing; old *committed*
  checkpoints are removed by the store's gc (``keep``) only after a newer commit.
- The Trainer loads ``rng_state_{rank}.pth`` (``rng_state.pth`` at world size 1) and
  only logs when it is missing: a rank that is new at this world size keeps its seeded
  RNG. The data order does not depend on it: sampling is sequential over
  :class:`GlobalPositionDataset`, whose item ``p`` is global sample position ``p``.
- Exact data position across world sizes: accelerate shards a sequential batch
  sampler round-robin (per-rank batch ``k`` is global batch ``k * W + rank``), so
  optimizer step ``s`` trains on global positions ``[s * G, (s + 1) * G)`` for every
  ``W`` when ``G = micro x accum x W`` is constant; on resume the Trainer skips
  ``global_step * accum`` batches per rank, i.e. exactly the first ``global_step * G``
  positions. Each rank records the positions it really trained on in its step log.

Costs (seconds of wall time on the calling rank, bytes of files): the commit's
``save_s`` (status line and manifest) is the Trainer's own save, between ``on_step_end``
and ``on_save``, plus moving ``checkpoint-N`` aside; ``upload_s`` and ``bytes`` (every
node's files) are :class:`~trainer.integrations.common.DirCheckpointer`'s. On resume every node
downloads the whole checkpoint once (:func:`resolve_resume_checkpoint` logs the time).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainer.batch import BatchPlan, ElasticBatch
from trainer.checkpoint import Manifest
from trainer.guard import Decision, PreemptionGuard
from trainer.integrations import hf_env
from trainer.integrations.common import DirCheckpointer
from trainer.contract import LOG_DIR_ENV, STATUS_FILE_ENV
from trainer.runtime import DistContext, StatusWriter, StepLog, data_position, new_attempt_id
from trainer.sampler import ElasticSampler

__all__ = [
    "HF_FORMAT",
    "SAMPLE_POSITIONS_KEY",
    "ResumeError",
    "GlobalPositionDataset",
    "training_args_kwargs",
    "resolve_resume_checkpoint",
    "SpotvisorCallback",
    "SpotvisorTrainer",
]

log = logging.getLogger(__name__)

#: ``manifest.extra["format"]`` of a checkpoint this module committed.
HF_FORMAT = "hf-trainer"
#: The batch key carrying each sample's global position (a LongTensor of shape ``(micro_batch,)``).
SAMPLE_POSITIONS_KEY = "sample_positions"
_TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME


class ResumeError(Exception):
    """A committed checkpoint this job can never resume from (foreign format, other
    global batch size); the script prints the one-line message and exits 2."""


# --------------------------------------------------------------------------- data and arguments


class GlobalPositionDataset(torch.utils.data.Dataset):
    """The elastic sample stream as a map-style dataset: item ``p`` is global position ``p``.

    Item ``p`` is ``to_features(base[ElasticSampler(len(base), seed).index(p)])`` plus
    ``{SAMPLE_POSITIONS_KEY: p}``, so with sequential sampling the Trainer trains on
    positions in order and each batch says which ones (``default_data_collator`` turns
    them into a LongTensor of shape ``(micro_batch,)``). Epoch ``e`` of ``base`` is the
    permutation seeded with ``seed + e``, as in :mod:`trainer.run`.

    Args:
        base: the samples (any sequence, ``len(base) >= 1``).
        num_positions: length of the stream; ``target_steps * global_batch_size`` makes
            one Trainer "epoch" exactly the whole run.
        seed: data-order seed.
        to_features: turns one sample into a dict of tensors for the model (default:
            the sample itself, which must then be a mapping).

    Raises:
        ValueError: ``num_positions < 1`` or an empty ``base``.
    """

    def __init__(
        self,
        base: Sequence[Any],
        num_positions: int,
        *,
        seed: int = 0,
        to_features: Callable[[Any], Mapping[str, Any]] | None = None,
    ) -> None:
        if num_positions < 1:
            raise ValueError(f"num_positions must be >= 1, got {num_positions}")
        self.base = base
        self.num_positions = int(num_positions)
        self.sampler = ElasticSampler(len(base), seed)
        self.to_features = to_features

    def __len__(self) -> int:
        return self.num_positions

    def __getitem__(self, position: int) -> dict[str, Any]:
        if not 0 <= position < self.num_positions:
            raise IndexError(f"position {position} outside [0, {self.num_positions})")
        sample = self.base[self.sampler.index(position)]
        features = dict(self.to_features(sample) if self.to_features else sample)
        features[SAMPLE_POSITIONS_KEY] = position
        return features


def training_args_kwargs(
    batch: ElasticBatch,
    world_size: int,
    *,
    output_dir: str | os.PathLike[str],
    target_steps: int,
    checkpoint_interval: int,
    seed: int = 0,
) -> dict[str, Any]:
    """``TrainingArguments`` keywords that keep the global batch and data order exact.

    ``per_device_train_batch_size`` is the micro batch and ``gradient_accumulation_steps``
    is ``global_batch_size / (micro_batch_size * world_size)``. Sampling is sequential
    (the order lives in :class:`GlobalPositionDataset`), batches are sharded round-robin
    and never dispatched from rank 0, the data skip on resume stays on, and no
    ``save_total_limit`` rotation happens (the store's gc keeps committed checkpoints).
    Pass everything else (learning rate, scheduler, ...) next to these; passing one of
    these again is a ``TypeError`` from Python, on purpose.

    Args:
        batch: the job's global and micro batch sizes.
        world_size: ranks in this incarnation (``WORLD_SIZE``).
        output_dir: node-local folder the Trainer writes ``checkpoint-N`` into.
        target_steps: optimizer steps in total (``max_steps``).
        checkpoint_interval: periodic commit every N steps; 0: only notice and final ones.
        seed: the Trainer's seed (model init happens before, in the caller).

    Raises:
        BatchError: ``world_size`` cannot keep the global batch (lists the valid ones).
        ValueError: ``target_steps < 1`` or ``checkpoint_interval < 0``.
    """
    if target_steps < 1 or checkpoint_interval < 0:
        raise ValueError(f"bad target_steps={target_steps} / checkpoint_interval={checkpoint_interval}")
    plan = batch.plan(world_size)
    return {
        "output_dir": os.fspath(output_dir),
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "max_steps": target_steps,
        "save_strategy": "steps" if checkpoint_interval else "no",
        "save_steps": checkpoint_interval or 1,
        "save_total_limit": None,
        "save_on_each_node": False,
        "save_only_model": False,
        "ignore_data_skip": False,
        "train_sampling_strategy": "sequential",
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "dataloader_drop_last": False,
        "accelerator_config": {"split_batches": False, "dispatch_batches": False, "even_batches": True},
        "seed": seed,
        "report_to": "none",
        "disable_tqdm": True,
    }


# --------------------------------------------------------------------------- resume


def resolve_resume_checkpoint(
    checkpointer: DirCheckpointer, *, global_batch_size: int
) -> tuple[Manifest | None, Path | None]:
    """Fetch the newest committed checkpoint into node-local disk, for ``trainer.train``.

    Collective (every rank calls it once, before ``train``). A torn checkpoint (no
    manifest: a node died while saving or uploading; a shard missing or short) is never
    taken; one whose shard fails its sha256 is discarded and the previous committed one
    is fetched (:meth:`DirCheckpointer.fetch_latest`). The folder holds every rank's
    files as written at the checkpoint's world size; at another world size the Trainer
    finds no ``rng_state`` file for new ranks and ignores those of departed ranks.

    Returns:
        ``(manifest, folder)``, or ``(None, None)`` when nothing is committed. The
        folder is ``<scratch>/resume-<step>``; :class:`SpotvisorCallback` removes it
        after the first step (``resume_dir=``).

    Raises:
        ResumeError: the checkpoint was not written by this module (no
            ``trainer_state.json``), or with another global batch size.
        StorageError: the store failed.
    """
    t0 = time.perf_counter()
    manifest, local = checkpointer.fetch_latest()
    if manifest is None or local is None:
        log.info("no committed checkpoint in %s: starting at step 0", checkpointer.store.uri)
        return None, None
    uri = checkpointer.store.uri
    if manifest.extra.get("format") != HF_FORMAT or not (local / _TRAINER_STATE).is_file():
        raise ResumeError(
            f"checkpoint step {manifest.step} in {uri} was not written by the HF Trainer integration "
            f"(format {manifest.extra.get('format')!r}): use another checkpoint_uri"
        )
    if manifest.global_batch_size != global_batch_size:
        raise ResumeError(
            f"checkpoint step {manifest.step} in {uri} was trained with global_batch_size "
            f"{manifest.global_batch_size}, not {global_batch_size}: the data position would not be exact"
        )
    log.info("fetched committed step %d (world size %d) in %.2f s", manifest.step, manifest.world_size,
             time.perf_counter() - t0)
    return manifest, local


# --------------------------------------------------------------------------- the callback


class SpotvisorCallback(TrainerCallback):
    """Puts a ``Trainer`` on spotvisor's step-boundary contract (see the module docstring).

    Args:
        ctx: this process (:func:`trainer.runtime.setup_distributed`).
        checkpointer: commits ``checkpoint-N`` folders (its ``guard`` and ``status`` are used).
        plan: the batch split at this world size (``ElasticBatch.plan(world_size)``).
        steplog: per-rank step log for the run summary.
        hold_timeout_s: how long to hold after an interruption/rejoin commit before training on.
        seed: data-order seed (recorded in the manifest's data position).
        dataset_len: samples in the base dataset (recorded in the data position).
        resume_dir: the folder :func:`resolve_resume_checkpoint` returned; removed after
            the first step (the Trainer has loaded everything by then).

    ``args.output_dir`` must be node-local and this job's own: its ``checkpoint-*``
    folders are removed at ``on_train_begin`` and moved away by each commit.

    Every hook runs on every rank; ``on_step_end``, ``on_save`` and ``on_train_begin``
    are collective. Errors (a peer left during a collective, a failed commit) propagate
    out of ``trainer.train`` so the worker exits non-zero and torchrun restarts it.
    """

    def __init__(
        self,
        *,
        ctx: DistContext | None = None,
        checkpointer: DirCheckpointer | None = None,
        plan: BatchPlan | None = None,
        steplog: StepLog | None = None,
        hold_timeout_s: float | None = None,
        seed: int = 0,
        dataset_len: int | None = None,
        resume_dir: Path | None = None,
    ) -> None:
        explicit = (ctx, checkpointer, plan, steplog, hold_timeout_s, dataset_len)
        self.standalone = all(v is None for v in explicit) and resume_dir is None
        if not self.standalone and any(v is None for v in explicit):
            raise TypeError("SpotvisorCallback: give no argument (the job's environment says everything) or all of "
                            "ctx, checkpointer, plan, steplog, hold_timeout_s, dataset_len")
        if hold_timeout_s is not None and hold_timeout_s < 0:
            raise ValueError(f"hold_timeout_s must be >= 0, got {hold_timeout_s}")
        self.ctx = ctx
        self.checkpointer = checkpointer
        self.plan = plan
        self.steplog = steplog
        self.hold_timeout_s = hold_timeout_s
        self.seed = seed
        self.dataset_len = dataset_len
        self.resume_dir = resume_dir
        self._positions: list[int] = []
        self._loss = 0.0
        self._decision: Decision | None = None
        self._stopped_for_hold = False
        self._step_end_t: float | None = None
        # the one-line path: SIGTERM becomes a notice (main thread); the rest at on_train_begin
        self.active = not self.standalone
        self._signals = hf_env.SignalNotice() if self.standalone else None
        self._recorder: hf_env.InputRecorder | None = None

    @property
    def guard(self) -> PreemptionGuard:
        return self.checkpointer.guard

    @property
    def status(self) -> StatusWriter:
        return self.checkpointer.status

    def record(self, positions: Sequence[int], loss: float) -> None:
        """One micro batch this rank trained on: its global positions and its (accumulation-scaled) loss."""
        self._positions.extend(int(p) for p in positions)
        self._loss += float(loss)

    # -- hooks

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        if self.standalone:
            self.active = self._attach(args, state, kw)
        if not self.active:
            return control
        if self.ctx.is_local_leader:
            # Left by a worker killed between the Trainer's save and its commit: never committed,
            # and a save at the same step would mix its files (e.g. another world's rng_state_r).
            # (The one-line path keeps the folder it resumed from: its rng_state is read later.)
            keep = {self.resume_dir.name} if self.standalone and self.resume_dir is not None else set()
            for stale in Path(args.output_dir).glob("checkpoint-*"):
                if stale.name not in keep:
                    shutil.rmtree(stale, ignore_errors=True)
        last = self.checkpointer.last_committed
        self.status.emit("started", state.global_step, resumed_from=last.step if last else None,
                         global_batch_size=self.plan.global_batch_size,
                         micro_batch_size=self.plan.micro_batch_size, grad_accum_steps=self.plan.grad_accum_steps)
        if self.ctx.is_leader:
            log.info("world %d, global batch %d = %d x %d accum x %d ranks, step %d/%d", self.ctx.world_size,
                     self.plan.global_batch_size, self.plan.micro_batch_size, self.plan.grad_accum_steps,
                     self.ctx.world_size, state.global_step, state.max_steps)
        # A notice that came while the workers restarted: answer it at once when this step
        # is already committed (the usual case: we resumed here). Otherwise it stays
        # pending and the first step boundary answers it.
        decision = self.guard.check()
        if decision.checkpoint and last is not None and last.step == state.global_step:
            self.checkpointer.commit(state.global_step, _nothing, reason="notice", decision=decision,
                                     global_batch_size=self.plan.global_batch_size,
                                     data_position=self._data_position(state.global_step))
            if decision.hold and state.global_step < state.max_steps:
                self._hold(state.global_step, decision)
        return control

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        if not self.active:
            return control
        step = state.global_step
        if self.resume_dir is not None:
            self.checkpointer.cleanup(self.resume_dir)  # collective; everything was loaded before step 1
            self.resume_dir = None
        extra: dict[str, Any] = {}
        if self._recorder is not None:
            loss_sum, tokens, inputs = self._recorder.take()
            self._positions = hf_env.step_positions(step, self.plan, self.ctx.rank)
            if self._recorder.digests:
                extra["inputs"] = inputs
            self._loss = loss_sum / max(tokens, 1)
            loss = self._token_mean(loss_sum, tokens)
        else:
            loss = self._global_loss()
        self.steplog.write(step, self._positions, self._loss, **extra)
        self.status.emit("step", step, loss=loss)
        self._positions, self._loss = [], 0.0
        decision = self.guard.check()
        self._decision = decision if decision.checkpoint else None
        if decision.checkpoint:
            control.should_save = True
            if decision.hold and step < state.max_steps:
                control.should_training_stop = True
                self._stopped_for_hold = True
        if step >= state.max_steps:
            control.should_save = True  # the final commit, whatever save_strategy says
        self._step_end_t = time.perf_counter()
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        if not self.active:
            return control
        step = state.global_step
        decision, self._decision = self._decision, None
        final = step >= state.max_steps
        reason = "final" if final else ("notice" if decision else "periodic")
        folder = Path(args.output_dir) / f"checkpoint-{step}"
        # The Trainer's own save (between on_step_end and on_save) on this rank, seconds.
        trainer_save_s = time.perf_counter() - self._step_end_t if self._step_end_t is not None else None

        def take_folder(local: Path) -> None:
            # Every rank's _save_checkpoint has returned (DirCheckpointer's barrier). The node
            # leader moves this node's folder aside, so save_total_limit rotation and a later
            # save never touch it; it is removed once uploaded.
            if self.ctx.is_local_leader:
                if folder.is_dir():
                    shutil.move(os.fspath(folder), os.fspath(local))
                else:
                    local.mkdir(parents=True, exist_ok=True)

        self.checkpointer.commit(step, take_folder, reason=reason, decision=decision,
                                 global_batch_size=self.plan.global_batch_size,
                                 data_position=self._data_position(step),
                                 extra={"format": HF_FORMAT}, presave_s=trainer_save_s or 0.0)
        if decision is not None and decision.hold and not final:
            if self._signals is not None and self._signals.received_at is not None:
                self._leave(step)
            self._hold(step, decision)
            if self._stopped_for_hold:
                control.should_training_stop = False  # no restart came: train on, like trainer.run
                self._stopped_for_hold = False
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        if self._signals is not None:
            self._signals.exit_now = True  # training is over: a SIGTERM ends the worker
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None
        if not self.active:
            return control
        if self.resume_dir is not None:  # resumed at the target step: no step ran
            self.checkpointer.cleanup(self.resume_dir)
            self.resume_dir = None
        last = self.checkpointer.last_committed
        if state.global_step >= state.max_steps and last is not None and last.step == state.global_step:
            self.status.emit("completed", state.global_step)
            if self.ctx.is_leader:
                log.info("completed: step %d committed", state.global_step)
        return control

    # -- helpers

    def _leave(self, step: int) -> None:
        """This worker was sent SIGTERM (its node's torchrun forwards the agent's, on the
        node's notice, and is stopping): the commit of ``step`` answered it, so the worker
        ends now, status 143, instead of holding for a restart its own torchrun will never
        start. Its node then leaves the job at once, not when the cloud takes it (the whole
        notice lead, up to minutes, of a held job): the peers' hold fails, their torchrun
        restarts them from that commit, and the replacement joins. Never status 0 mid-job
        (that closes the rendezvous for good, pytorch#123678)."""
        if self.ctx.is_local_leader:
            log.warning("SIGTERM answered by the commit of step %d: this node's workers end", step)
        raise SystemExit(128 + signal.SIGTERM)

    def _hold(self, step: int, decision: Decision) -> None:
        self.status.emit("holding", step, notice_ids=list(decision.notice_ids), kinds=list(decision.kinds),
                         timeout_s=self.hold_timeout_s)
        if self.ctx.is_leader:
            log.info("holding at step %d for a restart (notices %s, timeout %.0f s)", step,
                     ",".join(decision.notice_ids), self.hold_timeout_s)
        if self._signals is not None:
            self._signals.exit_now = True  # committed: torchrun's SIGTERM (a restart) may end us now
        try:
            self.guard.hold_for_restart(self.hold_timeout_s, step)
        finally:
            if self._signals is not None:
                self._signals.exit_now = False
        if self.ctx.is_leader:
            log.warning("no restart within %.0f s of holding: training on", self.hold_timeout_s)

    def _attach(self, args: TrainingArguments, state: TrainerState, kw: dict[str, Any]) -> bool:
        """The one-line path's set-up (:mod:`trainer.integrations.hf_env`): False when not a spotvisor run."""
        attempt: list[str] = []

        def status(ctx: DistContext) -> StatusWriter:
            attempt.append(new_attempt_id(ctx))
            return StatusWriter(os.environ.get(STATUS_FILE_ENV), ctx, attempt[0])

        at = hf_env.attach(args, kw.get("train_dataloader"), status, self._signals)
        if at is None:
            return False
        self.ctx, self.checkpointer, self.plan = at.ctx, at.checkpointer, at.plan
        self.hold_timeout_s, self.dataset_len, self.seed = at.hold_timeout_s, at.dataset_len, int(args.seed)
        self.steplog = StepLog(os.environ.get(LOG_DIR_ENV), at.ctx, attempt[0])
        manifest = hf_env.check_resumed(at, state.global_step, args.output_dir)
        if manifest is not None:
            self.resume_dir = hf_env.resumed_folder(args.output_dir, manifest.step)
        model = kw.get("model")
        if model is None:
            hf_env.fail("SpotvisorCallback: the Trainer passed no model to its callbacks")
        self._recorder = hf_env.InputRecorder(model, digests=os.environ.get(hf_env.LOG_INPUTS_ENV) == "1")
        self._signals.exit_now = False
        return True

    def _token_mean(self, loss_sum: float, tokens: int) -> float:
        """The step's loss over every rank's target tokens (collective)."""
        t = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.initialized and self.ctx.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t[0].item()) / max(float(t[1].item()), 1.0)

    def _global_loss(self) -> float:
        if not (self.ctx.initialized and self.ctx.world_size > 1):
            return self._loss
        t = torch.tensor([self._loss], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item()) / self.ctx.world_size

    def _data_position(self, step: int) -> dict[str, int]:
        return data_position(step, self.plan.global_batch_size, self.seed, self.dataset_len)


def _nothing(local: Path) -> None:
    """save_fn for a step that is already committed (never called: DirCheckpointer reuses it)."""


# --------------------------------------------------------------------------- the Trainer


class SpotvisorTrainer(Trainer):
    """A ``Trainer`` that reports each micro batch's global positions to a :class:`SpotvisorCallback`.

    Pops :data:`SAMPLE_POSITIONS_KEY` (shape ``(micro_batch,)``) from each batch before the
    model sees it, and records it with the loss ``training_step`` returns. Everything else
    is the stock Trainer; the callback is added to ``callbacks``.

    Args:
        spotvisor: the callback (keyword only); other arguments are ``Trainer``'s.
    """

    def __init__(self, *args: Any, spotvisor: SpotvisorCallback, **kwargs: Any) -> None:
        callbacks = list(kwargs.pop("callbacks", None) or [])
        super().__init__(*args, callbacks=[*callbacks, spotvisor], **kwargs)
        self.spotvisor = spotvisor

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        positions = inputs.pop(SAMPLE_POSITIONS_KEY, None)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if positions is not None:
            self.spotvisor.record(positions.tolist() if isinstance(positions, torch.Tensor) else positions,
                                  float(loss))
        return loss
