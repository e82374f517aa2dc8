"""What every trainer on spotvisor shares, whatever its framework: who this process is,
the node-local files the agent reads, and the data position.

The agent's side of the contract (``daemon/agent.py``): it starts ``torchrun`` with

- ``SPOTVISOR_NOTICE_FILE``: the notices, read by :class:`trainer.guard.PreemptionGuard`;
- ``SPOTVISOR_STATUS_FILE``: JSON lines appended by LOCAL_RANK 0 (:class:`StatusWriter`);
  the agent leaves the job on the ``checkpoint_committed`` line naming its notice;
- ``SPOTVISOR_LOG_DIR``: one JSON-lines step log per rank and attempt (:class:`StepLog`),
  from which ``daemon/summary.py`` counts lost and repeated samples;
- ``SPOTVISOR_SCRATCH_DIR``: a node-local directory for framework checkpoints before upload;
- ``SPOTVISOR_S3_ENDPOINT_URL`` / ``SPOTVISOR_OSS_ENDPOINT``: the object store's endpoint.

Used by the reference trainer (:mod:`trainer.run`) and the integrations
(:mod:`trainer.integrations`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DistContext",
    "env_world",
    "setup_distributed",
    "teardown_distributed",
    "new_attempt_id",
    "barrier",
    "data_position",
    "StatusWriter",
    "StepLog",
    "scratch_dir",
    "configure_threads",
    "configure_logging",
    "STATUS_FILE_ENV",
    "LOG_DIR_ENV",
    "SCRATCH_DIR_ENV",
    "S3_ENDPOINT_ENV",
    "OSS_ENDPOINT_ENV",
]

STATUS_FILE_ENV = "SPOTVISOR_STATUS_FILE"
LOG_DIR_ENV = "SPOTVISOR_LOG_DIR"
SCRATCH_DIR_ENV = "SPOTVISOR_SCRATCH_DIR"
S3_ENDPOINT_ENV = "SPOTVISOR_S3_ENDPOINT_URL"
OSS_ENDPOINT_ENV = "SPOTVISOR_OSS_ENDPOINT"


# --------------------------------------------------------------------------- process group


@dataclass(frozen=True, slots=True)
class DistContext:
    """Who this process is. ``initialized``: a process group exists (torchrun)."""

    rank: int
    local_rank: int
    world_size: int
    backend: str | None
    device: torch.device
    initialized: bool

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def is_local_leader(self) -> bool:
        return self.local_rank == 0


def env_world() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from torchrun's environment, or ``(0, 0, 1)``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["WORLD_SIZE"])
    return 0, 0, 1


def setup_distributed(timeout_s: float = 120.0) -> DistContext:
    """Join torchrun's process group (nccl on CUDA, else gloo); plain process without torchrun.

    ``timeout_s`` bounds the group's set-up and every collective: a rendezvous round
    that counted a node which then never started its workers fails here (and
    torchrun re-rendezvouses) instead of waiting torch's default 30 minutes.
    """
    rank, local_rank, world = env_world()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" not in os.environ:
        return DistContext(0, 0, 1, None, device, False)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                            **({"device_id": device} if cuda else {}))
    return DistContext(dist.get_rank(), local_rank, dist.get_world_size(), backend, device, True)


def teardown_distributed(ctx: DistContext) -> None:
    if ctx.initialized and dist.is_initialized():
        dist.destroy_process_group()


def new_attempt_id(ctx: DistContext) -> str:
    """A fresh id for this worker-group incarnation, identical on every rank."""
    box = [uuid.uuid4().hex[:12] if ctx.is_leader else None]
    if ctx.initialized and ctx.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return str(box[0])


def barrier(ctx: DistContext) -> None:
    if ctx.initialized and ctx.world_size > 1:
        dist.barrier()


def data_position(step: int, global_batch_size: int, seed: int, dataset_len: int) -> dict[str, int]:
    """The manifest's ``data_position``: where the sample stream resumes."""
    consumed = step * global_batch_size
    return {
        "consumed_samples": consumed,
        "seed": seed,
        "dataset_len": dataset_len,
        "epoch": consumed // dataset_len,
    }


# --------------------------------------------------------------------------- node-local outputs


class StatusWriter:
    """Appends one JSON object per line to ``$SPOTVISOR_STATUS_FILE`` (LOCAL_RANK 0 only)."""

    __slots__ = ("path", "ctx", "attempt")

    def __init__(self, path: str | None, ctx: DistContext, attempt: str) -> None:
        self.path = path if (path and ctx.is_local_leader) else None
        self.ctx = ctx
        self.attempt = attempt

    def emit(self, event: str, step: int, **fields: Any) -> None:
        if self.path is None:
            return
        record = {
            "event": event,
            "time": time.time(),
            "attempt": self.attempt,
            "rank": self.ctx.rank,
            "world_size": self.ctx.world_size,
            "step": step,
            **fields,
        }
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()


class StepLog:
    """``$SPOTVISOR_LOG_DIR/steps-<attempt>-rank<RANK>.jsonl``: what each rank trained on."""

    __slots__ = ("_f", "ctx", "attempt")

    def __init__(self, log_dir: str | None, ctx: DistContext, attempt: str) -> None:
        self.ctx = ctx
        self.attempt = attempt
        self._f = None
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            path = Path(log_dir) / f"steps-{attempt}-rank{ctx.rank}.jsonl"
            self._f = open(path, "a", encoding="utf-8")

    def write(self, step: int, positions: list[int], loss: float) -> None:
        if self._f is None:
            return
        record = {
            "attempt": self.attempt,
            "rank": self.ctx.rank,
            "world_size": self.ctx.world_size,
            "step": step,
            "positions": positions,
            "loss": loss,
            "time": time.time(),
        }
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def scratch_dir(job: str = "job") -> Path:
    """A node-local directory for checkpoint files before upload: ``$SPOTVISOR_SCRATCH_DIR/<job>``,
    else ``<tmp>/spotvisor-<uid>/<job>`` (created)."""
    base = os.environ.get(SCRATCH_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"spotvisor-{os.getuid()}")
    path = Path(base) / job
    path.mkdir(parents=True, exist_ok=True)
    return path


def configure_threads() -> None:
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    try:
        n = int(omp) if omp else 1
    except ValueError:
        n = 1
    torch.set_num_threads(max(1, n))


def configure_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
