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

from dataclasses import dataclass
from typing import Any

import structlog

from daemon.gpunode.gpu import GpuSample

__all__ = ["GpuWatch", "parse_samples", "mean_sm_util"]

log = structlog.get_logger("spotvisor.gpu")


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
