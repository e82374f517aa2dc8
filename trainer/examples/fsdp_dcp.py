"""FSDP2 + DCP example trainer: ``python -m trainer.examples.fsdp_dcp`` on every rank (torchrun).

The reference trainer's job (:mod:`trainer.run`: byte-level GPT-2, constant global
batch, the same step-boundary loop, status lines, step logs and exit codes) with the
model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``, one unit per
transformer block plus the root) when the world has more than one rank, or
replicated by DDP with ``--wrap ddp``, and checkpoints written by every rank with
``torch.distributed.checkpoint`` through
:class:`~trainer.integrations.dcp.DcpCheckpointer`. A checkpoint written at one
world size (and wrapping) resumes at any other: DCP reshards on load.

The daemon starts it exactly like ``trainer.run`` (``module: trainer.examples.fsdp_dcp``
in the job config; the same flags, plus ``--wrap``). CPU: gloo, fp32; CUDA: NCCL.
Run alone (without torchrun) it is a world of one with an unwrapped model.

In-process resizes (``--resize in-process``, the default, with the daemon's rendezvous
store): the ranks that stay never restart, and the state moves peer to peer
(:mod:`trainer.integrations.p2p_reshard`): each rank receives exactly the rows of its
new shards that it lacks, from the ranks that hold them; nothing is gathered whole
anywhere and nothing but the joiners' metadata passes through rank 0. A shrink's
exchange runs before the group changes (a notice's boundary: the leaving ranks send
their rows), a grow's after (in the new group, where the joiners are). Every rank
builds the new model on the meta device (no initialisation), shards it over the new
world and fills its shards. A joiner reads no commit. A rank lost without notice took
its shards: the survivors re-form the group and load the newest commit (DCP reshards
it), in their running processes.

Exit codes: 0 when the target step is committed; 2 for a configuration the job can
never run (bad world size, data, a checkpoint of another global batch, model shape
or trainer); anything else non-zero for a failure torchrun should restart (a peer left).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import torch

from trainer.batch import BatchPlan
from trainer.guard import Decision
from trainer.integrations.common import broadcast_object
from trainer.integrations.dcp import DcpCheckpointer, DcpError, ForeignCheckpointError
from trainer.loop import ConfigError, ElasticJob, loaded, run_job
from trainer.run import TrainState, build_state, causal_lm_step, wrap_ddp
from trainer.run import build_parser as _run_parser
from trainer.integrations.fsdp_shards import ShardMover, release
from trainer.integrations.meta import materialize, on_meta, rebuild_optimizer
from trainer.integrations.replicas import add_replica_flags
from trainer.membership import joining
from trainer.runtime import (
    DistContext,
    scratch_dir,
)

__all__ = ["main", "build_parser", "DcpJob", "WRAPS"]

log = logging.getLogger("trainer.examples.fsdp_dcp")

#: ``--wrap`` choices for a world of more than one rank (a world of one is never wrapped).
WRAPS = ("fsdp", "ddp")


def build_parser() -> argparse.ArgumentParser:
    """The reference trainer's flags (the daemon passes the same), plus ``--wrap``."""
    p = _run_parser()
    p.prog = "python -m trainer.examples.fsdp_dcp"
    p.description = ("spotvisor example: byte-level GPT-2 sharded with FSDP2 (or DDP), "
                     "DCP checkpoints committed manifest-last, resumed at any world size.")
    p.add_argument("--wrap", choices=WRAPS, default="fsdp",
                   help="with more than one rank: shard with FSDP2 (default) or replicate with DDP")
    add_replica_flags(p, "FSDP2 shards")
    return p


class DcpJob(ElasticJob):
    """One incarnation of the job on one rank: :class:`trainer.loop.ElasticJob`'s loop with FSDP2/DDP and DCP.

    The loop is :class:`~trainer.loop.ElasticJob`'s; the model and its train step are
    the reference trainer's GPT-2 (:func:`trainer.run.build_state`,
    :func:`trainer.run.causal_lm_step`: override :meth:`build_state` for another);
    this class brings how the model is wrapped and how state is committed and resumed.
    The order differs from ``trainer.run``: :meth:`wrap` comes first, because DCP loads
    into the shards the wrapped model holds.
    """

    wrap_before_resume = True  # DCP loads into FSDP2's sharded parameters

    def __init__(self, args: argparse.Namespace, ctx: DistContext, plan: BatchPlan, data: Any) -> None:
        super().__init__(args, ctx, plan, data)  # store, status, step log, data, build_state(), guard
        self.ckpt: DcpCheckpointer | None = None
        #: FSDP2's shards through a resize or a loss: moved peer to peer, copied to another node
        self.shards = ShardMover(self)

    def build_state(self, device: torch.device | None = None) -> TrainState:
        """The reference GPT-2 + AdamW on ``device`` (default the rank's; ``meta``: shapes
        only, nothing initialised, for a model whose state comes from a peer)."""
        return build_state(self.args, device or self.ctx.device)

    def first_state(self) -> TrainState:
        """A joiner of the sharded job builds its model on the meta device: nothing of it
        is allocated or initialised while it waits to be admitted (at 7 B, 28 GB of
        parameters it would drop unused), and :meth:`reshard` allocates only its shards."""
        return self.build_state(torch.device("meta") if joining() and not self.state_replicated else None)

    @property
    def state_replicated(self) -> bool:  # type: ignore[override]
        """``--wrap ddp`` replicates the state; FSDP2 shards it (even at a world of one,
        where it is unwrapped, the resize path is the sharded one: one path to test)."""
        return self.args.wrap != "fsdp"

    def train_step(self) -> tuple[float, float, list[int]]:
        if self.replicating and self.shards.replica.copy is None and self.state.step > 0:
            self.shards.after_step()  # no copy since a resize or a rebuild: one now, before a loss can come
        out = causal_lm_step(self, self.shards.before_update if self.replicating else None)
        every = getattr(self.args, "replicate_every", 1)
        if self.replicating and (self.state.step % every == 0 or self.shards.replica.copy is None):
            self.shards.after_step()
        return out

    @property
    def replicating(self) -> bool:
        """FSDP2 with ``--replicate-shards``: each step's shards are copied to another node."""
        return bool(getattr(self.args, "replicate_shards", False)) and self.wrapping == "fsdp"

    def restage_after_loss(self, old_rank: int, old_world: int) -> bool:
        """After a loss (:class:`~trainer.recovery.Recovery`): rebuild the lost shards from
        their copies, for :meth:`reshard`; False without ``--replicate-shards`` or when the
        copies cannot (:meth:`ShardMover.restage_after_loss`): reload the newest commit."""
        if not getattr(self.args, "replicate_shards", False):  # the same flags on every rank
            return False
        return self.shards.restage_after_loss(old_rank, old_world)

    @property
    def wrapping(self) -> str:
        """How the model is spread over the world: ``"fsdp"``, ``"ddp"``, or ``"none"`` (one rank)."""
        if not (self.ctx.initialized and self.ctx.world_size > 1):
            return "none"
        return str(self.args.wrap)

    def wrap(self) -> None:
        """FSDP2 (or DDP) over the world; then the checkpointer over the final model and optimizer.
        A meta-device model (:meth:`reshard`) is allocated on the rank's device after sharding."""
        model = self.state.model
        names = {id(p): n for n, p in model.named_parameters()}
        unallocated = on_meta(model)
        if self.wrapping == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # named after the attempt: DTensor's caches key on a mesh's equality (rank map,
            # shape, names), and a resize back to a world size seen before would otherwise
            # get the old mesh back from them, with the old group and this rank's old
            # coordinate (seen: shards at another rank's offsets after a shrink)
            mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,),
                                    mesh_dim_names=(f"dp-{self.attempt}",))
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)  # the rest: embeddings (tied with lm_head), final norm
        if unallocated:
            materialize(model, self.ctx.device)
        if self.wrapping == "fsdp" or unallocated:
            # fully_shard swapped every parameter for a DTensor shard (to_empty for a new
            # tensor): the optimizer must hold those.
            self.state.optimizer = rebuild_optimizer(self.state.optimizer, names, dict(model.named_parameters()))
        if self.wrapping == "fsdp":
            self.ddp = model
        else:  # DDP when world > 1, else the model itself
            self.ddp = wrap_ddp(self.ctx, model, in_sync=self.states_in_sync)
        key = hashlib.sha256(self.args.checkpoint_uri.encode()).hexdigest()[:10]
        self.ckpt = DcpCheckpointer(
            self.ctx,
            self.store,
            self.ddp,
            self.state.optimizer,
            scratch=scratch_dir(f"dcp-{key}"),
            status=self.status,
            guard=self.guard,
            keep=self.args.keep_checkpoints,
        )

    # -- in-process resizes (trainer.resize.Resizer, trainer.recovery.Recovery)

    def peer_state(self) -> dict[str, Any]:
        """DDP: the whole state, as the reference trainer sends it. FSDP2: the step, and what
        a joiner needs to take part in the reshard (the old world size, AdamW's step count
        and hyperparameters): metadata only, the shards go peer to peer in :meth:`reshard`."""
        if self.state_replicated:
            return {"model": self.state.model.state_dict(), "optimizer": self.state.optimizer.state_dict(),
                    "step": self.state.step}
        return {"step": self.state.step, "fsdp": self.shards.metadata()}

    def load_peer_state(self, state: dict[str, Any]) -> None:
        if "model" in state:
            self.state.model.load_state_dict(state["model"])
            self.state.optimizer.load_state_dict(state["optimizer"])
        else:
            self.shards.take_metadata(state["fsdp"])
        self.state.step = int(state["step"])

    def grow_ranks(self, joiners: int) -> list[int]:
        """A grow by ``joiners``, after :meth:`stage_state`: the new rank of each old rank,
        then of each joiner (:class:`~trainer.resize.Resizer`). FSDP2 places the joiners
        where the fewest bytes of the shards move (:meth:`ShardMover.grow_ranks`); DDP,
        which moves the whole state to them anyway, appends them."""
        if self.state_replicated:
            return list(range(self.ctx.world_size + joiners))
        return self.shards.grow_ranks(joiners)

    def stage_state(self, keep: list[int]) -> None:
        """FSDP2, on every rank of the old group, before it changes (``keep``: the old ranks
        that stay, ``keep[j]`` becoming new rank ``j``): a shrink's exchange runs now, the
        leaving ranks sending their rows; a grow's ranks keep their shards for the exchange
        in the new group (:meth:`ShardMover.stage`)."""
        if not self.state_replicated:
            self.shards.stage(keep)

    def reshard(self, *, from_commit: bool) -> int | None:
        """After the group changed. DDP: re-wrap (every rank holds the state). FSDP2: a new
        model on the meta device, sharded over the new world and allocated; AdamW's state
        created; then every shard filled: a shrink's survivors copy the rows they received
        in :meth:`stage_state`, a grow's ranks exchange them now peer to peer (each receives
        only what its new shards lack). Or, ``from_commit``, the newest commit loaded into it.
        The checkpointer is rebuilt over the new model, knowing rank 0's newest commit.

        Raises:
            RuntimeError: this rank holds no staged state (a resize that skipped
                :meth:`stage_state`), or the new layout's tensors are not the old one's.
        """
        last = broadcast_object(self.ctx, self.last_committed)  # a joiner knows of no commit yet
        if self.state_replicated:
            self.wrap()
        else:
            step, staged = self.state.step, self.shards.take_staged()
            if not from_commit and staged is None:
                raise RuntimeError(f"rank {self.ctx.rank} holds no staged state to reshard from")
            old: list[torch.Tensor] = []  # the old model's shards, freed once no longer read
            if from_commit or not on_meta(self.state.model):  # a joiner's first model is on meta already
                old = [] if from_commit else [*self.shards.local_shards()[1], *_local_grads(self.state.model)]
                self.ddp = self.state.model = self.ckpt = None  # type: ignore[assignment]
                if from_commit:  # the old model's memory back before the new one is allocated and loaded
                    gc.collect()
                elif "new" in staged:  # a shrink's rows arrived in stage_state: the old shards are read no more
                    old = release(old, keep=staged["new"])  # whose memory the new shards may use
                self.state = self.build_state(torch.device("meta") if not from_commit else None)
            self.state.step = step
            self.wrap()
            if from_commit:
                self.resume()
                return self.last_committed.step if self.last_committed else None
            self.shards.fill(staged)
            release(old, keep=self.shards.in_place)  # a grow's or a loss's: the exchange read them
            del staged
        self.last_committed = last  # type: ignore[assignment]
        if self.ckpt is not None:
            self.ckpt.dir.last_committed = self.last_committed
        return None

    def resize_report(self) -> dict[str, Any]:
        """The last peer-to-peer exchange's bytes on this rank, and its new shards' (FSDP2)."""
        return {} if self.state_replicated else self.shards.report()

    # -- commits

    def resume(self) -> None:
        if self.ckpt is None:
            raise RuntimeError("call wrap() before resume(): DCP loads into the wrapped model")
        try:
            manifest = self.ckpt.resume(check=self._check_compatible)
        except (ForeignCheckpointError, DcpError) as exc:
            raise ConfigError(str(exc)) from exc
        loaded(self, manifest, self.ckpt.last_load.as_dict() if self.ckpt.last_load else None)

    def commit(self, *, reason: str, decision: Decision) -> None:
        if self.ckpt is None:
            raise RuntimeError("call wrap() before commit()")
        step = self.state.step
        self.ckpt.commit(step, reason=reason, decision=decision, global_batch_size=self.G,
                         data_position=self.data_position(step),
                         extra={"attempt": self.attempt, "wrap": self.wrapping})
        self.last_committed = self.ckpt.last_committed  # the loop records committed_step


def _local_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients the last step left on ``model``'s parameters (each rank's shard of
    them: the next step's ``zero_grad`` would have dropped them)."""
    from torch.distributed.tensor import DTensor

    return [(g.to_local() if isinstance(g, DTensor) else g) for p in model.parameters() if (g := p.grad) is not None]


def main(argv: Sequence[str] | None = None, *, job_cls: type[DcpJob] = DcpJob) -> int:
    """Run the job on this rank; returns the exit code (0 done, 2 bad configuration).

    ``job_cls`` lets a test or a user subclass :class:`DcpJob` (e.g. another model).
    """
    return run_job(argv, job_cls=job_cls, parser=build_parser())


if __name__ == "__main__":
    from trainer.runtime import exit_process

    exit_process(main())
