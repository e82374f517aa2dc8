"""What ``SpotvisorCallback()`` (no argument) takes from the job's environment and the Trainer.

The one-line path (``trainer.add_callback(SpotvisorCallback())`` on the user's own
``Trainer``, ``TrainingArguments`` and dataset) has no flag of spotvisor's to read. At
``on_train_begin``, when the Trainer has joined its process group and loaded any
checkpoint it was told to resume from, :func:`attach` builds what the explicit path
gets from its caller:

- the process (:class:`~trainer.runtime.DistContext`) from ``torch.distributed``;
- the store from ``$SPOTVISOR_CHECKPOINT_URI`` (set by the daemon for ``job.command``
  jobs), the status file, step logs, scratch and notice file from
  :mod:`trainer.contract`; the hold timeout from ``$SPOTVISOR_HOLD_TIMEOUT_S``;
- the batch split from ``TrainingArguments``: ``per_device_train_batch_size`` x
  ``gradient_accumulation_steps`` x world size is the global batch;

and :func:`check_resumed` refuses, in one line, to train on from anything but the
newest committed checkpoint (fail closed).

**SIGTERM.** :class:`SignalNotice` turns a SIGTERM into a local interruption notice:
the agent of a ``job.command`` job signals the workers of a node it was warned about
(and writes the notice file first). The handler runs in the main thread between
bytecodes, records the time, and returns: the step in flight finishes, the next step
boundary agrees on it with every rank (:class:`SignalGuard`) and saves. A SIGTERM while
holding after that commit, or outside training, ends the worker at once (exit 143):
that is torchrun restarting the group.

**What the Trainer really fed.** :class:`InputRecorder` is a forward hook on the model:
per micro batch it adds the loss (the step's mean for the status line) and, with
``$SPOTVISOR_LOG_INPUTS=1``, a 64-bit blake2b digest of each ``input_ids`` row to the
step log, so a test can check, from the model's side, that no sample was trained on
twice or skipped across restarts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.batch import BatchPlan
from trainer.checkpoint import Manifest, latest_committed, open_store
from trainer.contract import CHECKPOINT_URI_ENV, HOLD_TIMEOUT_ENV, LOG_INPUTS_ENV, NoticeEntry, NoticeKind
from trainer.guard import PreemptionGuard
from trainer.integrations.common import DirCheckpointer, broadcast_object
from trainer.runtime import DistContext, StatusWriter, normalize_uri, scratch_dir

__all__ = ["HOLD_TIMEOUT_ENV", "LOG_INPUTS_ENV", "SignalNotice", "SignalGuard", "InputRecorder", "Attached",
           "attach", "check_resumed", "fail", "step_positions"]

log = logging.getLogger(__name__)



def fail(message: str) -> None:
    """End this worker with one line on stderr and exit status 2 (no traceback)."""
    print(f"spotvisor: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# --------------------------------------------------------------------------- SIGTERM


class SignalNotice:
    """A SIGTERM handler (installed from the main thread) that records a notice.

    ``exit_now``: while True (holding after a commit, outside ``train``), a SIGTERM ends the
    worker at once with status 143 instead.
    """

    def __init__(self) -> None:
        self.received_at: float | None = None
        self.exit_now = True
        self._previous: Any = None
        self.installed = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self.installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.exit_now:
            raise SystemExit(128 + signal.SIGTERM)
        if self.received_at is None:
            self.received_at = time.time()
            log.warning("SIGTERM: saving at the next step boundary")

    def notice(self) -> NoticeEntry | None:
        """The SIGTERM as an interruption notice (its id names the node and the time), or None."""
        if self.received_at is None:
            return None
        node = os.environ.get("GROUP_RANK", "0")
        return NoticeEntry(id=f"sigterm-{node}-{int(self.received_at * 1000)}", kind=NoticeKind.INTERRUPTION,
                           time=self.received_at)


class SignalGuard(PreemptionGuard):
    """:class:`~trainer.guard.PreemptionGuard` that also counts a SIGTERM as a local
    interruption notice, unless the notice file already holds one (the agent writes the
    file, then signals: the commit then answers the agent's own notice id)."""

    __slots__ = ("signals",)

    def __init__(self, signals: SignalNotice, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.signals = signals

    def pending(self) -> list[NoticeEntry]:
        out = super().pending()
        sig = self.signals.notice()
        if sig is not None and sig.id not in self.handled_ids \
                and not any(n.kind is NoticeKind.INTERRUPTION for n in out):
            out.append(sig)
        return out


# --------------------------------------------------------------------------- what the model was fed


class InputRecorder:
    """A forward hook on the Trainer's model: each training micro batch's loss and, when
    ``digests``, a 16-hex-digit blake2b digest of each ``input_ids`` row.

    The loss is kept as a sum over tokens: the model's ``loss`` is a mean over the
    micro batch's target tokens, or (transformers 5, ``num_items_in_batch`` passed) a sum
    divided by the step's token count, so ``loss x divisor`` is the micro batch's token
    sum either way; the step's loss is then ``sum / tokens`` over every rank.
    """

    def __init__(self, model: torch.nn.Module, *, digests: bool) -> None:
        self.digests = digests
        self.loss_sum: torch.Tensor | None = None
        self.tokens = 0
        self.inputs: list[str] = []
        self._handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            labels = kwargs.get("labels")
            tokens = int((labels[..., 1:] != -100).sum()) if isinstance(labels, torch.Tensor) else 1
            divisor = kwargs.get("num_items_in_batch")
            divisor = float(divisor) if divisor is not None else float(tokens)
            d = loss.detach().float() * divisor
            self.loss_sum = d if self.loss_sum is None else self.loss_sum + d
            self.tokens += tokens
        if self.digests and isinstance(ids, torch.Tensor):
            rows = ids.detach().to("cpu", torch.int64).reshape(ids.shape[0], -1).numpy()
            self.inputs.extend(hashlib.blake2b(r.tobytes(), digest_size=8).hexdigest() for r in rows)

    def take(self) -> tuple[float, int, list[str]]:
        """This rank's token-summed loss and target tokens since the last call, and the digests."""
        loss = float(self.loss_sum.item()) if self.loss_sum is not None else 0.0
        out = (loss, self.tokens, self.inputs)
        self.inputs, self.loss_sum, self.tokens = [], None, 0
        return out

    def remove(self) -> None:
        self._handle.remove()


def step_positions(step: int, plan: BatchPlan, rank: int) -> list[int]:
    """The Trainer's stream positions rank ``rank`` trained on in optimizer step ``step`` (1-based).

    accelerate shards the Trainer's batch sampler round-robin (per-rank micro batch ``k`` is
    global micro batch ``k * W + rank``), so step ``s`` takes positions ``[(s-1) G, s G)``,
    ``G = micro x accum x W``; the Trainer's skip on resume is exactly that prefix.
    """
    b, a, w = plan.micro_batch_size, plan.grad_accum_steps, plan.world_size
    out: list[int] = []
    for i in range(a):
        k = ((step - 1) * a + i) * w + rank
        out.extend(range(k * b, (k + 1) * b))
    return out


# --------------------------------------------------------------------------- set-up at on_train_begin


class Attached:
    """What :func:`attach` built (see the module docstring)."""

    __slots__ = ("ctx", "checkpointer", "plan", "hold_timeout_s", "dataset_len")

    def __init__(self, ctx: DistContext, checkpointer: DirCheckpointer, plan: BatchPlan, hold_timeout_s: float,
                 dataset_len: int) -> None:
        self.ctx = ctx
        self.checkpointer = checkpointer
        self.plan = plan
        self.hold_timeout_s = hold_timeout_s
        self.dataset_len = dataset_len


def _context() -> DistContext:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not (dist.is_available() and dist.is_initialized()):
        return DistContext(0, 0, 1, None, torch.device("cpu"), False)
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    return DistContext(dist.get_rank(), local_rank, dist.get_world_size(), backend, device, True)


def attach(args: Any, train_dataloader: Any, status_factory: Any, signals: SignalNotice) -> Attached | None:
    """Build the callback's parts from the environment and ``args`` (``TrainingArguments``).

    Returns None (the callback stays passive, one warning) when ``$SPOTVISOR_CHECKPOINT_URI``
    is unset: the script runs outside spotvisor. Exits 2 with one line when the hold
    timeout is not a number or the store URI is bad.
    """
    uri = os.environ.get(CHECKPOINT_URI_ENV, "").strip()
    if not uri:
        log.warning("SpotvisorCallback: $%s is not set (not a spotvisor job.command run): not committing",
                    CHECKPOINT_URI_ENV)
        return None
    try:
        hold = float(os.environ.get(HOLD_TIMEOUT_ENV, "90"))
        if hold < 0:
            raise ValueError("negative")
        store = open_store(normalize_uri(uri))
    except ValueError as exc:
        fail(f"bad job setting ({HOLD_TIMEOUT_ENV} / {CHECKPOINT_URI_ENV}): {exc}")
    ctx = _context()
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and int(args.world_size) != ctx.world_size:
        fail(f"torchrun started {launched} ranks but the Trainer trains as {args.world_size} process(es), each on "
             "all the data: on CPU pass use_cpu=True to TrainingArguments")
    plan = BatchPlan(ctx.world_size, int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps))
    guard = SignalGuard(signals)
    status: StatusWriter = status_factory(ctx)
    checkpointer = DirCheckpointer(ctx, store, scratch_dir("hf"), status, guard)
    try:
        dataset_len = len(train_dataloader.dataset)
    except (AttributeError, TypeError):
        dataset_len = 0
    return Attached(ctx, checkpointer, plan, hold, dataset_len)


def check_resumed(at: Attached, step: int, output_dir: str) -> Manifest | None:
    """Fail closed unless the Trainer resumed from the newest committed checkpoint.
    Collective (rank 0 reads the store and broadcasts). Returns that manifest (None when
    nothing is committed and the Trainer starts at step 0).

    Exits 2 with one line naming the fix when: a committed checkpoint exists but the
    Trainer did not resume from it (``trainer.train()`` without ``resume_from_checkpoint``,
    or no ``job.output_dir``); it resumed from a checkpoint that was never committed; or
    the global batch at this world size differs from the checkpoint's (the Trainer's
    data skip would not land on the exact position).
    """
    ckpt = at.checkpointer
    manifest = latest_committed(ckpt.store) if at.ctx.is_leader else None
    manifest = broadcast_object(at.ctx, manifest)
    uri = ckpt.store.uri
    if manifest is None:
        if step > 0:
            fail(f"the Trainer resumed at step {step} from a checkpoint never committed to {uri}: resume only "
                 f"through job.output_dir ({output_dir}), which holds the newest committed one")
        return None
    if step != manifest.step:
        if step == 0:
            fail(f"step {manifest.step} is committed in {uri} but the Trainer started at step 0: pass "
                 f"resume_from_checkpoint=True (or get_last_checkpoint(args.output_dir)) to trainer.train(), "
                 f"and set job.output_dir: {output_dir}")
        fail(f"the Trainer resumed at step {step}, but the newest committed checkpoint is step {manifest.step} "
             f"in {uri}: set job.output_dir: {output_dir} so spotvisor restores it there")
    if manifest.extra.get("format") != "hf-trainer":
        fail(f"checkpoint step {manifest.step} in {uri} was not written by the HF callback: use another "
             "checkpoint_uri")
    if manifest.global_batch_size != at.plan.global_batch_size:
        fail(f"checkpoint step {manifest.step} was trained with a global batch of {manifest.global_batch_size} "
             f"(world size {manifest.world_size}); here it is {at.plan.micro_batch_size} x "
             f"{at.plan.grad_accum_steps} accum x {at.ctx.world_size} ranks = {at.plan.global_batch_size}, so the "
             "Trainer's data skip would not be exact: resume at the same world size (pool.min_nodes = "
             "pool.max_nodes), or set gradient_accumulation_steps for this one")
    ckpt.last_committed = manifest
    ckpt.guard.mark_handled(manifest.extra.get("notice_ids", ()))
    return manifest


def resumed_folder(output_dir: str, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"
