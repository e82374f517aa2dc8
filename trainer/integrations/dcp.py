"""Sharded checkpoints for plain-DDP and FSDP2 training through ``torch.distributed.checkpoint``.

A user's model (plain, ``DistributedDataParallel`` or FSDP2 ``fully_shard``) and
optimizer become one DCP checkpoint per commit, and a checkpoint written at one
world size loads at any other: DCP records which slice of each tensor every file
holds (``.metadata``) and each rank reads the slices its current shards need.

One commit at step N, on every rank (the directory protocol of
:class:`~trainer.integrations.common.DirCheckpointer`)::

    get_state_dict(model, optimizer)          FSDP2: this rank's DTensor shards; DDP: full tensors
    dcp.save(FileSystemWriter(save-N/))       rank r writes __<r>_0.distcp into its NODE's
                                              folder; rank 0 writes .metadata last (tmp + rename)
    node leaders upload their folder          rank 0 writes manifest.json LAST (the commit)

So on a two-node job (ranks 0,1 on A; 2 on B) A's folder holds ``__0_0.distcp``,
``__1_0.distcp`` and ``.metadata`` and B's holds ``__2_0.distcp``; the manifest lists
all four. Replicated tensors (DDP, an optimizer's ``step``) are written once, by
one rank, whichever DCP's planner picks.

Resume: every node downloads the *whole* newest committed checkpoint (all ranks'
files and ``.metadata``, each checked against the manifest's size and sha256),
then ``dcp.load`` fills the tensors of ``get_state_dict`` in place and
``set_state_dict`` hands them to model and optimizer. A checkpoint is never
loaded when:

- it has no manifest (a node died during save or upload): the previous committed one is;
- a shard is missing or corrupt in the store: it is discarded and the previous one tried;
- its manifest lists no ``.metadata`` (cannot come from :meth:`DcpCheckpointer.commit`,
  whose ``dcp.save`` returns only after ``.metadata`` is renamed into place): discarded too.

Step and data position come from the manifest, not from the DCP files: the data
position is one global ``consumed_samples`` (plus seed), the only data state with
a meaning at another world size.

Costs (all measured, seconds of wall time on the calling rank; bytes of files):
``CommitResult.save_s`` (state dict + ``dcp.save`` + barrier), ``upload_s`` and
``bytes`` (the whole checkpoint, all nodes) come from the commit and are also in
the manifest's ``extra`` and the status line; :attr:`DcpCheckpointer.last_load`
holds ``fetch_s`` (listing + download to this node) and ``load_s`` (``dcp.load`` +
``set_state_dict``) of the last resume. Every node stores the whole checkpoint
on local disk while resuming (``bytes``), once.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from trainer.checkpoint import CheckpointError, CheckpointStore, Manifest, discard
from trainer.guard import Decision, PreemptionGuard
from trainer.integrations.common import CommitResult, DirCheckpointer
from trainer.runtime import DistContext, StatusWriter, barrier

__all__ = [
    "DcpCheckpointer",
    "LoadReport",
    "DcpError",
    "ForeignCheckpointError",
    "DCP_FORMAT",
    "METADATA_NAME",
]

log = logging.getLogger(__name__)

#: ``manifest.extra["format"]`` of a checkpoint this module wrote.
DCP_FORMAT = "torch-dcp"
#: The file DCP's coordinator writes last; a DCP folder without it cannot be loaded.
METADATA_NAME = ".metadata"

_MODEL_KEY = "model"
_OPTIM_KEY = "optim"


class DcpError(CheckpointError):
    """``dcp.save`` or ``dcp.load`` failed (raised on every rank; ``__cause__`` holds DCP's error).

    On load this usually means the checkpoint does not fit this model or
    optimizer (a key missing, another shape): retrying cannot fix it.
    """


class ForeignCheckpointError(CheckpointError):
    """The newest committed checkpoint was not written by :class:`DcpCheckpointer`
    (another trainer used the same URI): retrying cannot fix it."""


@contextlib.contextmanager
def _single_process(active: bool) -> Iterator[None]:
    """Without a process group DCP runs without collectives; silence its warning saying so."""
    if not active:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What one :meth:`DcpCheckpointer.resume` did.

    Attributes:
        step: the step loaded.
        saved_world_size: ranks that wrote the checkpoint (the current world may differ).
        bytes: size of the whole checkpoint, downloaded by every node (bytes).
        fetch_s: newest-committed lookup + download to this node + barrier (seconds).
        load_s: ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` (seconds).
    """

    step: int
    saved_world_size: int
    bytes: int
    fetch_s: float
    load_s: float

    def as_dict(self) -> dict[str, int | float]:
        """The fields as a JSON-ready dict (seconds rounded to 0.1 ms), e.g. for a status line."""
        return {"step": self.step, "saved_world_size": self.saved_world_size, "bytes": self.bytes,
                "fetch_s": round(self.fetch_s, 4), "load_s": round(self.load_s, 4)}


class DcpCheckpointer:
    """Commits and resumes a model + optimizer (+ any :class:`Stateful`) as DCP checkpoints.

    Args:
        ctx: this process (rank, local rank, world size); ``ctx.initialized`` False
            means a plain process without a group (DCP then runs without collectives).
        store: where checkpoints are committed (``file://``, ``s3://``, ``oss://``).
        model: the model as trained: plain, ``DistributedDataParallel`` or FSDP2
            (``fully_shard``). Keys are the plain model's (DDP's ``module.`` is
            dropped), so a checkpoint of one wrapping loads into another.
        optimizer: its optimizer, built over the *wrapped* model's parameters.
        scratch: node-local directory for the save and resume folders (e.g.
            :func:`trainer.runtime.scratch_dir`); must not be shared between nodes.
        status: the agent's status file writer (``checkpoint_committed`` lines).
        guard: the job's guard; a commit marks the notices it answers handled.
        keep: committed checkpoints kept by gc after each commit (>= 1).
        stateful: more state saved alongside, by name (e.g. ``{"lr_scheduler": sched}``);
            each value's ``state_dict()`` is saved and ``load_state_dict()`` called on resume.
        process_group: the group DCP's collectives use (default: the world).

    Raises:
        ValueError: ``keep < 1`` or a ``stateful`` name that clashes with ``"model"``/``"optim"``.

    Every method is collective: all ranks call it at the same step boundary. The
    constructor does no I/O and no collective.
    """

    __slots__ = ("ctx", "model", "optimizer", "stateful", "process_group", "dir", "last_load")

    def __init__(
        self,
        ctx: DistContext,
        store: CheckpointStore,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scratch: Path,
        status: StatusWriter,
        guard: PreemptionGuard,
        keep: int = 2,
        stateful: Mapping[str, Stateful] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        stateful = dict(stateful or {})
        clash = {_MODEL_KEY, _OPTIM_KEY} & set(stateful)
        if clash:
            raise ValueError(f"stateful names {sorted(clash)} are reserved for the model and optimizer")
        self.ctx, self.model, self.optimizer = ctx, model, optimizer
        self.stateful, self.process_group = stateful, process_group
        self.dir = DirCheckpointer(ctx, store, scratch, status, guard, keep=keep)
        #: The last :meth:`resume` that loaded something, else None.
        self.last_load: LoadReport | None = None

    @property
    def last_committed(self) -> Manifest | None:
        """The newest checkpoint this process committed or resumed from."""
        return self.dir.last_committed

    # -- state

    def _state(self) -> dict[str, Any]:
        """What DCP saves and loads: the model's and optimizer's state dicts (this rank's
        shards under FSDP2) and the stateful extras. Initialises an optimizer that has
        not stepped yet (a zero-lr step), so its state has tensors to load into."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=StateDictOptions())
        return {_MODEL_KEY: model_sd, _OPTIM_KEY: optim_sd, **self.stateful}

    def _save(self, local: Path) -> None:
        state = self._state()
        writer = FileSystemWriter(local, overwrite=False)
        try:
            with _single_process(not self.ctx.initialized):
                dcp.save(state, storage_writer=writer, process_group=self.process_group,
                         no_dist=not self.ctx.initialized)
        except CheckpointException as exc:  # raised on every rank alike
            raise DcpError(f"dcp.save into {local} failed: {exc}") from exc

    def _load(self, local: Path) -> None:
        state = self._state()
        try:
            with _single_process(not self.ctx.initialized):
                dcp.load(state, storage_reader=FileSystemReader(local), process_group=self.process_group,
                         no_dist=not self.ctx.initialized)
        except CheckpointException as exc:
            raise DcpError(f"dcp.load from {local} failed (does the checkpoint fit this model?): {exc}") from exc
        set_state_dict(self.model, self.optimizer, model_state_dict=state[_MODEL_KEY],
                       optim_state_dict=state[_OPTIM_KEY])

    # -- commit

    def commit(
        self,
        step: int,
        *,
        reason: str,
        decision: Decision | None,
        global_batch_size: int,
        data_position: dict,
        extra: dict | None = None,
    ) -> CommitResult:
        """Save the state with ``dcp.save``, upload every node's files, and commit step ``step``.

        Blocks until the manifest is written (or the commit failed on every rank).
        A step already committed (e.g. the job resumed at it) is not saved again;
        its ``checkpoint_committed`` status line is still written.

        Args:
            step: optimizer steps completed (>= 0).
            reason: why ("notice", "periodic", "final"); recorded in the manifest.
            decision: the guard's decision at this boundary; its notice ids are recorded.
            global_batch_size: samples per optimizer step (>= 1).
            data_position: where the sample stream resumes, e.g.
                :func:`trainer.runtime.data_position` (JSON-serialisable).
            extra: more JSON-serialisable fields for the manifest's ``extra``.

        Returns:
            The manifest, ``save_s`` and ``upload_s`` (seconds) and ``bytes`` (the
            whole checkpoint, all nodes' files).

        Raises:
            DcpError: ``dcp.save`` failed (on every rank); nothing committed.
            CheckpointError: an upload or the commit failed (on every rank); nothing committed.
        """
        return self.dir.commit(
            step,
            self._save,
            reason=reason,
            decision=decision,
            global_batch_size=global_batch_size,
            data_position=data_position,
            extra={**(extra or {}), "format": DCP_FORMAT, "torch": torch.__version__},
        )

    # -- resume

    def _drop(self, local: Path) -> None:
        """Remove a fetched folder on an error path (node leader; no barrier: the job is ending)."""
        if self.ctx.is_local_leader:
            shutil.rmtree(local, ignore_errors=True)

    def resume(self, *, check: Callable[[Manifest], None] | None = None) -> Manifest | None:
        """Load the newest committed DCP checkpoint into model, optimizer and extras, in place.

        Works at any world size: the checkpoint is resharded to this one. Blocks for
        the download of the whole checkpoint to every node, then the load. Torn
        checkpoints are never considered; corrupt ones, and ones whose manifest
        lists no ``.metadata``, are discarded and the previous one is taken.

        Args:
            check: called on every rank with the manifest before anything is loaded
                (e.g. refuse another global batch size); what it raises propagates
                and the state is untouched. It must decide alike on every rank.

        Returns:
            The manifest loaded (``step``, ``data_position``, ``world_size`` of the
            writer), or None when nothing is committed (the state is untouched).
            :attr:`last_load` holds its costs.

        Raises:
            ForeignCheckpointError: the newest committed checkpoint is not a DCP one.
            DcpError: ``dcp.load`` failed (on every rank), e.g. another model shape.
            StorageError: the store failed.
        """
        while True:
            t0 = time.perf_counter()
            manifest, local = self.dir.fetch_latest()
            fetch_s = time.perf_counter() - t0
            if manifest is None or local is None:
                return None
            fmt = manifest.extra.get("format")
            if fmt != DCP_FORMAT:
                self._drop(local)
                raise ForeignCheckpointError(
                    f"step {manifest.step} in {self.dir.store.uri} is not a DCP checkpoint (format {fmt!r}, "
                    f"shards {[s.name for s in manifest.shards][:4]}...): use another checkpoint URI"
                )
            if any(s.name == METADATA_NAME for s in manifest.shards):
                break
            # Same decision on every rank: the manifest was broadcast by fetch_latest.
            self.dir.cleanup(local)
            if self.ctx.is_leader:
                log.error("discarding DCP checkpoint step %d: no %s in its manifest", manifest.step, METADATA_NAME)
                discard(self.dir.store, manifest.step)
            self.dir.last_committed = None
            barrier(self.ctx)
        if check is not None:
            try:
                check(manifest)
            except BaseException:
                self._drop(local)
                raise
        t1 = time.perf_counter()
        self._load(local)
        t2 = time.perf_counter()
        self.dir.cleanup(local)
        nbytes = sum(s.size for s in manifest.shards)
        self.last_load = LoadReport(step=manifest.step, saved_world_size=manifest.world_size, bytes=nbytes,
                                    fetch_s=fetch_s, load_s=t2 - t1)
        if self.ctx.is_leader:
            log.info("loaded DCP step %d (written at world size %d, now %d): %d bytes, fetch %.2f s, load %.2f s",
                     manifest.step, manifest.world_size, self.ctx.world_size, nbytes, fetch_s, t2 - t1)
        return manifest
