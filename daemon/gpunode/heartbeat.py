"""The node agent's heartbeat (:mod:`daemon.gpunode.agent`).

:class:`Heartbeat` tells the daemon the node is alive, with what it knows of the node: the
trainer's step, its newest ``step`` line's loss and the tokens trained since the agent
started (:class:`StepProgress`), the trainer's state and exit code, how many of its
reports the daemon has not answered yet (``reports_pending``), the GPUs' utilization
and memory (per-GPU means since the last heartbeat, sampled every second:
:class:`daemon.gpunode.gpu.GpuMeans`; absent on a CPU node) and the next chunk of
``trainer.log`` (:mod:`daemon.gpunode.nodelog`). Then it sleeps the interval the
daemon's last reply said (``heartbeat_interval_s``: it grows with the pool,
:func:`daemon.control.pool.heartbeat_interval_s`; until the first reply, the agent's own),
or less when the trainer starts or exits (``beat_now``): the daemon must know at once
whether a trainer runs. Each reply is handed to the agent to apply (it carries commands).
A failed heartbeat is said by the link once an outage, not each time
(:mod:`daemon.gpunode.outage`); the log chunk is read again next time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from daemon.gpunode.daemon_link import MAX_HEARTBEAT_INTERVAL_S, DaemonLink
from daemon.gpunode.gpu import GpuMeans, GpuSampler
from daemon.gpunode.nodelog import read_chunk
from daemon.gpunode.trainer_process import TrainerProcess

__all__ = ["Heartbeat", "StepProgress"]

_MAX_TOKENS_PER_STEP = 2**40  # a step line's `tokens` above this is not counted (a trainer's bug)
_GPU_SAMPLE_S = 1.0


class StepProgress:
    """The trainer's newest ``step`` line and the tokens trained since this agent started
    (the sum of the step lines' ``tokens``). Each heartbeat carries :meth:`body`, so the
    daemon hears of progress once a heartbeat however many steps a second: nothing grows.
    ``step``: the step of the newest status line of any kind (None after a restart)."""

    __slots__ = ("_newest", "_tokens", "step")

    def __init__(self) -> None:
        self._newest: dict[str, Any] | None = None
        self._tokens: int | None = None
        self.step: int | None = None

    def on_line(self, line: dict[str, Any]) -> None:
        """A status line. ``step``: the newest step and its loss (None unless a finite
        number); its ``tokens`` (an integer in [0, 2**40]) added to the total. ``started``
        (a new attempt): no newest step until its first. Others: nothing."""
        step, loss, tokens = line.get("step"), line.get("loss"), line.get("tokens")
        if isinstance(step, int):
            self.step = step
        if line.get("event") == "started":
            self._newest = None
        if line.get("event") != "step" or not isinstance(step, int) or isinstance(step, bool):
            return
        ok_loss = isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)
        self._newest = {"step": step, "loss": float(loss) if ok_loss else None}
        if isinstance(tokens, int) and not isinstance(tokens, bool) and 0 <= tokens <= _MAX_TOKENS_PER_STEP:
            self._tokens = (self._tokens or 0) + tokens

    def body(self) -> dict[str, Any] | None:
        """The heartbeat's ``progress`` (:func:`daemon.control.reports.parse_progress`)."""
        return None if self._newest is None else {**self._newest, "tokens": self._tokens}


@dataclass(eq=False)
class Heartbeat:
    """One node's heartbeats and GPU samples (see the module docstring).

    Args:
        link: the channel to the daemon.
        runner: the trainer's processes (their state and exit code are reported).
        progress: the trainer's step lines, as the agent reads them.
        gpu_sampler: samples the GPUs (closed by its owner, the agent).
        log_path: the trainer's log, shipped a chunk a heartbeat.
        interval_s: seconds between heartbeats until the daemon says.
        beat_now: set when the trainer's state changes: heartbeat without waiting.
        apply: the agent's handling of a reply (commands, start the trainer).

    Attributes:
        told_interval_s: the daemon's last word on the interval (None before its first).
        beat_sent: set after each heartbeat the daemon answered.
    """

    _: KW_ONLY
    link: DaemonLink
    runner: TrainerProcess
    progress: StepProgress
    gpu_sampler: GpuSampler
    log_path: Path
    interval_s: float
    beat_now: asyncio.Event
    apply: Callable[[dict[str, Any]], Awaitable[None]]
    told_interval_s: float | None = field(default=None, init=False)
    beat_sent: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    # trainer.log offset the daemon holds up to (its last reply)
    _log_want: int | None = field(default=None, init=False, repr=False)
    _gpu: GpuMeans = field(default_factory=GpuMeans, init=False, repr=False)  # samples since the last heartbeat

    def heed_interval(self, reply: dict[str, Any]) -> None:
        """Take the heartbeat interval the daemon wants (a reply without one: keep the last)."""
        v = reply.get("heartbeat_interval_s")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= MAX_HEARTBEAT_INTERVAL_S:
            self.told_interval_s = float(v)

    async def beat(self) -> None:
        """Heartbeat for good (see the module docstring)."""
        while True:
            self.beat_now.clear()  # a change from here on is in this heartbeat or calls the next one
            if self._gpu.samples == 0:  # none since the last heartbeat (a short interval): one now
                self._gpu.add(await asyncio.to_thread(self.gpu_sampler.sample))
            gpu = self._gpu.take()
            chunk = await asyncio.to_thread(read_chunk, self.log_path, self._log_want)
            try:
                reply = await self.link.post(
                    "/v1/agent/heartbeat",
                    {"step": self.progress.step, "progress": self.progress.body(),
                     "trainer": {"state": self.runner.state.value, "exit_code": self.runner.exit_code},
                     "reports_pending": self.link.reports_pending,
                     "gpu": None if gpu is None else [g.to_dict() for g in gpu], "log": chunk},
                )
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass  # said by the link, once an outage (daemon.gpunode.outage); the chunk is read again next time
            else:
                if isinstance(reply.get("log"), dict):
                    self._log_want = reply["log"].get("offset")
                self.heed_interval(reply)
                await self.apply(reply)
                self.beat_sent.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.told_interval_s or self.interval_s):
                    await self.beat_now.wait()

    async def sample_gpus(self) -> None:
        """Sample the GPUs every second, for good (NVML calls block briefly: in a thread)."""
        while True:
            self._gpu.add(await asyncio.to_thread(self.gpu_sampler.sample))
            await asyncio.sleep(_GPU_SAMPLE_S)
