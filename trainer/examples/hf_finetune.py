"""Fine-tune a tiny GPT-2 with the Hugging Face ``Trainer`` on spotvisor (``--lora``: PEFT LoRA).

Run by every rank under ``torchrun`` with the flags the daemon passes (see
``daemon/controlnode/supervisor.py`` ``job_spec``)::

    torchrun --nnodes=1:3 ... -m trainer.examples.hf_finetune --target-steps 60 \\
        --global-batch-size 12 --micro-batch-size 2 --checkpoint-uri file:///ckpt \\
        --checkpoint-interval 10 --hold-timeout-s 90 [--lora]

The model is built from a ``GPT2Config`` (nothing downloaded) and trained on the same
byte-level corpus as :mod:`trainer.run`; the data stream, status lines and step logs
follow the same contract, so ``daemon/analysis/summary.py`` counts lost and repeated samples
of either trainer alike. What spotvisor adds to a plain Trainer script is in
:mod:`trainer.integrations.hf`.

Exit codes (as :mod:`trainer.run`): 0 only when the target step is committed; 2 for
a configuration the job can never run (bad world size, data, a checkpoint written with
another global batch or by another trainer, ``--lora`` without peft), one line on
stderr; anything else non-zero for a failure torchrun should restart (a peer left).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import torch

from trainer.batch import BatchError, ElasticBatch
from trainer.checkpoint import open_store
from trainer.data import VOCAB_SIZE, DataError, TokenDataset, encode, load_corpus
from trainer.guard import PreemptionGuard
from trainer.contract import LOG_DIR_ENV, STATUS_FILE_ENV
from trainer.runtime import (
    add_job_arguments,
    normalize_uri,
    positive_int,
    StatusWriter,
    StepLog,
    barrier,
    configure_logging,
    configure_threads,
    env_world,
    new_attempt_id,
    scratch_dir,
    setup_distributed,
    teardown_distributed,
)

__all__ = ["main", "build_parser", "build_model"]

log = logging.getLogger("trainer.examples.hf_finetune")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.examples.hf_finetune",
        description="spotvisor example: HF Trainer fine-tune of a tiny byte-level GPT-2, elastic, committed checkpoints.",
    )
    add_job_arguments(p, global_batch_size=12, micro_batch_size=2, checkpoint_interval=20, keep_checkpoints=2)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--n-layer", type=positive_int, default=2)
    p.add_argument("--n-embd", type=positive_int, default=64)
    p.add_argument("--n-head", type=positive_int, default=2)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant schedule)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT) on the attention projections only")
    p.add_argument("--lora-r", type=positive_int, default=8, help="LoRA rank")
    p.add_argument("--lora-alpha", type=positive_int, default=16, help="LoRA scaling numerator")
    p.add_argument("--data", action="append", default=[], metavar="PATH",
                   help=".txt or .jsonl ({\"text\": ...} lines) file; repeatable; default: CPython's help texts")
    return p


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A GPT-2 from a config (no download), dropout off; a PEFT LoRA model with ``--lora``.

    Raises:
        ImportError: ``--lora`` and peft is not installed.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=VOCAB_SIZE,
                        n_positions=args.seq_len, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        # GPT-2's c_attn is a Conv1D (weight stored transposed): fan_in_fan_out.
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=["c_attn"],
                                                 fan_in_fan_out=True, lora_dropout=0.0, task_type="CAUSAL_LM"))
    return model


def _features(sample: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    # The model shifts labels itself: next-token loss over the window.
    return {"input_ids": sample[0], "labels": sample[0]}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.checkpoint_uri = normalize_uri(args.checkpoint_uri)
    rank, _, world = env_world()
    configure_logging(rank)
    configure_threads()
    try:
        # Refuse before joining the group: every rank sees the same WORLD_SIZE.
        batch = ElasticBatch(args.global_batch_size, args.micro_batch_size)
        plan = batch.plan(world)
        tokens = encode(load_corpus(args.data))
        dataset = TokenDataset(tokens, args.seq_len)
        store = open_store(args.checkpoint_uri)  # endpoints from $SPOTVISOR_S3_ENDPOINT_URL / _OSS_ENDPOINT
        if args.lora:
            import importlib.util

            if importlib.util.find_spec("peft") is None:
                raise DataError("--lora needs peft: pip install 'spotvisor[hf]'")
    except (BatchError, DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from transformers import TrainingArguments, default_data_collator
    from transformers.utils import logging as hf_logging

    from trainer.integrations.common import DirCheckpointer
    from trainer.integrations.hf import (
        GlobalPositionDataset,
        ResumeError,
        SpotvisorCallback,
        SpotvisorTrainer,
        resolve_resume_checkpoint,
        training_args_kwargs,
    )

    hf_logging.set_verbosity_warning()
    hf_logging.disable_progress_bar()
    ctx = setup_distributed(args.pg_timeout_s)
    attempt = new_attempt_id(ctx)
    status = StatusWriter(os.environ.get(STATUS_FILE_ENV), ctx, attempt)
    steplog = StepLog(os.environ.get(LOG_DIR_ENV), ctx, attempt)
    scratch = scratch_dir("hf")
    checkpointer = DirCheckpointer(ctx, store, scratch, status, PreemptionGuard(), keep=args.keep_checkpoints)
    try:
        try:
            _, resume_dir = resolve_resume_checkpoint(checkpointer, global_batch_size=args.global_batch_size)
        except ResumeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        targs = TrainingArguments(
            **training_args_kwargs(batch, ctx.world_size, output_dir=scratch / "trainer-output",
                                   target_steps=args.target_steps, checkpoint_interval=args.checkpoint_interval,
                                   seed=args.seed),
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, logging_strategy="no",
            ddp_timeout=int(args.pg_timeout_s), ddp_find_unused_parameters=False,
            use_cpu=not torch.cuda.is_available(),
        )
        callback = SpotvisorCallback(ctx=ctx, checkpointer=checkpointer, plan=plan, steplog=steplog,
                                     hold_timeout_s=args.hold_timeout_s, seed=args.seed, dataset_len=len(dataset),
                                     resume_dir=resume_dir)
        trainer = SpotvisorTrainer(
            model=build_model(args),
            args=targs,
            train_dataset=GlobalPositionDataset(dataset, args.target_steps * args.global_batch_size, seed=args.seed,
                                                to_features=_features),
            data_collator=default_data_collator,
            spotvisor=callback,
        )
        trainer.train(resume_from_checkpoint=str(resume_dir) if resume_dir else None)
        last = checkpointer.last_committed
        if trainer.state.global_step < args.target_steps or last is None or last.step != args.target_steps:
            raise RuntimeError(f"training stopped at step {trainer.state.global_step} of {args.target_steps}")
    finally:
        steplog.close()
    barrier(ctx)
    teardown_distributed(ctx)
    return 0


if __name__ == "__main__":
    from trainer.runtime import exit_process

    exit_process(main())
