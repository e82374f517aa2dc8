"""DeepSpeed's partitions copied to another node, so that a ZeRO job survives a node lost
without notice in its running processes without going back to its last commit.

ZeRO-1/2/3 partition the optimizer's state (ZeRO-3 the parameters too): a rank lost
without notice took its partition, and the survivors had to reload the newest commit.
With ``--replicate-shards`` each rank, every ``--replicate-every`` steps right after the
optimizer step, sends its partitions (the flat fp32 master partitions of each parameter
group and the optimizer's state of each, as DeepSpeed holds them) to its buddy on the next
node and keeps its predecessor's, through :class:`~trainer.integrations.replicas.BuddyReplica`
(host memory, a copy replaced only once wholly arrived), with a small table that says
where each parameter's fragment lies in them (:func:`partitions`): that table is all a
survivor needs to read a lost rank's partitions, whose layout it cannot compute.

After a loss (:meth:`DeepSpeedReplicas.restage_after_loss`, called by
:mod:`trainer.recovery` in the survivors' new group) the survivors agree which of them
holds each old rank's partitions (:func:`~trainer.integrations.replicas.agree_on_holders`,
as for FSDP2: its owner, or its buddy's copy), learn every old rank's fragment table from
its holder, and the engine is rebuilt at the new size and filled peer to peer from the
holders, as for a planned resize (:mod:`trainer.integrations.deepspeed_p2p`): nothing is
gathered whole. The state's scalars (AdamW's step, the LR scheduler, the engine's
counters) are the survivors' own, of the copies' step (kept with each snapshot, which
every rank takes of its partitions right before the engine's optimizer step that follows
a copy, :meth:`DeepSpeedReplicas.before_update`). A survivor whose optimizer had already
stepped past its job's step when the peer was lost (the loss came inside ZeRO's optimizer
step, which has collectives of its own: its partitions are of the next step, or of two)
goes back to that snapshot too.

Fails closed (the survivors reload the newest commit, one warning line): two
neighbouring nodes lost, copies of different steps, or a survivor that cannot go back to
the copies' step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainer.exchange import all_gather_json
from trainer.integrations.deepspeed_resize import optimizer_step, scalars, zero_stage
from trainer.integrations.replicas import BuddyReplica, agree_on_holders, on_device, per_node

__all__ = ["DeepSpeedReplicas", "partitions"]

log = logging.getLogger(__name__)


def _flat_groups(engine: Any) -> list[torch.Tensor]:
    """The engine's flat fp32 master partitions, one per parameter group (ZeRO-3: sub-group)."""
    opt = engine.optimizer
    return list(opt.fp32_partitioned_groups_flat if zero_stage(engine) == 3 else opt.single_partition_of_fp32_groups)


def _fragment(engine: Any, p: torch.nn.Parameter, rank: int) -> tuple[torch.Tensor | None, int]:
    """This rank's fp32 fragment of ``p`` (a view into a flat partition; None: it holds
    none) and where it starts in the flattened parameter. ``rank``: this rank's in the
    engine's data-parallel group (ZeRO-3's partition index)."""
    if zero_stage(engine) == 3:
        from deepspeed.utils import safe_get_local_fp32_param

        size = int(p.ds_tensor.ds_numel)
        start = rank * size
        numel = max(0, min(size, p.ds_numel - start))
        return (safe_get_local_fp32_param(p).narrow(0, 0, numel) if numel else None), start
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None, 0
    return mapping.get_hp_fragment(), int(mapping.lp_fragment_address.start)


def partitions(engine: Any, model: torch.nn.Module, rank: int) -> tuple[list[str], list[torch.Tensor]]:
    """This rank's whole part of the training state, as tensors to copy: ``(keys, tensors)``.
    ``rank``: this rank's in the engine's data-parallel group (the whole world here; after
    a loss, its rank in the old group, which is gone).

    ``tensors[0]``: an int64 table, one row per trainable parameter of ``model`` in
    ``named_parameters`` order, ``(partition index, offset in it, start in the flattened
    parameter, elements)`` (``-1, 0, 0, 0`` where this rank holds none of it); then the
    flat fp32 master partitions, one per group; then, for each optimizer state key in
    ``keys`` (sorted), that state of each group's partition. The partitions are
    DeepSpeed's own tensors (no copy). Raises ``RuntimeError`` when a fragment lies in none
    of them (another DeepSpeed's layout)."""
    flats = _flat_groups(engine)
    base = engine.optimizer.optimizer
    keys = sorted({k for st in base.state.values() for k, v in st.items()
                   if k != "step" and torch.is_tensor(v) and v.dim() > 0})
    rows = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        frag, start = _fragment(engine, p, rank)
        if frag is None:
            rows.append((-1, 0, 0, 0))
            continue
        at = frag.data_ptr()
        for i, flat in enumerate(flats):
            base_ptr = flat.data_ptr()
            if base_ptr <= at < base_ptr + flat.numel() * flat.element_size():
                rows.append((i, (at - base_ptr) // flat.element_size(), start, frag.numel()))
                break
        else:
            raise RuntimeError(f"{name}'s fp32 fragment lies in none of the engine's flat partitions")
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
    state = [base.state[flat][k] for k in keys for flat in flats]
    return keys, [table, *flats, *state]


class DeepSpeedReplicas:
    """One rank's copies of its buddy's DeepSpeed partitions (``--replicate-shards``), and
    the rebuild of the whole state from them after a loss. ``job``: the
    :class:`~trainer.examples.deepspeed_zero2.DeepSpeedJob` (its ``engine``, ``state``,
    ``ctx``, ``committed_step``, ``streaming``)."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.replica = BuddyReplica()
        self._keys: list[str] = []
        #: the scalars of the state as of the snapshot's step
        self._snapshot_scalars: dict[str, Any] | None = None

    def forget(self) -> None:
        """The layout changed (a resize): the copies and the snapshot are of the old one."""
        self.replica.forget()
        self._snapshot_scalars = None

    def after_step(self) -> None:
        """Copy this rank's partitions, as of its step, to its buddy (and take its
        predecessor's): after a step, or before one when there is no copy since a resize or
        a rebuild."""
        job = self.job
        self._keys, parts = partitions(job.engine, job.state.model, job.ctx.rank)
        self.replica.replicate(parts, step=job.state.step, rank=job.ctx.rank, world=job.ctx.world_size,
                               per_node=per_node(), interrupt=job.recovery.woken)

    def before_update(self) -> None:
        """Right before the engine's optimizer step, the step's gradients reduced: keep a
        snapshot of this rank's partitions, with the scalars, when the last copy is of this
        step (:meth:`~trainer.integrations.replicas.BuddyReplica.snapshot_before_update`)."""
        job = self.job
        if not self.replica.wants_snapshot(job.state.step):
            return  # (listing the partitions walks every parameter's fragment)
        _, parts = partitions(job.engine, job.state.model, job.ctx.rank)
        self.replica.snapshot_before_update(parts, step=job.state.step, rank=job.ctx.rank)
        self._snapshot_scalars = scalars(job.engine)

    def restage_after_loss(self, old_rank: int, old_world: int) -> dict[str, Any] | None:
        """The survivors' new group, after a loss (collective): the old layout staged as a
        planned resize stages it (:func:`~trainer.integrations.deepspeed_p2p.stage`), from
        the survivors' partitions (or their snapshots, going back to the copies' step) and
        the copies of the lost ranks', each held by its survivor, with every old rank's
        fragment table (all-gathered from the holders); the new engine's partitions are
        then filled peer to peer. None, with one warning line on rank 0, when the copies
        cannot rebuild it, or going back would pass the newest commit or a stream's
        position: the survivors reload the newest commit."""
        job, snap = self.job, self.replica.snapshot
        # a loss inside ZeRO's optimizer step (in its all-gather of the new parameters, or
        # between ZeRO-3's sub-groups) leaves this rank's partitions ahead of the engine's
        # count, or at two steps: not a state to rebuild from, only its snapshot is
        try:
            moved = optimizer_step(job.engine) not in (None, job.engine.global_steps)
        except RuntimeError:  # partitions at different steps
            moved = True
        got, survivors = agree_on_holders(job, self.replica, old_rank, old_world, per_node(), torn=moved)
        if isinstance(got, str):
            if job.ctx.is_leader:
                log.warning("the partitions lost cannot be rebuilt from their copies (%s): reloading the newest "
                            "commit", got)
            return None
        holders, step = got
        if step != job.state.step or moved:  # back to the copies' step: this rank's partitions from its snapshot
            assert snap is not None and snap.step == step and self._snapshot_scalars is not None
            own, values = on_device(snap.tensors, job.ctx.device), self._snapshot_scalars
        else:
            self._keys, own = partitions(job.engine, job.state.model, old_rank)
            values = scalars(job.engine)
        held = {old_rank: own}
        copy = self.replica.held(step)  # the last copy, or the one before (a loss inside a copy)
        if copy is not None and holders[copy.of] == job.ctx.rank and copy.of != old_rank:
            held[copy.of] = on_device(copy.tensors, job.ctx.device)  # held in host memory
        # every old rank's fragment table, from the survivor holding its parts: the old layout
        tables: dict[str, list] = {}
        for got_tables in all_gather_json({str(i): parts[0].tolist() for i, parts in held.items()}):
            tables.update(got_tables)
        if job.ctx.is_leader:
            lost = sorted(set(range(old_world)) - {int(s["old"]) for s in survivors})
            log.warning("rebuilding the partitions of old rank(s) %s from their copies (step %d)",
                        ",".join(map(str, lost)), step)
        job.state.step = step
        return {"p2p": True, "old": [[tuple(f) for f in tables[str(i)]] for i in range(old_world)],
                "keys": self._keys, **values, "held": held, "holders": holders}
