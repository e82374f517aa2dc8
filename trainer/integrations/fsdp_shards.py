"""An FSDP2 job's shards through an in-process resize and a loss: moved peer to peer, and
copied to another node after every step when asked.

:class:`ShardMover` is what :class:`trainer.examples.fsdp_dcp.DcpJob` delegates to; it
reads the job's ``state`` (model, optimizer, step), ``ctx`` and ``args``. The order of
events on every rank (:mod:`trainer.resize`, :mod:`trainer.recovery`)::

    shrink   stage(keep)     old group: the exchange runs now (the leaving ranks send)
             (the group changes)
             fill()          new model: copy in the rows received
    grow     stage(keep)     old group: keep this rank's shards, move nothing
             grow_ranks(k)   old group: where the joiners go (the fewest bytes move)
             (the group changes; the joiners take metadata(): old world, AdamW's step,
             the old shards' holders)
             fill()          new group: the exchange runs now (the joiners receive)
    loss     restage_after_loss(old_rank, old_world)
                             new group: own shards + the copies of the lost ranks'
             fill()          new group: the exchange, holders from the copies

``fill`` runs after the job built the new model on the meta device, sharded and
allocated it: it allocates AdamW's state (uncomputed: it is overwritten), fills every shard,
and sets AdamW's step count and hyperparameters back. The tensors move in one order
every rank computes alike (:meth:`ShardMover.local_shards`); the plan is
:mod:`trainer.integrations.p2p_reshard`'s, the copies :mod:`trainer.integrations.replicas`'.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from trainer.integrations.meta import allocate_optimizer_state
from trainer.integrations.p2p_reshard import Traffic, chunk_rows, exchange, grow_ranks, plan
from trainer.integrations.replicas import BuddyReplica, agree_on_holders, on_device, per_node

__all__ = ["ShardMover", "adopt", "fsdp_params", "release", "within"]

log = logging.getLogger("trainer.examples.fsdp_dcp")


class ShardMover:
    """One FSDP2 job's shards across its resizes (module docstring). Every method is
    collective over the group it runs in, except :meth:`metadata` and :meth:`report`."""

    def __init__(self, job: Any) -> None:
        self.job = job
        #: between a stage and its fill: the layout and the shards (a shrink's new ones, a grow's old ones)
        self.staged: dict[str, Any] | None = None
        #: this rank's bytes moved by the last exchange
        self.traffic: Traffic | None = None
        #: the copy of another node's shards this rank keeps (``--replicate-shards``)
        self.replica = BuddyReplica()
        self.prime_s = 0.0  # the last fill's creation of the optimizer's state (s)
        #: the old shards whose memory the last fill's new ones use (:meth:`_keep_in_place`): not to be freed
        self.in_place: list[torch.Tensor] = []

    # -- what every rank computes alike

    def local_shards(self) -> tuple[list[str], list[torch.Tensor], list[int]]:
        """This rank's shards of the whole state: for each parameter, itself, then each
        optimizer state of its shape (AdamW's moments), by key. Returns (their names, the
        local tensors, each one's global row count)."""
        from torch.distributed.tensor import DTensor

        names: list[str] = []
        local: list[torch.Tensor] = []
        rows: list[int] = []
        for name, key, t, _ in self._slots():
            names.append(f"{name}:{key}" if key else name)
            local.append((t.to_local() if isinstance(t, DTensor) else t).detach())
            rows.append(int(t.shape[0]))
        return names, local, rows

    def _slots(self) -> Iterator[tuple[str, str, torch.Tensor, dict[str, Any] | None]]:
        """:meth:`local_shards`' order: ``(parameter name, "" or the optimizer state's key,
        the tensor, the state dict holding it or None for the parameter)``."""
        opt_state = self.job.state.optimizer.state
        for name, p in self.job.state.model.named_parameters():
            yield name, "", p, None
            st = opt_state.get(p, {})
            for k in sorted(st):
                if torch.is_tensor(st[k]) and st[k].dim() > 0 and st[k].shape == p.shape:
                    yield name, k, st[k], st

    def _take_rows(self, got: list[torch.Tensor]) -> None:
        """A shrink's survivor, in :meth:`fill`: its new shards' rows, received in :meth:`stage`
        in :meth:`local_shards`' order, become the new model's and optimizer's tensors
        themselves (:func:`adopt`); a parameter FSDP2 pads gets them copied into its storage."""
        from torch.distributed.tensor import DTensor

        params, copied, adopted = fsdp_params(self.job.state.model), [], []
        for slot, rows in zip(self._slots(), got, strict=True):
            if adopt(slot, rows, params):
                adopted.append(rows)
            else:
                t = slot[2]
                (t.to_local() if isinstance(t, DTensor) else t).detach().copy_(rows)
                copied.append(rows)
        release(copied, keep=adopted)  # their memory now, not when the collector reaches the old model's

    def reshard_modules(self) -> None:
        """Put every FSDP2 module's sharded parameters back in place (``FSDPModule.reshard``:
        local, no collective). A collective that failed mid-step (a peer lost in a forward's
        all-gather or a backward's reduce-scatter) leaves the modules it had reached
        unsharded: their registered parameters are then the gathered full tensors, not the
        shards the optimizer holds. Their shards themselves are as the last step left them."""
        from torch.distributed.fsdp import FSDPModule

        model = self.job.state.model
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _layout(self, old_world: int) -> dict[str, Any]:
        """What a fill needs besides the shards: the old world size, AdamW's step count (None
        before its first step) and its param groups' hyperparameters."""
        opt = self.job.state.optimizer
        steps = {int(st["step"]) for st in opt.state.values() if "step" in st}
        if len(steps) > 1:
            raise RuntimeError(f"the optimizer's parameters are at different steps {sorted(steps)}")
        return {"old_world": old_world, "optim_step": next(iter(steps), None),
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}

    # -- the resizes

    def stage(self, keep: list[int]) -> None:
        """Every rank of the old group, before it changes (``keep[j]`` becomes new rank ``j``).
        A shrink (ranks leave): the exchange runs now, the leaving ranks sending; each
        survivor keeps the rows of its new shards until :meth:`fill`. A grow (all stay):
        each rank keeps its own shards for the exchange in the new group."""
        job = self.job
        names, local, rows = self.local_shards()
        world, me = job.ctx.world_size, job.ctx.rank
        staged = {**self._layout(world), "names": names}
        if len(keep) == world:
            self.staged = {**staged, "old": {me: local}, "own": me, "holders": list(range(world)), "rows": rows}
            return
        new_world, new = len(keep), None
        if me in keep:
            j = keep.index(me)
            new = []
            for t, n in zip(local, rows):  # in the memory of the old shard where it spans the new rows
                (start, size), first = chunk_rows(n, new_world, j), chunk_rows(n, world, me)[0]
                view = within(t, start - first, size)
                new.append(view if view is not None else torch.empty((size, *t.shape[1:]), dtype=t.dtype,
                                                                     device=t.device))
        self.traffic = exchange(plan(rows, world, new_world), {me: local}, new, rows=rows, old_world=world,
                                new_world=new_world, holders=list(range(world)), takers=keep)
        self.staged = {**staged, "new": new} if me in keep else None

    def grow_ranks(self, joiners: int) -> list[int]:
        """Every old rank, after its :meth:`stage` of a grow by ``joiners``: the new rank of
        each old rank, then of each joiner, where the fewest bytes move
        (:func:`~trainer.integrations.p2p_reshard.grow_ranks`, from the shapes alone: the
        same on every rank; a node's ranks stay consecutive); the old shards' holders in
        the new group are staged with it.

        Raises:
            RuntimeError: nothing is staged (a grow that skipped :meth:`stage`).
        """
        if self.staged is None:
            raise RuntimeError("no staged layout to place a grow's joiners by (a grow that skipped stage_state)")
        local = next(iter(self.staged["old"].values()))
        row_bytes = [math.prod(t.shape[1:]) * t.element_size() for t in local]
        ranks = grow_ranks(self.staged["rows"], row_bytes, self.staged["old_world"], joiners, per_node())
        self.staged["holders"] = ranks[:self.staged["old_world"]]
        return ranks

    def metadata(self) -> dict[str, Any]:
        """Rank 0 to a grow's joiners: the staged layout (a few values, no tensor).

        Raises:
            RuntimeError: nothing is staged (a grow that skipped :meth:`stage`).
        """
        if self.staged is None:
            raise RuntimeError("rank 0 holds no staged layout to send (a grow that skipped stage_state)")
        return {k: self.staged[k] for k in ("old_world", "optim_step", "groups", "holders")}

    def take_metadata(self, meta: dict[str, Any]) -> None:
        """A joiner: rank 0's :meth:`metadata`; it holds no old shard."""
        self.staged = {**meta, "names": None, "old": None}

    def take_staged(self) -> dict[str, Any] | None:
        """What the next :meth:`fill` needs, handed to the job before it drops the old model
        (a grow's old shards stay referenced by it); the copy kept is forgotten: the layout changes."""
        staged, self.staged = self.staged, None
        self.replica.forget()
        return staged

    def fill(self, staged: dict[str, Any]) -> None:
        """The new model's shards, from ``staged`` (:meth:`take_staged`), on every rank of the
        new group; the new model and optimizer are the job's, allocated and sharded.

        Raises:
            RuntimeError: the model or optimizer's tensors are not the old layout's.
        """
        job = self.job
        t0 = time.perf_counter()
        if staged["optim_step"] is not None:
            self._create_optimizer_state()
        self.prime_s = time.perf_counter() - t0
        names, new, rows = self.local_shards()
        if staged["names"] is not None and staged["names"] != names:
            raise RuntimeError("the model or optimizer's tensors differ from the old layout's: cannot reshard")
        self.in_place = []
        with torch.no_grad():
            if "new" in staged:  # a shrink's survivor: its rows arrived in stage()
                self._take_rows(staged["new"])
            else:  # a grow, a loss: the holders send, in the new group
                old_world, world = staged["old_world"], job.ctx.world_size
                if staged.get("own") is not None:
                    self.in_place = self._keep_in_place(staged["old"][staged["own"]], staged["own"], old_world, rows)
                    new = self.local_shards()[1]
                self.traffic = exchange(plan(rows, old_world, world), staged["old"] or {}, new, rows=rows,
                                        old_world=old_world, new_world=world,
                                        holders=staged.get("holders") or list(range(old_world)),
                                        takers=list(range(world)))
        opt = job.state.optimizer
        for st in opt.state.values():
            if "step" in st:
                st["step"] = (torch.full_like(st["step"], staged["optim_step"]) if torch.is_tensor(st["step"])
                              else staged["optim_step"])
        for group, saved in zip(opt.param_groups, staged["groups"]):
            group.update(saved)

    def _keep_in_place(self, old: list[torch.Tensor], own: int, old_world: int,
                       rows: list[int]) -> list[torch.Tensor]:
        """A grow's (or a loss's) rank, in :meth:`fill`: where the memory of its old shard of a
        tensor spans the rows of its new one (:func:`within`: each old rank of a grow whose
        joiners sit beside it, :meth:`grow_ranks`; a shrink's survivor growing back), the
        new model and optimizer take a view of that memory (:func:`adopt`) instead of
        fresh memory to copy into. The rows it holds are then in place (the exchange copies
        none of them) and the rows it receives land in memory it holds already. Nothing is
        allocated: no first touch of fresh pages (0.35 s per 808 MB here, against 0.04 s to
        rewrite them), and the rank never holds more than it did before. ``old``: this
        rank's old shards (old shard ``own`` of ``old_world``), its live model's (never a
        copy's or a snapshot's: their buffers are written again). Returns the old tensors
        whose memory the new ones use (not to be freed)."""
        world, me, kept = self.job.ctx.world_size, self.job.ctx.rank, []
        params = fsdp_params(self.job.state.model)
        for slot, src, n in zip(self._slots(), old, rows, strict=True):
            (n_start, n_size), o_start = chunk_rows(n, world, me), chunk_rows(n, old_world, own)[0]
            view = within(src, n_start - o_start, n_size)
            if view is not None and adopt(slot, view, params):
                kept.append(src)
        return kept

    def _create_optimizer_state(self) -> None:
        """The optimizer's state as its first step would create it, allocated and not
        computed (:func:`~trainer.integrations.meta.allocate_optimizer_state`: every tensor
        of it is overwritten next); for an optimizer whose state is of another form, the
        first step itself, on zero gradients over the new shards."""
        opt = self.job.state.optimizer
        if allocate_optimizer_state(opt):
            return
        params = [p for g in opt.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p in params:
            p.grad = None

    def report(self) -> dict[str, Any]:
        """The last exchange's bytes on this rank (sent, received, copied in place) and the
        bytes of its new shards, once (then empty until the next exchange)."""
        if self.traffic is None:
            return {}
        t, self.traffic = self.traffic, None
        shard = sum(x.numel() * x.element_size() for x in self.local_shards()[1])
        return {"reshard_sent_bytes": t.sent_bytes, "reshard_received_bytes": t.received_bytes,
                "reshard_copied_bytes": t.copied_bytes, "reshard_in_place_bytes": t.in_place_bytes,
                "shard_bytes": shard,
                "exchange_s": round(t.seconds, 4), "optimizer_state_s": round(self.prime_s, 4)}

    # -- the copies and a loss

    def after_step(self) -> None:
        """Copy this rank's shards, as of its step, to its buddy (and take its predecessor's):
        after a step, or before one when there is no copy since a resize or a rebuild. The
        caller decides whether and when this job replicates."""
        job = self.job
        self.replica.replicate(self.local_shards()[1], step=job.state.step, rank=job.ctx.rank,
                               world=job.ctx.world_size, per_node=per_node(), interrupt=job.recovery.woken)

    def before_update(self) -> None:
        """Right before the optimizer step, after the step's collectives: keep a snapshot of
        this rank's shards when the last copy is of this step
        (:meth:`~trainer.integrations.replicas.BuddyReplica.snapshot_before_update`)."""
        job = self.job
        self.replica.snapshot_before_update(self.local_shards()[1], step=job.state.step, rank=job.ctx.rank)

    def restage_after_loss(self, old_rank: int, old_world: int) -> bool:
        """The survivors' new group, after a loss: stage the old layout put back together from
        the survivors' own shards (or their snapshots, going back to the copies' step) and the
        copies of the lost ranks' (:func:`~trainer.integrations.replicas.recovery_holders`).
        False, with one warning line on rank 0, when the copies cannot rebuild it, or going
        back would pass the newest commit or a stream's position: the survivors reload the
        newest commit."""
        job, snap = self.job, self.replica.snapshot
        self.reshard_modules()  # the failed step may have left parameters unsharded
        got, survivors = agree_on_holders(job, self.replica, old_rank, old_world, per_node())
        if isinstance(got, str):
            if job.ctx.is_leader:
                log.warning("the shards lost cannot be rebuilt from their copies (%s): reloading the newest commit",
                            got)
            return False
        holders, step = got
        names, local, _ = self.local_shards()
        layout, own = self._layout(old_world), old_rank  # own: the live model's shards, kept in place where they can
        if step != job.state.step:  # back to the copies' step: this rank's own shards from its snapshot
            assert snap is not None and snap.step == step
            local = on_device(snap.tensors, job.ctx.device)
            layout["optim_step"] = step
            job.state.step, own = step, None  # the snapshot's buffers are taken again by the next one
        old = {old_rank: local}
        copy = self.replica.held(step)  # the last copy, or the one before (a loss inside a copy)
        if copy is not None and holders[copy.of] == job.ctx.rank and copy.of != old_rank:
            old[copy.of] = on_device(copy.tensors, job.ctx.device)  # held in host memory
        self.staged = {**layout, "names": names, "old": old, "own": own, "holders": holders}
        if job.ctx.is_leader:
            lost = sorted(set(range(old_world)) - {int(s["old"]) for s in survivors})
            log.warning("rebuilding the shards of old rank(s) %s from their copies (step %d)",
                        ",".join(map(str, lost)), step)
        return True


def release(tensors: Sequence[torch.Tensor], keep: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Free the storage of an old model's shards and gradients (``resize_(0)``: FSDP2's own
    way to drop a parameter's memory) now, not when the collector gets to the old modules'
    reference cycles (FSDP2's modules, states and hooks refer to each other): a resize
    used to ``gc.collect()`` for that, 0.1 s of each survivor's pause at 200 M on 2 busy
    cores. Nothing may read them after, except the storage of those in ``keep`` (the new
    model's views of it, :func:`adopt`), left alone. Returns ``[]``."""
    held = {k.untyped_storage().data_ptr() for k in keep}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.resizable() and storage.data_ptr() not in held:
            storage.resize_(0)
    return []


def within(t: torch.Tensor, first: int, rows: int) -> torch.Tensor | None:
    """Rows ``first .. first + rows`` of ``t`` counted from its first row, as a view of the
    memory ``t`` is a view of, where that memory spans them (``first`` may be negative
    and the rows may run past ``t``'s own: a shard that is a view of a larger one, or
    FSDP2's padded storage); None where it does not, or ``t`` is not laid out row after
    row. Rows outside ``t``'s own are whatever that memory holds (nobody's: the caller
    writes them). ``rows`` 0: None (nothing to keep)."""
    if rows <= 0 or t.dim() == 0 or not t.is_contiguous():
        return None
    row = math.prod(t.shape[1:])
    offset = t.storage_offset() + first * row
    if offset < 0 or (offset + rows * row) * t.element_size() > t.untyped_storage().nbytes():
        return None
    return t.as_strided((rows, *t.shape[1:]), t.stride(), offset)


def fsdp_params(model: torch.nn.Module) -> dict[int, Any]:
    """FSDP2's record of each sharded parameter of ``model``, by the parameter's
    ``id`` (empty where the model is not FSDP2's, or torch keeps it elsewhere)."""
    from torch.distributed.fsdp import FSDPModule

    params: dict[int, Any] = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
            for fp in getattr(group, "fsdp_params", None) or []:
                params[id(fp.sharded_param)] = fp
    return params


def adopt(slot: tuple[str, str, torch.Tensor, dict[str, Any] | None], rows: torch.Tensor,
          params: dict[int, Any]) -> bool:
    """Make ``rows`` the tensor the new model or optimizer holds at ``slot`` (one of
    :meth:`ShardMover._slots`; ``rows``: this rank's new shard there, filled or about to
    be; ``params``: :func:`fsdp_params` of the model), without a copy. An optimizer's
    state takes it as it is; a parameter too, through FSDP2's own step for a sharded
    parameter whose tensor changed (``FSDPParam.reset_sharded_param``: the all-gather's
    input becomes it), where FSDP2 needs no padding of it (``rows`` of its padded
    shape). False, nothing changed, where it cannot: the caller copies."""
    from torch.distributed.tensor import DTensor

    _, key, t, st = slot
    if st is None:
        fp = params.get(id(t))
        if (fp is None or not isinstance(t, DTensor) or rows.dtype != t.dtype or rows.device != t.device
                or tuple(rows.shape) != tuple(fp.padded_sharded_param_size)):
            return False
        t._local_tensor = rows
        fp.reset_sharded_param()
    elif isinstance(t, DTensor):
        st[key] = DTensor.from_local(rows, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                     stride=t.stride())
    else:
        st[key] = rows
    return True
