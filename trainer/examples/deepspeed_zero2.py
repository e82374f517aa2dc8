"""DeepSpeed ZeRO-2 example trainer: ``python -m trainer.examples.deepspeed_zero2`` on every rank.

The reference trainer's job (:mod:`trainer.run`: byte-level GPT-2, constant global
batch, the same step-boundary loop, status lines, step logs and exit codes) with the
model and optimizer inside a DeepSpeed engine (ZeRO stage 2, or 1 or 3 with
``--zero-stage``) and checkpoints committed and resumed by
:class:`~trainer.integrations.deepspeed.DeepSpeedCheckpointer`.

In-process resizes (``--resize in-process``, the default, with the daemon's rendezvous
store): the ranks that stay never restart. Before the group changes every rank keeps
its ZeRO partitions and learns the old layout; after, each builds a new engine at the
new data-parallel size (:mod:`trainer.integrations.deepspeed_resize`) and receives
only what its new partitions lack from the ranks holding it
(:mod:`trainer.integrations.deepspeed_p2p`); a joiner takes a few values from rank 0
and reads no commit. A rank lost without notice took its
partition of the optimizer's state: with ``--replicate-shards`` the survivors rebuild it
from its copy on the next node (:mod:`trainer.integrations.deepspeed_replicas`), else
they rebuild the engine and load the newest commit, in their processes either way. A resume at another world size (that one, or a restart) goes
through DeepSpeed's universal checkpoint, converted once and cached in the store.

The daemon starts it exactly like ``trainer.run`` (``module: trainer.examples.deepspeed_zero2``
in the job config; same command-line flags). On a machine without CUDA it runs on
the CPU accelerator (``DS_ACCELERATOR=cpu``) with gloo and fp32; on CUDA with NCCL
and bf16. The optimizer is torch's AdamW handed to DeepSpeed as a client optimizer,
so nothing is JIT-compiled. Run alone (without torchrun) it is a world of one.

Exit codes: 0 when the target step is committed; 2 for a configuration the job can
never run (bad world size, data, global batch differing from the checkpoint's);
anything else non-zero for a failure torchrun should restart (a peer left).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from trainer.batch import BatchPlan
from trainer.guard import Decision
from trainer.integrations import deepspeed_p2p
from trainer.integrations.common import broadcast_object
from trainer.integrations.deepspeed import DeepSpeedCheckpointer, disable_jit_ops, ds_config
from trainer.integrations.deepspeed_replicas import DeepSpeedReplicas, partitions
from trainer.integrations.deepspeed_resize import no_model_broadcast, release_engine
from trainer.integrations.meta import materialize, on_meta, rebuild_optimizer
from trainer.integrations.p2p_reshard import Traffic
from trainer.integrations.replicas import add_replica_flags
from trainer.loop import ConfigError, ElasticJob, loaded, run_job
from trainer.membership import joining
from trainer.run import build_parser as _run_parser
from trainer.run import TrainState, build_state
from trainer.runtime import (
    DistContext,
    mean_loss,
    scratch_dir,
)
from trainer.sampler import ElasticSampler

__all__ = ["main", "build_parser", "DeepSpeedJob"]

log = logging.getLogger("trainer.examples.deepspeed_zero2")

ZERO_STAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The reference trainer's flags (the daemon passes the same), under this program's name."""
    p = _run_parser()
    p.prog = "python -m trainer.examples.deepspeed_zero2"
    p.description = "spotvisor example: byte-level GPT-2 with DeepSpeed ZeRO-2, committed checkpoints, any world size."
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=ZERO_STAGE,
                   help="ZeRO stage: 1 partitions the optimizer's state, 2 its gradients too, 3 the "
                        "parameters too (default 2)")
    add_replica_flags(p, "ZeRO partitions")
    return p


def _prepare_environment() -> None:
    """Before ``import deepspeed``: CPU accelerator without CUDA, no op builds; a world of one without torchrun."""
    os.environ.setdefault("DS_BUILD_OPS", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


class DeepSpeedJob(ElasticJob):
    """One incarnation of the job on one rank: :class:`trainer.loop.ElasticJob`'s loop on a DeepSpeed engine.

    The loop (guard check, commit on notice/periodic/final, hold, status lines, step
    logs) is :class:`~trainer.loop.ElasticJob`'s; the model is the reference trainer's
    GPT-2 (:func:`trainer.run.build_state`: override :meth:`build_state` for another);
    this class brings the engine, its train step, commit and resume.
    """

    #: The engine is rebuilt at the new data-parallel size in these processes
    #: (:mod:`trainer.integrations.deepspeed_resize`), so a resize moves no commit: ZeRO's
    #: partitions go peer to peer (:mod:`trainer.integrations.deepspeed_p2p`).
    in_process_resize = True
    #: ZeRO partitions the optimizer's state: a peer lost without notice took its part, so
    #: the survivors rebuild it from its copy on the next node (``--replicate-shards``) or
    #: reload the newest commit (in these processes).
    state_replicated = False

    def __init__(self, args: argparse.Namespace, ctx: DistContext, plan: BatchPlan, data: Any) -> None:
        super().__init__(args, ctx, plan, data)  # store, status, step log, data, build_state(), guard
        frozen = [n for n, p in self.state.model.named_parameters() if not p.requires_grad]
        if frozen and self.resizes_in_process:  # fail closed: a resize would leave them uninitialised
            raise ConfigError(f"--resize in-process: {len(frozen)} frozen parameter(s) ({frozen[0]}, ...), and an "
                              "in-process DeepSpeed resize carries only the trained ones (ZeRO's partitions and "
                              "the model made from them); pass --resize restart")
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        disable_jit_ops()  # CPU: no C++ build of DeepSpeed's shared-memory comm op
        # DeepSpeed imports its Muon optimizer at the first engine built in a process (to keep
        # `import deepspeed` fast), and that import loads torch's compiler: 1.3 s. Paid here,
        # before a joiner queues up, it is not paid inside a grow while the survivors wait.
        with contextlib.suppress(ImportError):
            import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
        self.engine: Any = None  # built by resume() (it loads into it), or after a joiner joins
        self.ckpt: DeepSpeedCheckpointer | None = None
        #: during a resize, on the ranks that stay and the joiners: the old layout and the
        #: partitions this rank holds (deepspeed_p2p.stage; after a loss, the replicas')
        self._staged: dict[str, Any] | None = None
        self._traffic: Traffic | None = None  # the last exchange's, this rank
        #: with --replicate-shards: the copy of the previous node's partitions this rank keeps
        self.replicas = DeepSpeedReplicas(self)

    def build_engine(self, *, broadcast: bool = True) -> None:
        """``deepspeed.initialize`` over ``self.state`` at the group's data-parallel size, and
        the checkpointer over the engine. ``broadcast=False``: without DeepSpeed's broadcast
        of rank 0's parameters, for a model whose every value is set after (a resize's:
        :func:`~trainer.integrations.deepspeed_resize.no_model_broadcast`)."""
        import deepspeed

        config = ds_config(
            global_batch_size=self.G,
            micro_batch_size=self.plan.micro_batch_size,
            world_size=self.ctx.world_size,
            zero_stage=getattr(self.args, "zero_stage", ZERO_STAGE),  # a parser of its own may lack it
            bf16=self.ctx.device.type == "cuda",
            gradient_clipping=1.0,
        )
        with contextlib.nullcontext() if broadcast else no_model_broadcast():
            self.engine, _, _, _ = deepspeed.initialize(
                model=self.state.model, optimizer=self.state.optimizer, config=config
            )
        key = hashlib.sha256(self.args.checkpoint_uri.encode()).hexdigest()[:10]
        self.ckpt = DeepSpeedCheckpointer(
            self.engine,
            self.ctx,
            self.store,
            scratch=scratch_dir(f"deepspeed-{key}"),
            status=self.status,
            guard=self.guard,
            global_batch_size=self.G,
            keep=self.args.keep_checkpoints,
        )

    def build_state(self, device: torch.device | None = None) -> TrainState:
        """The reference GPT-2 + AdamW on ``device`` (default the rank's; ``meta``: shapes
        only, nothing initialised, for a model whose state is set next)."""
        return build_state(self.args, device or self.ctx.device)

    def first_state(self) -> TrainState:
        """A joiner builds its model on the meta device: nothing of it is allocated or
        initialised while it waits to be admitted; :meth:`reshard` allocates it."""
        return self.build_state(torch.device("meta") if joining() else None)

    def resume(self) -> None:
        if self.engine is None:
            self.build_engine()
        assert self.ckpt is not None
        manifest = self.ckpt.resume(check=self._check_compatible)
        loaded(self, manifest, self.ckpt.last_resume.as_dict() if self.ckpt.last_resume else None)

    def wrap(self) -> None:
        """Nothing to wrap: the engine is built by :meth:`resume` (it loads into it) or :meth:`reshard`."""

    # -- in-process resizes (trainer.resize.Resizer, trainer.recovery.Recovery)

    def stage_state(self, keep: list[int]) -> None:
        """Every rank of the old group: keep this rank's partitions and learn the old layout;
        a shrink's leavers hand theirs to the survivors
        (:func:`~trainer.integrations.deepspeed_p2p.stage`). The ranks in ``keep`` hold
        them for :meth:`reshard`, the leaving ones drop them."""
        self._staged = deepspeed_p2p.stage(self.engine, self.state.model, keep)

    def restage_after_loss(self, old_rank: int, old_world: int) -> bool:
        """After a loss (:class:`~trainer.recovery.Recovery`, in the survivors' new group):
        the old layout staged from the survivors' partitions and the copies of the lost
        ranks', for :meth:`reshard` to move peer to peer; False without
        ``--replicate-shards`` or when the copies cannot
        (:meth:`DeepSpeedReplicas.restage_after_loss`): reload the newest commit."""
        if not getattr(self.args, "replicate_shards", False):  # the same flags on every rank
            return False
        self._staged = self.replicas.restage_after_loss(old_rank, old_world)
        return self._staged is not None

    def peer_state(self) -> dict[str, Any]:
        """Rank 0 to a joiner: the old layout (metadata: the partitions go peer to peer in
        :meth:`reshard`), and the step."""
        if self._staged is None:
            raise RuntimeError("rank 0 holds no staged state to send (a grow that skipped stage_state)")
        return {"deepspeed": deepspeed_p2p.metadata(self._staged), "step": self.state.step}

    def load_peer_state(self, state: dict[str, Any]) -> None:
        self._staged = tree_map_only(torch.Tensor, lambda t: t.cpu(), state["deepspeed"])
        self.state.step = int(state["step"])

    def reshard(self, *, from_commit: bool) -> int | None:
        """After the group changed: a new model, optimizer and engine at the new data-parallel
        size, set from the staged state; or, ``from_commit`` (a peer lost with its partition
        of the optimizer's state), the newest commit loaded into it. Returns the step loaded
        from a commit, or None.

        Raises:
            RuntimeError: this rank holds no staged state (a resize that skipped :meth:`stage_state`).
        """
        last = broadcast_object(self.ctx, self.last_committed)  # a joiner knows of no commit yet
        staged, self._staged = self._staged, None
        if not from_commit and staged is None:
            raise RuntimeError(f"rank {self.ctx.rank} holds no staged state to rebuild the engine from")
        step = self.state.step
        release_engine(self.engine)
        self.replicas.forget()  # of the old layout
        self.engine = self.ckpt = self.ddp = None  # type: ignore[assignment]
        if from_commit:  # initialised: there may be no commit
            self.state = self.build_state()
        else:  # every value is set from the staged state: allocate, do not initialise
            if not on_meta(self.state.model):  # a joiner's first model is on meta already
                self.state = self.build_state(torch.device("meta"))
            model = self.state.model
            names = {id(p): n for n, p in model.named_parameters()}
            materialize(model, self.ctx.device)
            self.state.optimizer = rebuild_optimizer(self.state.optimizer, names, dict(model.named_parameters()))
        self.ddp = self.state.model
        self.state.step = step
        self.build_engine(broadcast=from_commit)  # else fill() below sets every value on every rank
        assert self.ckpt is not None
        if from_commit:
            self.resume()
            return self.last_committed.step if self.last_committed else None
        self._traffic = deepspeed_p2p.fill(self.engine, self.state.model, staged)
        del staged
        if self.engine.global_steps != step:
            raise RuntimeError(f"the staged state is at optimizer step {self.engine.global_steps}, the job at {step}")
        self.last_committed = last
        self.ckpt.dir.last_committed = last
        return None

    def resize_report(self) -> dict[str, Any]:
        """The last peer-to-peer exchange's bytes on this rank, once, and the
        bytes of its new partitions (fp32 masters and optimizer state)."""
        t, self._traffic = self._traffic, None
        if t is None:
            return {}
        parts = partitions(self.engine, self.state.model, self.ctx.rank)[1][1:]  # without the table
        shard = sum(x.numel() * x.element_size() for x in parts)
        return {"reshard_sent_bytes": t.sent_bytes, "reshard_received_bytes": t.received_bytes,
                "reshard_copied_bytes": t.copied_bytes, "shard_bytes": shard, "exchange_s": round(t.seconds, 4)}

    def commit(self, *, reason: str, decision: Decision) -> None:
        step = self.state.step
        assert self.ckpt is not None
        self.ckpt.commit(step, reason=reason, decision=decision,
                         data_position=self.data_position(step),
                         client_state={"attempt": self.attempt})
        self.last_committed = self.ckpt.last_committed

    def train_step(self) -> tuple[float, float, list[int]]:
        """One optimizer step (``grad_accum_steps`` micro batches). Returns (global loss, local loss, positions)."""
        step = self.state.step
        micro = ElasticSampler.positions_for(step, self.plan, self.ctx.rank)
        engine, replicating = self.engine, bool(getattr(self.args, "replicate_shards", False))
        if replicating and self.replicas.replica.copy is None and step > 0:
            self.replicas.after_step()  # no copy since a resize or a rebuild: one now, before a loss can come
        engine.train()
        total = torch.zeros((), device=self.ctx.device)
        for i, mb in enumerate(micro, 1):
            x, y = self.batch(mb)
            x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
            logits = engine(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps inside
            if i == len(micro) and replicating:  # the step's gradients reduced, the update not made
                self.replicas.before_update()
            engine.step()  # steps the optimizer at the accumulation boundary only
            total += loss.detach()
            # the boundary is DeepSpeed's own count of micro-batches (micro_steps): one that is not
            # the job's last micro-batch of the step mixes two steps' batches in one update
            if engine.global_steps != step + (i == len(micro)):
                raise RuntimeError(f"DeepSpeed's optimizer is at step {engine.global_steps} after micro-batch {i} "
                                   f"of {len(micro)} of step {step + 1}: its gradient accumulation boundary is not "
                                   "the step's")
        glob, local = mean_loss(self.ctx, total, len(micro))
        self.state.step += 1
        every = getattr(self.args, "replicate_every", 1)
        if replicating and (self.state.step % every == 0 or self.replicas.replica.copy is None):
            self.replicas.after_step()
        return glob, local, [p for mb in micro for p in mb]


def main(argv: Sequence[str] | None = None, *, job_cls: type[DeepSpeedJob] = DeepSpeedJob) -> int:
    """Run the job on this rank; returns the exit code (0 done, 2 bad configuration).

    ``job_cls`` lets a test or a user subclass :class:`DeepSpeedJob` (e.g. another model).
    """
    return run_job(argv, job_cls=job_cls, parser=build_parser(), prepare=_prepare_environment)


if __name__ == "__main__":
    from trainer.runtime import exit_process

    exit_process(main())
