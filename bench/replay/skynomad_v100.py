"""``python -m bench.replay.skynomad_v100 [--trace DIR] [--windows 3,5,7,8,14] [--json OUT]``

The V100 cross-region setting of SkyNomad's artifact (andylizf/skynomad-artifact @
62b9aaa, ``scripts_multi/benchmark_components/configs/v100.py``; Apache-2.0), replayed
through the daemon's own decisions (:mod:`bench.replay.sim`):

- three zones in three regions: us-east-1c, us-east-2b, us-west-2a (one placement
  domain each: a move between them is a whole-job migration), one p3.2xlarge (1 V100);
- the deadline: 59.91 h, what the artifact computes for the 60-hour windows of that
  data ((1107 - 1) ticks × 195 s); the job: the deadline / 1.5 = 39.94 h of work on one
  on-demand V100;
- the windows: the artifact's sequential tiling of the 45-day trace into windows of
  1106 ticks, windows 3, 5, 7, 8 and 14 (the five of its Figure 9b);
- a 50 GB checkpoint; 0.2 h of restart overhead (here: 120 s boot + 550 s torchrun
  restart and initialisation + 50 s load at 1 GB/s); on-demand at $3.06/h; spot at
  each zone's per-tick price in the trace; a move copies the 50 GB at 0.5 GB/s and pays
  AWS's $0.02/GB inter-region transfer.

It prints, per window and as the mean over the windows, each policy's cost (USD) and
whether the deadline was met, beside the means the artifact publishes for its own
policies (its README, ``--config v100``): the two are different simulators on the same
trace data, so the comparison is of magnitude, not to the cent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.replay.__main__ import render, ON_DEMAND, domains_for
from bench.replay.sim import JobModel, Market, Replay, Result
from bench.replay.traces import Trace, TraceError, load_trace
from daemon.control.migration import Plan
from daemon.control.policies import DEFAULT_POLICY, get_policy

ZONES = ("us-east-1c", "us-east-2b", "us-west-2a")
WINDOWS = (3, 5, 7, 8, 14)
TICK_S = 195.0
WINDOW_TICKS = 1106  # ceil(deadline × 3600 / 195): the artifact's tiling
DEADLINE_H = (1107 - 1) * TICK_S / 3600  # 59.908 h
JOB_H = DEADLINE_H / 1.5  # 39.94 h
STEP_S = 60.0
JOB = JobModel(target_steps=round(JOB_H * 3600 / STEP_S), step_s=STEP_S, ref_gpus=1, checkpoint_bytes=50e9,
               checkpoint_every_steps=30, boot_s=120.0, restart_s=550.0)
POLICIES = (ON_DEMAND, "restart_on_preemption", DEFAULT_POLICY, "deadline_aware")
# the artifact's README, `--config v100`: mean cost (USD) over the five windows
PUBLISHED = {"Optimal (DP oracle)": 37.37, "SkyNomad": 41.73, "SkyNomad (oracle lifetimes)": 41.99,
             "UP(S) (Uniform Progress, eager failover)": 47.02, "UP(A) (probe availability)": 49.09,
             "UP(AP) (probe availability and cost)": 51.00}
DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "skynomad" / "v100-9zone"


def window(trace: Trace, w: int) -> Trace:
    """Window ``w`` of the artifact's sequential tiling (ticks ``w × 1106`` on)."""
    start = trace.zones[ZONES[0]].times[w * WINDOW_TICKS]
    return trace.window(start, start + WINDOW_TICKS * TICK_S)


def run_window(trace: Trace, w: int, policies=POLICIES, *, migration: bool = True) -> list[Result]:
    t = window(trace, w)
    out = []
    for name in policies:
        r = Replay(t, get_policy(DEFAULT_POLICY if name == ON_DEMAND else name), job=JOB,
                   market=Market(on_demand=name == ON_DEMAND), target_nodes=1, zones=list(ZONES),
                   deadline_s=DEADLINE_H * 3600, domains=domains_for(ZONES, "region"),
                   migration=Plan() if migration else None).run()
        r.policy = name
        out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replay.skynomad_v100", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the v100-9zone folder")
    p.add_argument("--windows", default=",".join(map(str, WINDOWS)))
    p.add_argument("--no-migration", action="store_true", help="the job stays in us-east-1")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    try:
        trace = load_trace(args.trace)
        windows = [int(x) for x in args.windows.split(",")]
    except (TraceError, ValueError) as exc:
        print(f"bench.replay.skynomad_v100: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = {w: run_window(trace, w, migration=not args.no_migration) for w in windows}
    wall = time.perf_counter() - t0
    print(f"SkyNomad V100 setting: zones {', '.join(ZONES)}; job {JOB_H:.2f} h, deadline {DEADLINE_H:.2f} h "
          f"(1.5x); windows {windows}; {wall:.1f} s")
    print("USD per window (deadline met: yes / MISSED); data: Can't Be Late / SkyNomad traces, Apache-2.0")
    head = ["POLICY"] + [f"W{w}" for w in windows] + ["MEAN USD", "MET", "MOVES", "OD H"]
    table = [head]
    for i, name in enumerate(POLICIES):
        rs = [rows[w][i] for w in windows]
        mean = sum(r.cost_usd for r in rs) / len(rs)
        table.append([name] + [f"{r.cost_usd:.2f}" + ("" if r.deadline_met else " MISSED") for r in rs]
                     + [f"{mean:.2f}", f"{sum(bool(r.deadline_met) for r in rs)}/{len(rs)}",
                        str(sum(r.migrations for r in rs)), f"{sum(r.on_demand_node_hours for r in rs):.1f}"])
    print(render(table))
    print("published by the SkyNomad artifact for the same five windows (mean USD): "
          + "; ".join(f"{k} {v:.2f}" for k, v in PUBLISHED.items()))
    if args.json:
        args.json.write_text(json.dumps({str(w): {r.policy: {k: v for k, v in r.to_dict().items() if k != "timeline"}
                                                  for r in rows[w]} for w in windows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
