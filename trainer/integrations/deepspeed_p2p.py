"""ZeRO's partitions moved peer to peer at an in-process resize: each rank of the new
data-parallel size receives exactly the elements of its new partitions it lacks, from the
ranks that hold them; nothing is gathered whole anywhere.

ZeRO-1/2 flatten each parameter group and cut it into one partition per rank (ZeRO-3
cuts each parameter, and flattens each rank's pieces into its sub-groups); each
parameter's fp32 master copy and its optimizer state lie in one or more ranks'
partitions as *fragments* (:func:`~trainer.integrations.deepspeed_replicas.partitions`
gives a rank's table: per parameter, its partition index, the fragment's offset in it,
where the fragment starts in the flattened parameter, its elements). Another world size
cuts the same flattened parameters at other places, and pads differently at the end: so
the plan is made per parameter, from both layouts' tables, as overlaps of intervals of
the flattened parameter (:func:`plan`, pure). The new layout's tables come from the new
engine itself (built, its state allocated, then all-gathered: a few integers per
parameter), never from re-implementing DeepSpeed's alignment rules.

Only the fp32 master partitions and the optimizer's moments move by the plan. The
low-precision model (:func:`_low_precision`): ZeRO-1/2 keep it whole on every rank, so
at a planned resize the ranks of the old group copy their own into the new model and a
joiner receives it, each parameter from one of them in turn; after a loss (whose copies
may be of an earlier step) it is made from the new masters as after an optimizer step,
by DeepSpeed's ``update_lp_params`` (a cast and an all-gather); ZeRO-3 casts each rank's
own partition of each parameter.

A grow exchanges in the new group (the joiners are there); a shrink first hands each
leaving rank's partitions whole to one survivor, in the old group (:func:`hand_over`),
then exchanges in the new group from the holders, as after a loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainer.integrations.p2p_reshard import Traffic, Transfer, transfer

__all__ = ["Fragment", "Piece", "exchange", "fill", "hand_over", "hand_over_targets", "metadata", "plan", "slot",
           "stage"]

#: one parameter's fragment on one rank: ``(partition index, offset in it, start in the
#: flattened parameter, elements)``; ``(-1, 0, 0, 0)``: the rank holds none of it
Fragment = tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[lo, hi)`` of flattened parameter ``param``, which old rank ``src``
    holds and new rank ``dst`` needs."""

    param: int
    src: int
    dst: int
    lo: int
    hi: int


def plan(old: Sequence[Sequence[Fragment]], new: Sequence[Sequence[Fragment]]) -> list[Piece]:
    """The pieces that carry every new rank's fragments from the old ranks' (pure).

    Args:
        old: ``old[i][p]``: old rank ``i``'s fragment of parameter ``p``.
        new: ``new[j][p]``: new rank ``j``'s.

    Returns:
        Pieces ordered by parameter, then new rank, then old rank: every element of every
        new fragment in exactly one piece, from the old rank holding it.

    Raises:
        ValueError: the layouts do not have the same parameters, or an element a new
            fragment needs is in no old fragment (another model's layout).
    """
    counts = {len(t) for t in (*old, *new)}
    if len(counts) > 1:
        raise ValueError(f"the layouts' tables list different numbers of parameters {sorted(counts)}")
    params = counts.pop() if counts else 0
    pieces: list[Piece] = []
    for p in range(params):
        held = sorted((f[2], f[2] + f[3], i) for i, t in enumerate(old) if (f := t[p])[0] >= 0 and f[3] > 0)
        for j, t in enumerate(new):
            part, _, lo, n = t[p]
            if part < 0 or n <= 0:
                continue
            at, hi = lo, lo + n
            for s0, s1, i in held:
                if s1 <= at or s0 >= hi:
                    continue
                if s0 > at:
                    break
                end = min(s1, hi)
                pieces.append(Piece(p, i, j, at, end))
                at = end
                if at == hi:
                    break
            if at != hi:
                raise ValueError(f"parameter {p}: elements {at}..{hi} of new rank {j}'s fragment are in no old "
                                 "rank's partitions")
    return pieces


def slot(parts: Sequence[torch.Tensor], keys: int, s: int, group: int) -> torch.Tensor:
    """In a rank's ``parts`` (``[table, *flats, *state of key 0 per group, ...]``, as
    :func:`~trainer.integrations.deepspeed_replicas.partitions` lists them, ``keys``
    optimizer state keys): slot ``s`` of partition ``group`` (0: the fp32 master, ``k +
    1``: the state of key ``k``)."""
    groups = (len(parts) - 1) // (1 + keys)
    return parts[1 + s * groups + group]


def exchange(pieces: Sequence[Piece], old: Sequence[Sequence[Fragment]], new: Sequence[Sequence[Fragment]], *,
             held: Mapping[int, Sequence[torch.Tensor]], into: Sequence[torch.Tensor] | None, keys: int,
             holders: Sequence[int], takers: Sequence[int]) -> Traffic:
    """Carry out ``pieces`` (:func:`plan` of ``old`` and ``new``) on this rank of the default
    group, for the fp32 masters and each of ``keys`` optimizer states: send what it holds
    that others take, receive what it takes, copy what it both holds and takes.

    Collective over the default group: every rank calls it with the same pieces and
    tables. The transfers are numbered alike on every rank and carried out by
    :func:`~trainer.integrations.p2p_reshard.transfer` (batches, no cycle of waits).

    Args:
        held: ``held[i]``: old rank ``i``'s parts, for each old rank whose parts this rank
            holds (its own; after a shrink's :func:`hand_over`, a leaver's too).
        into: this rank's new parts (the new engine's own tensors), or None (it takes none).
        holders: ``holders[i]``: the rank holding old rank ``i``'s parts.
        takers: ``takers[j]``: the rank taking new rank ``j``'s parts.

    Raises:
        ValueError: ``holders`` or ``takers`` of the wrong length; this rank lacks parts
            the plan says it holds or takes (before any send).
    """
    if len(holders) != len(old) or len(takers) != len(new):
        raise ValueError(f"{len(holders)} holders for {len(old)} old ranks, {len(takers)} takers for {len(new)}")
    me = dist.get_rank()
    for i, r in enumerate(holders):
        if r == me and i not in held:
            raise ValueError(f"this rank holds old rank {i}'s partitions by the plan, and has none")
    if me in takers and into is None:
        raise ValueError("this rank takes a new partition by the plan, and has none allocated")
    # every transfer numbered over the whole plan, alike on every rank
    mine: list[Transfer] = []
    n = 0
    for pc in pieces:
        src, dst = holders[pc.src], takers[pc.dst]
        if me not in (src, dst):
            n += 1 + keys
            continue
        fo, fn = old[pc.src][pc.param], new[pc.dst][pc.param]
        for s in range(1 + keys):
            view = (slot(held[pc.src], keys, s, fo[0]).narrow(0, fo[1] + pc.lo - fo[2], pc.hi - pc.lo)
                    if me == src else None)
            out = (slot(into, keys, s, fn[0]).narrow(0, fn[1] + pc.lo - fn[2], pc.hi - pc.lo)  # type: ignore[arg-type]
                   if me == dst else None)
            mine.append((n, src, dst, view, out))
            n += 1
    return transfer(mine, n)


def hand_over_targets(world: int, keep: Sequence[int]) -> dict[int, int]:
    """Which survivor each leaving rank of a shrink hands its partitions to (pure): the one
    whose new partition overlaps the leaver's old one most, on the even split that ZeRO
    makes of each flat group (ZeRO-1/2) or each parameter (ZeRO-3) into one partition per
    rank (alignment padding aside), so the fewest elements travel a second time, from
    that holder to their new owner, in the exchange. A leaver's partition (``1/world`` of
    the split) spans at most two of the larger new ones: the holder owns at least half of
    it. Ties go to the survivor holding fewer leavers' partitions so far, then the lower
    new rank.

    Args:
        world: the old data-parallel size.
        keep: the old ranks that stay, in new-rank order (``keep[j]`` becomes new rank ``j``).

    Returns:
        ``{leaving old rank: the old rank of its holder}``; empty when nobody leaves.

    Raises:
        ValueError: ``keep`` is empty, repeats a rank, or names one outside ``[0, world)``.
    """
    if not keep or len(set(keep)) != len(keep) or not all(0 <= k < world for k in keep):
        raise ValueError(f"keep {list(keep)} must be distinct ranks of the old world of {world}")
    new = len(keep)
    held = dict.fromkeys(keep, 0)
    out: dict[int, int] = {}
    for i in (r for r in range(world) if r not in held):
        # on a common scale of world * new elements: old rank i holds [i*new, (i+1)*new),
        # new rank j [j*world, (j+1)*world)
        overlap = [max(0, min((i + 1) * new, (j + 1) * world) - max(i * new, j * world)) for j in range(new)]
        j = min(range(new), key=lambda j: (-overlap[j], held[keep[j]], j))
        out[i] = keep[j]
        held[keep[j]] += 1
    return out


def hand_over(parts: Sequence[torch.Tensor] | None, sizes: Sequence[Sequence[int]], keep: Sequence[int],
              dtypes: Sequence[torch.dtype]) -> tuple[list[int], dict[int, list[torch.Tensor]]]:
    """A shrink, in the old group before it changes: each leaving rank sends its parts whole
    to one survivor (:func:`hand_over_targets`: the one that will own most of them), which
    keeps them for the exchange in the new group. Collective over the old group.

    Args:
        parts: this rank's parts (every old rank has its own).
        sizes: ``sizes[i]``: the element count of each of old rank ``i``'s parts (all-gathered).
        keep: the old ranks that stay (``keep[j]`` becomes new rank ``j``).
        dtypes: the dtype of each part (the same on every rank: an int64 table, then fp32).

    Returns:
        ``(holders, received)``: ``holders[i]`` the *new* rank holding old rank ``i``'s
        parts; ``received`` the leavers' parts this rank now holds, by old rank.
    """
    me, world = dist.get_rank(), len(sizes)
    to = hand_over_targets(world, keep)
    leavers = list(to)
    holders = [keep.index(to.get(i, i)) for i in range(world)]
    ops: list[dist.P2POp] = []
    received: dict[int, list[torch.Tensor]] = {}
    for leaver in leavers:
        if me == leaver:
            assert parts is not None
            ops += [dist.P2POp(dist.isend, t.reshape(-1).contiguous(), to[leaver], tag=n) for n, t in enumerate(parts)]
        elif me == to[leaver]:
            bufs = [torch.empty(n, dtype=dtypes[k]) for k, n in enumerate(sizes[leaver])]
            ops += [dist.P2POp(dist.irecv, b, leaver, tag=n) for n, b in enumerate(bufs)]
            received[leaver] = [bufs[0].view(-1, 4), *bufs[1:]]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return holders, received


def stage(engine: Any, model: torch.nn.Module, keep: Sequence[int]) -> dict[str, Any] | None:
    """Every rank of the old group, before it changes (``keep[j]`` becomes new rank ``j``):
    the old layout's tables all-gathered (a few integers per parameter), this rank's own
    parts kept (DeepSpeed's own tensors, no copy) and, for a shrink, the leavers' parts
    handed over whole to the survivors (:func:`hand_over`). Returns what :func:`fill`
    needs (None on a leaving rank), and the engine's scalars of this step. ZeRO-1/2: the
    rank's low-precision model too (views of the old engine's buffers, kept alive until
    the fill), which every rank of the old group holds whole: the new model is copied
    from it, and only a joiner receives it."""
    from trainer.exchange import all_gather_json
    from trainer.integrations.deepspeed_replicas import partitions
    from trainer.integrations.deepspeed_resize import scalars, zero_stage

    me, world = dist.get_rank(), dist.get_world_size()
    keys, parts = partitions(engine, model, me)
    info = all_gather_json({"table": parts[0].tolist(), "sizes": [t.numel() for t in parts]})
    staged: dict[str, Any] = {"p2p": True, "old": [[tuple(f) for f in x["table"]] for x in info], "keys": keys,
                              **scalars(engine)}
    if zero_stage(engine) != 3:
        staged["lp"] = [p.detach() for p in model.parameters() if p.requires_grad]
    if len(keep) == world:
        return {**staged, "held": {me: parts}, "holders": list(range(world))}
    holders, received = hand_over(parts, [x["sizes"] for x in info], keep, [t.dtype for t in parts])
    handed = sum(t.numel() * t.element_size() for got in received.values() for t in got)
    return {**staged, "held": {me: parts, **received}, "holders": holders, "handed_bytes": handed} \
        if me in keep else None


def metadata(staged: dict[str, Any]) -> dict[str, Any]:
    """What a grow's joiners take from rank 0: the staged layout without any tensor."""
    return {k: v for k, v in staged.items() if k not in ("held", "lp")}


def fill(engine: Any, model: torch.nn.Module, staged: dict[str, Any]) -> Traffic:
    """Every rank of the new group, its new engine built (not stepped): the optimizer's
    state allocated, the new layout's tables all-gathered, every new partition filled from
    the holders (:func:`exchange`), the low-precision model made (:func:`_low_precision`),
    and the scalars set. Returns this rank's traffic, a shrink's hand-over received included.

    Raises:
        RuntimeError: the new engine's optimizer state has other keys than the old one's,
            or the layouts are not of the same parameters.
    """
    from trainer.exchange import all_gather_json
    from trainer.integrations.deepspeed_replicas import partitions
    from trainer.integrations.deepspeed_resize import create_optimizer_state, set_scalars, zero_stage

    base = engine.optimizer.optimizer
    if staged["optim_step"] is not None and not base.state:
        create_optimizer_state(engine, zero_stage(engine))
    keys, into = partitions(engine, model, dist.get_rank())
    if keys != staged["keys"]:
        raise RuntimeError(f"the new engine's optimizer state has keys {keys}, the old one's {staged['keys']}")
    info = all_gather_json({"table": into[0].tolist(), "lp": staged.get("lp") is not None})
    new = [[tuple(f) for f in x["table"]] for x in info]
    try:
        pieces = plan(staged["old"], new)
    except ValueError as exc:
        raise RuntimeError(f"cannot move the partitions to the new layout: {exc}") from exc
    with torch.no_grad():
        traffic = exchange(pieces, staged["old"], new, held=staged.get("held") or {}, into=into, keys=len(keys),
                           holders=staged["holders"], takers=list(range(dist.get_world_size())))
        lp = _low_precision(engine, model, staged.get("lp"), [bool(x["lp"]) for x in info])
    set_scalars(engine, staged)
    traffic.received_bytes += staged.get("handed_bytes", 0) + lp.received_bytes  # and a shrink's hand-over
    traffic.sent_bytes += lp.sent_bytes
    return traffic


def _low_precision(engine: Any, model: torch.nn.Module, old: list[torch.Tensor] | None,
                   holding: list[bool]) -> Traffic:
    """The new model's low-precision parameters, as after an optimizer step. ZeRO-1/2 at a
    planned resize, where the ranks of the old group hold the old model whole (``old``;
    ``holding[r]``: rank ``r`` does): each copies its own, and each rank that holds none
    (a joiner) receives every parameter from one holder (parameter ``k`` from the
    ``k``-th holder, round the holders): the joiner alone receives the model. Otherwise
    (after a loss, whose copies may be of an earlier step than the survivors' models;
    ZeRO-3) from the new masters (:func:`_update_low_precision`). Returns this rank's
    traffic for it."""
    from trainer.integrations.deepspeed_resize import zero_stage

    keepers = [r for r, h in enumerate(holding) if h]
    if zero_stage(engine) == 3 or not keepers:  # the same branch on every rank: ``holding`` is all-gathered
        _update_low_precision(engine)
        return Traffic()
    new = [p for p in model.parameters() if p.requires_grad]
    if old is not None and [t.shape for t in old] != [p.shape for p in new]:
        raise RuntimeError("the old model's parameters are not the new model's: cannot copy them")
    me, lacking = dist.get_rank(), [r for r, h in enumerate(holding) if not h]
    mine: list[Transfer] = []
    n = 0
    for k, p in enumerate(new):
        src = keepers[k % len(keepers)]
        if old is not None:
            p.data.copy_(old[k])
        for dst in lacking:
            if me in (src, dst):
                mine.append((n, src, dst, old[k].reshape(-1) if me == src else None,  # type: ignore[index]
                             p.data.view(-1) if me == dst else None))
            n += 1
    return transfer(mine, n)


def _update_low_precision(engine: Any) -> None:
    """The model's low-precision parameters made from the new fp32 masters, as ZeRO's
    optimizer step makes them. ZeRO-1/2 (``update_lp_params``): each rank casts its
    partition, then an all-gather gives every rank the whole model. ZeRO-3
    (``_reassign_or_swap_out_partitioned_parameters``, per sub-group): each rank casts
    its partition of each parameter into ``ds_tensor``; the forward gathers them."""
    from trainer.integrations.deepspeed_resize import zero_stage

    opt = engine.optimizer
    if zero_stage(engine) != 3:
        opt.update_lp_params()
        return
    for sub in range(len(opt.fp32_partitioned_groups_flat)):
        opt._reassign_or_swap_out_partitioned_parameters(sub)
