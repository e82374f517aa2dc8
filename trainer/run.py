"""Reference trainer: ``python -m trainer.run`` on every rank (torchrun) or alone.

Trains a causal LM (transformers) with DDP: a small GPT-2 on bytes by default, or
``--model`` / ``--tokenizer`` by name or path (``from_pretrained``) on ``--data`` files,
a ``--dataset`` or a ``--streaming`` read of either (:func:`trainer.data.load_data`); with a constant global batch,
notice-driven checkpoint commits and resume at any valid world size. The node
agent starts it under ``torchrun --nnodes=MIN:MAX``; torchrun restarts the workers
on a membership change (a node joining, or lost without notice), and each new
incarnation ("attempt") resumes from the newest committed checkpoint. On an
interruption notice the survivors instead go on in their running workers after the
notice commit (:meth:`trainer.resize.Resizer.shrink`: a new attempt at the same step, no restart).

The loop (guard check, commits, in-process shrink, hold, status lines, step logs) is
:class:`trainer.loop.ElasticJob`'s; this module brings the model: :class:`ReferenceJob`
(GPT-2 under DDP, one shard per commit), the builders the examples reuse
(:func:`build_parser`, :func:`build_state`) and :func:`causal_lm_step`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.checkpoint import MANIFEST_NAME, CheckpointError, Manifest, ShardInfo, load_shard, step_dir, write_shard
from trainer.data import VOCAB_SIZE, add_data_arguments, load_data
from trainer.guard import Decision
from trainer.integrations.common import Committer, CommitResult, newest_intact
from trainer.loop import ConfigError, ElasticJob, run_job
from trainer.runtime import DistContext, add_job_arguments, mean_loss, positive_int
from trainer.sampler import ElasticSampler

__all__ = ["main", "build_parser", "build_state", "causal_lm_step", "wrap_ddp", "ReferenceJob", "TrainState",
           "ConfigError"]

log = logging.getLogger("trainer.run")

# what a worker imports lazily (build_model): a node's zygote imports it before the fork
# (daemon/gpunode/zygote.py), so each worker starts without the import
WORKER_PRELOAD = ("transformers.models.gpt2.modeling_gpt2",)

MODEL_SHARD = "model.pt"


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.run",
        description="spotvisor reference trainer: a causal LM (byte-level GPT-2 by default), elastic DDP, "
                    "committed checkpoints.",
    )
    add_job_arguments(p)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--model", metavar="NAME_OR_PATH",
                   help="a transformers causal LM (AutoModelForCausalLM.from_pretrained); default: a new GPT-2 "
                        "of --n-layer/--n-embd/--n-head")
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=256)
    p.add_argument("--n-head", type=positive_int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--data", action="append", default=[], metavar="PATH",
                   help=".txt or .jsonl ({\"text\": ...} lines) file; repeatable; default: CPython's help texts")
    add_data_arguments(p)
    p.add_argument("--resize", choices=("in-process", "restart"), default="in-process",
                   help="after a notice commit, the survivors re-form the process group in their running "
                        "workers (in-process, needs $SPOTVISOR_RDZV_ENDPOINT) or hold for torchrun's restart")
    return p


# --------------------------------------------------------------------------- state


@dataclass(slots=True)
class TrainState:
    """What a checkpoint holds: the model, its optimizer and the steps completed."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0


def build_model(args: argparse.Namespace, *, meta: bool = False) -> torch.nn.Module:
    """``--model`` (``from_pretrained``; on ``meta``, its config only) or a new GPT-2 of
    ``args.vocab_size`` ids (:func:`trainer.data.load_data` sets it; 256 bytes if unset).

    Raises:
        ConfigError: the model cannot be loaded, holds fewer ids than the tokenizer, or
            fewer positions than ``--seq-len``.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = getattr(args, "vocab_size", None) or VOCAB_SIZE
    if getattr(args, "model", None):
        return _pretrained(args, vocab, meta=meta)
    config = GPT2Config(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        vocab_size=vocab,
        n_positions=args.seq_len,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config)


def _pretrained(args: argparse.Namespace, vocab: int, *, meta: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    try:
        config = AutoConfig.from_pretrained(args.model)
        model = (AutoModelForCausalLM.from_config(config) if meta
                 else AutoModelForCausalLM.from_pretrained(args.model, config=config))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {args.model}: cannot load it ({(str(exc).splitlines() or [''])[0][:200]})") from None
    ids = model.get_input_embeddings().num_embeddings
    if ids < vocab:
        raise ConfigError(f"--model {args.model} embeds {ids} ids, the tokenizer has {vocab}: use the model's "
                          "tokenizer (--tokenizer) or resize its embeddings")
    positions = next((getattr(config, k) for k in ("n_positions", "max_position_embeddings")
                      if isinstance(getattr(config, k, None), int)), None)
    if positions is not None and positions < args.seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than --model {args.model}'s {positions} positions")
    return model


def build_state(args: argparse.Namespace, device: torch.device) -> TrainState:
    """The GPT-2 of ``args`` and its AdamW on ``device``; on ``meta``, shapes only (nothing
    is allocated or initialised: a resize fills it from a peer)."""
    if device.type == "meta":
        with torch.device("meta"):
            model = build_model(args, meta=True)
    else:
        model = build_model(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return TrainState(model=model, optimizer=optimizer, step=0)


def state_to_bytes(state: TrainState) -> bytes:
    buf = io.BytesIO()
    torch.save(
        {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(), "step": state.step},
        buf,
    )
    return buf.getvalue()


def load_state(state: TrainState, data: bytes, device: torch.device) -> None:
    blob = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    state.model.load_state_dict(blob["model"])
    state.optimizer.load_state_dict(blob["optimizer"])
    state.step = int(blob["step"])


# --------------------------------------------------------------------------- the job


class ReferenceJob(ElasticJob):
    """The reference trainer's job: a byte-level GPT-2 (transformers) under DDP, one
    shard (``model.pt``: model, optimizer, step) per commit, written by rank 0."""

    def build_state(self) -> TrainState:
        return build_state(self.args, self.ctx.device)

    def resume(self) -> None:
        """Every rank loads the newest intact commit's shard (a corrupt one is discarded and
        the previous one tried: :func:`~trainer.integrations.common.newest_intact`)."""
        manifest, data = newest_intact(self.ctx, self.store, lambda m: load_shard(self.store, m, MODEL_SHARD))
        if manifest is None:
            log.info("no committed checkpoint in %s: starting at step 0", self.store.uri)
        else:
            self._check_compatible(manifest)
            assert data is not None
            load_state(self.state, data, self.ctx.device)
            if self.state.step != manifest.step:
                raise CheckpointError(f"shard step {self.state.step} != manifest step {manifest.step}")
            self.guard.mark_handled(manifest.extra.get("notice_ids", ()))
            log.info("resumed from step %d (written at world size %d, now %d)",
                     manifest.step, manifest.world_size, self.ctx.world_size)
        self.last_committed = manifest
        self.committed_step = manifest.step if manifest is not None else None
        self.start_data(manifest.data_position if manifest is not None else None)

    def commit(self, *, reason: str, decision: Decision) -> None:
        """Collective: rank 0 writes the shard, then the manifest (:class:`~trainer.integrations.common.Committer`)."""
        self._commit(reason, decision)

    def _commit(self, reason: str, decision: Decision | None) -> CommitResult:
        step = self.state.step
        last = self.last_committed
        if self.committed_step == step and (last is None or last.step != step):
            # committed before this rank knew of it (it joined in-process since, or became
            # rank 0 of a shrink): the manifest is in the store, not in memory
            self.last_committed = Manifest.from_json(self.store.get_bytes(f"{step_dir(step)}/{MANIFEST_NAME}"))
        committer = Committer(self.ctx, self.store, self.status, self.guard, keep=self.args.keep_checkpoints,
                              last_committed=self.last_committed)
        result = committer.commit(step, _ModelShard(self), reason=reason, decision=decision,
                                  global_batch_size=self.G, data_position=self.data_position(step),
                                  extra={"attempt": self.attempt})
        self.last_committed = committer.last_committed
        self.committed_step = step
        return result

    def _write_checkpoint(self, step: int, reason: str) -> tuple[int, bool, float, float]:
        """Commit ``step`` (``state.step``), as :meth:`commit` does, for a benchmark.
        Returns (bytes of the checkpoint, whether it was already committed, save s, upload s)."""
        assert step == self.state.step
        r = self._commit(reason, None)
        return r.bytes, r.reused, r.save_s, r.upload_s

    def wrap(self) -> None:
        self.ddp = wrap_ddp(self.ctx, self.state.model, in_sync=self.states_in_sync)

    def peer_state(self) -> dict:
        return {"model": self.state.model.state_dict(), "optimizer": self.state.optimizer.state_dict(),
                "step": self.state.step}

    def load_peer_state(self, state: dict) -> None:
        self.state.model.load_state_dict(state["model"])
        self.state.optimizer.load_state_dict(state["optimizer"])
        self.state.step = int(state["step"])

    def train_step(self) -> tuple[float, float, list[int]]:
        return causal_lm_step(self)


class _ModelShard:
    """The reference trainer's :class:`~trainer.integrations.common.ShardWriter`: rank 0
    serialises model, optimizer and step (:func:`state_to_bytes`) and uploads them as
    one shard, ``model.pt``, from memory."""

    def __init__(self, job: ReferenceJob) -> None:
        self.job = job
        self.data: bytes | None = None

    def prepare(self, step: int) -> None:
        pass

    def save(self, step: int) -> None:
        if self.job.ctx.is_leader:
            self.data = state_to_bytes(self.job.state)

    def upload(self, step: int) -> list[ShardInfo]:
        if self.data is None:
            return []
        return [write_shard(self.job.store, step, MODEL_SHARD, self.data)]

    def cleanup(self, step: int) -> None:
        self.data = None


def wrap_ddp(ctx: DistContext, model: torch.nn.Module, *, in_sync: bool = False) -> torch.nn.Module:
    """``model`` under DDP when the world has more than one rank, else the model itself.
    ``in_sync``: every rank already holds the same parameters (after an in-process
    resize), so DDP skips its broadcast of them from rank 0 (``init_sync=False``): at
    200 M parameters on CPU that broadcast was most of a shrink's 0.9 s."""
    if ctx.initialized and ctx.world_size > 1:
        kwargs = {"device_ids": [ctx.device.index]} if ctx.device.type == "cuda" else {}
        return DDP(model, init_sync=not in_sync, **kwargs)
    return model


def causal_lm_step(job: ElasticJob,
                   before_update: Callable[[], object] | None = None) -> tuple[float, float, list[int]]:
    """One optimizer step of a transformers causal LM (``job.ddp``: DDP, FSDP2 or the bare
    model): ``grad_accum_steps`` micro batches, gradients synced on the last;
    ``before_update`` runs after the step's last collective, before the optimizer changes
    the state (a snapshot of the step before). Returns (global mean loss, this rank's mean
    loss, the sample positions it trained on)."""
    step = job.state.step
    micro = ElasticSampler.positions_for(step, job.plan, job.ctx.rank)
    model, opt = job.ddp, job.state.optimizer
    model.train()
    opt.zero_grad(set_to_none=True)
    total = torch.zeros((), device=job.ctx.device)
    for i, mb in enumerate(micro):
        x, y = job.batch(mb)
        x, y = x.to(job.ctx.device, non_blocking=True), y.to(job.ctx.device, non_blocking=True)
        last = i == len(micro) - 1
        sync = contextlib.nullcontext() if (last or not isinstance(model, DDP)) else model.no_sync()
        with sync:
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            (loss / len(micro)).backward()
        total += loss.detach()
    # every collective of the step (DDP's gradient all-reduce, the loss's) before the update:
    # a peer lost in any of them leaves every survivor at the same state, the step not taken
    glob, local = mean_loss(job.ctx, total, len(micro))
    torch.nn.utils.clip_grad_norm_(job.state.model.parameters(), 1.0)
    if before_update is not None:
        before_update()
    opt.step()
    job.state.step += 1
    return glob, local, [p for mb in micro for p in mb]


# --------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None, *, job_cls: type[ElasticJob] = ReferenceJob,
         data: Callable[[argparse.Namespace], Any] = load_data) -> int:
    """Run the reference job on this rank; returns the exit code (0 done, 2 bad configuration).
    ``data``: what it trains on, from its flags (:func:`trainer.loop.run_job`'s)."""
    return run_job(argv, job_cls=job_cls, parser=build_parser(), data=data)


if __name__ == "__main__":
    from trainer.runtime import exit_process

    exit_process(main())
