"""spotvisor-agent: the node agent that runs on every spot instance.

It has these jobs, each an owned task in one ``TaskGroup``:

- ``metadata``: poll the cloud's metadata endpoint (default every 1 s) for an
  interruption notice (:class:`~daemon.gpunode.notice_watch.NoticeWatch`); on a new one,
  write it to the notice file at once (the trainer ranks read it at their next step
  boundary) and report it to the daemon.
- ``heartbeat`` (:class:`~daemon.gpunode.heartbeat.Heartbeat`): tell the daemon the node is alive (and the trainer's step, its newest
  ``step`` line's loss and the tokens trained since the agent started, the
  GPUs' utilization and memory — absent on a CPU node, :mod:`daemon.gpunode.gpu` — and the
  next chunk of ``trainer.log``, :mod:`daemon.gpunode.nodelog`), then sleep the interval the
  daemon's last reply said (``heartbeat_interval_s``: it grows with the pool,
  :func:`daemon.control.pool.heartbeat_interval_s`; until the first reply, the CLI's), or
  less when the trainer starts or exits: the daemon must know at once whether a
  trainer runs (a drain asks it to commit; a node with none is released). The
  reply carries the daemon's commands too: start the trainer, request a checkpoint
  (kind ``rejoin`` or ``checkpoint``), drain, cancel a request, restart the trainer
  in place with a new job spec (the job stalled: :mod:`daemon.control.stall`).
- TLS (:class:`~daemon.gpunode.daemon_link.DaemonLink`, which carries every exchange
  with the daemon): with an ``https://`` daemon URL and ``--ca-file`` (the daemon's CA, which
  it hands to each node it launches: :mod:`daemon.controlnode.tls`), the agent trusts
  that CA only, not the system's store, and checks the daemon's name against the
  certificate; with no CA file, the system's store. A daemon whose certificate does
  not verify never sees a request (the handshake fails first, so the token is not
  sent): the agent logs ``daemon_certificate_untrusted`` and retries with backoff, as
  for any daemon it cannot reach (a restarted daemon keeps its CA). A plain ``http://``
  daemon URL is taken only for a loopback host (:func:`check_daemon_url`): the agent
  refuses to start rather than send its token in clear across the network.
- ``commands``: keep one ``POST /v1/agent/commands`` long-poll outstanding, so a
  command reaches the node at once however long the heartbeat interval is; its
  reply is applied as a heartbeat reply is (each command comes by one channel or the
  other, never both). A daemon without the route (404: an older one) leaves the
  agent on heartbeats alone.
- ``gpu``: sample the GPUs every second; each heartbeat carries the per-GPU means
  since the last one (:class:`daemon.gpunode.gpu.GpuMeans`).
- a ``job.command`` job (the user's own script, which reads no notice file): on a
  notice or a drain the agent writes the plain notice (``$SPOTVISOR_NOTICE``:
  :mod:`trainer.contract`) and SIGTERMs torchrun at once, which forwards it to every
  worker; what still runs at the deadline is SIGKILLed
  (:meth:`~daemon.gpunode.trainer_process.TrainerProcess.notice`).
- ``status``: tail the trainer's status file and forward what matters
  (``started``, ``checkpoint_committed``, ``holding``, ``completed``). When the
  checkpoint that answers this node's interruption notice is committed, the node
  leaves the job by SIGTERM to its torchrun agent (never by its workers exiting 0:
  that would close the rendezvous for good, pytorch#123678).
- ``trainer``: start and supervise ``torchrun --nnodes=MIN:MAX`` as a c10d
  rendezvous client of the rendezvous store (:class:`~daemon.gpunode.trainer_process.TrainerProcess`:
  started at registration, handed the job when the daemon admits the node, so the
  import is not spent while the survivors hold). A job with a ``job.workdir`` or a ``job.setup``
  prepares first (:mod:`daemon.gpunode.code`: fetched, verified, unpacked, set up; the
  daemon keeps the node ``preparing``, never admitted): the prewarm follows, and a node
  whose preparation failed reports ``setup_failed`` and never starts a trainer.

The node-local contract with the trainer (the environment, the notice file, the
status file) is :mod:`trainer.contract`, which both sides import.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from daemon.gpunode.daemon_link import COMMAND_WAIT_S, DaemonLink, check_daemon_url, daemon_ssl_context, daemon_urls
from daemon.gpunode.gpu import GpuSampler, NvmlSampler
from daemon.gpunode.heartbeat import Heartbeat, StepProgress
from daemon.gpunode.nodelog import last_error, mask_secrets
from daemon.gpunode.notice_watch import NoticeWatch
from daemon.logs import configure_logging
from daemon.gpunode.metadata.base import MetadataDialect, MetadataUnavailable, Notice
from daemon.gpunode.metadata.registry import DEFAULT_URLS, DIALECTS, make_client
from daemon.control.lifecycle import TrainerState
from daemon.control.reports import STATUS_EVENTS
from daemon.gpunode.code import needs_preparing, prepare_node
from daemon.gpunode.trainer_process import TrainerProcess
from trainer.contract import NoticeEntry, NoticeFile, NoticeKind, StatusTail, write_endpoint_file
from trainer.store_retry import parse_endpoint

__all__ = ["NodeAgent", "StepProgress", "main", "daemon_ssl_context", "check_daemon_url"]

log = structlog.get_logger("spotvisor.agent")


class NodeAgent:
    """One node's agent. Construct (no I/O), then ``await run()`` until cancelled.

    It decides what the node does; two collaborators carry out the I/O at its edges:
    :class:`~daemon.gpunode.daemon_link.DaemonLink` (the daemon: session, registration,
    reports, command long-poll) and :class:`~daemon.gpunode.notice_watch.NoticeWatch`
    (the cloud's metadata endpoint). The trainer's processes are
    :class:`~daemon.gpunode.trainer_process.TrainerProcess`.

    Args:
        daemon_url: the daemon's agent port, e.g. ``http://10.0.0.2:7480``, or an HA pool's
            control nodes' comma-separated (:class:`~daemon.gpunode.daemon_link.DaemonLink`).
        token: this node's bearer token (issued by the daemon at launch).
        node_id: this node's id in the pool.
        metadata: the metadata dialect client (polls the cloud's endpoint).
        workdir: node-local directory for the notice/status files and logs.
        gpu_sampler: samples the GPUs every second (default: NVML; absent → None).
        heartbeat_interval_s: seconds between heartbeats until the daemon says (its
            register and heartbeat replies carry the interval it wants).
        command_wait_s: how long each command long-poll may be held (seconds).
        ca_file: the daemon's CA certificate (PEM): for an https ``daemon_url``, trust it
            and no other CA (:func:`daemon_ssl_context`); None: the system's store.

    Raises:
        ValueError: ``daemon_url`` is plain http to a host that is not loopback
            (:func:`check_daemon_url`): the token is never sent in clear beyond the machine.
    """

    def __init__(self, *, daemon_url: str, token: str, node_id: str, metadata: MetadataDialect, workdir: Path,
                 poll_interval_s: float = 1.0, heartbeat_interval_s: float = 1.0,
                 metadata_alarm_after: int = 5, metadata_max_backoff_s: float = 5.0,
                 gpu_sampler: GpuSampler | None = None, command_wait_s: float = COMMAND_WAIT_S,
                 ca_file: str | os.PathLike[str] | None = None) -> None:
        self.link = DaemonLink(daemon_url=daemon_url, token=token, node_id=node_id, ca_file=ca_file,
                               command_wait_s=command_wait_s)
        self.node_id = node_id
        self.metadata = metadata
        self.watch = NoticeWatch(metadata, node_id=node_id, report=self.link.report, poll_interval_s=poll_interval_s,
                                 alarm_after=metadata_alarm_after, max_backoff_s=metadata_max_backoff_s)
        self.workdir = Path(workdir)
        self._notice: Notice | None = None
        self.notices: NoticeFile | None = None
        self.status_path = self.workdir / "status.jsonl"
        self.log_dir = self.workdir / "logs"
        self._beat_now = asyncio.Event()  # the trainer's state changed: heartbeat without waiting
        self.runner = TrainerProcess(workdir=self.workdir, node_id=node_id, on_change=self._beat_now.set)
        self._progress = StepProgress()  # the newest step line, for the heartbeats
        self._interruption: NoticeEntry | None = None  # this node's own notice, once seen
        self._background: set[asyncio.Future[None]] = set()
        self.gpu_sampler: GpuSampler = gpu_sampler if gpu_sampler is not None else NvmlSampler()
        self.heartbeat = Heartbeat(link=self.link, runner=self.runner, progress=self._progress,
                                   gpu_sampler=self.gpu_sampler, log_path=self.workdir / "trainer.log",
                                   interval_s=heartbeat_interval_s, beat_now=self._beat_now, apply=self._apply)
        self._apply_lock = asyncio.Lock()  # heartbeat and long-poll replies are applied one at a time
        self._store_at: str | None = None  # the rendezvous endpoint the node's file holds

    @property
    def told_interval_s(self) -> float | None:
        """The daemon's last word on the heartbeat interval (None before its first)."""
        return self.heartbeat.told_interval_s

    @property
    def metadata_failures(self) -> int:
        """Failed metadata polls in the current streak."""
        return self.watch.failures

    @property
    def trainer(self) -> TrainerState:
        """This node's torchrun, as heartbeats report it (:class:`TrainerProcess`)."""
        return self.runner.state

    # -- lifecycle ------------------------------------------------------------
    async def run(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        self.notices = NoticeFile(self.workdir / "notices.json")
        await self.link.open()
        try:
            self.runner.job = await self._register()
            self.runner.prepared = not needs_preparing(self.runner.job)  # job.workdir / job.setup first
            if self.runner.prepared:
                await self.runner.prewarm()
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._warm(), name=f"agent:prewarm:{self.node_id}")
                tg.create_task(self._metadata_loop(), name=f"agent:metadata:{self.node_id}")
                if self.metadata.has_rebalance:  # AWS only
                    tg.create_task(self.watch.watch_rebalance(), name=f"agent:rebalance:{self.node_id}")
                tg.create_task(self.heartbeat.beat(), name=f"agent:heartbeat:{self.node_id}")
                tg.create_task(self.link.poll_commands(self._apply), name=f"agent:commands:{self.node_id}")
                tg.create_task(self.heartbeat.sample_gpus(), name=f"agent:gpu:{self.node_id}")
                tg.create_task(self._status_loop(), name=f"agent:status:{self.node_id}")
                tg.create_task(self.link.deliver_reports(), name=f"agent:outbox:{self.node_id}")
        finally:
            await asyncio.shield(self._shutdown())

    async def _warm(self) -> None:
        if self.runner.prepared or await prepare_node(self.runner, report=self._report, beat_now=self._beat_now,
                                                      beat_sent=self.heartbeat.beat_sent):
            await self.runner.until_warm()

    async def _shutdown(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.runner.stop_prewarmed()
        await self.runner.stop()
        await asyncio.to_thread(self.gpu_sampler.close)
        await self.metadata.aclose()
        await self.link.aclose()

    # -- the daemon -------------------------------------------------------------
    async def _register(self) -> dict[str, Any]:
        """Register (retried until the daemon answers); the job spec of the reply."""
        reply = await self.link.register()
        self.heartbeat.heed_interval(reply)
        log.info("agent_registered", node_id=self.node_id, heartbeat_interval_s=self.told_interval_s)
        return reply["job"]

    def _report(self, kind: str, **data: Any) -> None:
        self.link.report(kind, **data)

    # -- loops --------------------------------------------------------------------
    async def _metadata_loop(self) -> None:
        """Poll for notices (:class:`NoticeWatch`); each new one goes to :meth:`_on_interruption`."""
        await self.watch.watch(self._on_interruption)

    def _on_interruption(self, notice: Notice) -> None:
        assert self.notices is not None
        seen_at = time.time()
        deadline = notice.deadline.timestamp() if notice.deadline is not None else None
        # The id the job and the daemon know this notice by names this node: notice.id hashes
        # only the body, and a cloud reclaiming many instances at one time serves the same
        # body on each. With one shared id, the commit for the first node's notice marks the
        # others' as handled too: a node that sees its notice after that commit never gets
        # one of its own and leaves at the deadline, losing the steps trained since.
        nid = f"{self.node_id}:{notice.id}"
        entry = NoticeEntry(nid, NoticeKind.INTERRUPTION, seen_at, deadline)
        self.notices.add(entry)  # first: the trainer acts on the file, not on the daemon
        self._interruption = entry
        self._notice = notice
        log.warning("interruption_notice", node_id=self.node_id, deadline=deadline, action=notice.action)
        self._report("interruption_notice", notice={**notice.to_dict(), "id": nid}, seen_at=seen_at,
                     deadline=deadline)
        if self.runner.signals_on_notice:  # job.command: SIGTERM; the script's own handler saves
            self.runner.notice(nid, kind="interruption", seen_at=seen_at, deadline=deadline)
        elif self.trainer is TrainerState.RUNNING and deadline is not None:
            asyncio.get_running_loop().call_later(
                max(0.0, deadline - time.time() - 3.0), self._leave_if_still_running, entry.id
            )

    def _leave_if_still_running(self, notice_id: str) -> None:
        # The deadline is near and no commit answered the notice: leave cleanly anyway.
        if self.trainer is TrainerState.RUNNING:
            self.runner.leave("leaving_before_commit", notice_id=notice_id)

    async def _apply(self, reply: dict[str, Any]) -> None:
        async with self._apply_lock:  # one reply at a time: two could both see the trainer not started
            await self._apply_locked(reply)

    async def _apply_locked(self, reply: dict[str, Any]) -> None:
        assert self.notices is not None
        await self._follow_store(reply.get("rendezvous"))
        for cmd in reply.get("commands", []):
            if cmd.get("kind") == "drain":
                # the daemon asks this node to leave (e.g. rebalance "replace"): act
                # exactly as on an interruption notice, with no deadline
                entry = NoticeEntry(cmd["id"], NoticeKind.INTERRUPTION, time.time(), None)
                if self.notices.add(entry):
                    self._interruption = entry
                    log.info("drain_requested", node_id=self.node_id, request_id=cmd["id"])
                    self.runner.notice(cmd["id"], kind="drain", seen_at=time.time(), deadline=None)  # job.command
            elif cmd.get("kind") == "cancel":
                self.notices.remove([cmd["id"]])
                log.info("checkpoint_request_cancelled", node_id=self.node_id, request_id=cmd["id"])
            elif cmd.get("kind") == "checkpoint":
                kind = NoticeKind.REJOIN if cmd.get("reason") == "rejoin" else NoticeKind.CHECKPOINT
                self.notices.add(NoticeEntry(cmd["id"], kind, time.time(), None))
                log.info("checkpoint_requested", node_id=self.node_id, request_id=cmd["id"], kind=kind.value)
            elif cmd.get("kind") == "restart":
                await self._restart(cmd)
        if (reply.get("start_trainer") and self.trainer in (TrainerState.NOT_STARTED, TrainerState.WARMING)
                and self._interruption is None and self.runner.prepared):
            credential = reply.get("join_credential")  # the daemon's, for the workers' environment only
            await self.runner.start(join=bool(reply.get("join")),
                                    credential=credential if isinstance(credential, str) else None,
                                    cohort=start_cohort(reply.get("start_cohort")))

    async def _follow_store(self, endpoint: Any) -> None:
        """The leading daemon's rendezvous endpoint (``host:port``) into the node's file when
        it changes: an HA takeover moves the store, and every new store client of the
        workers looks there first (:func:`trainer.store_retry.current_endpoint`)."""
        if not isinstance(endpoint, str) or endpoint == self._store_at or parse_endpoint(endpoint) is None:
            return
        try:
            await asyncio.to_thread(write_endpoint_file, self.runner.rendezvous_path, endpoint)
        except OSError as exc:
            log.warning("rendezvous_file_unwritable", node_id=self.node_id, error=str(exc)[:200])
            return
        if self._store_at is not None:
            log.info("rendezvous_store_moved", node_id=self.node_id, old=self._store_at, new=endpoint)
        self._store_at = endpoint

    async def _restart(self, cmd: dict[str, Any]) -> None:
        """The daemon restarts the trainer in place (the job stalled): stop what still runs,
        take the new job spec; the reply's ``start_trainer`` starts it again. Not on a node
        that is leaving (its own notice), nor without a spec."""
        job = cmd.get("job")
        if not (isinstance(job, dict) and isinstance(job.get("argv"), list)) or self._interruption is not None:
            log.warning("restart_ignored", node_id=self.node_id, request_id=cmd.get("id"),
                        why="leaving" if self._interruption is not None else "no job spec")
            return
        code = await self.runner.restart(job)
        if code is not None:
            self._report("trainer_exited", exit_code=code)
        self._progress.step = None  # the old trainer's: the restarted one reports its own
        log.info("trainer_restart", node_id=self.node_id, request_id=cmd.get("id"), stopped_exit_code=code)
        if self.runner.prepared and self.runner.warm is None:
            # the restarted torchrun starts as the first did: a prewarmed launcher, whose zygote
            # forks the workers (the start that follows hands it the new spec while it imports)
            await self.runner.prewarm()
            self._own(asyncio.ensure_future(self.runner.until_warm()))

    def _own(self, task: "asyncio.Future[None]") -> None:
        """Keep ``task`` until it is done; :meth:`_shutdown` cancels what is left."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _status_loop(self) -> None:
        tail = StatusTail(self.status_path)
        while True:
            for line in tail.read_new():
                self._on_status(line)
            if self.runner.proc is not None and self.runner.proc.returncode is not None:
                for line in tail.read_new():  # its last lines first
                    self._on_status(line)
                code = self.runner.reap()
                if code is not None:
                    log.info("trainer_exited", node_id=self.node_id, exit_code=code)
                    self._report("trainer_exited", exit_code=code)
            await asyncio.sleep(0.2)

    def _on_status(self, line: dict[str, Any]) -> None:
        assert self.notices is not None
        event = line.get("event")
        self._progress.on_line(line)
        # the daemon keeps the first report of a line (by attempt and step), so only the node
        # of global rank 0 reports it, and a node whose own notice a commit answers: at
        # 1,000 nodes one report per commit instead of 1,000 (bench/scale.py). Every node
        # reports its own ``started`` (once per attempt): the daemon takes a node's claim to
        # rank 0 of a new attempt on another node's word (daemon/control/attempts.py), and
        # learns which nodes hold ranks of the running attempt.
        if event == "workers_failed":  # the launcher's line: torchrun restarts failed workers
            restarts = line.get("restarts_left")
            said = mask_secrets(last_error(self.runner.workdir / "trainer.log"), self.runner.job.get("secrets"))
            self._report("workers_failed", restarts_left=restarts if isinstance(restarts, int) else None,
                         last_line=said)  # (the daemon masks again)
            return
        if event not in STATUS_EVENTS:
            return
        ids = list(line.get("notice_ids") or []) if event == "checkpoint_committed" else []
        mine = self._interruption
        answers_mine = mine is not None and mine.id in ids
        if line.get("rank", 0) == 0 or answers_mine or event == "started":
            self._report("trainer_status", line=line)
        if event == "checkpoint_committed":
            self.notices.remove(ids)
            # Leave only on the commit that answers this node's notice: the trainer
            # holds after it, so no step computed after the commit is thrown away.
            if answers_mine:
                self.runner.leave("leaving_job", step=line.get("step"))
                if self._notice is not None:
                    # Azure: tell the platform it may act now (only after the commit); others: nothing
                    self._own(asyncio.ensure_future(self.watch.acknowledge(self._notice)))


def start_cohort(raw: Any) -> tuple[int, float] | None:
    """The daemon's ``start_cohort`` (``{"nodes": N, "until": unix s}``) as ``(N, until)``;
    None when absent or malformed (no wait: the first round as c10d forms it)."""
    if not isinstance(raw, dict):
        return None
    nodes, until = raw.get("nodes"), raw.get("until")
    if (type(nodes) is not int or not 1 < nodes <= 100_000 or not isinstance(until, (int, float))
            or isinstance(until, bool) or not 0 < until < 1e11):
        return None
    return nodes, float(until)


def _version() -> str:
    try:
        return importlib.metadata.version("spotvisor")
    except importlib.metadata.PackageNotFoundError:  # a bare checkout
        return "unknown"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spotvisor-agent", description="spotvisor node agent")
    # what a node's bootstrap compares with the daemon's version (daemon/providers/bootstrap.py)
    p.add_argument("--version", action="version", version=f"spotvisor-agent {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the agent on this node")
    r.add_argument("--daemon-url", required=True,
                   help="the daemon's agent URL; for an HA pool every control node's, comma-separated "
                        "(the agent follows whichever leads)")
    r.add_argument("--node-id", required=True)
    r.add_argument("--ca-file", default=os.environ.get("SPOTVISOR_DAEMON_CA_FILE") or None,
                   help="the daemon's CA certificate (PEM): an https daemon is trusted only if it verifies "
                        "against it (default: $SPOTVISOR_DAEMON_CA_FILE; none: the system's trust store)")
    r.add_argument("--metadata-url", help="the metadata endpoint (default: the dialect's own)")
    r.add_argument("--dialect", default="aws", choices=DIALECTS)
    r.add_argument("--metadata-alarm-after", type=int, default=5,
                   help="failed polls in a row before a metadata_unreachable alarm")
    r.add_argument("--metadata-max-backoff-s", type=float, default=5.0,
                   help="cap of the exponential backoff between failed polls")
    r.add_argument("--workdir", default="/var/lib/spotvisor-agent")
    r.add_argument("--poll-interval-s", type=float, default=1.0)
    r.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    r.add_argument("--metadata-timeout-s", type=float, default=2.0)
    q = sub.add_parser("probe", help="poll the metadata endpoint once and print the notice as JSON (or null)")
    q.add_argument("--dialect", required=True, choices=DIALECTS)
    q.add_argument("--metadata-url", help="the metadata endpoint (default: the dialect's own)")
    q.add_argument("--timeout-s", type=float, default=2.0)
    q.add_argument("--watch", action="store_true", help="keep polling; print each new notice")
    q.add_argument("--interval-s", type=float, default=1.0, help="with --watch: seconds between polls")
    return p.parse_args(argv)


def _notice_line(notice: Notice | None) -> str:
    if notice is None:
        return "null"
    d = notice.to_dict()
    return json.dumps({k: d.get(k) for k in ("provider", "kind", "action", "deadline", "id")})


async def _probe(args: argparse.Namespace) -> int:
    """Operators' check of a node: exit 0 with the notice or null; 1 if the endpoint fails."""
    url = args.metadata_url or DEFAULT_URLS[args.dialect]
    client = make_client(args.dialect, url, timeout_s=args.timeout_s)
    seen: set[str] = set()
    try:
        while True:
            try:
                notice = await client.poll()
            except MetadataUnavailable as exc:
                print(f"spotvisor-agent probe: {url}: {exc}", file=sys.stderr)
                return 1
            if not args.watch:
                print(_notice_line(notice), flush=True)
                return 0
            if notice is not None and notice.id not in seen:
                seen.add(notice.id)
                print(_notice_line(notice), flush=True)
            await asyncio.sleep(args.interval_s)
    finally:
        await client.aclose()


def _client(dialect: str, url: str | None, timeout_s: float, poll_interval_s: float) -> MetadataDialect:
    kwargs: dict[str, Any] = {"timeout_s": timeout_s}
    if dialect == "gcp":
        kwargs["wait_s"] = max(5.0, poll_interval_s)  # hanging GETs instead of tight polling
    return make_client(dialect, url or DEFAULT_URLS[dialect], **kwargs)


async def _amain(args: argparse.Namespace) -> int:
    token = os.environ.get("SPOTVISOR_AGENT_TOKEN", "")
    if not token:
        print("spotvisor-agent: SPOTVISOR_AGENT_TOKEN is not set (the daemon issues it at launch)", file=sys.stderr)
        return 2
    try:
        daemon_urls(args.daemon_url)
    except ValueError as exc:
        print(f"spotvisor-agent: {exc}", file=sys.stderr)
        return 2
    try:  # a CA file that cannot be used is a configuration error: stop here, not retry
        await asyncio.to_thread(daemon_ssl_context, args.ca_file)
    except OSError as exc:  # ssl.SSLError included
        print(f"spotvisor-agent: --ca-file {args.ca_file}: {getattr(exc, 'strerror', None) or exc} "
              "(give the daemon's CA certificate, PEM)", file=sys.stderr)
        return 2
    agent = NodeAgent(
        daemon_url=args.daemon_url, token=token, node_id=args.node_id,
        metadata=_client(args.dialect, args.metadata_url, args.metadata_timeout_s, args.poll_interval_s),
        workdir=Path(args.workdir), poll_interval_s=args.poll_interval_s,
        heartbeat_interval_s=args.heartbeat_interval_s, metadata_alarm_after=args.metadata_alarm_after,
        metadata_max_backoff_s=args.metadata_max_backoff_s, ca_file=args.ca_file,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(agent.run(), name=f"agent:{args.node_id}")
    waiter = asyncio.create_task(stop.wait(), name="agent:signal")
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises what ended the agent (PermissionError: a refused token)
        return 0
    finally:
        for t in (task, waiter):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.cmd == "probe":
        configure_logging(level="WARNING")  # stdout carries only the JSON lines
        try:
            return asyncio.run(_probe(args))
        except KeyboardInterrupt:
            return 130
    configure_logging()
    try:
        return asyncio.run(_amain(args))
    except PermissionError as exc:
        print(f"spotvisor-agent: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
