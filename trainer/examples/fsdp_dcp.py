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
store): the ranks that stay never restart. Before the group changes (a notice's
boundary, with the leaving ranks still there; a grow's boundary) the shards are
gathered into one full state on the new rank 0, in host memory
(``get_state_dict(full_state_dict, cpu_offload)``). After, every rank builds the model
on the meta device (no initialisation), shards it over the new world, and takes its
shards from rank 0 (``set_state_dict(broadcast_from_rank0)``). A joiner reads no
commit. A rank lost without notice took its shards: the survivors re-form the group
and load the newest commit (DCP reshards it), in their running processes.

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
import torch.distributed as dist
from torch.utils._pytree import tree_map_only
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.batch import BatchPlan
from trainer.guard import Decision
from trainer.integrations.common import broadcast_object
from trainer.integrations.dcp import DcpCheckpointer, DcpError, ForeignCheckpointError
from trainer.loop import ConfigError, ElasticJob, loaded, run_job
from trainer.run import TrainState, build_state, causal_lm_step, wrap_ddp
from trainer.run import build_parser as _run_parser
from trainer.runtime import (
    DistContext,
    broadcast_state,
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
    return p


def _rebuild_optimizer(opt: torch.optim.Optimizer, names: dict[int, str],
                       params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The same optimizer (class, groups, every group's hyperparameters) over new parameter objects.

    ``names`` maps ``id(old parameter)`` to its name; ``params`` maps the name to the new one.

    Raises:
        ValueError: the optimizer already has state (it must be rebuilt before its first step).
    """
    if opt.state:
        raise ValueError("the optimizer has state already: shard the model before the first step")
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [params[names[id(p)]] for p in g["params"]]}
        for g in opt.param_groups
    ]
    return type(opt)(groups)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate a meta-device ``model`` (built without initialisation) on ``device``,
    uninitialised, in place, keeping tied parameters tied (``Module.to_empty`` gives each
    module its own copy of a parameter two modules share, e.g. GPT-2's ``lm_head`` and
    ``wte``; FSDP2's sharded parameters stay shared)."""
    first: dict[int, str] = {}
    aliases: list[tuple[str, str]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    model.to_empty(device=device)
    for alias, name in aliases:
        owner, _, attr = alias.rpartition(".")
        shared = model.get_parameter(name)
        if model.get_parameter(alias) is not shared:
            setattr(model.get_submodule(owner), attr, shared)


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
        #: new rank 0 during a resize: the full state, host memory ({"model", "optim"})
        self._staged: dict[str, Any] | None = None

    def build_state(self, device: torch.device | None = None) -> TrainState:
        """The reference GPT-2 + AdamW on ``device`` (default the rank's; ``meta``: shapes
        only, nothing initialised, for a model whose state comes from a peer)."""
        return build_state(self.args, device or self.ctx.device)

    @property
    def state_replicated(self) -> bool:  # type: ignore[override]
        """``--wrap ddp`` replicates the state; FSDP2 shards it (even at a world of one,
        where it is unwrapped, the resize path is the sharded one: one path to test)."""
        return self.args.wrap != "fsdp"

    def train_step(self) -> tuple[float, float, list[int]]:
        return causal_lm_step(self)

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
        on_meta = any(p.is_meta for p in model.parameters())
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
        if on_meta:
            materialize(model, self.ctx.device)
        if self.wrapping == "fsdp" or on_meta:
            # fully_shard swapped every parameter for a DTensor shard (to_empty for a new
            # tensor): the optimizer must hold those.
            self.state.optimizer = _rebuild_optimizer(self.state.optimizer, names, dict(model.named_parameters()))
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
        """DDP: the whole state, as the reference trainer sends it. FSDP2: the step only;
        the model and optimizer go in :meth:`reshard`, shard by shard."""
        if self.state_replicated:
            return {"model": self.state.model.state_dict(), "optimizer": self.state.optimizer.state_dict(),
                    "step": self.state.step}
        return {"step": self.state.step}

    def load_peer_state(self, state: dict[str, Any]) -> None:
        if "model" in state:
            self.state.model.load_state_dict(state["model"])
            self.state.optimizer.load_state_dict(state["optimizer"])
        self.state.step = int(state["step"])

    def stage_state(self, keep: list[int]) -> None:
        """FSDP2, on every rank of the old group: gather the full model and optimizer state
        into host memory on old rank 0 (``cpu_offload``: no rank holds it on the GPU), and
        when old rank 0 leaves, send it to ``keep[0]``, the new rank 0. Holds about the
        model's fp32 bytes x 3 (AdamW) in that one process's host memory until
        :meth:`reshard`."""
        if self.state_replicated:
            return
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.ddp, options=opts)  # collective; {} on ranks other than 0
        optim_sd = get_optimizer_state_dict(self.ddp, self.state.optimizer, options=opts)
        staged = {"model": model_sd, "optim": optim_sd} if self.ctx.rank == 0 else None
        if keep[0] != 0 and self.ctx.world_size > 1:  # old rank 0 leaves: the new one takes the state
            group = dist.new_group([0, keep[0]])
            if self.ctx.rank in (0, keep[0]):
                staged = broadcast_state(staged, src=0, device=self.ctx.device, group=group)
                if self.ctx.rank == keep[0]:  # NCCL received it on the GPU
                    staged = tree_map_only(torch.Tensor, lambda t: t.cpu(), staged)
            dist.destroy_process_group(group)
        self._staged = staged if self.ctx.rank == keep[0] else None

    def reshard(self, *, from_commit: bool) -> int | None:
        """After the group changed. DDP: re-wrap (every rank holds the state). FSDP2: a new
        model on the meta device, sharded over the new world, allocated, and filled from
        new rank 0's staged state (``broadcast_from_rank0``: each rank keeps its shards
        only); or, ``from_commit``, the newest commit loaded into it. The checkpointer is
        rebuilt over the new model, knowing rank 0's newest commit.

        Raises:
            RuntimeError: new rank 0 has no staged state (a resize that skipped :meth:`stage_state`).
        """
        last = broadcast_object(self.ctx, self.last_committed)  # a joiner knows of no commit yet
        if self.state_replicated:
            self.wrap()
        else:
            step, staged = self.state.step, self._staged
            self._staged = None
            if not from_commit and self.ctx.is_leader and staged is None:
                raise RuntimeError("rank 0 holds no staged state to reshard from")
            # free the old shards first (the checkpointer holds the model and optimizer too)
            self.ddp = self.state.model = self.ckpt = None  # type: ignore[assignment]
            self.state = self.build_state(torch.device("meta") if not from_commit else None)
            gc.collect()
            self.state.step = step
            self.wrap()
            if from_commit:
                self.resume()
                return self.last_committed.step if self.last_committed else None
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.ddp, staged["model"] if staged else {}, options=opts)
            set_optimizer_state_dict(self.ddp, self.state.optimizer, staged["optim"] if staged else {}, options=opts)
            del staged
        self.last_committed = last  # type: ignore[assignment]
        if self.ckpt is not None:
            self.ckpt.dir.last_committed = self.last_committed
        return None

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
        self.last_committed = self.ckpt.last_committed
        self.committed_step = step


def main(argv: Sequence[str] | None = None, *, job_cls: type[DcpJob] = DcpJob) -> int:
    """Run the job on this rank; returns the exit code (0 done, 2 bad configuration).

    ``job_cls`` lets a test or a user subclass :class:`DcpJob` (e.g. another model).
    """
    return run_job(argv, job_cls=job_cls, parser=build_parser())


if __name__ == "__main__":
    from trainer.runtime import exit_process

    exit_process(main())
