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

Exit codes: 0 when the target step is committed; 2 for a configuration the job can
never run (bad world size, data, a checkpoint of another global batch, model shape
or trainer); anything else non-zero for a failure torchrun should restart (a peer left).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
from collections.abc import Sequence

import torch

from trainer.batch import BatchPlan
from trainer.guard import Decision
from trainer.integrations.dcp import DcpCheckpointer, DcpError, ForeignCheckpointError
from trainer.loop import ConfigError, ElasticJob, run_job
from trainer.run import TrainState, build_state, causal_lm_step, wrap_ddp
from trainer.run import build_parser as _run_parser
from trainer.runtime import (
    DistContext,
    data_position,
    scratch_dir,
)
from trainer.sampler import ElasticSampler

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
    in_process_resize = False  # FSDP2 shards: a new world size reloads from the commit

    def __init__(self, args: argparse.Namespace, ctx: DistContext, plan: BatchPlan, tokens: torch.Tensor) -> None:
        super().__init__(args, ctx, plan, tokens)  # store, status, step log, data, build_state(), guard
        self.ckpt: DcpCheckpointer | None = None

    def build_state(self) -> TrainState:
        return build_state(self.args, self.ctx.device)  # the reference GPT-2 + AdamW

    def train_step(self) -> tuple[float, float, list[int]]:
        return causal_lm_step(self)

    @property
    def wrapping(self) -> str:
        """How the model is spread over the world: ``"fsdp"``, ``"ddp"``, or ``"none"`` (one rank)."""
        if not (self.ctx.initialized and self.ctx.world_size > 1):
            return "none"
        return str(self.args.wrap)

    def wrap(self) -> None:
        """FSDP2 (or DDP) over the world; then the checkpointer over the final model and optimizer."""
        model = self.state.model
        if self.wrapping == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            names = {id(p): n for n, p in model.named_parameters()}
            mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)  # the rest: embeddings (tied with lm_head), final norm
            # fully_shard swapped every parameter for a DTensor shard: the optimizer must hold those.
            self.state.optimizer = _rebuild_optimizer(self.state.optimizer, names, dict(model.named_parameters()))
            self.ddp = model
        else:
            self.ddp = wrap_ddp(self.ctx, model)  # DDP when world > 1, else the model itself
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

    def resume(self) -> None:
        if self.ckpt is None:
            raise RuntimeError("call wrap() before resume(): DCP loads into the wrapped model")
        try:
            manifest = self.ckpt.resume(check=self._check_compatible)
        except (ForeignCheckpointError, DcpError) as exc:
            raise ConfigError(str(exc)) from exc
        if manifest is None:
            if self.ctx.is_leader:
                log.info("no committed checkpoint in %s: starting at step 0", self.store.uri)
        else:
            self.state.step = manifest.step
            info = self.ckpt.last_load.as_dict() if self.ckpt.last_load else {}
            info.pop("step", None)
            self.status.emit("checkpoint_loaded", manifest.step, **info)
        self.last_committed = manifest
        self.sampler = ElasticSampler(len(self.dataset), self.seed)

    def commit(self, *, reason: str, decision: Decision) -> None:
        if self.ckpt is None:
            raise RuntimeError("call wrap() before commit()")
        step = self.state.step
        self.ckpt.commit(step, reason=reason, decision=decision, global_batch_size=self.G,
                         data_position=data_position(step, self.G, self.seed, len(self.dataset)),
                         extra={"attempt": self.attempt, "wrap": self.wrapping})
        self.last_committed = self.ckpt.last_committed


def main(argv: Sequence[str] | None = None, *, job_cls: type[DcpJob] = DcpJob) -> int:
    """Run the job on this rank; returns the exit code (0 done, 2 bad configuration).

    ``job_cls`` lets a test or a user subclass :class:`DcpJob` (e.g. another model).
    """
    return run_job(argv, job_cls=job_cls, parser=build_parser())


if __name__ == "__main__":
    sys.exit(main())
