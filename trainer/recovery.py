"""The recovery path of an :class:`~trainer.loop.ElasticJob`: a peer lost without notice.

A collective fails on every survivor (a rank whose peer is gone errors, and so does every
rank blocked on it once the first ones drop the old group). :meth:`Recovery.lost_a_peer`
tells that failure from any other; :meth:`Recovery.recover` re-forms the group without
the lost peer in these processes, and the step that failed is trained again. A
:class:`~trainer.membership.LossWatch` (:meth:`Recovery.follow`) wakes a survivor blocked
on a silent peer when the others re-form.

What :meth:`Recovery.recover` does on every survivor: wait for the rendezvous store if
it is out of reach (restarting, or moving to a new HA leader; at most ``--store-wait-s``,
probed on a fixed beat so the survivors arrive together), say it is coming, drop the old
group, agree on the new membership with the others through the rendezvous store
(:class:`~trainer.membership.SurvivorRound`: a rank that does not answer within
``--loss-settle-s`` of the first arrival is presumed lost, and the round waits for
every rank that answered, however long it computes before its collective fails),
join the new group; the ranks a
step behind take the state from the most advanced survivor (a rank whose optimizer step
completed before its last collective failed). Then a new attempt at that step: the step
that failed is trained again at the smaller world, with the same global batch. That is
for replicated state (DDP). A sharded job (``state_replicated`` False) lost the peer's
shards: when its ranks keep copies of each other's (FSDP2 with ``--replicate-shards``:
the job's ``restage_after_loss``), the survivors rebuild the old layout from them and
move it to the new one, losing no step (at most ``--replicate-every`` - 1); otherwise
they reload the newest commit in these processes (the job's
``reshard(from_commit=True)``) and train on from there: the steps since that commit are
lost. No worker restarts either way.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import threading
import time
from typing import Any

import torch.distributed as dist

from trainer.batch import ElasticBatch
from trainer.checkpoint import MANIFEST_NAME, CheckpointError, step_dir
from trainer.contract import NODE_ID_ENV
from trainer.exchange import all_gather_json, broadcast_json
from trainer.membership import JoinRefused, JoinTimeout, LossWatch, SurvivorRound, run_id
from trainer.runtime import regroup, rendezvous_endpoint
from trainer.storage import ObjectNotFoundError, StorageError
from trainer.store_retry import wait_for_store

__all__ = ["Recovery", "first_line", "raised_in"]

log = logging.getLogger("trainer.run")

#: gloo's messages when a peer's connection is gone (its errors are plain RuntimeErrors)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Read error", "Write error",
              "Timed out waiting", "Broken pipe", "Socket closed")


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of ``exc``'s message, or its type's name. A leading C++ source
    location (gloo's ``[/__w/pytorch/.../gloo/transport/tcp/pair.cc:537] ``) is cut to
    its file's name; a line longer than ``limit`` characters ends at a word, with "…"."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if line.startswith("[") and "]" in line:
        where, rest = line[1:].split("]", 1)
        line = f"[{os.path.basename(where)}]{rest}"
    if len(line) > limit:
        line = line[:limit - 1].rsplit(" ", 1)[0] + "…"
    return line


def raised_in(exc: BaseException, frames: int = 6) -> str:
    """Where ``exc`` was raised: its innermost ``frames`` Python frames, innermost first,
    as ``file:line function`` joined by `` < `` (which collective of which step part
    failed: a timeout alone does not say). Empty without a traceback."""
    import traceback

    tb = traceback.extract_tb(exc.__traceback__)[-frames:]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(tb))


class Recovery:
    """The survivors of a peer lost without notice go on in their running processes."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self._watch: LossWatch | None = None  # unblocks this worker when other survivors re-form without it

    def lost_a_peer(self, exc: RuntimeError) -> bool:
        """Whether ``exc`` is a collective that failed because a peer is gone (and this
        job can go on without it in these processes). torch's distributed errors
        (``DistError``: NCCL's ``DistBackendError`` after an abort, a store's
        ``DistNetworkError``) and gloo's transport errors, which are plain RuntimeErrors."""
        if not self.job.resizer.can_grow:
            return False
        if isinstance(exc, dist.DistError):
            return True
        text = str(exc)
        return any(marker in text for marker in _PEER_GONE)

    def follow(self) -> None:
        """Point the loss watch at this attempt's group (started on first use)."""
        job = self.job
        if not job.resizer.can_grow:
            return
        if self._watch is None:
            endpoint = rendezvous_endpoint()
            assert endpoint is not None
            self._watch = LossWatch(endpoint, run_id())
        self._watch.follow(job.attempt, job.ctx.rank)

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()

    @property
    def woken(self) -> threading.Event | None:
        """Set once the other survivors of a lost peer woke this worker to re-form (None
        before the loss watch starts): a wait no socket ends watches it."""
        return self._watch.woken if self._watch is not None else None

    def recover(self, failure: str) -> None:
        """Re-form the group without the lost peer, in these processes, and start a new
        attempt at the step that failed (the module's docstring walks through it).

        Raises:
            SystemExit(1): the survivors' world size cannot take the global batch, this
                rank's entry in the survivors' round does not verify (no join credential),
                or the rendezvous store stayed out of reach for ``--store-wait-s`` (the
                round needs it; every survivor waits for it the same way, so a store
                restarting or moving to a new HA leader costs no step): torchrun or the
                daemon takes over. A rank that arrives after the others
                re-formed joins them through the join queue instead, a boundary later.
        """
        job = self.job
        old_rank, old_world, step, t0 = job.ctx.rank, job.ctx.world_size, job.state.step, time.perf_counter()
        log.warning("a collective failed at step %d (%s): re-forming the group without the lost peer", step, failure)
        endpoint = rendezvous_endpoint()
        assert endpoint is not None  # lost_a_peer
        if wait_for_store(endpoint, job.args.store_wait_s, what="the survivors' round") is None:
            log.warning("the rendezvous store stayed out of reach for --store-wait-s %.0f s: exiting for a "
                        "restart from the newest commit", job.args.store_wait_s)
            raise SystemExit(1)
        node = os.environ.get(NODE_ID_ENV) or socket.gethostname()
        if self._watch is not None:
            self._watch.pause()  # before any socket of the round opens: nothing may shut this group's now
        try:
            survivors = SurvivorRound(endpoint, run_id(), job.attempt, old_rank, old_world,
                                      timeout_s=job.args.pg_timeout_s)
            survivors.coming()  # dropping the group can take a while (gc of the failed step)
            self._drop_group()
            rank, world, prefix = survivors.settle(settle_s=job.args.loss_settle_s, credential=job.credential,
                                                   node=node)
        except JoinTimeout as exc:
            # it answered the round too late (its loss watch not following yet, or the store
            # out of reach): the others re-formed without it; it joins as a newcomer
            log.warning("%s; joining the survivors' group as a newcomer", exc)
            job.resizer.join(f"{node}/rank{old_rank}", 0, 1)
            return
        except JoinRefused as exc:
            log.warning("%s; exiting for a restart", exc)
            raise SystemExit(1) from None
        if not ElasticBatch(job.G, job.plan.micro_batch_size).is_valid(world):
            log.warning("the global batch %d cannot be split over the %d surviving ranks; exiting for a restart",
                        job.G, world)
            raise SystemExit(1)
        job.ctx = regroup(job.ctx, rank, world, prefix, endpoint, job.args.pg_timeout_s,
                          store_wait_s=job.args.store_wait_s)
        self._catch_up(old_rank, old_world, t0, step)

    def learn_commit(self) -> bool:
        """Collective, after a re-form that interrupted a commit: whether rank 0 of the old
        group wrote the step's manifest before it was lost (the survivors did not hear).
        If it did, the step counts as committed here too, so the boundary decided again
        reuses that commit (``Committer.commit``) instead of writing the step's shards a
        second time under a committed manifest. A sharded job reloaded the newest commit in
        its recovery and knows it already. Returns False: the boundary is decided again in
        the new group. Raises ``CheckpointError`` (every rank) when rank 0 cannot tell (a
        storage error): fail closed, for a restart from the newest commit."""
        job = self.job
        if not job.state_replicated:
            return False
        step = job.state.step
        found: bool | str = False
        if job.ctx.is_leader:
            try:
                job.store.get_bytes(f"{step_dir(step)}/{MANIFEST_NAME}")
                found = True
            except ObjectNotFoundError:
                found = False
            except StorageError as exc:  # unknown: writing the step again could tear a commit
                found = f"{type(exc).__name__}: {exc}"
        found = broadcast_json(found, src=0)
        if isinstance(found, str):
            raise CheckpointError(f"step {step}: cannot tell whether the interrupted commit landed ({found})")
        if found and job.committed_step != step:
            log.warning("step %d was committed before the lost peer's rank 0 could say so: reusing it", step)
            job.committed_step = step
        return False

    def _drop_group(self) -> None:
        """Leave the old group (its loss watch paused): drop DDP's reducer, abort and
        destroy the group."""
        job = self.job
        job.ddp = job.state.model  # DDP's reducer holds the old group
        if dist.is_initialized():
            # NCCL: abort ends this rank's pending kernels. gloo closes no connection on abort
            # or destroy (a survivor blocked on this rank is woken by its own LossWatch)
            with contextlib.suppress(RuntimeError, NotImplementedError):
                dist.distributed_c10d._get_default_group().abort()
            dist.destroy_process_group()
        gc.collect()  # the failed step's graph, and with it DDP's reducer on the old group

    def _catch_up(self, old_rank: int, old_world: int, t0: float, step: int) -> None:
        """In the new group: the survivors a step behind take the state of the most
        advanced one (replicated); a sharded job rebuilds the lost shards from the copies
        its ranks keep of each other's (``restage_after_loss``: FSDP2 with
        ``--replicate-shards``), or every rank reloads the newest commit."""
        job, world = self.job, self.job.ctx.world_size
        if not job.state_replicated:
            restage = getattr(job, "restage_after_loss", None)  # collective: every survivor asks
            if restage is not None and restage(old_rank, old_world):
                job.resizer.restart_attempt(old_world, t0, "recovered", resumed_from=None, from_replicas=True,
                                            lost_ranks=old_world - world, failed_step=step)
                return
            job.resizer.restart_attempt(old_world, t0, "reloaded", resumed_from=None, from_commit=True,
                                        lost_ranks=old_world - world, failed_step=step)
            return
        steps = [int(s) for s in all_gather_json(job.state.step)]
        top = max(steps)
        behind = [r for r, s in enumerate(steps) if s != top]
        if behind:
            job.resizer.send_state(steps.index(top), behind)
        job.resizer.restart_attempt(old_world, t0, "recovered", resumed_from=None, lost_ranks=old_world - world,
                                    failed_step=step)
