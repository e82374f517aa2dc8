"""Which of this machine's GPUs each local instance sees (``CUDA_VISIBLE_DEVICES``).

The local provider's instances are process groups on one machine. Left alone, every
instance's local rank 0 takes ``cuda:0``, and NCCL refuses two ranks of one job on one
GPU (``Duplicate GPU detected``: a lent H200 did so 56 times on 2026-12-04). So the
provider decides once, from the GPUs it sees and the most the pool can ask for:

- **pin**: at least ``pool.max_nodes`` x the largest local ``gpus_per_node`` GPUs: each
  instance is given its own (the lowest free indexes), back to the free list when it ends;
- **hide**: fewer: no instance sees any GPU (``CUDA_VISIBLE_DEVICES=""``), and the job
  trains on the CPU with gloo, as on a machine without one.

Never a mix: every rank of a job must pick the same backend (``trainer.runtime`` picks
NCCL whenever CUDA is available). A machine without GPUs leaves the environment as it is.

The GPUs seen: ``$CUDA_VISIBLE_DEVICES``'s items when it is set (as CUDA reads it: an
empty value shows none), else the ``/dev/nvidia<N>`` device files (the NVIDIA driver's,
one per GPU). Pure but for :func:`host_gpus` and :meth:`GpuSlots.of_host`, which read the
environment and ``/dev``.
"""

from __future__ import annotations

import os

import structlog

from daemon.host_gpus import host_gpus

__all__ = ["host_gpus", "GpuSlots"]

log = structlog.get_logger("spotvisor.daemon")

class GpuSlots:
    """The provider's GPUs: ``mode`` ``"pin"``, ``"hide"`` or ``"none"`` (no GPU here), and
    which instance holds which. ``needed``: ``pool.max_nodes`` x the largest local
    ``gpus_per_node``."""

    def __init__(self, gpus: list[str], needed: int) -> None:
        self.mode = "none" if not gpus else "pin" if len(gpus) >= needed > 0 else "hide"
        self._free = list(gpus)
        self._held: dict[str, list[str]] = {}

    @classmethod
    def of_host(cls, needed: int) -> "GpuSlots":
        """This machine's (:func:`host_gpus`), with one warning line when they are hidden."""
        gpus = host_gpus(os.environ)
        slots = cls(gpus, needed)
        if slots.mode == "hide":
            log.warning("local_gpus_hidden", gpus=len(gpus), needed=needed,
                        note="fewer GPUs than pool.max_nodes x gpus_per_node: every instance trains on the CPU")
        return slots

    def take(self, instance_id: str, count: int) -> str | None:
        """The instance's ``CUDA_VISIBLE_DEVICES``; None to leave the environment as it is.

        Raises:
            RuntimeError: pinning, and fewer than ``count`` GPUs free (more instances than
                the pool's maximum: a bug, never a silent share).
        """
        if self.mode == "none":
            return None
        if self.mode == "hide":
            return ""
        if len(self._free) < count:
            raise RuntimeError(f"{count} GPU(s) asked for {instance_id}, {len(self._free)} free")
        self._held[instance_id], self._free = self._free[:count], self._free[count:]
        return ",".join(self._held[instance_id])

    def hold(self, instance_id: str, visible: str) -> None:
        """An instance adopted from an earlier daemon still runs on ``visible``
        (its ``CUDA_VISIBLE_DEVICES``): off the free list until it is gone."""
        ids = [g for g in visible.split(",") if g]
        self._held[instance_id] = ids
        self._free = [g for g in self._free if g not in ids]

    def give_back(self, instance_id: str) -> None:
        """The instance has ended: its GPUs are free again (idempotent)."""
        self._free = sorted(self._free + self._held.pop(instance_id, []), key=lambda g: (len(g), g))
