"""DeepSpeed on spotvisor's commit protocol, with resume at any world size.

Commit: every rank calls ``engine.save_checkpoint(local_dir, tag="global_step<N>")``
(a collective save into node-local scratch), then :class:`~trainer.integrations.common.DirCheckpointer`
uploads each node's files and commits ``step-<N>/manifest.json`` last. The client
state carries ``universal_checkpoint_info`` so the checkpoint can later be converted.

Resume (:meth:`DeepSpeedCheckpointer.resume`), all ranks alike::

    rank 0      newest committed manifest -> broadcast
    same DP world size as the writer:
      node leaders fetch step-N/ (sha256 checked)      DirCheckpointer.fetch_latest
      all ranks    engine.load_checkpoint(dir, tag)
    another DP world size (ZeRO partitions no longer fit, DeepSpeed#2898):
      rank 0       step-N/universal.json present, its shards present with their sizes,
                   made from these very shards?  -> use it (cached)
                   else fetch step-N/, convert with deepspeed.checkpoint.ds_to_universal
                   (--inject_missing_state), upload as step-N/universal/..., then write
                   step-N/universal.json LAST (the cache's own commit point)
      node leaders fetch step-N/universal/ (sha256 checked; a corrupt cache is dropped
                   and converted again once)
      all ranks    engine.load_checkpoint(dir, tag) in universal mode

Example (``configs/local-deepspeed.yaml``): step 22 is committed at world size 3 on a
notice; the node is taken and the job resumes at 2: rank 0 converts step 22 once (the
demo model, 0.44 M parameters: ~0.5 s) and caches it beside the original; another
restart at 2 (or at 1) uses the cache. When the replacement joins, the job commits
for the rejoin and resumes at 3 from that commit: a plain load when it is still step
22 as written at 3, a conversion of the newer step when that was written at 2.

A universal cache is never trusted torn: without its marker it does not exist,
and the marker lists every file with size and sha256 and the digest of the
original shards it was made from. Conversion runs in-process on rank 0 while the
other ranks wait in a broadcast, so the process-group timeout must exceed it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


from trainer.batch import ElasticBatch
from trainer.checkpoint import (
    CheckpointError,
    CheckpointStore,
    CorruptCheckpointError,
    Manifest,
    ObjectNotFoundError,
    StorageError,
    discard,
    fetch_dir,
    latest_committed,
    step_dir,
    write_dir,
)
from trainer.guard import Decision, PreemptionGuard
from trainer.integrations.common import CommitResult, DirCheckpointer, all_gather_objects, broadcast_object
from trainer.runtime import DistContext, StatusWriter, barrier

__all__ = [
    "ds_config",
    "disable_jit_ops",
    "DeepSpeedCheckpointer",
    "ResumeInfo",
    "UNIVERSAL_PREFIX",
    "universal_marker_key",
    "source_digest",
    "cached_universal",
    "write_universal",
    "drop_universal",
    "convert_to_universal",
]

log = logging.getLogger(__name__)

#: Shards of the universal conversion live under ``step-<N>/universal/``.
UNIVERSAL_PREFIX = "universal/"
#: The client-state key DeepSpeed's converter looks for (``deepspeed.checkpoint.constants``).
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION = 0.2
_MARKER_KIND = "deepspeed_universal"
_CLIENT_STEP = "spotvisor_step"


def ds_config(
    *,
    global_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    zero_stage: int = 2,
    bf16: bool = False,
    gradient_clipping: float = 1.0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A DeepSpeed config that keeps the global batch constant at ``world_size`` data-parallel ranks.

    ``train_batch_size`` is ``global_batch_size`` (samples per optimizer step); the
    micro batch (samples per forward/backward on one rank) and the gradient
    accumulation steps come from :meth:`ElasticBatch.plan`. A client torch optimizer
    is allowed (``zero_allow_untested_optimizer``) so nothing is JIT-compiled.

    Args:
        global_batch_size: samples per optimizer step, over all ranks (>= 1).
        micro_batch_size: samples per forward/backward on one rank (>= 1).
        world_size: data-parallel ranks now.
        zero_stage: ZeRO stage 0-3.
        bf16: bf16 mixed precision (use on CUDA only).
        gradient_clipping: max global gradient norm (0: none).
        extra: merged last, key by key at the top level (e.g. ``{"steps_per_print": 10}``).

    Returns:
        The config dict for ``deepspeed.initialize(config=...)``.

    Raises:
        BatchError: ``world_size`` cannot keep the global batch (the message lists the valid sizes).
        ValueError: ``zero_stage`` outside 0-3.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    plan = ElasticBatch(global_batch_size, micro_batch_size).plan(world_size)
    config: dict[str, Any] = {
        "train_batch_size": global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": gradient_clipping,
        "bf16": {"enabled": bool(bf16)},
        "checkpoint": {"load_universal": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    config.update(extra or {})
    return config


def disable_jit_ops() -> bool:
    """On DeepSpeed's CPU accelerator, make DeepSpeed build no native op (call before ``deepspeed.initialize``).

    DeepSpeed's torch comm backend JIT-compiles its shared-memory all-reduce op
    (``deepspeed_shm_comm``, ~80 s of C++ on two cores) whenever
    ``deepspeed.ops.__compatible_ops__`` says it can, yet only
    ``inference_all_reduce`` uses it; training collectives go through the process
    group (gloo). The dict is cached in the module (DeepSpeed keeps edits to it), so
    marking every op incompatible there skips the probe and the build. On another
    accelerator (CUDA) nothing is changed.

    Returns:
        Whether the ops were disabled (the accelerator is the CPU).
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    cached = vars(deepspeed.ops).get("__compatible_ops__") or {}
    vars(deepspeed.ops)["__compatible_ops__"] = dict.fromkeys(cached, False)
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class ResumeInfo:
    """What one :meth:`DeepSpeedCheckpointer.resume` did.

    Attributes:
        step: the step resumed at.
        saved_world_size: data-parallel ranks that wrote the checkpoint.
        world_size: data-parallel ranks now.
        universal: loaded through the universal format (world sizes differ).
        cached: the universal conversion was already in the store (no conversion now).
        fetch_s: seconds downloading on this node: the checkpoint, its universal
            form, or (on rank 0 when it converts) the original it converts.
        convert_s: seconds of ``ds_to_universal`` on rank 0 (0 when cached or not universal).
        upload_s: seconds uploading the conversion (rank 0; 0 when cached or not universal).
        load_s: seconds in ``engine.load_checkpoint``.
        bytes: bytes loaded (the checkpoint, or its universal form).
    """

    step: int
    saved_world_size: int
    world_size: int
    universal: bool
    cached: bool
    fetch_s: float
    convert_s: float
    upload_s: float
    load_s: float
    bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


# --------------------------------------------------------------------------- the universal cache


def universal_marker_key(step: int) -> str:
    """``step-<N>/universal.json``: the universal cache's marker, written after its shards."""
    return f"{step_dir(step)}/universal.json"


def source_digest(manifest: Manifest) -> str:
    """sha256 over the (name, sha256) of a checkpoint's shards: ties a conversion to its source."""
    body = json.dumps(sorted((s.name, s.sha256) for s in manifest.shards), separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def cached_universal(store: CheckpointStore, manifest: Manifest) -> Manifest | None:
    """The universal cache of a committed checkpoint, if its marker exists and still holds.

    Holds: the marker parses, names this step, was made from exactly these shards
    (:func:`source_digest`), and every shard it lists is present with its size. The
    sha256 is checked when the shards are fetched.

    Returns:
        The marker (a :class:`Manifest` whose shards are named ``universal/...``), or None.

    Raises:
        StorageError: the backend failed.
    """
    try:
        raw = store.get_bytes(universal_marker_key(manifest.step))
    except ObjectNotFoundError:
        return None
    try:
        marker = Manifest.from_json(raw)
    except StorageError:
        raise
    except CheckpointError as exc:
        log.warning("ignoring unparsable universal marker of step %d: %s", manifest.step, exc)
        return None
    if marker.step != manifest.step or marker.extra.get("kind") != _MARKER_KIND:
        return None
    if marker.extra.get("source") != source_digest(manifest):
        log.warning("universal cache of step %d was made from other shards: converting again", manifest.step)
        return None
    present = store.list(f"{step_dir(manifest.step)}/{UNIVERSAL_PREFIX}")
    for s in marker.shards:
        if present.get(f"{step_dir(manifest.step)}/{s.name}") != s.size:
            log.warning("universal cache of step %d is torn (%s): converting again", manifest.step, s.name)
            return None
    return marker


def write_universal(
    store: CheckpointStore, manifest: Manifest, local_dir: Path, *, saved_world_size: int, extra: dict | None = None
) -> Manifest:
    """Upload a universal conversion of ``manifest``'s checkpoint and commit it, marker last.

    Every file under ``local_dir`` (``global_step<N>/...`` and ``latest_universal``)
    becomes ``step-<N>/universal/<path>``; leftovers of an earlier, interrupted
    upload are deleted first (marker first). Then ``step-<N>/universal.json`` is
    written: a :class:`Manifest` listing every file (size, sha256) with
    ``extra["source"] = source_digest(manifest)``.

    Returns:
        The marker.

    Raises:
        StorageError: the backend failed (no marker is written, so the cache does not exist).
        ValueError: a file name the store cannot hold.
    """
    step = manifest.step
    drop_universal(store, step)
    shards = write_dir(store, step, local_dir, prefix=UNIVERSAL_PREFIX)
    marker = Manifest(
        step=step,
        world_size=saved_world_size,
        global_batch_size=manifest.global_batch_size,
        data_position=manifest.data_position,
        shards=tuple(shards),
        time=time.time(),
        extra={**(extra or {}), "kind": _MARKER_KIND, "source": source_digest(manifest)},
    )
    store.put_bytes(universal_marker_key(step), marker.to_json().encode())  # LAST: the cache's commit point
    return marker


def drop_universal(store: CheckpointStore, step: int) -> None:
    """Delete step ``step``'s universal cache, marker first (an interrupted delete leaves it absent)."""
    store.delete([universal_marker_key(step)])
    store.delete(list(store.list(f"{step_dir(step)}/{UNIVERSAL_PREFIX}")))


def convert_to_universal(input_folder: Path, output_folder: Path, *, log_file: Path | None = None) -> float:
    """Run DeepSpeed's ``ds_to_universal`` (in this process, one worker, ``--inject_missing_state``).

    ``output_folder`` becomes the universal ``global_step<N>`` folder and
    ``output_folder.parent / "latest_universal"`` names it. The converter's chatter
    (stdout, tqdm on stderr) goes to ``log_file`` (or is dropped).

    Returns:
        Seconds spent.

    Raises:
        CheckpointError: the conversion failed (the converter's message and output tail).
    """
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(input_folder),
        output_folder=str(output_folder),
        num_extract_workers=1,  # > 1 forks a process pool from a process that holds a process group
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    out = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            ds_to_universal.main(args)
    except Exception as exc:  # the converter raises anything (AssertionError, KeyError, ...)
        tail = out.getvalue()[-2000:].strip().replace("\n", " | ")
        raise CheckpointError(f"ds_to_universal {input_folder} failed: {exc!r}; output: {tail}") from exc
    finally:
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            log_file.write_text(out.getvalue())
    return time.perf_counter() - t0


@contextlib.contextmanager
def _universal_mode(engine: Any, on: bool) -> Iterator[None]:
    """Make ``engine.load_checkpoint`` read the universal format (or not) for one load.

    DeepSpeed 0.19 reads ``checkpoint.load_universal`` only through
    ``engine.load_universal_checkpoint()`` -> ``engine._config.load_universal_checkpoint``,
    and only while loading, so the engine built before we knew the saved world size
    can switch for one load and back.
    """
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = on
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


# --------------------------------------------------------------------------- the checkpointer


class DeepSpeedCheckpointer:
    """Commits and resumes a DeepSpeed engine through spotvisor's manifest-last protocol.

    Args:
        engine: the ``DeepSpeedEngine`` from ``deepspeed.initialize``.
        ctx: this process (rank, local rank, world size).
        store: where checkpoints are committed.
        scratch: node-local directory for saves, fetches and conversions (removed after use).
        status: the agent's status file writer (``checkpoint_committed`` lines).
        guard: the job's guard; the notices a commit answers are marked handled.
        global_batch_size: samples per optimizer step, recorded in every manifest.
        keep: committed checkpoints kept by gc after each commit (>= 1).

    Every method is collective: all ranks call it at the same point. After
    :meth:`resume`, :attr:`client_state` holds the client state saved with the
    checkpoint and :attr:`last_resume` what the resume cost.
    """

    def __init__(
        self,
        engine: Any,
        ctx: DistContext,
        store: CheckpointStore,
        *,
        scratch: Path,
        status: StatusWriter,
        guard: PreemptionGuard,
        global_batch_size: int,
        keep: int = 2,
    ) -> None:
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.engine = engine
        self.ctx = ctx
        self.store = store
        self.scratch = Path(scratch)
        self.global_batch_size = global_batch_size
        self.dir = DirCheckpointer(ctx, store, self.scratch, status, guard, keep=keep)
        self.guard = guard
        self.client_state: dict[str, Any] = {}
        self.last_resume: ResumeInfo | None = None

    @property
    def last_committed(self) -> Manifest | None:
        """The newest checkpoint this job committed or resumed from."""
        return self.dir.last_committed

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks of the engine (the world size for pure data parallelism)."""
        return int(getattr(self.engine, "dp_world_size", self.ctx.world_size))

    @staticmethod
    def tag(step: int) -> str:
        """DeepSpeed's checkpoint tag for step ``step``: ``global_step<N>``."""
        return f"global_step{step}"

    # -- commit

    def commit(
        self,
        step: int,
        *,
        reason: str,
        decision: Decision | None,
        data_position: dict,
        client_state: dict[str, Any] | None = None,
    ) -> CommitResult:
        """Save the engine at step ``step`` (all ranks) and commit it (manifest last).

        Args:
            step: optimizer steps completed.
            reason: ``notice``, ``periodic``, ``final``, ... (status line and manifest).
            decision: the guard's decision at this boundary (its notices are recorded), or None.
            data_position: where the data stream resumes (see :func:`trainer.runtime.data_position`).
            client_state: saved with the engine and returned by :meth:`resume` as :attr:`client_state`.

        Returns:
            The manifest and the measured save/upload seconds and bytes.

        Raises:
            CheckpointError: any rank failed; nothing was committed (raised on every rank).
        """
        tag = self.tag(step)
        state = {
            **(client_state or {}),
            _CLIENT_STEP: step,
            UNIVERSAL_CHECKPOINT_INFO: {"universal_checkpoint_version": UNIVERSAL_CHECKPOINT_VERSION},
        }

        def save(local: Path) -> None:
            self.engine.save_checkpoint(str(local), tag=tag, client_state=state, save_latest=True)

        return self.dir.commit(
            step,
            save,
            reason=reason,
            decision=decision,
            global_batch_size=self.global_batch_size,
            data_position=data_position,
            extra={"framework": "deepspeed", "ds_tag": tag, "ds_dp_world_size": self.dp_world_size,
                   "zero_stage": int(self.engine.zero_optimization_stage())},
        )

    # -- resume

    def _saved_world(self, manifest: Manifest) -> int:
        return int(manifest.extra.get("ds_dp_world_size", manifest.world_size))

    def resume(self, *, check: Callable[[Manifest], None] | None = None) -> Manifest | None:
        """Load the newest committed checkpoint into the engine, at any world size.

        Same data-parallel world size as the writer: a plain ``load_checkpoint``.
        Another one: the checkpoint's universal form, converted once by rank 0 and
        cached in the store (see the module docstring). Corrupt checkpoints are
        discarded and the previous committed one is tried; torn ones are never seen.

        Args:
            check: called on every rank with the chosen manifest before anything is
                loaded; whatever it raises (e.g. a global batch the job cannot keep)
                propagates and the engine is untouched.

        Returns:
            The manifest resumed from, or None when nothing is committed (engine untouched).

        Raises:
            CheckpointError: the conversion failed, the universal cache stayed corrupt
                after one fresh conversion, or the loaded client state names another step.
            StorageError: the store failed.
        """
        while True:
            manifest = latest_committed(self.store) if self.ctx.is_leader else None
            manifest = broadcast_object(self.ctx, manifest)
            if manifest is None:
                self.last_resume = None
                return None
            if check is not None:
                check(manifest)
            if self._saved_world(manifest) == self.dp_world_size:
                t0 = time.perf_counter()
                got, local = self.dir.fetch_latest()  # discards corrupt ones, may pick an older one
                fetch_s = time.perf_counter() - t0
                if got is None:
                    self.last_resume = None
                    return None
                if got.step != manifest.step:  # that one was corrupt and discarded: choose again
                    self.dir.cleanup(local)
                    continue
                return self._load(got, local, universal=False, cached=False, fetch_s=fetch_s, convert_s=0.0,
                                  upload_s=0.0)
            loaded = self._resume_universal(manifest)
            if loaded is not None:
                return loaded

    def _resume_universal(self, manifest: Manifest) -> Manifest | None:
        """Resume ``manifest`` through its universal form; None when it was discarded (corrupt)."""
        step = manifest.step
        local = self.scratch / f"universal-{step:08d}"
        for attempt in (1, 2):
            # 1. rank 0: a cache that holds, or a fresh conversion (cache written marker-last)
            outcome: dict[str, Any] = {}
            if self.ctx.is_leader:
                outcome = self._ensure_universal(manifest, local, force=attempt > 1)
            outcome = broadcast_object(self.ctx, outcome)  # type: ignore[assignment]
            if outcome.get("error"):
                raise CheckpointError(outcome["error"])
            if outcome.get("discarded"):
                return None
            marker = Manifest.from_json(outcome["marker"].encode())
            # 2. every node fetches the cache (rank 0 has just written it to `local` if it converted;
            #    rank 0 is local rank 0 of its node, so its node needs nothing more)
            t0 = time.perf_counter()
            corrupt = None
            if self.ctx.is_local_leader and not (self.ctx.is_leader and outcome.get("converted")):
                shutil.rmtree(local, ignore_errors=True)
                try:
                    fetch_dir(self.store, marker, local, prefix=UNIVERSAL_PREFIX)
                except CorruptCheckpointError as exc:
                    corrupt = f"rank {self.ctx.rank}: {exc}"
            fetch_s = time.perf_counter() - t0
            if self.ctx.is_leader and outcome.get("converted"):
                fetch_s = float(outcome.get("fetch_s", 0.0))  # rank 0 fetched the original instead
            reports = [c for c in all_gather_objects(self.ctx, corrupt) if c]
            if not reports:
                self.guard.mark_handled(manifest.extra.get("notice_ids", ()))
                self.dir.last_committed = manifest
                self._load(manifest, local, universal=True, cached=bool(outcome.get("cached")),
                           fetch_s=fetch_s, convert_s=float(outcome.get("convert_s", 0.0)),
                           upload_s=float(outcome.get("upload_s", 0.0)),
                           nbytes=sum(s.size for s in marker.shards))
                return manifest
            if self.ctx.is_leader:
                log.error("universal cache of step %d is corrupt (%s): converting again", step, reports[0])
                drop_universal(self.store, step)
            barrier(self.ctx)
        raise CheckpointError(f"universal cache of step {step} in {self.store.uri} is corrupt after a fresh conversion")

    def _ensure_universal(self, manifest: Manifest, local: Path, *, force: bool) -> dict[str, Any]:
        """Rank 0: make sure ``step-N/universal/`` holds a valid conversion; never raises."""
        step, tag = manifest.step, str(manifest.extra.get("ds_tag") or self.tag(manifest.step))
        work = self.scratch / f"convert-{step:08d}"
        try:
            marker = None if force else cached_universal(self.store, manifest)
            if marker is not None:
                log.info("step %d: universal checkpoint cached in the store (%d files, %d bytes)",
                         step, len(marker.shards), sum(s.size for s in marker.shards))
                return {"marker": marker.to_json(), "cached": True, "converted": False}
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)
            t0 = time.perf_counter()
            try:
                fetch_dir(self.store, manifest, work / "src")
            except CorruptCheckpointError as exc:
                log.error("discarding corrupt checkpoint step %d: %s", step, exc)
                discard(self.store, step)
                return {"discarded": True}
            fetch_s = time.perf_counter() - t0
            convert_s = convert_to_universal(work / "src" / tag, local / tag, log_file=work.with_suffix(".log"))
            t1 = time.perf_counter()
            marker = write_universal(
                self.store, manifest, local, saved_world_size=self._saved_world(manifest),
                extra={"ds_tag": tag, "converted_at_world_size": self.dp_world_size,
                       "convert_s": round(convert_s, 4)},
            )
            upload_s = time.perf_counter() - t1
            log.info("step %d: converted to universal (fetch %.2f s, convert %.2f s, upload %.2f s, %d files, "
                     "%d bytes)", step, fetch_s, convert_s, upload_s, len(marker.shards),
                     sum(x.size for x in marker.shards))
            return {"marker": marker.to_json(), "cached": False, "converted": True,
                    "fetch_s": fetch_s, "convert_s": convert_s, "upload_s": upload_s}
        except (CheckpointError, ValueError, OSError) as exc:
            return {"error": f"step {step}: universal conversion failed: {exc}"}
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _load(self, manifest: Manifest, local: Path, *, universal: bool, cached: bool, fetch_s: float,
              convert_s: float, upload_s: float, nbytes: int | None = None) -> Manifest:
        tag = str(manifest.extra.get("ds_tag") or self.tag(manifest.step))
        t0 = time.perf_counter()
        with _universal_mode(self.engine, universal):
            path, client_state = self.engine.load_checkpoint(
                str(local), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        load_s = time.perf_counter() - t0
        self.dir.cleanup(local)
        if path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint {tag} in the fetched step {manifest.step}")
        client_state = dict(client_state or {})
        saved_step = client_state.get(_CLIENT_STEP, manifest.step)
        if saved_step != manifest.step:
            raise CheckpointError(f"checkpoint client state names step {saved_step}, manifest step {manifest.step}")
        self.client_state = client_state
        info = ResumeInfo(
            step=manifest.step,
            saved_world_size=self._saved_world(manifest),
            world_size=self.dp_world_size,
            universal=universal,
            cached=cached,
            fetch_s=fetch_s,
            convert_s=convert_s,
            upload_s=upload_s,
            load_s=load_s,
            bytes=nbytes if nbytes is not None else sum(s.size for s in manifest.shards),
        )
        self.last_resume = info
        if self.ctx.is_leader:
            log.info("resumed step %d (written at DP world size %d, now %d%s): load %.2f s, %d bytes",
                     manifest.step, info.saved_world_size, info.world_size,
                     ", universal" + (" (cached)" if cached else " (converted)") if universal else "",
                     load_s, info.bytes)
        return manifest
