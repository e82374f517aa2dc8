"""The embedded provider: an "instance" is a process group on this machine.

Each instance is a node agent (``python -m daemon.gpunode.agent run``) started by a small init
(:data:`daemon.providers.local_instance.INSTANCE_INIT`), in a session of their own (killed as a
whole, like a VM being reclaimed), with its own working directory under
``<state_dir>/nodes/<node_id>/``, its own ``TMPDIR`` (removed when it ends, as a VM's
``/tmp`` goes with the VM: torchrun's log directories, the zygote's socket) and its own
metadata endpoint on 127.0.0.1 speaking one of
`provider.metadata_dialects` (AWS IMDSv2 by default:
:class:`daemon.providers.local_metadata.aws.FakeImds`; the others in
:mod:`daemon.providers.local_metadata`).

Chaos hooks, used by :mod:`daemon.providers.chaos`: :meth:`LocalProvider.publish_interruption`
publishes a spot interruption notice on the instance's metadata endpoint and
SIGKILLs the process group when the notice's time comes, as EC2 would;
:meth:`LocalProvider.kill` SIGKILLs it at once, with no notice.

By default the instances are children of the daemon and end with it, however it ends:
``aclose`` kills them on a graceful stop, and if the daemon dies without closing (SIGKILL, a
crash, the OOM killer) each instance's init sees the end of a pipe only the daemon can write
and kills every process of its instance. A local pool does not survive a daemon restart (the
next daemon finds no instance and launches new ones); cloud providers' instances do.

Under an outside runner (``spotvisord demo`` whose chaos kills the daemon:
:mod:`daemon.interfaces.demo_runner`) the runner holds that pipe's write end and this
provider gets the read end (:data:`~daemon.providers.local_instance.LIFELINE_FD_ENV`): the
instances then outlive the daemon, as a cloud's do. Each serves its own metadata endpoint
(:mod:`daemon.providers.local_metadata.serve`, which also reclaims it at a notice's
deadline), leaves a record in its node directory, and the next daemon's provider adopts the
live ones in :meth:`LocalProvider.describe`; ``aclose`` leaves them running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any
from datetime import datetime, timezone
from pathlib import Path

import psutil
import structlog

from daemon.config import LocalProviderSpec
from daemon.providers.local_gpus import GpuSlots
from daemon.providers.local_instance import (
    ADMIN_TOKEN_FILE,
    INSTANCE_ENV,
    INSTANCE_INIT,
    LIFELINE_FD_ENV,
    RECORD_FILE,
    STORE_PID_FILE_ENV,
    InstanceRecord,
    kill_instance_processes,
    live_records,
    outer_lifeline_fd,
    process_alive,
    wait_gone,
)
from daemon.providers.local_metadata import make_fake
from daemon.control.pool import Offer
from daemon.providers.base import CapacityError, Instance, NodeSpec, Provider, ProviderError, register_provider
from daemon.state_dir import UnsafeStatePath, open_private, private_dir, write_private

__all__ = ["LocalProvider"]

log = structlog.get_logger("spotvisor.provider.local")
#: seconds an instance's SIGKILLed processes get to be gone before its end is called done
KILL_WAIT_S = 10.0

# the names this module had before the instance's side moved out (tests import them here)
_INSTANCE_ENV, _INSTANCE_INIT, _kill_instance_processes = INSTANCE_ENV, INSTANCE_INIT, kill_instance_processes
#: what the instances' environment never carries: the runner's descriptors are the daemon's
_RUNNER_ENV = (LIFELINE_FD_ENV, STORE_PID_FILE_ENV)

@dataclass(slots=True)
class _LocalInstance:
    id: str
    node: NodeSpec
    offer: Offer
    workdir: Path
    launched_at: float
    dialect: str = "aws"
    imds: Any = None  # the fake metadata endpoint of ``dialect``, in this process (the daemon's lifeline)
    imds_url: str | None = None  # the endpoint's URL, wherever it runs
    proc: asyncio.subprocess.Process | None = None  # None: adopted from an earlier daemon
    pid: int | None = None  # the init's, and its psutil create_time: an adopted instance is checked by both
    create_time: float = 0.0
    published_at: float | None = None  # the current notice's, as the instance's own endpoint answered
    state: str = "pending"  # pending | running | gone
    gpus: str | None = None  # its CUDA_VISIBLE_DEVICES (daemon/providers/local_gpus.py); None: left as it was
    tmp: str | None = None  # its own TMPDIR, removed with it, as a VM's /tmp goes with the VM
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


@register_provider("local")
class LocalProvider(Provider):
    """Process-group instances; see the module docstring.

    Args:
        spec: ``launch_delay_s`` (seconds between launch and the agent starting),
            ``spot_price_usd_h``.
        state_dir: where instance working directories go.
        agent_args: extra arguments for every agent (e.g. poll interval).
        gpus_needed: ``pool.max_nodes`` x the largest local ``gpus_per_node`` (:mod:`~daemon.providers.local_gpus`).

    Raises:
        ValueError: :data:`~daemon.providers.local_instance.LIFELINE_FD_ENV` is set but names
            no inherited pipe.
    """

    name = "local"

    def __init__(self, *, spec: LocalProviderSpec, state_dir: Path, agent_args: list[str] | None = None,
                 gpus_needed: int = 0) -> None:
        self.spec = spec
        self._gpus = GpuSlots.of_host(gpus_needed)  # one set per instance, or none for any
        self.state_dir = Path(state_dir)
        self.agent_args = list(agent_args or [])
        self._instances: dict[str, _LocalInstance] = {}
        self._seq = 0
        self._closed = False
        self._boot_gate = asyncio.Event()  # cleared by chaos: instances launched meanwhile wait to boot
        self._boot_gate.set()
        self._capacity_out: dict[str, float] = {}  # region → unix s until which launches there fail (chaos)
        # the instances' lifeline (see INSTANCE_INIT): each instance's init gets the read end;
        # the write end stays here, close-on-exec, until aclose() or this process's death;
        # or an outside runner holds it and passed us the read end (the instances outlive us)
        self._lifeline: tuple[int, int] | None = None
        self._outer_lifeline = outer_lifeline_fd()
        if self._outer_lifeline is not None:
            os.set_inheritable(self._outer_lifeline, False)  # to the instances' inits only (pass_fds)

    @property
    def outlives_daemon(self) -> bool:
        """Whether the instances outlive this daemon (an outside runner holds their lifeline)."""
        return self._outer_lifeline is not None

    # -- contract -------------------------------------------------------------
    async def launch(self, offer: Offer, node: NodeSpec) -> Instance:
        if self._closed:
            raise RuntimeError("LocalProvider is closed")
        until = self._capacity_out.get(offer.region)
        if until is not None and time.time() < until:
            # what EC2 answers when a zone has no spot capacity (InsufficientInstanceCapacity)
            raise CapacityError(f"no capacity for {offer.instance_type} in {offer.region} "
                                f"(chaos capacity_out for {until - time.time():.0f} s more)")
        self._seq += 1
        iid = f"local-{os.getpid()}-{self._seq:04d}"
        workdir = self.state_dir / "nodes" / node.node_id
        try:  # a link planted on the way is refused, not followed (daemon.state_dir)
            private_dir(workdir, root=self.state_dir)
        except UnsafeStatePath as exc:
            raise ProviderError(str(exc)) from exc
        dialects = self.spec.metadata_dialects
        inst = _LocalInstance(iid, node, offer, workdir, time.time(), dialect=dialects[(self._seq - 1) % len(dialects)])
        self._instances[iid] = inst
        self._spawn(inst, self._boot(inst), f"local:boot:{node.node_id}")
        log.info("instance_launch_accepted", instance_id=iid, node_id=node.node_id)
        return self._view(inst)

    async def terminate(self, instance_id: str) -> None:
        inst = self._instances.get(instance_id)
        if inst is None or inst.state == "gone":
            return
        await self._kill(inst, reason="terminate")

    async def describe(self, tag: str) -> list[Instance]:
        if self.outlives_daemon and not self._closed:
            self._adopt(await asyncio.to_thread(live_records, self.state_dir))
        return [
            self._view(i)
            for i in self._instances.values()
            if i.node.pool == tag and self._refresh(i) != "gone"
        ]

    async def spot_price(self, offer: Offer) -> float | None:
        return self.spec.spot_price_usd_h

    async def aclose(self) -> None:
        """Kill every instance (the daemon's lifeline); under an outside runner leave them
        running, as a cloud provider does: only this process's own tasks stop."""
        if self._closed:
            return
        self._closed = True
        for inst in list(self._instances.values()):
            if self.outlives_daemon:
                for t in list(inst.tasks):
                    t.cancel()
            else:
                await self._kill(inst, reason="provider_closed")
        if self._lifeline is not None:
            for fd in self._lifeline:
                os.close(fd)
            self._lifeline = None

    # -- chaos hooks ----------------------------------------------------------
    async def publish_interruption(self, instance_id: str, *, lead_s: float, action: str = "terminate") -> datetime:
        """Publish a spot interruption notice; SIGKILL the instance ``lead_s`` seconds later.

        Returns the notice's deadline (aware UTC). Raises KeyError for an unknown or
        gone instance, RuntimeError if it has not booted yet (no metadata endpoint).
        """
        inst = self._live(instance_id)
        if inst.imds is None and inst.imds_url is None:
            raise RuntimeError(f"instance {instance_id} has not booted yet")
        deadline = datetime.fromtimestamp(time.time() + lead_s, tz=timezone.utc)
        if inst.imds is not None:
            inst.imds.publish_interruption(action=action, time=deadline)
            self._spawn(inst, self._kill_at(inst, lead_s), f"local:reclaim:{inst.node.node_id}")
        else:  # the instance's own endpoint, which reclaims it at the deadline (serve.py)
            from daemon.providers.local_metadata.serve import publish_interruption

            token = await asyncio.to_thread(_read_private, inst.workdir / ADMIN_TOKEN_FILE)
            inst.published_at = await publish_interruption(inst.imds_url, token, action=action,  # type: ignore[arg-type]
                                                           deadline=deadline.timestamp())
        log.info("interruption_published", instance_id=instance_id, lead_s=lead_s)
        return deadline

    def notice_published_at(self, instance_id: str) -> float | None:
        """Unix time the current notice appeared on the instance's endpoint (None: none)."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return None
        return inst.published_at if inst.imds is None else inst.imds.published_at

    def capacity_out(self, region: str, for_s: float) -> None:
        """Chaos: every launch in ``region`` fails with a capacity error for ``for_s`` seconds."""
        self._capacity_out[region] = time.time() + for_s

    def hold_boots(self) -> None:
        """Chaos: instances launched from now on (and those still booting) do not boot until
        :meth:`release_boots`; the supervisor sees them in ``launching``."""
        self._boot_gate.clear()

    def release_boots(self) -> None:
        self._boot_gate.set()

    def dialect(self, instance_id: str) -> str:
        return self._instances[instance_id].dialect

    async def kill(self, instance_id: str) -> None:
        """SIGKILL the instance's process group now, with no notice."""
        await self._kill(self._live(instance_id), reason="chaos_kill")

    def workdir(self, instance_id: str) -> Path:
        return self._instances[instance_id].workdir

    # -- internals ------------------------------------------------------------
    def _live(self, instance_id: str) -> _LocalInstance:
        inst = self._instances.get(instance_id)
        if inst is None or self._refresh(inst) == "gone":
            raise KeyError(f"no live local instance {instance_id}")
        return inst

    def _spawn(self, inst: _LocalInstance, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        inst.tasks.add(task)
        task.add_done_callback(inst.tasks.discard)

    def _adopt(self, records: list[InstanceRecord]) -> None:
        """Take in the live instances an earlier daemon of this state directory launched
        (their records, :func:`~daemon.providers.local_instance.live_records`: a record whose
        init is gone, or whose pid another process now has, is not among them)."""
        known = set(self._instances)
        for rec in records:
            if rec.id in known:
                continue
            node = NodeSpec(node_id=rec.node_id, pool=rec.pool, token="", daemon_url="")
            inst = _LocalInstance(rec.id, node, Offer(**rec.offer), self.state_dir / "nodes" / rec.node_id,
                                  rec.launched_at, dialect=rec.dialect, imds_url=rec.imds_url, pid=rec.pid,
                                  create_time=rec.create_time, state="running", gpus=rec.gpus, tmp=rec.tmp)
            self._instances[rec.id] = inst
            if rec.gpus:  # still in use by it: never handed to another instance
                self._gpus.hold(rec.id, rec.gpus)
            log.info("instance_adopted", instance_id=rec.id, node_id=rec.node_id, pid=rec.pid)

    async def _boot(self, inst: _LocalInstance) -> None:
        await asyncio.sleep(self.spec.launch_delay_s)  # simulated boot time
        await self._boot_gate.wait()  # chaos: replacements held back (a slow or short region)
        if inst.state == "gone":
            return
        meta_sock: socket.socket | None = None
        meta_argv: list[str] = []
        if self._outer_lifeline is None:
            inst.imds = make_fake(inst.dialect)
            await inst.imds.start()
            inst.imds_url = inst.imds.url
        else:  # the instance serves its own endpoint, on a socket bound here (its URL known now)
            meta_sock = socket.create_server(("127.0.0.1", 0))
            inst.imds_url = f"http://127.0.0.1:{meta_sock.getsockname()[1]}"
            token_file = inst.workdir / ADMIN_TOKEN_FILE
            await asyncio.to_thread(write_private, token_file, secrets.token_urlsafe(32).encode(), atomic=True)
            meta_argv = ["-m", "daemon.providers.local_metadata.serve", "--dialect", inst.dialect,
                         "--fd", str(meta_sock.fileno()), "--token-file", str(token_file)]
        log_file = os.fdopen(open_private(inst.workdir / "instance.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")
        try:
            env = {k: v for k, v in os.environ.items() if k not in _RUNNER_ENV}
            env["SPOTVISOR_AGENT_TOKEN"] = inst.node.token
            env[INSTANCE_ENV] = inst.id  # marks every process of this "VM", see kill_instance_processes
            env["TMPDIR"] = inst.tmp = inst.tmp or await asyncio.to_thread(tempfile.mkdtemp, prefix="spotvisor-vm-")
            env.setdefault("PYTHONUNBUFFERED", "1")
            inst.gpus = self._gpus.take(inst.id, inst.offer.gpus_per_node)
            if inst.gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = inst.gpus
            if self._outer_lifeline is not None:
                watch_fd = self._outer_lifeline
            else:
                if self._lifeline is None:
                    self._lifeline = os.pipe()  # both ends non-inheritable (PEP 446)
                watch_fd = self._lifeline[0]
            ca_args = [] if inst.node.ca_cert_pem is None else ["--ca-file", str(inst.workdir / "daemon-ca.pem")]
            if ca_args:  # an https daemon URL: the agent trusts the daemon's CA only
                await asyncio.to_thread(write_private, Path(ca_args[1]), inst.node.ca_cert_pem.encode())
            meta_fd = -1 if meta_sock is None else meta_sock.fileno()
            inst.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", INSTANCE_INIT, str(watch_fd), str(meta_fd), str(len(meta_argv)), *meta_argv,
                "-m", "daemon.gpunode.agent", "run",
                "--daemon-url", inst.node.daemon_url,
                "--node-id", inst.node.node_id,
                "--dialect", inst.dialect,
                "--metadata-url", inst.imds_url,
                "--workdir", str(inst.workdir),
                *ca_args,
                *self.agent_args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own session and process group, as a VM
                pass_fds=(watch_fd,) if meta_sock is None else (watch_fd, meta_fd),
                env=env,
            )
        finally:
            log_file.close()
            if meta_sock is not None:
                meta_sock.close()  # the instance's endpoint has its own
        inst.pid = inst.proc.pid
        inst.state = "running"
        if self._outer_lifeline is not None:  # what the next daemon adopts it by
            await asyncio.to_thread(self._write_record, inst)
        log.info("instance_running", instance_id=inst.id, pid=inst.proc.pid)

    def _write_record(self, inst: _LocalInstance) -> None:
        try:
            inst.create_time = psutil.Process(inst.pid).create_time()
        except psutil.Error:  # gone already: nothing to adopt
            return
        InstanceRecord(id=inst.id, node_id=inst.node.node_id, pool=inst.node.pool, pid=inst.pid or 0,
                       create_time=inst.create_time, imds_url=inst.imds_url or "", dialect=inst.dialect,
                       offer=dataclasses.asdict(inst.offer), launched_at=inst.launched_at,
                       gpus=inst.gpus, tmp=inst.tmp).write(inst.workdir)

    async def _kill_at(self, inst: _LocalInstance, delay_s: float) -> None:
        await asyncio.sleep(delay_s)  # the notice's lead time, as the cloud gives it
        await self._kill(inst, reason="spot_reclaimed")

    async def _kill(self, inst: _LocalInstance, *, reason: str) -> None:
        was = inst.state
        inst.state = "gone"
        for t in [t for t in inst.tasks if t is not asyncio.current_task()]:
            t.cancel()
        if inst.proc is not None and inst.proc.returncode is None:
            await _end_processes(inst.proc, inst.id)
        elif inst.proc is None and inst.pid is not None and process_alive(inst.pid, inst.create_time):
            await asyncio.to_thread(_kill_adopted, inst.pid, inst.id)
        await asyncio.to_thread(_remove_tmp, inst.tmp)  # nothing of it runs any more
        if inst.imds is not None:
            await inst.imds.aclose()
        if inst.pid is not None and self._outer_lifeline is not None:
            (inst.workdir / RECORD_FILE).unlink(missing_ok=True)
        self._gpus.give_back(inst.id)  # its processes are gone: nothing runs on them
        if was != "gone":
            log.info("instance_gone", instance_id=inst.id, reason=reason)

    def _refresh(self, inst: _LocalInstance) -> str:
        if inst.state == "running":
            if inst.proc is not None:
                ended = inst.proc.returncode is not None
            else:  # adopted: not our child
                ended = inst.pid is None or not process_alive(inst.pid, inst.create_time)
            if ended:
                inst.state = "gone"
                self._gpus.give_back(inst.id)
        return inst.state

    def _view(self, inst: _LocalInstance) -> Instance:
        return Instance(
            id=inst.id,
            node_id=inst.node.node_id,
            provider=self.name,
            state=inst.state,
            zone=inst.offer.zone,
            instance_type=inst.offer.instance_type,
            launched_at=inst.launched_at,
        )


def _read_private(path: Path) -> str:
    with os.fdopen(open_private(path, os.O_RDONLY), "rb") as f:
        return f.read(4096).decode().strip()


async def _end_processes(init: asyncio.subprocess.Process, instance_id: str) -> None:
    """SIGKILL every process of an instance whose init is this process's child, and return
    once they are gone, as a reclaimed VM's are (a SIGKILLed process runs on until it is
    scheduled: a moment on a busy host; :data:`KILL_WAIT_S` at most, then a warning).
    The sweeps read every process's environment: off the event loop."""
    victims = await asyncio.to_thread(kill_instance_processes, init.pid, instance_id)
    await init.wait()  # then again: what the init spawned during the sweep was not in /proc yet
    victims += await asyncio.to_thread(kill_instance_processes, init.pid, instance_id)
    alive = await asyncio.to_thread(wait_gone, victims, KILL_WAIT_S)
    if alive:
        log.warning("instance_processes_alive", instance_id=instance_id, pids=[p.pid for p in alive][:20])


def _remove_tmp(path: str | None) -> None:
    """An ended instance's TMPDIR (torchrun's log directories, the zygote's socket, what
    its workers put there): gone with it. Nothing when it had none (an older record)."""
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _kill_adopted(pid: int, instance_id: str) -> None:
    """SIGKILL an adopted instance (not this process's child) and wait, 10 s at most, until
    its processes are gone."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        procs = []
    procs += kill_instance_processes(pid, instance_id)
    wait_gone(procs, KILL_WAIT_S)
