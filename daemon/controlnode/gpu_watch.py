"""The daemon's check that the job keeps its GPUs busy, over the samples each
heartbeat carries (sampled on the node: :mod:`daemon.gpunode.gpu`).

:class:`GpuWatch` keeps each node's latest sample (for
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

import math
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from daemon.gpunode.gpu import GpuSample

__all__ = ["GpuWatch", "parse_samples", "mean_sm_util", "MAX_GPU_MEMORY_BYTES", "MAX_GPUS"]

log = structlog.get_logger("spotvisor.gpu")


# the most memory one GPU may report (bytes): 1 TiB, past any GPU made (the largest hold
# 288 GB: AMD MI355X; NVIDIA B300). A larger or negative figure is a lie, never exported.
MAX_GPU_MEMORY_BYTES = 2**40
# the most GPUs one node may list (an index is 0..this-1); 8 or 16 on any instance today
MAX_GPUS = 256

Drop = Callable[[str, object], None]


def _log_drop(problem: str, what: object) -> None:
    log.warning("gpu_sample_unparsable", problem=problem, raw=repr(what)[:200])


def _bounded(item: dict[str, Any], key: str, hi: float, drop: Drop, *, integer: bool) -> float | int | None:
    """``item[key]`` if it is a number (an int, for ``integer``) in ``[0, hi]``, finite; else
    None, and ``drop`` is told unless the value was absent (null)."""
    v = item.get(key)
    if v is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kinds):
        drop(f"{key} is not {'an integer' if integer else 'a number'}", item)
        return None
    if not (math.isfinite(v) and 0 <= v <= hi):
        drop(f"{key} {v!r} is outside [0, {hi:g}]", item)
        return None
    return int(v) if integer else float(v)


def parse_samples(raw: object, *, drop: Drop | None = None) -> list[GpuSample] | None:
    """A heartbeat's ``gpu`` field → samples; ``None`` (absent) for null or a bad payload.

    A payload that is not a list of at most :data:`MAX_GPUS` GPU objects (each with an
    ``index`` in ``0..MAX_GPUS-1``) is dropped whole (absent), never guessed at. A figure
    out of bounds is dropped alone (that GPU's figure is absent): ``sm_util_pct`` must be
    a finite percent in [0, 100], ``mem_used_bytes`` and ``mem_total_bytes`` integers in
    [0, :data:`MAX_GPU_MEMORY_BYTES`]. Each drop calls ``drop(problem, what)`` once (the
    daemon logs one line and counts it, :meth:`Supervisor.drop`); default: a log line.
    """
    drop = drop or _log_drop
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_GPUS:
        drop("gpu is not a list of at most 256 GPUs", raw)
        return None
    out = []
    for item in raw:
        index = item.get("index") if isinstance(item, dict) else None
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_GPUS:
            drop("a GPU without an index in 0..255", item)
            return None
        out.append(GpuSample(
            index=index,
            sm_util_pct=_bounded(item, "sm_util_pct", 100.0, drop, integer=False),  # type: ignore[arg-type]
            mem_used_bytes=_bounded(item, "mem_used_bytes", MAX_GPU_MEMORY_BYTES, drop, integer=True),  # type: ignore[arg-type]
            mem_total_bytes=_bounded(item, "mem_total_bytes", MAX_GPU_MEMORY_BYTES, drop, integer=True),  # type: ignore[arg-type]
            name=str(item.get("name") or "")[:64],
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
