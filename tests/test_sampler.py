"""ElasticSampler and ElasticBatch: exact data position across world-size changes."""

from __future__ import annotations

import pytest

from trainer.batch import BatchError, ElasticBatch
from trainer.sampler import ElasticSampler


def _run_history(sampler: ElasticSampler, batch: ElasticBatch, history: list[tuple[int, int]]) -> list[int]:
    """Positions trained over ``history`` = [(world_size, steps), ...], in training order."""
    seen: list[int] = []
    step = 0
    for world, steps in history:
        plan = batch.plan(world)
        for _ in range(steps):
            for rank in range(world):
                micro = sampler.positions_for(step, plan, rank)
                assert len(micro) == plan.grad_accum_steps
                assert all(len(mb) == plan.micro_batch_size for mb in micro)
                seen.extend(p for mb in micro for p in mb)
            step += 1
    return seen


@pytest.mark.parametrize("dataset_len", [24, 100, 7])  # G divides it / does not / G > len
def test_world_size_history_is_exact(dataset_len: int) -> None:
    batch = ElasticBatch(global_batch_size=12, micro_batch_size=2)
    sampler = ElasticSampler(dataset_len, seed=3)
    history = [(3, 4), (2, 3), (3, 2), (1, 5), (6, 1), (2, 2)]
    seen = _run_history(sampler, batch, history)
    total = 12 * sum(n for _, n in history)
    assert sorted(seen) == list(range(total))
    assert len(set(seen)) == len(seen)
    # Each epoch's indices are a permutation of the dataset.
    indices = [sampler.index(p) for p in range(total)]
    for e in range(total // dataset_len):
        assert sorted(indices[e * dataset_len : (e + 1) * dataset_len]) == list(range(dataset_len))


def test_positions_are_contiguous_blocks_per_rank() -> None:
    batch = ElasticBatch(12, 2)
    plan = batch.plan(3)
    assert ElasticSampler.positions_for(0, plan, 0) == [[0, 1], [2, 3]]
    assert ElasticSampler.positions_for(0, plan, 2) == [[8, 9], [10, 11]]
    assert ElasticSampler.positions_for(1, batch.plan(2), 1) == [[18, 19], [20, 21], [22, 23]]
    assert ElasticSampler.positions_for(2, batch.plan(1), 0)[0] == [24, 25]
    assert list(ElasticSampler.step_range(5, plan)) == list(range(60, 72))


def test_same_step_same_samples_at_any_world_size() -> None:
    """The union over ranks of one step does not depend on the world size."""
    batch = ElasticBatch(12, 2)
    sampler = ElasticSampler(50, seed=1)
    union = {
        w: sorted(i for r in range(w) for mb in sampler.indices_for(7, batch.plan(w), r) for i in mb)
        for w in batch.valid_world_sizes()
    }
    assert len({tuple(v) for v in union.values()}) == 1


def test_epoch_straddling_step() -> None:
    batch = ElasticBatch(12, 2)
    sampler = ElasticSampler(10, seed=0)
    plan = batch.plan(2)
    pos = [p for r in range(2) for mb in sampler.positions_for(0, plan, r) for p in mb]
    assert pos == list(range(12))
    idx = [sampler.index(p) for p in pos]
    assert sorted(idx[:10]) == list(range(10))  # epoch 0 complete
    assert idx[10:] == sampler.permutation(1)[:2]  # then epoch 1 begins
    assert sampler.epoch_of(11) == 1


def test_determinism_by_seed() -> None:
    a, b, c = ElasticSampler(1000, 5), ElasticSampler(1000, 5), ElasticSampler(1000, 6)
    assert [a.index(p) for p in range(2500)] == [b.index(p) for p in range(2500)]
    assert a.permutation(0) != c.permutation(0)
    assert a.permutation(0) != a.permutation(1)  # epochs are shuffled differently
    assert sorted(a.permutation(2)) == list(range(1000))
    # The cache does not change answers.
    tiny = ElasticSampler(1000, 5, cache_epochs=1)
    assert [tiny.index(p) for p in (5, 1500, 7, 2999, 5)] == [a.index(p) for p in (5, 1500, 7, 2999, 5)]


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dataset_len"):
        ElasticSampler(0, 0)
    s = ElasticSampler(10, 0)
    plan = ElasticBatch(12, 2).plan(2)
    with pytest.raises(ValueError, match="rank 2"):
        s.positions_for(0, plan, 2)
    with pytest.raises(ValueError, match="step"):
        s.positions_for(-1, plan, 0)
    with pytest.raises(ValueError, match="position"):
        s.index(-1)


# --------------------------------------------------------------------------- ElasticBatch


def test_batch_valid_world_sizes() -> None:
    b = ElasticBatch(12, 2)
    assert b.valid_world_sizes() == [1, 2, 3, 6]
    assert b.valid_world_sizes(max_world_size=4) == [1, 2, 3]
    assert b.is_valid(3) and not b.is_valid(4) and not b.is_valid(0)
    for w in b.valid_world_sizes():
        plan = b.plan(w)
        assert plan.global_batch_size == 12
        assert plan.micro_batch_size * plan.grad_accum_steps * w == 12
    assert b.plan(2).grad_accum_steps == 3
    assert b.plan(2).samples_per_rank == 6


def test_batch_refusal_lists_valid_sizes() -> None:
    b = ElasticBatch(12, 2)
    with pytest.raises(BatchError, match=r"world size 4 .*valid world sizes: 1, 2, 3, 6$"):
        b.plan(4)
    assert isinstance(BatchError("x"), ValueError)


@pytest.mark.parametrize("g,m", [(10, 3), (0, 1), (4, 0)])
def test_batch_rejects_impossible_config(g: int, m: int) -> None:
    with pytest.raises(BatchError):
        ElasticBatch(g, m)
