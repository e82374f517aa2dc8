"""This node's torchrun, as its agent runs it: prewarmed at registration, handed the job
when the daemon admits the node, signalled when the node leaves.

Its lifecycle is :class:`daemon.control.lifecycle.TrainerState` (not_started → (warming →)
running → exited), checked against the table on every change; every change calls
``on_change`` (the agent heartbeats at once: the daemon must know whether a trainer runs).
The process is started at registration (:mod:`daemon.gpunode.launcher`: torchrun
imported, waiting), so the import is not spent while the survivors hold.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import structlog

from daemon.control.lifecycle import TrainerState, check_trainer_transition
from daemon.gpunode.launcher import READY_FD_ENV
from daemon.gpunode.proctree import kill_tree
from daemon.gpunode.zygote import MODULE_ENV as ZYGOTE_MODULE_ENV
from daemon.gpunode.zygote import entry_module
from daemon.model import TORCHRUN_ARGV, UNREPORTED_MAX_RESTARTS_KEY
from trainer.contract import (JOIN_CREDENTIAL_ENV, LOG_DIR_ENV, NODE_ID_ENV, NOTICE_ENV, NOTICE_FILE_ENV,
                              RDZV_ENDPOINT_FILE_ENV, SCRATCH_DIR_ENV, START_COHORT_ENV, STATUS_FILE_ENV,
                              TRAINER_PYTHONPATH_ENV, write_plain_notice)

__all__ = ["TrainerProcess", "DRAIN_GRACE_S"]

log = structlog.get_logger("spotvisor.agent")

# job.command, a drain (the daemon's, no cloud deadline): the script's SIGTERM handler has
# this long (seconds) before what still runs is SIGKILLed; AWS's documented notice lead
DRAIN_GRACE_S = 120.0


def unreported(argv: list[str], max_restarts: int | None) -> list[str]:
    """``argv`` for a torchrun started without the launcher, whose workers' failures nobody
    reports: its ``--max-restarts`` set to ``max_restarts`` (the spec's
    :data:`~daemon.model.UNREPORTED_MAX_RESTARTS_KEY`; None: ``argv`` as it is), so that a
    crash loop ends in its exit, which the daemon sees, and not in hours of restarts."""
    if max_restarts is None or tuple(argv[:2]) != TORCHRUN_ARGV:
        return argv
    out = list(argv)
    for i in range(2, len(out)):  # torchrun's own options (the spec's are --name=value), up to the script
        if not out[i].startswith("--"):
            break
        if out[i].startswith("--max-restarts="):
            out[i] = f"--max-restarts={max_restarts}"
    return out


class TrainerProcess:
    """One node's torchrun. ``job``: the daemon's ``{"argv", "env", "secrets"?, "cwd"?}`` (set at
    registration); ``state``, ``exit_code``: what heartbeats report; ``code_dir``: the
    unpacked ``job.workdir`` (:mod:`daemon.gpunode.code`), the trainer's working directory
    and first on its ``PYTHONPATH``, kept for the node's life (a restart's new spec
    does not change the version this node runs)."""

    def __init__(self, *, workdir: Path, node_id: str, on_change: Callable[[], None]) -> None:
        self.workdir = workdir
        self.node_id = node_id
        self.job: dict[str, Any] = {}
        self.code_dir: Path | None = None
        self.prepared = True  # False while job.workdir / job.setup are not done: it never starts (code.py)
        self.state = TrainerState.NOT_STARTED
        self.exit_code: int | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.warm: asyncio.subprocess.Process | None = None  # torchrun importing, not started (prewarm)
        self._ready_pipe: int | None = None  # the read end of the launcher's "ready" pipe, until awaited
        self._on_change = on_change
        self._left: asyncio.subprocess.Process | None = None  # the process leave() signalled (once)
        self._deadline_kill: asyncio.TimerHandle | None = None

    def _to(self, new: TrainerState) -> None:
        check_trainer_transition(self.state, new)
        self.state = new
        self._on_change()

    def leave(self, why: str, **fields: Any) -> bool:
        """SIGTERM torchrun (never its workers exiting 0: that would close the rendezvous
        for good, pytorch#123678), logged as ``why``; once per process (a second SIGTERM
        would cut torchrun's wait for its workers short). False if no trainer runs."""
        if self.proc is None or self.proc.returncode is not None or self._left is self.proc:
            return False
        log.info(why, node_id=self.node_id, **fields)
        self._left = self.proc
        self.proc.send_signal(signal.SIGTERM)
        return True

    @property
    def signals_on_notice(self) -> bool:
        """The job is the user's own script (``job.command``): a notice is a SIGTERM and
        the plain notice (:func:`trainer.contract.write_plain_notice`), not a commit request."""
        return bool(self.job.get("notice_signal"))

    @property
    def plain_notice_path(self) -> Path:
        return self.workdir / "notice.json"

    @property
    def rendezvous_path(self) -> Path:
        """The store's address as the leading daemon says (:data:`trainer.contract.RDZV_ENDPOINT_FILE_ENV`)."""
        return self.workdir / "rendezvous"

    def notice(self, notice_id: str, *, kind: str, seen_at: float, deadline: float | None) -> bool:
        """``job.command``: write the plain notice, then SIGTERM torchrun, which forwards it to
        every worker at once and waits for them (``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, set
        by the daemon past any cloud's lead); at ``deadline`` (unix s; None: ``seen_at`` +
        :data:`DRAIN_GRACE_S`) whatever still runs is SIGKILLed, workers and torchrun.
        False if no trainer runs (the file is written anyway: a worker may still read it),
        or the job is not ``job.command`` (:attr:`signals_on_notice`: nothing is done)."""
        if not self.signals_on_notice:
            return False
        body = write_plain_notice(self.plain_notice_path, notice_id=notice_id, kind=kind, seen_at=seen_at,
                                  deadline=deadline)
        if not self.leave("notice_sigterm", notice_id=notice_id, seconds_left=body["seconds_left"]):
            return False
        proc = self.proc
        assert proc is not None
        due = (deadline if deadline is not None else seen_at + DRAIN_GRACE_S) - time.time()
        if self._deadline_kill is not None:
            self._deadline_kill.cancel()
        self._deadline_kill = asyncio.get_running_loop().call_later(max(0.0, due), self._kill_at_deadline, proc)
        return True

    def _kill_at_deadline(self, proc: asyncio.subprocess.Process) -> None:
        self._deadline_kill = None
        if proc.returncode is None:
            reached = kill_tree(proc.pid)
            log.warning("trainer_killed_at_deadline", node_id=self.node_id, pids=len(reached))

    def reap(self) -> int | None:
        """If the running trainer has exited: its exit code (the state becomes ``exited``)."""
        if self.proc is None or self.state is not TrainerState.RUNNING or self.proc.returncode is None:
            return None
        self.exit_code = self.proc.returncode
        self._to(TrainerState.EXITED)
        return self.exit_code

    @staticmethod
    def _untokened_env() -> dict[str, str]:
        """The agent's environment without its token (never handed to the trainer), nor a
        join credential of its own (the trainer's is the daemon's, given at :meth:`start`)."""
        env = dict(os.environ)
        env.pop("SPOTVISOR_AGENT_TOKEN", None)
        env.pop(JOIN_CREDENTIAL_ENV, None)
        env.pop(START_COHORT_ENV, None)
        return env

    @property
    def python(self) -> str:
        """The interpreter the trainer runs on: the job's ``"python"`` (``job.python``), else the agent's."""
        return self.job.get("python") or sys.executable

    def _foreign(self) -> bool:
        return self.python != sys.executable

    def job_env(self) -> dict[str, str]:
        """The trainer's environment: the agent's (less its token), the job's, its secrets
        (the spec's ``"secrets"``: in this environment only, never on a command line, in a
        file or a log line), and the contract's files.
        On another interpreter than the agent's (``job.python``), the directory named by
        ``$SPOTVISOR_TRAINER_PYTHONPATH`` (the bootstrap's copy of ``trainer/`` alone) comes
        first on its ``PYTHONPATH``: spotvisor's trainer package without the agent's
        virtualenv before the image's torch."""
        env = self._untokened_env()
        env.update(self.job.get("env", {}))
        env.update(self.job.get("secrets", {}))
        extra = env.get(TRAINER_PYTHONPATH_ENV, "")
        if self._foreign() and extra and os.path.isdir(extra):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH", "")) if p)
        env.update(
            {NOTICE_FILE_ENV: str(self.workdir / "notices.json"), STATUS_FILE_ENV: str(self.workdir / "status.jsonl"),
             LOG_DIR_ENV: str(self.workdir / "logs"), SCRATCH_DIR_ENV: str(self.workdir / "scratch"),
             NODE_ID_ENV: self.node_id, RDZV_ENDPOINT_FILE_ENV: str(self.rendezvous_path)}
        )
        if self.signals_on_notice:
            env[NOTICE_ENV] = str(self.plain_notice_path)
        if self.code_dir is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.code_dir), env.get("PYTHONPATH")) if p)
        return env

    def cwd(self) -> str | None:
        """The trainer's working directory: the unpacked workdir, else the job's ``cwd`` (None: the agent's)."""
        return str(self.code_dir) if self.code_dir is not None else self.job.get("cwd") or None

    async def _spawn(self, argv: list[str], env: dict[str, str], stdin: int,
                     pass_fds: tuple[int, ...] = ()) -> asyncio.subprocess.Process:
        out = open(self.workdir / "trainer.log", "ab")
        try:
            return await asyncio.create_subprocess_exec(
                self.python, *argv, stdin=stdin, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env,
                cwd=self.cwd(), pass_fds=pass_fds,
            )
        finally:
            out.close()

    async def prewarm(self) -> None:
        """Start torchrun's process now, importing, for :meth:`start` to set
        going when the daemon admits this node (:mod:`daemon.gpunode.launcher`). Only for a job
        whose command is ``-m torch.distributed.run``, on the agent's own interpreter (the
        launcher is spotvisor's: another interpreter, ``job.python``, has only ``trainer``).
        Until the launcher says it has imported (or exits), heartbeats report the trainer
        ``warming`` (:meth:`until_warm`)."""
        if tuple(self.job.get("argv", ())[:2]) != TORCHRUN_ARGV or self._foreign():
            return
        # the job's environment, less its secrets (handed over at start only): the launcher's
        # zygote imports the workers' libraries under the variables they will run with
        secrets = self.job.get("secrets", {})
        env = {k: v for k, v in self.job_env().items() if k not in secrets}
        ready_r, ready_w = os.pipe()
        env[READY_FD_ENV] = str(ready_w)
        module = entry_module(list(self.job["argv"]))
        if module:  # the launcher's zygote imports it (a trainer.* module) before the job is handed over
            env[ZYGOTE_MODULE_ENV] = module
        try:
            self.warm = await self._spawn(["-u", "-m", "daemon.gpunode.launcher"], env, asyncio.subprocess.PIPE,
                                           pass_fds=(ready_w,))
        except BaseException as exc:
            os.close(ready_r)
            if not isinstance(exc, OSError):
                raise
            log.warning("prewarm_failed", node_id=self.node_id, error=str(exc))  # started unwarmed when admitted
            return
        finally:
            os.close(ready_w)  # the launcher holds the only write end: its exit is EOF here
        self._ready_pipe = ready_r
        self._to(TrainerState.WARMING)
        log.info("trainer_prewarming", node_id=self.node_id, pid=self.warm.pid)

    async def until_warm(self) -> None:
        """Wait for the launcher's ``ready`` (or its exit), then heartbeat at once: the
        daemon asks the survivors for the rejoin commit only for a warm node."""
        fd, self._ready_pipe = self._ready_pipe, None
        if fd is None:
            return
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        said = b""
        try:
            transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                        os.fdopen(fd, "rb", buffering=0))
            try:
                said = await reader.readline()
            finally:
                transport.close()
        except (OSError, ValueError) as exc:  # never the agent's end: the job starts anyway, unwarmed
            log.warning("prewarm_pipe_failed", node_id=self.node_id, error=str(exc))
        if said != b"ready\n" and self.warm is not None:
            # it exited (or closed the pipe) before it had imported, not handed the job
            # yet: drop it, and start torchrun directly when admitted
            dead, self.warm = self.warm, None
            if dead.returncode is None:
                dead.kill()
            await dead.wait()
            log.warning("prewarm_failed", node_id=self.node_id, exit_code=dead.returncode)
        elif said == b"ready\n":
            log.info("trainer_warm", node_id=self.node_id)
        if self.state is TrainerState.WARMING:  # else: started meanwhile, its import went on in torchrun
            self._to(TrainerState.NOT_STARTED)

    async def _go(self, warm: asyncio.subprocess.Process, argv: list[str], env: dict[str, str]) -> bool:
        """Hand the job to the prewarmed launcher; False if it is gone."""
        assert warm.stdin is not None
        line = json.dumps({"argv": argv[len(TORCHRUN_ARGV):], "env": env, "cwd": self.cwd()})
        try:
            warm.stdin.write(line.encode() + b"\n")
            await warm.stdin.drain()
            warm.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # it exited while importing
            log.warning("prewarmed_trainer_gone", node_id=self.node_id, exit_code=warm.returncode)
            return False
        return True

    async def start(self, *, join: bool = False, credential: str | None = None,
                    cohort: tuple[int, float] | None = None) -> None:
        """Start the job: torchrun's command, or with ``join`` the job's ``"join"`` spec
        (its workers join the running group in-process; the daemon says so when it admits
        this node into a running job with ``job.grow: in_process``). ``credential``: the
        node's join credential from the daemon's reply, for the workers'
        ``$SPOTVISOR_JOIN_CREDENTIAL``: in their environment only (a prewarmed launcher
        gets it on its standard input), never on a command line or in a log line.
        ``cohort``: ``(nodes, until)`` when the daemon admitted this node at the job's start
        with others (``$SPOTVISOR_START_COHORT``: torchrun's first round waits for theirs)."""
        spec = self.job.get("join") if join and self.job.get("join") else self.job
        self.plain_notice_path.unlink(missing_ok=True)  # a notice file there is from no notice of this trainer
        env = self.job_env()
        env.update(spec.get("env", {}))
        if credential:
            env[JOIN_CREDENTIAL_ENV] = credential
        if cohort is not None and spec is self.job:
            env[START_COHORT_ENV] = f"{cohort[0]}@{cohort[1]:.3f}"
        argv = list(spec["argv"])
        importing = self.state is TrainerState.WARMING
        warm, self.warm = self.warm, None
        if warm is not None and warm.returncode is None and tuple(argv[:2]) == TORCHRUN_ARGV \
                and await self._go(warm, argv, env):
            self.proc = warm
        else:
            self.proc = await self._spawn(unreported(argv, spec.get(UNREPORTED_MAX_RESTARTS_KEY)), env,
                                          asyncio.subprocess.DEVNULL)
        self._to(TrainerState.RUNNING)
        # prewarmed: torchrun's process was already started (imported: and done importing,
        # else it goes on from where its import is)
        log.info("trainer_started", node_id=self.node_id, pid=self.proc.pid, prewarmed=self.proc is warm,
                 imported=self.proc is warm and not importing, **({"join": True} if spec is not self.job else {}))

    async def restart(self, job: dict[str, Any]) -> int | None:
        """The daemon restarts this node's trainer in place (the job stalled:
        :mod:`daemon.control.stall`): stop the one still running (SIGTERM, SIGKILL after
        40 s), take ``job`` (the daemon's ``{"argv", "env", "join"?}``, a new rendezvous id)
        for the next :meth:`start`, and go back to ``not_started``. A trainer not started
        yet only takes the new spec (a prewarmed launcher goes on importing: it is handed
        the spec at :meth:`start`). Returns the exit status of the trainer it stopped;
        None if none ran, or its exit was reaped already (and reported by the caller of
        :meth:`reap`)."""
        code = None
        if self.state is TrainerState.RUNNING:
            await self.stop()
            code = self.reap()
        self.job = job
        if self.state is TrainerState.EXITED:
            self.proc, self.exit_code = None, None
            self._to(TrainerState.NOT_STARTED)
        return code

    async def stop_prewarmed(self) -> None:
        warm, self.warm = self.warm, None
        if warm is not None and warm.returncode is None:
            warm.kill()
            await warm.wait()

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(40):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()
