"""What every trainer on spotvisor shares, whatever its framework: who this process is,
the status file and step logs it writes (:class:`StatusWriter`, :class:`StepLog`), and the
data position. The environment and file formats it shares with the agent are
:mod:`trainer.contract`'s; the step logs are what ``daemon/analysis/summary.py``
counts lost and repeated samples from; :func:`shrink_process_group` forms the
survivors' group after a preemption at ``$SPOTVISOR_RDZV_ENDPOINT`` without
restarting them.

Used by the reference trainer (:mod:`trainer.run`) and the integrations
(:mod:`trainer.integrations`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainer import group_sockets
from trainer.contract import RDZV_ENDPOINT_ENV, SCRATCH_DIR_ENV
from trainer.exchange import all_gather_json, broadcast_json
from trainer.store_retry import current_endpoint, parse_endpoint, wait_for_store

__all__ = [
    "exit_process",
    "add_job_arguments",
    "normalize_uri",
    "positive_int",
    "non_negative_int",
    "DistContext",
    "env_world",
    "setup_distributed",
    "joiner_context",
    "teardown_distributed",
    "rendezvous_endpoint",
    "shrink_process_group",
    "regroup",
    "store_id",
    "REGROUP_TRIES",
    "broadcast_state",
    "new_attempt_id",
    "barrier",
    "mean_loss",
    "data_position",
    "StatusWriter",
    "StepLog",
    "scratch_dir",
    "configure_threads",
    "configure_logging",
]

log = logging.getLogger("trainer.runtime")

#: How many times :func:`regroup` meets the others when the rendezvous store breaks off.
REGROUP_TRIES = 3
#: The key of the store's id (:func:`store_id`), outside every job's prefix.
STORE_ID_KEY = "spotvisor/store-id"


# --------------------------------------------------------------------------- the daemon's flags


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def normalize_uri(uri: str) -> str:
    """A checkpoint URI as given, or a local path turned into ``file:///abs/path``."""
    if "://" in uri:
        return uri
    return Path(uri).resolve().as_uri()


def add_job_arguments(p: argparse.ArgumentParser, *, global_batch_size: int = 32, micro_batch_size: int = 8,
                      checkpoint_interval: int = 50, keep_checkpoints: int = 3) -> argparse.ArgumentParser:
    """The flags ``daemon/controlnode/supervisor.py`` passes to every job module (its ``job_spec``).

    A trainer of one's own accepts these, then adds its model's flags after them
    (the config's ``job.args``). The defaults only matter when run by hand.
    """
    p.add_argument("--target-steps", type=positive_int, required=True, help="optimizer steps to train in total")
    p.add_argument("--global-batch-size", type=positive_int, default=global_batch_size,
                   help="samples per optimizer step (constant across resizes)")
    p.add_argument("--micro-batch-size", type=positive_int, default=micro_batch_size,
                   help="samples per forward/backward on one rank")
    p.add_argument("--checkpoint-uri", required=True,
                   help="file:///abs/path, s3://bucket/prefix, oss://bucket/prefix, or a local path")
    p.add_argument("--checkpoint-interval", type=non_negative_int, default=checkpoint_interval,
                   help="periodic commit every N steps (0: none)")
    p.add_argument("--hold-timeout-s", type=float, default=90.0,
                   help="how long to hold after a notice commit before training on (seconds)")
    p.add_argument("--pg-timeout-s", type=float, default=120.0,
                   help="process-group set-up and collective timeout (seconds)")
    p.add_argument("--join-timeout-s", type=float, default=300.0,
                   help="how long a node started to join the running group waits to be admitted (seconds)")
    p.add_argument("--loss-settle-s", type=float, default=1.0,
                   help="after a peer is lost without notice, how long a rank may take to answer the "
                        "survivors' round before it is presumed lost (seconds; the round then waits for "
                        "every rank that answered)")
    p.add_argument("--store-wait-s", type=float, default=300.0,
                   help="how long a worker re-forming its group in-process (a survivors' round after a peer "
                        "is lost without notice, a shrink, a grow) waits for a rendezvous store that is out of "
                        "reach (restarting, or moving to a new HA leader) before it exits for a restart from the "
                        "newest commit (seconds; the group is formed in the store)")
    p.add_argument("--keep-checkpoints", type=positive_int, default=keep_checkpoints,
                   help="committed checkpoints kept by gc")
    return p


# --------------------------------------------------------------------------- process group


@dataclass(frozen=True, slots=True)
class DistContext:
    """Who this process is. ``initialized``: a process group exists (torchrun)."""

    rank: int
    local_rank: int
    world_size: int
    backend: str | None
    device: torch.device
    initialized: bool

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def is_local_leader(self) -> bool:
        return self.local_rank == 0


def env_world() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from torchrun's environment, or ``(0, 0, 1)``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["WORLD_SIZE"])
    return 0, 0, 1


def setup_distributed(timeout_s: float = 120.0) -> DistContext:
    """Join torchrun's process group (nccl on CUDA, else gloo); plain process without torchrun.

    ``timeout_s`` bounds the group's set-up and every collective: a rendezvous round
    that counted a node which then never started its workers fails here (and
    torchrun re-rendezvouses) instead of waiting torch's default 30 minutes.
    """
    rank, local_rank, world = env_world()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" not in os.environ:
        return DistContext(0, 0, 1, None, device, False)
    backend = "nccl" if cuda else "gloo"
    store = group_store(rank, world, timedelta(seconds=timeout_s))
    with group_sockets.making_group():  # its sockets, and every later group's (the loss watch shuts them)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                **({"store": store, "rank": rank, "world_size": world} if store is not None else {}),
                                **({"device_id": device} if cuda else {}))
    return DistContext(dist.get_rank(), local_rank, dist.get_world_size(), backend, device, True)


def group_store(rank: int, world: int, timeout: timedelta) -> dist.TCPStore | None:
    """The worker group's store (what ``env://`` would make), its server on rank 0 bound
    to exactly ``MASTER_ADDR`` (:func:`trainer.listen.listen_socket`) instead of every
    interface: it has no authentication. ``None`` (torch's own ``env://`` path) when
    ``MASTER_ADDR`` is not an IP literal (a name may resolve here to an address the other
    nodes cannot reach, e.g. 127.0.1.1), or torchrun's agent hosts the store (always
    under ``--rdzv-backend=spotvisor``: rank 0's agent, on its node's address on the job's
    network, :mod:`trainer.rendezvous`). Raises ``OSError`` when rank 0 cannot bind it
    (the port taken meanwhile), as ``env://`` would."""
    import ipaddress

    from trainer.listen import listen_socket

    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not port.isdigit() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return None
    if rank != 0:
        return dist.TCPStore(addr, int(port), world, is_master=False, timeout=timeout)
    sock = listen_socket(addr, int(port))
    # c10d owns the descriptor from here on (it closes it with the store)
    return dist.TCPStore(addr, sock.getsockname()[1], world, is_master=True, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=sock.detach())


def joiner_context() -> DistContext:
    """This process before it joins a running group (``SPOTVISOR_JOIN=1``): its local rank
    and device, no group yet (:mod:`trainer.membership`). Its launcher's ``RANK`` and
    ``WORLD_SIZE`` are its own node's and are not used."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return DistContext(0, local_rank, 1, "nccl" if cuda else "gloo", device, False)


def exit_process(code: int) -> NoReturn:
    """End a trainer process with ``code`` once its work is done, without the interpreter's
    finalization: flush the standard streams and the logging handlers, then ``os._exit``.

    Why: after ``destroy_process_group`` a native thread of libtorch (gloo's workers, the
    store client's) can still reach for the GIL while the interpreter finalizes; CPython
    then ends that thread with ``pthread_exit``, whose forced unwind through a ``noexcept``
    C++ frame is ``std::terminate`` ("terminate called without an active exception",
    SIGABRT). Seen on rank 1 after ``completed: step 6 committed`` in about 1 of 30 two-rank
    runs on a loaded 2-core machine (tests/test_trainer_run.py); torchrun then reports the
    finished job as failed (exit -6) and restarts it. pytorch#179291 (an atexit
    ``destroy_process_group``) was abandoned as not enough; nothing left to finalize here
    needs the interpreter: every commit is fsynced, the step log closed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def teardown_distributed(ctx: DistContext) -> None:
    if ctx.initialized and dist.is_initialized():
        dist.destroy_process_group()


def rendezvous_endpoint() -> tuple[str, int] | None:
    """``(host, port)`` of the rendezvous store now: the agent's endpoint file once it
    holds one (:func:`trainer.store_retry.current_endpoint`: the store moved with an HA
    takeover), else ``$SPOTVISOR_RDZV_ENDPOINT``; None when neither gives one (no store:
    no in-process resize)."""
    started = parse_endpoint(os.environ.get(RDZV_ENDPOINT_ENV, ""))
    return current_endpoint(started) if started is not None else None


def shrink_process_group(ctx: DistContext, survivors: list[int], key: str, endpoint: tuple[str, int],
                         timeout_s: float, *, store_wait_s: float = 300.0) -> DistContext:
    """Re-form the default process group over ``survivors`` (old ranks, ascending), in place.

    For a *planned* leave (an interruption notice): the leaving ranks are still alive
    and have just committed with everyone, so the survivors keep their processes, their
    model and optimizer state and their imports, and only the group changes. Called on
    every survivor (never on a leaving rank, which waits for its node to be stopped):
    the old group is destroyed here (gloo and NCCL alike; the leaving ranks' end of it
    simply goes quiet) and a new one is initialized through ``PrefixStore(key, TCPStore
    client of endpoint)``. The endpoint is the rendezvous store on the control node, not
    the old rank 0's store: rank 0 may be among the leavers. ``key`` must be the same on
    every survivor and new for each shrink (the caller derives it from the attempt id and
    the step). New ranks keep the old order: ``survivors.index(old_rank)``.

    Returns the new context (same local rank, backend and device; ``world_size ==
    len(survivors)``), and rewrites torchrun's variables to match
    (:func:`publish_world_env`). About 10 ms for gloo on one machine: no process starts, nothing
    is loaded. A store lost meanwhile is waited for (``store_wait_s``, :func:`regroup`).

    Raises:
        ValueError: this rank is not among ``survivors``, or ``ctx`` has no process group.
        RuntimeError / DistStoreError: (torch) a survivor did not join within ``timeout_s``;
            let it propagate: the worker exits non-zero and torchrun restarts the group,
            which resumes from the commit just made.
    """
    if not ctx.initialized or ctx.rank not in survivors:
        raise ValueError(f"rank {ctx.rank} cannot shrink into {survivors}")
    return regroup(ctx, survivors.index(ctx.rank), len(survivors), key, endpoint, timeout_s,
                   store_wait_s=store_wait_s)


def regroup(ctx: DistContext, rank: int, world_size: int, key: str, endpoint: tuple[str, int],
            timeout_s: float, *, node_key: str | None = None, store_wait_s: float = 300.0) -> DistContext:
    """Destroy this process's default group (if any) and join a new one of ``world_size``
    ranks as ``rank``, through ``PrefixStore(key/<store id>, TCPStore client of
    endpoint)``: the shrink's survivors, and an in-process grow's survivors and joiners
    (:mod:`trainer.membership`). Rewrites torchrun's variables (:func:`publish_world_env`;
    ``node_key`` names this process's node there, default its ``GROUP_RANK``).

    The rendezvous store can be lost while the members meet in it (SIGKILLed with its
    control node, restarted empty on the same port, or moved to a new HA leader): a
    member whose connection to it breaks (``DistNetworkError``) waits for it to answer
    again (:func:`trainer.store_retry.wait_for_store`, at most ``store_wait_s`` seconds,
    where it is now) and meets the others again there. The ``<store id>`` in the prefix
    is the store's own (:func:`store_id`: the first client of a store sets it), so every
    member that reaches the same store meets under the same keys, whether or not it saw
    the loss: one that connected only to the new store is not left alone under the old
    prefix. At most :data:`REGROUP_TRIES` tries.

    Raises:
        RuntimeError / DistStoreError: (torch) a member did not join within ``timeout_s``.
        DistNetworkError: (torch) the store broke off :data:`REGROUP_TRIES` times, or did
            not answer again within ``store_wait_s``.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    backend = ctx.backend or ("nccl" if ctx.device.type == "cuda" else "gloo")
    timeout = timedelta(seconds=timeout_s)
    for tries in range(1, REGROUP_TRIES + 1):
        try:
            client = dist.TCPStore(endpoint[0], endpoint[1], is_master=False, timeout=timeout)
            prefix = f"{key}/{store_id(client)}"
            with group_sockets.making_group():
                dist.init_process_group(backend=backend, store=dist.PrefixStore(prefix, client), rank=rank,
                                        world_size=world_size, timeout=timeout,
                                        **({"device_id": ctx.device} if ctx.device.type == "cuda" else {}))
            break
        except dist.DistNetworkError as exc:
            _forget_failed_group()
            if tries == REGROUP_TRIES:
                raise
            log.warning("the rendezvous store broke off while the group re-formed (%s): waiting for it to meet "
                        "again", (str(exc).splitlines() or ["no answer"])[0][:200])
            found = wait_for_store(endpoint, store_wait_s, what="the group's re-forming")
            if found is None:
                raise
            endpoint = found
    new = DistContext(rank, ctx.local_rank, world_size, backend, ctx.device, True)
    publish_world_env(new, node_key=node_key)
    return new


def _forget_failed_group() -> None:
    """After an ``init_process_group`` that failed: what ``destroy_process_group()`` does
    for the default group, so the next try names its group as the other members do.
    c10d names a default group by a process-wide count (its store keys are
    ``<name>/...``) that a failed init has moved on and only a destroy sets back to 0
    (torch 2.13, ``distributed_c10d._process_group_name``): a member that retried met
    under ``1/`` while one that tried once waited under ``0/``."""
    if dist.is_initialized():
        dist.destroy_process_group()
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def store_id(client: dist.Store) -> str:
    """The rendezvous store's id: set by the first client that asks a store started
    empty (a random hex string, ``compare_set`` on ``spotvisor/store-id``: atomic on the
    server), read by every later one. Tells one incarnation of the store from the next."""
    return client.compare_set(STORE_ID_KEY, "", uuid.uuid4().hex).decode()


def broadcast_state(state: Any, *, src: int, device: torch.device, group: Any = None) -> Any:
    """``state`` of rank ``src`` (nested dicts, lists and tuples of tensors and plain
    values: a ``state_dict``) on every rank of ``group`` (default: the default group).
    Collective. The structure, each tensor's shape and dtype in its place, goes as JSON
    (:func:`trainer.exchange.encode_tree`: never pickled, so a peer's bytes are parsed,
    not run; at most :data:`STATE_STRUCTURE_BYTES`); then each tensor with ``broadcast``
    on ``device`` (NCCL needs the GPU), into a tensor the receiver allocates: each side
    holds the state once. Returns ``state`` on ``src`` and the received copy (tensors on
    ``device``) elsewhere; ``state`` is ignored there.

    Raises:
        trainer.exchange.TreeError: (every rank) ``state`` holds a value that cannot be
            sent (a namedtuple, a set, an object), named with where it is; or a receiver
            was sent an encoding it refuses.
    """
    from trainer.exchange import TreeError, broadcast_json, decode_tree, encode_tree

    is_src = dist.get_rank() == src  # src is a global rank, as broadcast takes it
    leaves: list[torch.Tensor] = []
    payload: Any = None
    if is_src:
        try:
            payload = {"tree": encode_tree(state, leaves)}
        except TreeError as exc:  # every rank hears of it: none waits for tensors that never come
            payload = {"error": str(exc)}
    got = broadcast_json(payload, src=src, group=group, limit=STATE_STRUCTURE_BYTES)
    if not isinstance(got, dict) or ("tree" not in got and "error" not in got):
        raise TreeError(f"rank {src} sent no state structure")
    if "error" in got:
        raise TreeError(f"rank {src} cannot send its state: {got['error']}")
    if is_src:
        for t in leaves:
            dist.broadcast(t.detach().to(device), src=src, group=group)  # no copy when it is there already
        return state

    def receive(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        return buf

    return decode_tree(got["tree"], receive)


#: The largest structure of a state (bytes of JSON) a rank takes from a peer: some
#: hundred bytes per tensor; a state_dict of 10,000 tensors fits
STATE_STRUCTURE_BYTES = 64 << 20


def publish_world_env(ctx: DistContext, *, node_key: str | None = None) -> None:
    """Rewrite torchrun's worker variables in this process for the group ``ctx`` after an
    in-process resize, so that code reading them (a user's script, a library) sees the new
    world: ``RANK`` and ``ROLE_RANK``, ``WORLD_SIZE`` and ``ROLE_WORLD_SIZE``, and
    ``GROUP_RANK`` / ``GROUP_WORLD_SIZE``, the nodes numbered in the order of their ranks
    (one all-gather, as JSON: :func:`trainer.exchange.all_gather_json`, of the old
    ``GROUP_RANK``, or of ``node_key``: a joiner's node, whose ranks follow the survivors'
    or, in a sharded job's grow, sit among them). ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` do not change; ``MASTER_ADDR`` / ``MASTER_PORT`` still name the
    old group's store, which may be gone. Called on every rank of ``ctx``'s group.

    The variables: https://docs.pytorch.org/docs/stable/elastic/run.html#environment-variables
    """
    old_node = node_key if node_key is not None else os.environ.get("GROUP_RANK", str(ctx.rank))
    nodes = all_gather_json(old_node)  # a joiner's word: parsed, never unpickled
    # a node's ranks are contiguous (torchrun's numbering, kept by every resize)
    order = list(dict.fromkeys(n for n in nodes if n is not None))
    os.environ.update({
        "RANK": str(ctx.rank), "ROLE_RANK": str(ctx.rank),
        "WORLD_SIZE": str(ctx.world_size), "ROLE_WORLD_SIZE": str(ctx.world_size),
        "GROUP_RANK": str(order.index(old_node)), "GROUP_WORLD_SIZE": str(len(order)),
    })


def new_attempt_id(ctx: DistContext) -> str:
    """A fresh id for this worker-group incarnation, identical on every rank."""
    attempt = uuid.uuid4().hex[:12] if ctx.is_leader else None
    if ctx.initialized and ctx.world_size > 1:
        attempt = broadcast_json(attempt, src=0)
    return str(attempt)


def barrier(ctx: DistContext) -> None:
    if ctx.initialized and ctx.world_size > 1:
        dist.barrier()


def mean_loss(ctx: DistContext, total: torch.Tensor, micro_batches: int) -> tuple[float, float]:
    """A step's loss from the sum of its ``micro_batches`` micro-batch losses on this rank:
    ``(mean over every rank, this rank's mean)`` (collective when the world has more than one rank)."""
    local = total / micro_batches
    glob = local.clone()
    if ctx.initialized and ctx.world_size > 1:
        dist.all_reduce(glob, op=dist.ReduceOp.SUM)
        glob /= ctx.world_size
    return float(glob.item()), float(local.item())


def data_position(step: int, global_batch_size: int, seed: int, dataset_len: int) -> dict[str, int]:
    """The manifest's ``data_position``: where the sample stream resumes."""
    consumed = step * global_batch_size
    return {
        "consumed_samples": consumed,
        "seed": seed,
        "dataset_len": dataset_len,
        "epoch": consumed // dataset_len,
    }


# --------------------------------------------------------------------------- node-local outputs


class StatusWriter:
    """Appends one JSON object per line to ``$SPOTVISOR_STATUS_FILE`` (LOCAL_RANK 0 only)."""

    __slots__ = ("path", "ctx", "attempt")

    def __init__(self, path: str | None, ctx: DistContext, attempt: str) -> None:
        self.path = path if (path and ctx.is_local_leader) else None
        self.ctx = ctx
        self.attempt = attempt

    def emit(self, event: str, step: int, **fields: Any) -> None:
        if self.path is None:
            return
        record = {
            "event": event,
            "time": time.time(),
            "attempt": self.attempt,
            "rank": self.ctx.rank,
            "world_size": self.ctx.world_size,
            "step": step,
            **fields,
        }
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()

    def step(self, step: int, *, loss: float | None = None, tokens: int | None = None) -> None:
        """One optimizer step finished: a ``step`` line. ``loss``: the step's loss (a float);
        ``tokens``: the tokens trained in that step by all ranks together (the global batch's
        tokens, padding excluded if the trainer can tell; None: not counted). The agent sends the
        newest step line with each heartbeat and the daemon derives steps/s, tokens/s and the
        expected finish from them (``/metrics``, ``spotctl status``)."""
        fields: dict[str, Any] = {"loss": None if loss is None else float(loss)}
        if tokens is not None:
            fields["tokens"] = int(tokens)
        self.emit("step", step, **fields)


class StepLog:
    """``$SPOTVISOR_LOG_DIR/steps-<attempt>-rank<RANK>.jsonl``: what each rank trained on."""

    __slots__ = ("_f", "ctx", "attempt")

    def __init__(self, log_dir: str | None, ctx: DistContext, attempt: str) -> None:
        self.ctx = ctx
        self.attempt = attempt
        self._f = None
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            path = Path(log_dir) / f"steps-{attempt}-rank{ctx.rank}.jsonl"
            self._f = open(path, "a", encoding="utf-8")

    def write(self, step: int, positions: list[int], loss: float, **extra: Any) -> None:
        """One step's line; ``extra``: more fields (e.g. ``inputs``: digests of what the model was fed)."""
        if self._f is None:
            return
        record = {
            "attempt": self.attempt,
            "rank": self.ctx.rank,
            "world_size": self.ctx.world_size,
            "step": step,
            "positions": positions,
            "loss": loss,
            "time": time.time(),
            **extra,
        }
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def scratch_dir(job: str = "job") -> Path:
    """A node-local directory for checkpoint files before upload: ``$SPOTVISOR_SCRATCH_DIR/<job>``,
    else ``<tmp>/spotvisor-<uid>/<job>`` (created)."""
    base = os.environ.get(SCRATCH_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"spotvisor-{os.getuid()}")
    path = Path(base) / job
    path.mkdir(parents=True, exist_ok=True)
    return path


def configure_threads() -> None:
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    try:
        n = int(omp) if omp else 1
    except ValueError:
        n = 1
    torch.set_num_threads(max(1, n))


class _CurrentRank(logging.Filter):
    """Stamps each record with the worker's rank *now* (``%(rank)s``) and lets INFO and
    below through only on rank 0: a resize renumbers the ranks, and a survivor that
    becomes rank 0 must log the job's progress (set once at the start, the first rank 0's
    leaving took the progress lines out of every node's log)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank  # the last rank known: between two groups, the one before

    def filter(self, record: logging.LogRecord) -> bool:
        try:  # another thread may be destroying the group meanwhile (a resize)
            if dist.is_available() and dist.is_initialized():
                self.rank = dist.get_rank()
        except (RuntimeError, ValueError):
            pass
        record.rank = self.rank
        return record.levelno >= logging.WARNING or self.rank == 0


def configure_logging(rank: int) -> None:
    """stderr logging, INFO on the current rank 0 and WARNING elsewhere, each line naming
    the rank the worker has when it writes it (:class:`_CurrentRank`; ``rank``: the one it
    starts with); structlog (used by :mod:`trainer.checkpoint`) goes through the same
    handlers."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _CurrentRank) for f in handler.filters):
            handler.addFilter(_CurrentRank(rank))
    import structlog

    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, structlog.processors.KeyValueRenderer(sort_keys=True)],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
