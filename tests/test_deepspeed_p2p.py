"""The plan that moves ZeRO-1/2's partitions from one data-parallel size to another
(``trainer.integrations.deepspeed_p2p.plan``), on layouts cut as ZeRO cuts them: every
element of every new partition comes from the old partition that holds it, once; and a
shrink's hand-over (``hand_over_targets``), which leaves the fewest elements to travel
twice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.integrations.deepspeed_p2p import Piece, hand_over_targets, plan


def zero_layout(sizes: list[int], world: int, align: int) -> list[list[tuple[int, int, int, int]]]:
    """Each rank's fragment table for one flat group of parameters of ``sizes`` elements,
    padded at the end to a multiple of ``world * align`` and cut into ``world`` equal
    partitions, as DeepSpeed's ZeRO-1/2 do."""
    total = sum(sizes)
    padded = -(-total // (world * align)) * world * align
    part = padded // world
    tables = []
    for r in range(world):
        lo, hi, at, rows = r * part, (r + 1) * part, 0, []
        for n in sizes:
            a, b = max(at, lo), min(at + n, hi)
            rows.append((0, a - lo, a - at, b - a) if b > a else (-1, 0, 0, 0))
            at += n
        tables.append(rows)
    return tables


def apply(pieces: list[Piece], old, new, sizes: list[int]) -> list[dict[int, list[float]]]:
    """What each new rank holds after the pieces ran, from old partitions whose every
    element is its global position (param, element)."""
    got: list[dict[int, list]] = [{p: [None] * t[p][3] for p in range(len(sizes)) if t[p][0] >= 0} for t in new]
    for pc in pieces:
        fo, fn = old[pc.src][pc.param], new[pc.dst][pc.param]
        assert fo[2] <= pc.lo < pc.hi <= fo[2] + fo[3], "a piece from outside its source's fragment"
        for e in range(pc.lo, pc.hi):
            cell = got[pc.dst][pc.param]
            assert cell[e - fn[2]] is None, "an element received twice"
            cell[e - fn[2]] = (pc.param, e)
    return got


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8), old_world=st.integers(1, 6),
       new_world=st.integers(1, 6), align=st.sampled_from([1, 2, 4]))
def test_every_new_element_comes_once_from_the_old_rank_holding_it(sizes, old_world, new_world, align) -> None:
    old, new = zero_layout(sizes, old_world, align), zero_layout(sizes, new_world, align)
    got = apply(plan(old, new), old, new, sizes)
    for j, t in enumerate(new):
        for p, (part, _, start, n) in enumerate(t):
            if part >= 0:
                assert got[j][p] == [(p, e) for e in range(start, start + n)]


def test_a_grow_moves_only_the_elements_whose_rank_changes() -> None:
    """16 elements over 2 ranks ([0, 8), [8, 16)), then 3 ([0, 6), [6, 12), [12, 16) and
    padding): rank 0 keeps [0, 6), rank 1 keeps [8, 12); [6, 8) goes from rank 0 to 1 and
    [12, 16) from rank 1 to the joiner, rank 2."""
    pieces = plan(zero_layout([10, 6], 2, 1), zero_layout([10, 6], 3, 1))
    flat = {0: 0, 1: 10}  # where each parameter starts in the flat group
    spans = sorted((flat[pc.param] + pc.lo, flat[pc.param] + pc.hi, pc.src, pc.dst) for pc in pieces)
    assert spans == [(0, 6, 0, 0), (6, 8, 0, 1), (8, 10, 1, 1), (10, 12, 1, 1), (12, 16, 1, 2)]


def test_layouts_of_other_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="different numbers of parameters"):
        plan(zero_layout([4, 4], 2, 1), zero_layout([4, 4, 4], 2, 1))
    with pytest.raises(ValueError, match="in no old rank's partitions"):
        plan(zero_layout([4], 2, 1), zero_layout([8], 2, 1))


def second_hop(sizes: list[int], world: int, keep: list[int], align: int, to: dict[int, int]) -> tuple[int, int]:
    """A shrink from ``world`` to the ranks ``keep`` with leaver ``i``'s partitions handed
    to ``to[i]``: (the leavers' elements, those of them whose new owner is not their
    holder, which the exchange sends a second time)."""
    old, new = zero_layout(sizes, world, align), zero_layout(sizes, len(keep), align)
    theirs = twice = 0
    for pc in plan(old, new):
        if pc.src in to:
            theirs += pc.hi - pc.lo
            twice += (pc.hi - pc.lo) * (keep[pc.dst] != to[pc.src])
    return theirs, twice


@settings(max_examples=300, deadline=None)
@given(data=st.data(), sizes=st.lists(st.integers(1, 64), min_size=1, max_size=6), world=st.integers(2, 8),
       align=st.sampled_from([1, 2, 4]))
def test_a_shrinks_leavers_hand_their_partitions_to_the_survivor_that_owns_most_of_them(
        data, sizes, world, align) -> None:
    keep = sorted(data.draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world - 1), label="keep"))
    to = hand_over_targets(world, keep)
    assert sorted(to) == [r for r in range(world) if r not in keep] and set(to.values()) <= set(keep)
    theirs, twice = second_hop(sizes, world, keep, align, to)
    # at most half of each leaver's partition goes on, but for what the padding shifts
    # (the last partition of each layout, up to world * align elements)
    assert twice <= theirs / 2 * len(to) + len(to) * (world + len(keep)) * align, (to, theirs, twice)
    # never more than handing every leaver to the first survivor (the rule before)
    assert twice <= second_hop(sizes, world, keep, align, dict.fromkeys(to, keep[0]))[1] + world * align * len(to)


def test_the_last_rank_leaving_hands_over_to_the_rank_that_owns_its_elements() -> None:
    """4 -> 3 without rank 3 ([48, 64) of 64 elements): new rank 2 will own [44, 64), so
    old rank 2 holds rank 3's partition and none of its 16 elements travels twice (the
    rule before, old rank 0, sent all 16 on)."""
    assert hand_over_targets(4, [0, 1, 2]) == {3: 2}
    assert hand_over_targets(3, [0, 2]) == {1: 0}  # [1/3, 2/3): half each; the tie to the lower new rank
    assert hand_over_targets(4, [0, 1]) == {2: 1, 3: 1}
    assert second_hop([64], 4, [0, 1, 2], 1, {3: 2}) == (16, 0)
    assert second_hop([64], 4, [0, 1, 2], 1, {3: 0}) == (16, 16)
    with pytest.raises(ValueError, match="distinct ranks"):
        hand_over_targets(3, [0, 0])
