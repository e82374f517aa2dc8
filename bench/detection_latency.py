"""Detection latency of an interruption notice, per metadata dialect, at the agent's defaults.

For every dialect (aws, aliyun, gcp, azure) this starts ``--n`` pairs of (local fake
endpoint, poller) and runs them all at once. The poller is the node agent's own
metadata loop (:meth:`daemon.gpunode.agent.NodeAgent._metadata_loop`, with its tenacity
backoff and, for GCP, hanging GETs) on the client the agent builds for that dialect
with the agent's default options (poll interval 1 s, request timeout 2 s, GCP
``wait_s`` 5 s). Only ``_on_interruption`` is replaced, to record the wall time
at which the loop first saw the notice. Each fake publishes one notice at a
uniformly random moment in a one-second window after a warm-up, i.e. at a random
phase of the poll cycle, and the sample is ``seen - published`` (both
``time.time()``; ``published`` is the fake's own ``published_at``).

Run from the repository root::

    python -m bench.detection_latency            # or: python bench/detection_latency.py
    python -m bench.detection_latency --n 50 --seed 7 --out /tmp/latency.json

It prints a table (dialect, n, median_s, p90_s, max_s) and writes the samples and
the summary as JSON to ``bench-results-detection.json`` (``--out``). Exit status 1
if a notice was not seen within its bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import this checkout's daemon package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.gpunode.agent import NodeAgent, _client, _parse  # noqa: E402
from daemon.logs import configure_logging  # noqa: E402
from daemon.gpunode.metadata.base import Notice  # noqa: E402
from daemon.gpunode.metadata.registry import DIALECTS  # noqa: E402
from daemon.providers.local_metadata import make_fake  # noqa: E402

__all__ = ["Defaults", "Summary", "measure", "main"]

WARMUP_S = 1.5  # before the random phase: the first poll is done and the loop is in its rhythm
DEFAULT_OUT = "bench-results-detection.json"


@dataclass(frozen=True, slots=True)
class Defaults:
    """What a node agent runs with when started without options (``spotvisor-agent run``)."""

    poll_interval_s: float
    metadata_timeout_s: float
    gcp_wait_s: float  # the hanging GET's wait the agent picks for GCP

    @classmethod
    def of_agent(cls) -> Defaults:
        args = _parse(["run", "--daemon-url", "http://127.0.0.1:1", "--node-id", "bench"])
        gcp = _client("gcp", "http://127.0.0.1:1", args.metadata_timeout_s, args.poll_interval_s)  # no I/O
        return cls(poll_interval_s=args.poll_interval_s, metadata_timeout_s=args.metadata_timeout_s,
                   gcp_wait_s=gcp.wait_s)


@dataclass(frozen=True, slots=True)
class Summary:
    dialect: str
    n: int
    median_s: float
    p90_s: float
    max_s: float
    missed: int

    @classmethod
    def of(cls, dialect: str, samples: list[float | None]) -> Summary:
        seen = sorted(s for s in samples if s is not None)
        if not seen:
            return cls(dialect, 0, float("nan"), float("nan"), float("nan"), len(samples))
        p90 = statistics.quantiles(seen, n=10, method="inclusive")[-1] if len(seen) > 1 else seen[0]
        return cls(dialect, len(seen), statistics.median(seen), p90, seen[-1], len(samples) - len(seen))


class _TimingAgent(NodeAgent):
    """A node agent whose metadata loop only records when it first sees a notice."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen_at: float | None = None
        self.seen = asyncio.Event()

    def _on_interruption(self, notice: Notice) -> None:
        if self.seen_at is None:
            self.seen_at = time.time()  # as NodeAgent._on_interruption stamps seen_at
            self.seen.set()


async def _sample(dialect: str, index: int, *, defaults: Defaults, delay_s: float, workdir: Path) -> float | None:
    """One fake + one poller; the notice goes up ``delay_s`` after the poller starts."""
    fake = make_fake(dialect)
    await fake.start()
    metadata = _client(dialect, fake.url, defaults.metadata_timeout_s, defaults.poll_interval_s)
    agent = _TimingAgent(daemon_url="http://127.0.0.1:1", token="bench", node_id=f"bench-{dialect}-{index}",
                         metadata=metadata, workdir=workdir)
    loop_task = asyncio.create_task(agent._metadata_loop(), name=f"bench:metadata:{dialect}:{index}")
    try:
        await asyncio.sleep(delay_s)
        fake.publish_interruption("terminate")
        published_at = fake.published_at
        bound_s = 3 * defaults.poll_interval_s + 2 * defaults.metadata_timeout_s + 5.0
        try:
            async with asyncio.timeout(bound_s):
                await agent.seen.wait()
        except TimeoutError:
            return None
        if agent.seen_at is None or published_at is None:
            raise RuntimeError(f"{dialect} fake {index}: no publish or no sighting time recorded")
        return agent.seen_at - published_at
    finally:
        loop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop_task
        await metadata.aclose()
        await fake.aclose()


async def measure(*, n: int, seed: int, dialects: tuple[str, ...] = DIALECTS) -> dict[str, list[float | None]]:
    """``n`` samples per dialect, all running concurrently; returns seconds per sample (None: missed)."""
    defaults = Defaults.of_agent()
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="sv-bench-") as tmp:
        jobs = {
            dialect: [
                _sample(dialect, i, defaults=defaults, workdir=Path(tmp),
                        delay_s=WARMUP_S + rng.uniform(0.0, defaults.poll_interval_s))
                for i in range(n)
            ]
            for dialect in dialects
        }
        results = await asyncio.gather(*(asyncio.gather(*coros) for coros in jobs.values()))
    return dict(zip(jobs, (list(r) for r in results)))


def _table(summaries: list[Summary]) -> str:
    lines = [f"{'dialect':<8} {'n':>4} {'median_s':>9} {'p90_s':>9} {'max_s':>9}"]
    for s in summaries:
        missed = f"   ({s.missed} missed)" if s.missed else ""
        lines.append(f"{s.dialect:<8} {s.n:>4} {s.median_s:>9.3f} {s.p90_s:>9.3f} {s.max_s:>9.3f}{missed}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.detection_latency", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=50, help="notices per dialect (default 50)")
    p.add_argument("--seed", type=int, default=None, help="seed of the publish phases (default: random)")
    p.add_argument("--dialect", action="append", choices=DIALECTS, help="only these dialects (repeatable)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON results file (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    dialects = tuple(args.dialect) if args.dialect else DIALECTS

    configure_logging(level="WARNING")  # stderr; the table goes to stdout
    defaults = Defaults.of_agent()
    started = time.monotonic()
    samples = asyncio.run(measure(n=args.n, seed=seed, dialects=dialects))
    wall_s = time.monotonic() - started
    summaries = [Summary.of(d, s) for d, s in samples.items()]

    print(f"detection latency (seen - published), poll interval {defaults.poll_interval_s:g} s, "
          f"gcp hanging GETs (wait_s {defaults.gcp_wait_s:g}), {args.n} notices per dialect, seed {seed}, "
          f"{wall_s:.1f} s wall")
    print(_table(summaries))
    doc = {
        "bench": "detection_latency",
        "time": time.time(),
        "seed": seed,
        "n_per_dialect": args.n,
        "poll_interval_s": defaults.poll_interval_s,
        "metadata_timeout_s": defaults.metadata_timeout_s,
        "gcp_wait_s": defaults.gcp_wait_s,
        "warmup_s": WARMUP_S,
        "wall_s": round(wall_s, 3),
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "processor": platform.machine()},
        "results": {
            s.dialect: {"n": s.n, "missed": s.missed, "median_s": s.median_s, "p90_s": s.p90_s,
                        "max_s": s.max_s, "samples_s": samples[s.dialect]}
            for s in summaries
        },
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if any(s.missed for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
