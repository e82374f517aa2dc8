"""The embedded provider: an "instance" is a process group on this machine.

Each instance is a node agent (``python -m daemon.gpunode.agent run``) started by a small init
(:data:`_INSTANCE_INIT`), in a session of their own (killed as a whole, like a VM
being reclaimed), with its own working directory under ``<state_dir>/nodes/<node_id>/``
and its own metadata endpoint on 127.0.0.1 speaking one of `provider.metadata_dialects` (AWS IMDSv2 by
default: :class:`daemon.providers.local_metadata.aws.FakeImds`; the others in
:mod:`daemon.providers.local_metadata`).

Chaos hooks, used by :mod:`daemon.providers.chaos`: :meth:`LocalProvider.publish_interruption`
publishes a spot interruption notice on the instance's metadata endpoint and
SIGKILLs the process group when the notice's time comes, as EC2 would;
:meth:`LocalProvider.kill` SIGKILLs it at once, with no notice.

The instances are children of the daemon and end with it, however it ends: ``aclose``
kills them on a graceful stop, and if the daemon dies without closing (SIGKILL, a
crash, the OOM killer) each instance's first process, a small init
(:data:`_INSTANCE_INIT`), sees the end of a pipe only the daemon can write and kills
every process of its instance. A local pool does not survive a daemon restart (the
next daemon finds no instance and launches new ones); cloud providers' instances do.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from datetime import datetime, timezone
from pathlib import Path

import psutil
import structlog

from daemon.config import LocalProviderSpec
from daemon.providers.local_metadata import make_fake
from daemon.control.pool import Offer
from daemon.providers.base import CapacityError, Instance, NodeSpec, Provider, ProviderError, register_provider
from daemon.state_dir import UnsafeStatePath, open_private, private_dir

__all__ = ["LocalProvider"]

log = structlog.get_logger("spotvisor.provider.local")

_INSTANCE_ENV = "SPOTVISOR_LOCAL_INSTANCE_ID"

# The first process of every local instance (``python -c _INSTANCE_INIT WATCH_FD ARGV...``),
# its "init": the VM the node agent runs on. It starts ``python ARGV...`` (the agent) and
# ends the whole instance (SIGKILL to every process of it, as a reclaimed VM) as soon as
# one of these happens:
#
# - end of file on WATCH_FD, the read end of a pipe whose write end only the daemon holds
#   (it is close-on-exec there, and every child the daemon starts gets only the fds it is
#   passed): the kernel closes it when the daemon dies, however it dies;
# - the agent exits (the provider then lists the instance gone: nothing of it may train on);
# - SIGTERM, SIGHUP or SIGINT.
#
# It is the instance's child subreaper (PR_SET_CHILD_SUBREAPER): a process of the instance
# whose parent dies (torchrun's workers run in sessions of their own) is re-parented to it,
# never to the system's init, so "every process of the instance" is exactly its
# descendants, and it reaps them. Standard library and psutil only: it starts in ~50 ms.
_INSTANCE_INIT = r"""
import ctypes, os, selectors, signal, sys
import psutil

watch_fd, argv = int(sys.argv[1]), sys.argv[2:]
os.set_inheritable(watch_fd, False)
try:
    if ctypes.CDLL(None, use_errno=True).prctl(36, *map(ctypes.c_ulong, (1, 0, 0, 0))) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
except (AttributeError, OSError) as exc:  # not Linux: orphans of the instance are not found after the daemon
    print(f"spotvisor local instance: no child subreaper ({exc})", file=sys.stderr, flush=True)
ending = []
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)  # every signal below wakes the select
signal.signal(signal.SIGCHLD, lambda *_: None)
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, lambda signum, _: ending.append(signum))
agent = os.posix_spawn(sys.executable, [sys.executable, *argv], os.environ,
                       setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))  # as subprocess's restore_signals
status = None
sel = selectors.DefaultSelector()
sel.register(watch_fd, selectors.EVENT_READ)
sel.register(wake_r, selectors.EVENT_READ)
while status is None and not ending:
    for key, _ in sel.select():
        if key.fd == watch_fd:
            if not os.read(watch_fd, 512):
                ending.append("daemon gone")
        else:
            os.read(wake_r, 512)
    while True:  # reap the agent, and any orphan of the instance re-parented here
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid == agent:
            status = st
me = psutil.Process()
while True:  # the instance ends: kill every descendant, reap, until none is left
    for proc in me.children(recursive=True):
        try:
            proc.kill()
        except psutil.Error:
            pass
    try:
        pid, st = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if pid == agent and status is None:
        status = st
code = os.waitstatus_to_exitcode(status) if status is not None else 128 + signal.SIGKILL
sys.exit(code if code >= 0 else 128 - code)
"""


def _kill_instance_processes(root_pid: int, instance_id: str) -> None:
    """SIGKILL every process of a local instance at once, as a VM being reclaimed.

    torchrun starts its workers in sessions of their own (``start_new_session``),
    so killing the instance's process group is not enough: collect the instance
    init's descendants and any process carrying this instance's id in its
    environment (orphans re-parented to the system's init, should the instance's
    own have died first), then kill them all.
    """
    victims: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(root_pid)
        victims[root.pid] = root
        victims.update((c.pid, c) for c in root.children(recursive=True))
    except psutil.NoSuchProcess:
        pass
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid in victims or proc.pid == me:
            continue
        try:
            if proc.environ().get(_INSTANCE_ENV) == instance_id:
                victims[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    for proc in victims.values():
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


@dataclass(slots=True)
class _LocalInstance:
    id: str
    node: NodeSpec
    offer: Offer
    workdir: Path
    launched_at: float
    dialect: str = "aws"
    imds: Any = None  # the fake metadata endpoint of ``dialect``
    proc: asyncio.subprocess.Process | None = None
    state: str = "pending"  # pending | running | gone
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


def _write_private(path: Path, data: bytes) -> None:
    """Write ``path`` (0600) in the state directory, never through a planted link."""
    fd = open_private(path, os.O_WRONLY | os.O_CREAT)
    with os.fdopen(fd, "wb") as f:
        f.truncate(0)
        f.write(data)


@register_provider("local")
class LocalProvider(Provider):
    """Process-group instances; see the module docstring.

    Args:
        spec: ``launch_delay_s`` (seconds between launch and the agent starting),
            ``spot_price_usd_h``.
        state_dir: where instance working directories go.
        agent_args: extra arguments for every agent (e.g. poll interval).
    """

    name = "local"

    def __init__(self, *, spec: LocalProviderSpec, state_dir: Path, agent_args: list[str] | None = None) -> None:
        self.spec = spec
        self.state_dir = Path(state_dir)
        self.agent_args = list(agent_args or [])
        self._instances: dict[str, _LocalInstance] = {}
        self._seq = 0
        self._closed = False
        self._boot_gate = asyncio.Event()  # cleared by chaos: instances launched meanwhile wait to boot
        self._boot_gate.set()
        self._capacity_out: dict[str, float] = {}  # region → unix s until which launches there fail (chaos)
        # the instances' lifeline (see _INSTANCE_INIT): each instance's init gets the read end;
        # the write end stays here, close-on-exec, until aclose() or this process's death
        self._lifeline: tuple[int, int] | None = None

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
        return [
            self._view(i)
            for i in self._instances.values()
            if i.node.pool == tag and self._refresh(i) != "gone"
        ]

    async def spot_price(self, offer: Offer) -> float | None:
        return self.spec.spot_price_usd_h

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for inst in list(self._instances.values()):
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
        if inst.imds is None:
            raise RuntimeError(f"instance {instance_id} has not booted yet")
        deadline = datetime.fromtimestamp(time.time() + lead_s, tz=timezone.utc)
        inst.imds.publish_interruption(action=action, time=deadline)
        self._spawn(inst, self._kill_at(inst, lead_s), f"local:reclaim:{inst.node.node_id}")
        log.info("interruption_published", instance_id=instance_id, lead_s=lead_s)
        return deadline

    def notice_published_at(self, instance_id: str) -> float | None:
        """Unix time the current notice appeared on the instance's endpoint (None: none)."""
        inst = self._instances.get(instance_id)
        return None if inst is None or inst.imds is None else inst.imds.published_at

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

    async def _boot(self, inst: _LocalInstance) -> None:
        await asyncio.sleep(self.spec.launch_delay_s)  # simulated boot time
        await self._boot_gate.wait()  # chaos: replacements held back (a slow or short region)
        if inst.state == "gone":
            return
        inst.imds = make_fake(inst.dialect)
        await inst.imds.start()
        log_file = os.fdopen(open_private(inst.workdir / "instance.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")
        try:
            env = dict(os.environ)
            env["SPOTVISOR_AGENT_TOKEN"] = inst.node.token
            env[_INSTANCE_ENV] = inst.id  # marks every process of this "VM", see _kill_instance_processes
            env.setdefault("PYTHONUNBUFFERED", "1")
            if self._lifeline is None:
                self._lifeline = os.pipe()  # both ends non-inheritable (PEP 446)
            watch_fd = self._lifeline[0]
            ca_args = [] if inst.node.ca_cert_pem is None else ["--ca-file", str(inst.workdir / "daemon-ca.pem")]
            if ca_args:  # an https daemon URL: the agent trusts the daemon's CA only
                await asyncio.to_thread(_write_private, Path(ca_args[1]), inst.node.ca_cert_pem.encode())
            inst.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _INSTANCE_INIT, str(watch_fd),
                "-m", "daemon.gpunode.agent", "run",
                "--daemon-url", inst.node.daemon_url,
                "--node-id", inst.node.node_id,
                "--dialect", inst.dialect,
                "--metadata-url", inst.imds.url,
                "--workdir", str(inst.workdir),
                *ca_args,
                *self.agent_args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own session and process group, as a VM
                pass_fds=(watch_fd,),
                env=env,
            )
        finally:
            log_file.close()
        inst.state = "running"
        log.info("instance_running", instance_id=inst.id, pid=inst.proc.pid)

    async def _kill_at(self, inst: _LocalInstance, delay_s: float) -> None:
        await asyncio.sleep(delay_s)  # the notice's lead time, as the cloud gives it
        await self._kill(inst, reason="spot_reclaimed")

    async def _kill(self, inst: _LocalInstance, *, reason: str) -> None:
        was = inst.state
        inst.state = "gone"
        current = asyncio.current_task()
        for t in list(inst.tasks):
            if t is not current:
                t.cancel()
        if inst.proc is not None and inst.proc.returncode is None:
            _kill_instance_processes(inst.proc.pid, inst.id)
            await inst.proc.wait()
        if inst.imds is not None:
            await inst.imds.aclose()
        if was != "gone":
            log.info("instance_gone", instance_id=inst.id, reason=reason)

    def _refresh(self, inst: _LocalInstance) -> str:
        if inst.state == "running" and inst.proc is not None and inst.proc.returncode is not None:
            inst.state = "gone"
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
