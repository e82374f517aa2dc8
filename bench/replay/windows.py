"""``python -m bench.replay.windows [--traces DIR] [--ratios 1.2,1.5,2] [--grow in_process] [--json OUT]``

The deadline property over every window of every public trace: for each trace, each
deadline ratio and each window (the trace cut into windows of the deadline's length,
one starting every ``stride``), it replays always-on-demand, ``deadline_aware`` and
``home_zone`` (and spot alone, ``spotvisor``, for scale) and checks that both deadline
policies meet every deadline that on-demand meets. It prints one row per trace and
ratio: windows, deadlines on-demand met, deadlines each policy missed among those (the
property says 0), its mean cost relative to on-demand and to a lower bound on any pool's
cost (:func:`bench.replay.optimum.pool_bound`: spot first, no restarts; so above 1), and
how often spot alone met them.

The traces and their settings (:data:`SETTINGS`): Bamboo's p3 and g4dn groups (cap 32
and 24 nodes, a 2-hour job at the cap), and the 9-zone V100 data at SkyNomad's setting
(the three zones of its V100 experiment, one region each, a 39.9-hour job; every
window of the 45 days); and every other shared trace: GCP's A100 and V100 groups (a
2-hour job of 32 nodes), Parcae's copy of the p3 trace (the same) and its four one-hour
windows (a 0.4-hour job of 32 nodes, a window every 6 minutes), Oobleck's synthetic
traces (30 nodes, one removed every 5 minutes to 6 hours; a job of 24 nodes, half an
hour to 2 hours as the trace allows) and its rescaled p3 and GCP traces. Sources and
licences: shared/traces/README.md. All of it: about 5 minutes on one core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from bench.replay.__main__ import render, domains_for
from bench.replay.optimum import pool_bound
from bench.replay.sim import JobModel, Market, Replay
from bench.replay.traces import Trace, TraceError, load_trace
from daemon.control.policies import get_policy

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"


@dataclass(frozen=True)
class Setting:
    """How one trace is replayed: its path under the traces folder, the zones, the pool's
    target, the job's length (hours at the target on on-demand), the window stride (hours;
    None: the deadline's length, the windows tile the trace as SkyNomad's artifact does)."""

    path: str
    target: int
    job_h: float
    stride_h: float | None
    zones: tuple[str, ...] | None = None
    step_s: float = 2.0
    checkpoint_gb: float = 16.0
    restart_s: float = 60.0


SETTINGS = (
    Setting("bamboo/p3-trace.csv", target=32, job_h=2.0, stride_h=1.0),
    Setting("bamboo/g4dn-trace.csv", target=24, job_h=2.0, stride_h=1.0),
    Setting("skynomad/v100-9zone", target=1, job_h=39.94, stride_h=None, zones=("us-east-1c", "us-east-2b", "us-west-2a"),
            step_s=60.0, checkpoint_gb=50.0, restart_s=550.0),
    # the rest of the shared traces: GCP's A100 and V100 groups (Bamboo's, up to 64 and 80
    # instances), the p3 trace as Parcae keeps it and its four one-hour windows, and
    # Oobleck's (30 nodes, one removed every interval; the p3 and GCP traces rescaled)
    Setting("bamboo/gcloud/a100x1-east1b.txt", target=32, job_h=2.0, stride_h=1.0),
    Setting("bamboo/gcloud/v100x1-east1c.txt", target=32, job_h=2.0, stride_h=1.0),
    Setting("parcae/p3-alive.csv", target=32, job_h=2.0, stride_h=1.0),
    *(Setting(f"parcae/gpt-6.7b/{name}.txt", target=32, job_h=0.4, stride_h=0.1)
      for name in ("trace_hh_55_65", "trace_hl_15_25", "trace_lh_80_90", "trace_ll_10_11")),
    *(Setting(f"oobleck/every-{every}.csv", target=24, job_h=job_h, stride_h=job_h / 2)
      for every, job_h in (("5m", 0.5), ("10m", 1.0), ("30m", 2.0), ("1h", 2.0), ("3h", 2.0), ("6h", 2.0))),
    Setting("oobleck/scale_p3-trace.csv", target=24, job_h=2.0, stride_h=1.0),
    Setting("oobleck/scale_gcp-trace.csv", target=24, job_h=2.0, stride_h=1.0),
)


@dataclass
class Row:
    """One window: start (hours into the trace) and, per policy, cost (USD) and whether met;
    ``optimum``: a lower bound on the cost of the job by the deadline there (USD,
    :func:`bench.replay.optimum.pool_bound`)."""

    start_h: float
    on_demand: tuple[float, bool]
    deadline_aware: tuple[float, bool]
    spot: tuple[float, bool]
    optimum: float = float("nan")
    home_zone: tuple[float, bool] = (float("nan"), False)


def windows(trace: Trace, length_s: float, stride_s: float) -> Iterator[tuple[float, Trace]]:
    """Every window of ``length_s`` starting each ``stride_s`` that fits in the trace."""
    start = 0.0
    while start + length_s <= trace.duration_s + 1e-6:
        yield start, trace.window(start, start + length_s)
        start += stride_s


def check(trace: Trace, s: Setting, ratio: float, *, grow_in_process: bool = False) -> list[Row]:
    """The three policies on every window of ``trace`` at deadline ``ratio × s.job_h``
    (``grow_in_process``: ``job.grow: in_process``, :class:`bench.replay.sim.Replay`)."""
    job = JobModel(target_steps=max(1, round(s.job_h * 3600 / s.step_s)), step_s=s.step_s, ref_gpus=s.target,
                   checkpoint_bytes=s.checkpoint_gb * 1e9, restart_s=s.restart_s,
                   checkpoint_every_steps=max(1, round(1800 / s.step_s)))
    deadline = s.job_h * ratio * 3600
    zones = list(s.zones) if s.zones else None
    domains = domains_for(zones or sorted(trace.zones), "region")
    rows = []
    for start, w in windows(trace, deadline, deadline if s.stride_h is None else s.stride_h * 3600):
        def run(name: str, market: Market) -> tuple[float, bool]:
            r = Replay(w, get_policy(name), job=job, market=market, target_nodes=s.target, zones=zones,
                       deadline_s=deadline, domains=domains, grow_in_process=grow_in_process).run()
            return r.cost_usd, bool(r.deadline_met)

        bound = pool_bound(w, zones or sorted(w.zones), target=s.target,
                           node_s=job.target_steps * job.step_s * job.ref_gpus, deadline_s=deadline,
                           on_demand_usd_h=Market.on_demand_usd_h, spot_usd_h=Market.spot_usd_h)
        rows.append(Row(start / 3600, run("spotvisor", Market(on_demand=True)), run("deadline_aware", Market()),
                        run("spotvisor", Market()), bound, run("home_zone", Market())))
    return rows


def summary(rows: list[Row]) -> dict[str, object]:
    """Per deadline policy (``deadline_aware``, ``home_zone``): the deadlines it missed
    among those on-demand met, and its mean cost relative to on-demand and to the bound."""
    met = [r for r in rows if r.on_demand[1]]
    out: dict[str, object] = {"windows": len(rows), "on_demand_met": len(met)}
    for name in ("deadline_aware", "home_zone"):
        runs = [(r, getattr(r, name)) for r in met]
        missed = [r.start_h for r, (_, ok) in runs if not ok]
        rel = [cost / r.on_demand[0] for r, (cost, _) in runs if r.on_demand[0] > 0]
        opt = [cost / r.optimum for r, (cost, ok) in runs if ok and r.optimum > 0]
        out.update({f"{name}_missed": len(missed), f"{name}_missed_at_h": missed,
                    f"{name}_cost_vs_on_demand": round(sum(rel) / len(rel), 3) if rel else None,
                    f"{name}_cost_vs_optimum": round(sum(opt) / len(opt), 3) if opt else None})
    out["missed_at_h"] = out["deadline_aware_missed_at_h"]
    out["spot_alone_met"] = sum(1 for r in met if r.spot[1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replay.windows", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=SHARED, help="the shared traces folder")
    p.add_argument("--ratios", default="1.2,1.5,2.0", help="deadlines as multiples of the job's length")
    p.add_argument("--grow", choices=("restart", "in_process"), default="restart",
                   help="how a running job takes new nodes (job.grow; python -m bench.replay --help)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    try:
        ratios = [float(x) for x in args.ratios.split(",")]
        traces = [(s, load_trace(args.traces / s.path)) for s in SETTINGS]
    except (TraceError, ValueError) as exc:
        print(f"bench.replay.windows: {exc}", file=sys.stderr)
        return 2
    out, bad = {}, 0
    head = ["TRACE", "RATIO", "WINDOWS", "OD MET", "DA MISSED", "DA COST/OD", "DA COST/OPT", "HZ MISSED",
            "HZ COST/OD", "HZ COST/OPT", "SPOT ALONE MET", "S"]
    table = [head]
    for s, trace in traces:
        for ratio in ratios:
            t0 = time.perf_counter()
            sm = summary(check(trace, s, ratio, grow_in_process=args.grow == "in_process"))
            out[f"{s.path}@{ratio}"] = sm
            bad += int(sm["deadline_aware_missed"]) + int(sm["home_zone_missed"])  # type: ignore[call-overload]
            table.append([s.path, f"{ratio:g}", str(sm["windows"]), str(sm["on_demand_met"]),
                          str(sm["deadline_aware_missed"]), str(sm["deadline_aware_cost_vs_on_demand"]),
                          str(sm["deadline_aware_cost_vs_optimum"]), str(sm["home_zone_missed"]),
                          str(sm["home_zone_cost_vs_on_demand"]), str(sm["home_zone_cost_vs_optimum"]),
                          f"{sm['spot_alone_met']}/{sm['on_demand_met']}", f"{time.perf_counter() - t0:.0f}"])
    print(render(table))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
