"""Which samples each rank trains on at each step, whatever the world-size history.

The sample stream is one infinite sequence of *global positions* 0, 1, 2, ...
Position ``p`` belongs to epoch ``p // dataset_len`` and names the dataset index
``perm(epoch)[p % dataset_len]``, where ``perm(epoch)`` is a permutation of
``range(dataset_len)`` drawn from a generator seeded with ``seed + epoch``.

Step ``s`` consumes the global positions ``[s * G, (s + 1) * G)`` with ``G`` the
global batch size. Rank ``r`` of a world of ``W`` takes the contiguous block
``[s * G + r * G / W, s * G + (r + 1) * G / W)`` and splits it into micro batches.
Because ``G`` never changes, the data position after ``s`` steps is ``s * G``
whatever world sizes those steps ran at, so resuming at another world size skips
no sample and repeats none.

Why not a per-rank ``DistributedSampler`` with saved loader state: that state is
one offset per rank and has no meaning at another world size (torchtitan#811).
Only the global ``consumed_samples`` (+ seed) survives a resize; every rank
derives its slice from it.

Example (G = 12, micro batch 2)::

    step 0 at W=3: rank0 [0..3], rank1 [4..7], rank2 [8..11]   (2 micro batches each)
    step 1 at W=2: rank0 [12..17], rank1 [18..23]              (3 micro batches each)
    step 2 at W=1: rank0 [24..35]                              (6 micro batches)
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from trainer.batch import BatchPlan

__all__ = ["ElasticSampler"]


class ElasticSampler:
    """Deterministic global sample order, sliced per step and rank.

    Args:
        dataset_len: number of samples in the dataset (``>= 1``).
        seed: base seed; epoch ``e`` is shuffled with ``seed + e``.

    Raises:
        ValueError: ``dataset_len < 1``.
    """

    __slots__ = ("dataset_len", "seed", "_perms", "_cache_size")

    def __init__(self, dataset_len: int, seed: int, *, cache_epochs: int = 4) -> None:
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be >= 1, got {dataset_len}")
        self.dataset_len = int(dataset_len)
        self.seed = int(seed)
        self._perms: OrderedDict[int, list[int]] = OrderedDict()
        self._cache_size = max(1, cache_epochs)

    def permutation(self, epoch: int) -> list[int]:
        """The order of dataset indices in ``epoch`` (a permutation of ``range(dataset_len)``)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(self.seed + epoch)
            perm = torch.randperm(self.dataset_len, generator=gen).tolist()
            self._perms[epoch] = perm
            while len(self._perms) > self._cache_size:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def epoch_of(self, position: int) -> int:
        return position // self.dataset_len

    def index(self, position: int) -> int:
        """Dataset index at global position ``position`` (``>= 0``)."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        epoch, offset = divmod(position, self.dataset_len)
        return self.permutation(epoch)[offset]

    @staticmethod
    def step_range(step: int, plan: BatchPlan) -> range:
        """Global positions step ``step`` consumes, over all ranks."""
        g = plan.global_batch_size
        return range(step * g, (step + 1) * g)

    @staticmethod
    def positions_for(step: int, plan: BatchPlan, rank: int) -> list[list[int]]:
        """Global positions rank ``rank`` trains on at ``step``, one list per micro batch.

        Raises:
            ValueError: ``step < 0`` or ``rank`` outside ``[0, plan.world_size)``.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} outside world of size {plan.world_size}")
        start = step * plan.global_batch_size + rank * plan.samples_per_rank
        m = plan.micro_batch_size
        return [
            list(range(start + i * m, start + (i + 1) * m)) for i in range(plan.grad_accum_steps)
        ]

    def indices_for(self, step: int, plan: BatchPlan, rank: int) -> list[list[int]]:
        """Like :meth:`positions_for`, mapped to dataset indices."""
        return [[self.index(p) for p in mb] for mb in self.positions_for(step, plan, rank)]
