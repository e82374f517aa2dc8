"""DeepSpeed ZeRO-2 example trainer: ``python -m trainer.examples.deepspeed_zero2`` on every rank.

The reference trainer's job (:mod:`trainer.run`: byte-level GPT-2, constant global
batch, the same step-boundary loop, status lines, step logs and exit codes) with the
model and optimizer inside a DeepSpeed engine (ZeRO stage 2) and checkpoints
committed and resumed by :class:`~trainer.integrations.deepspeed.DeepSpeedCheckpointer`.
A resume at another world size goes through DeepSpeed's universal checkpoint,
converted once and cached in the checkpoint store.

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
import hashlib
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from trainer.batch import BatchPlan
from trainer.guard import Decision
from trainer.integrations.deepspeed import DeepSpeedCheckpointer, disable_jit_ops, ds_config
from trainer.loop import ElasticJob, loaded, run_job
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

    in_process_resize = False  # each rank holds a shard: a new world size reloads from the commit

    def __init__(self, args: argparse.Namespace, ctx: DistContext, plan: BatchPlan, data: Any) -> None:
        super().__init__(args, ctx, plan, data)  # store, status, step log, data, build_state(), guard
        import deepspeed
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        disable_jit_ops()  # CPU: no C++ build of DeepSpeed's shared-memory comm op
        config = ds_config(
            global_batch_size=self.G,
            micro_batch_size=plan.micro_batch_size,
            world_size=ctx.world_size,
            zero_stage=ZERO_STAGE,
            bf16=ctx.device.type == "cuda",
            gradient_clipping=1.0,
        )
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.state.model, optimizer=self.state.optimizer, config=config
        )
        key = hashlib.sha256(args.checkpoint_uri.encode()).hexdigest()[:10]
        self.ckpt = DeepSpeedCheckpointer(
            self.engine,
            ctx,
            self.store,
            scratch=scratch_dir(f"deepspeed-{key}"),
            status=self.status,
            guard=self.guard,
            global_batch_size=self.G,
            keep=args.keep_checkpoints,
        )

    def build_state(self) -> TrainState:
        return build_state(self.args, self.ctx.device)  # the reference GPT-2 + AdamW

    def resume(self) -> None:
        manifest = self.ckpt.resume(check=self._check_compatible)
        loaded(self, manifest, self.ckpt.last_resume.as_dict() if self.ckpt.last_resume else None)

    def wrap(self) -> None:
        """Nothing to wrap: the engine is built with the job (resume needs it)."""

    def commit(self, *, reason: str, decision: Decision) -> None:
        step = self.state.step
        self.ckpt.commit(step, reason=reason, decision=decision,
                         data_position=self.data_position(step),
                         client_state={"attempt": self.attempt})
        self.last_committed = self.ckpt.last_committed

    def train_step(self) -> tuple[float, float, list[int]]:
        """One optimizer step (``grad_accum_steps`` micro batches). Returns (global loss, local loss, positions)."""
        step = self.state.step
        micro = ElasticSampler.positions_for(step, self.plan, self.ctx.rank)
        engine = self.engine
        engine.train()
        total = torch.zeros((), device=self.ctx.device)
        for mb in micro:
            x, y = self.batch(mb)
            x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
            logits = engine(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps inside
            engine.step()  # steps the optimizer at the accumulation boundary only
            total += loss.detach()
        if engine.global_steps != step + 1:
            raise RuntimeError(f"DeepSpeed counts {engine.global_steps} optimizer steps after step {step + 1}")
        glob, local = mean_loss(self.ctx, total, len(micro))
        self.state.step += 1
        return glob, local, [p for mb in micro for p in mb]


def main(argv: Sequence[str] | None = None, *, job_cls: type[DeepSpeedJob] = DeepSpeedJob) -> int:
    """Run the job on this rank; returns the exit code (0 done, 2 bad configuration).

    ``job_cls`` lets a test or a user subclass :class:`DeepSpeedJob` (e.g. another model).
    """
    return run_job(argv, job_cls=job_cls, parser=build_parser(), prepare=_prepare_environment)


if __name__ == "__main__":
    from trainer.runtime import exit_process

    exit_process(main())
