"""Global batch arithmetic for a job whose world size changes.

The global batch size is a property of the training run (it shapes the loss
curve); the world size is an accident of spot capacity. For a world size ``W``:

    global_batch_size = micro_batch_size x gradient_accumulation_steps x W

so a world size is valid only when ``W`` divides ``global_batch_size /
micro_batch_size``. The pool planner asks :meth:`ElasticBatch.valid_world_sizes`
before choosing capacity, and the trainer refuses any other size at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchError", "ElasticBatch", "BatchPlan"]


class BatchError(ValueError):
    """An impossible batch configuration or world size."""


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """How one step is computed at one world size.

    ``samples_per_rank`` = ``micro_batch_size * grad_accum_steps`` samples per rank per step.
    """

    world_size: int
    micro_batch_size: int
    grad_accum_steps: int

    @property
    def samples_per_rank(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def global_batch_size(self) -> int:
        return self.samples_per_rank * self.world_size


@dataclass(frozen=True, slots=True)
class ElasticBatch:
    """A fixed global batch (samples per optimizer step) split over any valid world size.

    Raises:
        BatchError: at construction, if ``global_batch_size`` is not a positive
            multiple of ``micro_batch_size``.
    """

    global_batch_size: int
    micro_batch_size: int

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise BatchError(
                f"global_batch_size ({self.global_batch_size}) and micro_batch_size "
                f"({self.micro_batch_size}) must be >= 1"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise BatchError(
                f"global_batch_size {self.global_batch_size} is not a multiple of "
                f"micro_batch_size {self.micro_batch_size} (pick a global batch that is)"
            )

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def valid_world_sizes(self, max_world_size: int | None = None) -> list[int]:
        """World sizes (ranks) that keep the global batch exact, ascending."""
        n = self.micro_batches_per_step
        top = n if max_world_size is None else min(n, max_world_size)
        return [w for w in range(1, top + 1) if n % w == 0]

    def is_valid(self, world_size: int) -> bool:
        return world_size >= 1 and self.micro_batches_per_step % world_size == 0

    def plan(self, world_size: int) -> BatchPlan:
        """The per-rank split for ``world_size`` ranks.

        Raises:
            BatchError: ``world_size`` does not divide the global batch; the message
                lists the valid world sizes.
        """
        if not self.is_valid(world_size):
            valid = ", ".join(map(str, self.valid_world_sizes()))
            raise BatchError(
                f"world size {world_size} cannot keep global_batch_size "
                f"{self.global_batch_size} with micro_batch_size {self.micro_batch_size}; "
                f"valid world sizes: {valid}"
            )
        return BatchPlan(
            world_size=world_size,
            micro_batch_size=self.micro_batch_size,
            grad_accum_steps=self.micro_batches_per_step // world_size,
        )
