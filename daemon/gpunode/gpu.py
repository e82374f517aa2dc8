"""GPU figures on a GPU node: what its GPUs do, sampled through NVML.

:class:`NvmlSampler` reads, for every GPU of the node, through
NVML (``nvidia-ml-py``, imported as ``pynvml``):

- ``sm_util_pct``: ``nvmlDeviceGetUtilizationRates().gpu``, the percent of the
  last sample period (1/6 s to 1 s depending on the product) during which one or
  more kernels ran. It is a busy-time figure, not SM occupancy: a GPU running one
  small kernel all the time reads 100 %. Low values are the signal that matters
  here (the GPU waits for input).
- ``mem_used_bytes`` / ``mem_total_bytes``: ``nvmlDeviceGetMemoryInfo``.

The agent samples every second and each heartbeat carries, per GPU, the mean
``sm_util_pct`` over the samples taken since the previous heartbeat and the latest
memory figures (:class:`GpuMeans`): a big pool heartbeats only every few seconds
(the daemon stretches the interval, :func:`daemon.control.pool.heartbeat_interval_s`), and
one instant per heartbeat would be a poor reading of how busy the GPUs were.

A node without NVML (a CPU node, no driver, no GPU) reports the sample as
**absent** (``None``), never as zeros: an idle GPU and no GPU are different
facts. A GPU whose query fails (e.g. fallen off the bus) reports ``None`` values
for itself. NVML calls block (microseconds to milliseconds): the agent calls
:meth:`NvmlSampler.sample` through ``asyncio.to_thread``.

The daemon's side (the ``gpu_underutilized`` check over these samples) is
:mod:`daemon.controlnode.gpu_watch`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

import pynvml
import structlog

__all__ = ["GpuSample", "GpuSampler", "NvmlSampler", "GpuMeans"]

log = structlog.get_logger("spotvisor.gpu")


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one instant. ``None`` values: NVML could not read this GPU."""

    index: int
    sm_util_pct: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None
    name: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GpuSampler(Protocol):
    """What the agent samples with. ``sample()`` blocks briefly (call it in a thread);
    it returns one :class:`GpuSample` per GPU, or ``None`` when the node has no GPU
    that NVML can see (absent, not zero)."""

    def sample(self) -> list[GpuSample] | None: ...

    def close(self) -> None: ...


class NvmlSampler:
    """Samples every GPU of this node through NVML; see the module docstring.

    Constructor does no I/O. The first :meth:`sample` initialises NVML; if that
    fails (``NVMLError``: no library, no driver) or finds no GPU, the node is
    GPU-less for the sampler's lifetime and every sample is ``None`` (``reason``
    says why). :meth:`close` is idempotent.
    """

    __slots__ = ("_state", "_handles", "_names", "reason")

    def __init__(self) -> None:
        self._state = "new"  # new | open | absent | closed
        self._handles: list[Any] = []
        self._names: list[str] = []
        self.reason = ""

    def sample(self) -> list[GpuSample] | None:
        if self._state == "new":
            self._open()
        if self._state != "open":
            return None
        out = []
        for i, handle in enumerate(self._handles):
            try:
                util = pynvml.nvmlDeviceGetUtilizationRates(handle)
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            except pynvml.NVMLError as exc:
                log.warning("gpu_query_failed", gpu=i, error=str(exc))
                out.append(GpuSample(i, None, None, None, self._names[i]))
                continue
            out.append(GpuSample(i, float(util.gpu), int(mem.used), int(mem.total), self._names[i]))
        return out

    def close(self) -> None:
        if self._state == "open":
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.warning("nvml_shutdown_failed", error=str(exc))
        self._state = "closed"
        self._handles = []

    def _open(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._absent(f"NVML unavailable: {exc}")
            return
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            self._absent(f"NVML could not list the GPUs: {exc}")
            return
        if not self._handles:
            pynvml.nvmlShutdown()
            self._absent("NVML sees no GPU")
            return
        self._state = "open"
        log.info("gpu_sampling", gpus=len(self._handles), names=self._names)

    def _absent(self, reason: str) -> None:
        self._state = "absent"
        self.reason = reason
        log.info("gpu_absent", reason=reason)


class GpuMeans:
    """The agent's side: the samples taken between two heartbeats, folded into one per GPU.

    :meth:`add` each sample (None: absent); :meth:`take` returns, per GPU index, the mean
    ``sm_util_pct`` of the samples that had one (rounded to 0.1 %; None if none had) with
    the latest memory figures and name, and starts over. It returns None (absent) when
    no sample since the last take had any GPU. Memory stays bounded: sums, not samples.
    """

    __slots__ = ("_sums", "_counts", "_latest", "samples")

    def __init__(self) -> None:
        self._sums: dict[int, float] = {}
        self._counts: dict[int, int] = {}
        self._latest: dict[int, GpuSample] = {}
        self.samples = 0  # samples added since the last take (absent ones included)

    def add(self, samples: list[GpuSample] | None) -> None:
        self.samples += 1
        for g in samples or ():
            self._latest[g.index] = g
            if g.sm_util_pct is not None:
                self._sums[g.index] = self._sums.get(g.index, 0.0) + g.sm_util_pct
                self._counts[g.index] = self._counts.get(g.index, 0) + 1

    def take(self) -> list[GpuSample] | None:
        out = [
            GpuSample(i, round(self._sums[i] / self._counts[i], 1) if self._counts.get(i) else None,
                      g.mem_used_bytes, g.mem_total_bytes, g.name)
            for i, g in sorted(self._latest.items())
        ]
        self._sums, self._counts, self._latest, self.samples = {}, {}, {}, 0
        return out or None


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
