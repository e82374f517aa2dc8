"""Code delivery on the control node: the pinned ``job.workdir`` and each node's preparation.

- **At start** (:meth:`CodeDelivery.publish`): ``job.workdir`` is packed and hashed
  (:mod:`.workdir`, in a thread) and uploaded to each domain's store once per hash; this
  daemon run **pins** that version (:attr:`CodeDelivery.pin`, ``code_published``): every
  node registering during the run is handed it in its job spec
  (:func:`daemon.controlnode.jobspec.job_spec`), however the directory changes meanwhile.
  A node keeps the version it was handed for its life (``Node.code_version``); an edit
  reaches new nodes after the daemon restarts (a new pin).
- **Each node** of a job with a workdir or a setup is ``preparing`` from its
  registration (:meth:`daemon.controlnode.agent_link.AgentLink.seen`) until its agent
  reports the outcome: ``code_ready`` → ``ready`` (``node_ready`` with ``code_version``
  and ``setup_s``), ``setup_failed`` → ``node_setup_failed``, and the pure decision
  (:func:`daemon.control.setup.on_prepared`) terminates it as ``failed``; the planner
  replaces it. ``job.setup_max_failures`` failures in a row stop the buying
  (``setup_halted``, the line in ``spotctl status``): :meth:`offers` gives the planner
  none until the daemon restarts.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import structlog

from daemon.control.actions import Terminate
from daemon.control.lifecycle import TrainerState
from daemon.control.offers import Offer
from daemon.control.reports import CodeReady, SetupFailed
from daemon.control.setup import SetupRecord, on_prepared
from daemon.controlnode.core import Core
from daemon.controlnode.workdir import CodePin, WorkdirError, pack, publish
from daemon.model import EventKind, Node, NodeState

__all__ = ["CodeDelivery", "WorkdirError"]

log = structlog.get_logger("spotvisor.daemon")


class CodeDelivery:
    """The pinned workdir and the preparation record of one daemon run. Constructor does no I/O.

    ``terminate``: :meth:`daemon.controlnode.fleet.Fleet.apply` (a failed node's release)."""

    def __init__(self, core: Core, *, terminate: Callable[[Terminate], Awaitable[None]]) -> None:
        self.core = core
        self._terminate = terminate
        self.pin: CodePin | None = None  # this run's job.workdir version (None: no workdir)
        self.record = SetupRecord()
        self._failed: set[str] = set()  # nodes whose failure is counted (a repeated report counts once)

    async def publish(self) -> None:
        """Pack, hash and upload ``job.workdir`` (nothing without one), and pin it.

        Raises:
            WorkdirError: it cannot be packed or uploaded (one line naming job.workdir).
        """
        job = self.core.config.job
        if job.workdir is None:
            return
        state = self.core.config.daemon.state_path()
        exclude = list(job.workdir_exclude)
        try:  # the state directory inside the workdir (workdir: .) is never shipped
            exclude.append(state.relative_to(job.workdir).as_posix())
        except ValueError:
            pass
        packed = await asyncio.to_thread(pack, job.workdir, state / "code", exclude=tuple(exclude),
                                         max_bytes=job.workdir_max_bytes)
        self.pin = await asyncio.to_thread(publish, self.core.config, packed)
        log.info("code_published", sha256=packed.sha256, bytes=packed.bytes, files=packed.files)
        self.core.record(EventKind.CODE_PUBLISHED, None, code_version=packed.sha256, workdir=job.workdir,
                         bytes=packed.bytes, files=packed.files, content_bytes=packed.content_bytes,
                         uris=sorted(set(self.pin.uris.values())))

    def offers(self, offers: list[Offer]) -> list[Offer]:
        """What the planner may buy from: none once the buying halted."""
        return [] if self.record.halted else offers

    def status(self) -> dict[str, Any]:
        """``spotctl status``'s ``code``: the pinned version, and the halt line ("" buying)."""
        return {"version": self.pin.sha256 if self.pin else None, "halted": self.record.halted,
                "setup_failures_in_a_row": self.record.failures_in_a_row}

    def on_ready(self, node: Node, msg: CodeReady) -> None:
        """``node``'s agent prepared: ``ready`` (the record's run of failures ends)."""
        core = self.core
        self.record = on_prepared(self.record, core.view(node), ok=True,
                                  max_failures=core.config.job.setup_max_failures).record
        if node.state is not NodeState.PREPARING:
            return  # a repeat, or an agent restarted on a node past its preparation
        if msg.trainer in (TrainerState.WARMING.value, TrainerState.NOT_STARTED.value):
            node.trainer = TrainerState(msg.trainer)  # admission waits for a warming node's import
        node.ready_at = core.clock()
        core.set_state(node, NodeState.READY)
        core.record(EventKind.NODE_READY, node.id, boot_s=round(node.ready_at - node.created_at, 2),
                    code_version=node.code_version or None, setup_s=msg.setup_s)
        core.wake()

    def on_setup_failed(self, node: Node, msg: SetupFailed) -> None:
        """``node``'s preparation failed: ``node_setup_failed``; the node is terminated, and
        after ``job.setup_max_failures`` in a row the buying halts (``setup_halted``)."""
        core = self.core
        if node.id in self._failed:
            return
        self._failed.add(node.id)
        core.record(EventKind.NODE_SETUP_FAILED, node.id, stage=msg.stage, exit_code=msg.exit_code,
                    last_line=msg.last_line, code_version=node.code_version or None)
        out = on_prepared(self.record, core.view(node), ok=False, max_failures=core.config.job.setup_max_failures,
                          stage=msg.stage, exit_code=msg.exit_code, last_line=msg.last_line)
        self.record = out.record
        for action in out.actions:
            if isinstance(action, Terminate):
                core.spawn(self._terminate(action), f"terminate:{action.node_id}")
        if out.halted_now:
            log.error("setup_halted", pool=core.pool, message=out.halted_now)
            core.record(EventKind.SETUP_HALTED, None, failures=out.record.failures_in_a_row,
                        message=out.halted_now)
        core.wake()
