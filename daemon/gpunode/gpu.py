"""GPU utilization: what a node's GPUs do, sampled through NVML, and the daemon's
check that the job keeps them busy.

**Agent side.** :class:`NvmlSampler` reads, for every GPU of the node, through
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

**Daemon side.** :class:`GpuWatch` keeps each node's latest sample (for
``spotctl status`` and ``/metrics``) and decides ``gpu_underutilized``: while a
node runs the job's trainer, the mean SM utilization over its GPUs stays below
``threshold_pct`` (default 50 %) for ``window_s`` (default 300 s). One event per
*episode*: the episode ends when a sample reaches the threshold, the node stops
training, or its samples become absent; a new episode can then fire again.
Usually this is a data-loading bottleneck (too few loader workers, slow storage).

Each heartbeat is one observation (its mean over the interval since the last one),
so the window holds fewer, smoother observations when the interval is long: with
1,000 nodes told 40 s, a 300 s window is 7 or 8 heartbeats of 40 s means each.

Example (threshold 50 %, window 300 s, one heartbeat a second): a node reads 30 %
from 12:00:00; at 12:05:00 the event fires once (mean 30 %); it keeps reading
30 %, nothing more; at 12:07:00 it reads 80 %, the episode ends; from 12:10:00 it
reads 20 % again, and at 12:15:00 a second event fires.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

import pynvml
import structlog

__all__ = ["GpuSample", "GpuSampler", "NvmlSampler", "GpuMeans", "GpuWatch", "parse_samples", "mean_sm_util"]

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


def parse_samples(raw: object) -> list[GpuSample] | None:
    """A heartbeat's ``gpu`` field → samples; ``None`` (absent) for null or a bad payload.

    A payload that is not a list of GPU objects is logged and dropped (absent),
    never guessed at.
    """
    if raw is None:
        return None
    if not isinstance(raw, list):
        log.warning("gpu_sample_unparsable", raw=repr(raw)[:200])
        return None
    out = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("index"), int):
            log.warning("gpu_sample_unparsable", raw=repr(item)[:200])
            return None
        util, used, total = item.get("sm_util_pct"), item.get("mem_used_bytes"), item.get("mem_total_bytes")
        out.append(GpuSample(
            index=item["index"],
            sm_util_pct=float(util) if isinstance(util, (int, float)) else None,
            mem_used_bytes=int(used) if isinstance(used, int) else None,
            mem_total_bytes=int(total) if isinstance(total, int) else None,
            name=str(item.get("name") or ""),
        ))
    return out or None


def mean_sm_util(samples: list[GpuSample] | None) -> float | None:
    """Mean SM utilization (percent) over the GPUs that reported one; None if none did."""
    utils = [s.sm_util_pct for s in samples or () if s.sm_util_pct is not None]
    return sum(utils) / len(utils) if utils else None


@dataclass(slots=True)
class _Episode:
    since: float  # unix s of the first low sample
    total: float = 0.0  # sum of the node means seen in the episode (percent)
    count: int = 0
    reported: bool = False


class GpuWatch:
    """Per node: the latest GPU sample and the low-utilization episode; see the module docstring.

    Args:
        threshold_pct: mean SM utilization below this (percent) is "low".
        window_s: a low episode this long (seconds) is reported, once.

    Raises:
        ValueError: a threshold outside (0, 100] or a window that is not positive.
    """

    __slots__ = ("threshold_pct", "window_s", "_latest", "_episodes")

    def __init__(self, *, threshold_pct: float = 50.0, window_s: float = 300.0) -> None:
        if not 0 < threshold_pct <= 100:
            raise ValueError(f"threshold_pct must be in (0, 100], got {threshold_pct}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.threshold_pct = threshold_pct
        self.window_s = window_s
        self._latest: dict[str, list[GpuSample] | None] = {}
        self._episodes: dict[str, _Episode] = {}

    def latest(self, node_id: str) -> list[GpuSample] | None:
        """The node's last sample (None: absent, or nothing heard yet)."""
        return self._latest.get(node_id)

    def observe(self, node_id: str, samples: list[GpuSample] | None, *, now: float,
                training: bool) -> dict[str, Any] | None:
        """Take one sample of ``node_id`` at ``now`` (unix s).

        ``training``: the node runs the job's trainer now (outside of that, idle GPUs
        are expected: booting, waiting to be admitted, draining). Returns the
        ``gpu_underutilized`` event data when this sample completes a window, else None.
        """
        self._latest[node_id] = samples
        mean = mean_sm_util(samples)
        if not training or mean is None or mean >= self.threshold_pct:
            self._episodes.pop(node_id, None)
            return None
        ep = self._episodes.get(node_id)
        if ep is None:
            ep = self._episodes[node_id] = _Episode(since=now)
        ep.total += mean
        ep.count += 1
        if ep.reported or now - ep.since < self.window_s:
            return None
        ep.reported = True
        return {
            "mean_sm_util_pct": round(ep.total / ep.count, 1),
            "last_sm_util_pct": round(mean, 1),
            "threshold_pct": self.threshold_pct,
            "window_s": self.window_s,
            "below_since": ep.since,
            "gpus": len(samples or ()),
        }

    def forget(self, node_id: str) -> None:
        """Drop what is known of a node (it is gone)."""
        self._latest.pop(node_id, None)
        self._episodes.pop(node_id, None)
