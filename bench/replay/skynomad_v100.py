"""``python -m bench.replay.skynomad_v100 [--trace DIR] [--windows 3,5,7,8,14] [--cost-model ours|skynomad] [--json OUT]``

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

It prints, per window and as the mean over the windows, each policy's cost (USD),
``COST/OPT`` (its mean cost over the mean of the offline optimum's lower bound,
:mod:`bench.replay.optimum`, on the same windows) and whether the deadline was met,
beside the means the artifact publishes for its own policies (its README,
``--config v100``; per window in its ``research/data/v100.csv``).

``--cost-model ours`` (the default) runs the daemon's policies in our simulator; the
optimum is the DP with our job's boot, restart, load, copy and egress. The two
simulators differ, so against the published figures that is a comparison of magnitude.
``--cost-model skynomad`` charges as the artifact's simulator does
(:mod:`bench.replay.tickmodel`) and runs its UP(S) baseline and the optimal schedule
there, like for like with the published UP(S) and Optimal, beside our home-zone policy
(:mod:`bench.replay.homezone`) and, with ``--lookahead``, the model-predictive one.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dataclasses import dataclass, field
from typing import Any, Sequence

from bench.replay.__main__ import _Parser, render, ON_DEMAND, domains_for
from bench.replay.homezone import HomeZone
from bench.replay.lookahead import LookAhead
from bench.replay.optimum import optimal, optimum
from bench.replay.sim import JobModel, Market, Replay, Result
from bench.replay.tickmodel import OnDemand, TickJob, TickMarket, TickResult, UniformProgress, simulate
from bench.replay.traces import Trace, TraceError, load_trace
from daemon.control.availability import Availability, seeded
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
# SkyNomad's cost model (--cost-model skynomad): its task, deadline, 0.2 h overhead, 50 GB
SKYNOMAD_JOB = TickJob(task_s=JOB_H * 3600, deadline_s=DEADLINE_H * 3600, overhead_s=0.2 * 3600, checkpoint_gb=50.0)
# the optimum for our cost model: the job's steps, its boot + restart + load, our copy and egress
OUR_JOB = TickJob(task_s=JOB.target_steps * JOB.step_s, deadline_s=DEADLINE_H * 3600,
                  overhead_s=JOB.boot_s + JOB.restart_s + JOB.load_s(1), checkpoint_gb=JOB.checkpoint_bytes / 1e9,
                  copy_gb_s=0.5, egress_usd_per_gb=0.02)
# home_zone with more to go on than the pool's own launches: every region probed each 10 min
# from the window's start (as a capacity probe would), watched for the 48 h before it
# (as a daemon that outlives its jobs would have; the tick model's policies are given as much),
# or both; or, "after a job", what the pool of the window before saw of its own run, taken
# as daemon.market_dir gives it to the next pool (availability.seeded)
VARIANTS = {"home_zone probed": {"probe_s": 600.0}, "home_zone seen 48 h": {"past_h": 48.0},
            "home_zone both": {"probe_s": 600.0, "past_h": 48.0}, "home_zone after a job": {"after_job": True}}
POLICIES = (ON_DEMAND, "restart_on_preemption", DEFAULT_POLICY, "deadline_aware", "home_zone", *VARIANTS)
# the artifact's README, `--config v100`: mean cost (USD) over the five windows
PUBLISHED = {"Optimal (DP oracle)": 37.37, "SkyNomad": 41.73, "SkyNomad (oracle lifetimes)": 41.99,
             "UP(S) (Uniform Progress, eager failover)": 47.02, "UP(A) (probe availability)": 49.09,
             "UP(AP) (probe availability and cost)": 51.00}
DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "skynomad" / "v100-9zone"


def window(trace: Trace, w: int) -> Trace:
    """Window ``w`` of the artifact's sequential tiling (ticks ``w × 1106`` on)."""
    start = trace.zones[ZONES[0]].times[w * WINDOW_TICKS]
    return trace.window(start, start + WINDOW_TICKS * TICK_S)


def seen_before(trace: Trace, w: int, hours: float, *, watched_after: bool = False) -> Availability:
    """The availability record of a daemon that watched every region for ``hours`` before
    window ``w`` (one look per tick, at times before the window's 0), as the tick model's
    policies are given the windows before; unless ``watched_after``, every region but the
    job's first is unwatched from the window's start (the daemon launches only there)."""
    start = trace.zones[ZONES[0]].times[w * WINDOW_TICKS]
    regions = domains_for(ZONES, "region")
    av, t = Availability(), -hours * 3600
    while t < 0:
        if start + t >= 0:
            for z in ZONES:
                cap = trace.zones[z].capacity_at(start + t)
                av = av.observe(regions[z], cap is None or cap > 0, t)
        t += TICK_S
    for z in ZONES[1:] if not watched_after else ():
        av = av.observe(regions[z], None, 0.0)
    return av


def _replay(trace: Trace, w: int, policy: str, *, migration: bool, on_demand: bool = False,
            availability: Availability | None = None, **extra: Any) -> Replay:
    return Replay(window(trace, w), get_policy(policy), job=JOB, market=Market(on_demand=on_demand), target_nodes=1,
                  zones=list(ZONES), deadline_s=DEADLINE_H * 3600, domains=domains_for(ZONES, "region"),
                  migration=Plan() if migration else None, availability=availability, **extra)


def after_a_job(trace: Trace, w: int, *, migration: bool = True) -> Availability:
    """What a pool starting window ``w`` takes from ``daemon.market_dir`` when the pool before
    it ran home_zone over window ``w - 1`` (its own record, in window ``w``'s time: the window
    before ends at 0), that pool's word ending where it stopped writing (its job's end), as
    :mod:`daemon.controlnode.market_memory` reads a record no longer rewritten."""
    if w == 0:
        return Availability()  # nothing ran before the trace's first window
    before = _replay(trace, w - 1, "home_zone", migration=migration)
    before.run()
    shift = WINDOW_TICKS * TICK_S
    record = {d: [(t - shift, up) for t, up in changes] + ([(before.now - shift, None)] if changes[-1][1] is not None
                                                            else [])
              for d, changes in before.availability.changes.items()}
    return seeded(Availability(), [record], 0.0)


def run_window(trace: Trace, w: int, policies=POLICIES, *, migration: bool = True) -> list[Result]:
    out = []
    for name in policies:
        extra = dict(VARIANTS.get(name, {}))
        past_h, after_job = extra.pop("past_h", None), extra.pop("after_job", False)
        policy = DEFAULT_POLICY if name == ON_DEMAND else "home_zone" if name in VARIANTS else name
        past = (seen_before(trace, w, past_h, watched_after="probe_s" in extra) if past_h is not None
                else after_a_job(trace, w, migration=migration) if after_job else None)
        r = _replay(trace, w, policy, migration=migration, on_demand=name == ON_DEMAND, availability=past,
                    **extra).run()
        r.policy = name
        out.append(r)
    return out


def tick_market(trace: Trace, w: int, zones: Sequence[str] = ZONES) -> TickMarket:
    """Window ``w`` as the artifact's simulator sees it: one tick per row (195 s)."""
    return TickMarket.from_trace(trace, zones, w * WINDOW_TICKS, WINDOW_TICKS, gap_s=TICK_S)


def run_window_skynomad(trace: Trace, w: int, *, lookahead: bool = False) -> tuple[list[TickResult], float]:
    """Window ``w`` in SkyNomad's cost model: on-demand, UP(S), the optimal schedule, the
    home-zone policy (and the look-ahead policy, seeded), each policy that learns given
    the two windows before as its past, and the optimum's lower bound (USD)."""
    m = tick_market(trace, w)
    start = max(0, (w - 2) * WINDOW_TICKS)
    past = TickMarket.from_trace(trace, ZONES, start, w * WINDOW_TICKS - start, gap_s=TICK_S).avail
    rows = [simulate(m, SKYNOMAD_JOB, OnDemand()), simulate(m, SKYNOMAD_JOB, UniformProgress()),
            optimal(m, SKYNOMAD_JOB), simulate(m, SKYNOMAD_JOB, HomeZone(past))]
    if lookahead:
        rows.append(simulate(m, SKYNOMAD_JOB, LookAhead(past)))
    return rows, optimum(m, SKYNOMAD_JOB).cost_usd


@dataclass
class Row:
    """One policy over the windows: USD and deadline met per window, moves, on-demand hours."""

    name: str
    costs: list[float] = field(default_factory=list)
    met: list[bool] = field(default_factory=list)
    moves: int = 0
    od_h: float = 0.0

    def add(self, cost: float, met: bool, moves: int, od_h: float) -> None:
        self.costs.append(cost)
        self.met.append(met)
        self.moves += moves
        self.od_h += od_h


def table(rows: list[Row], bounds: list[float], windows: list[int], published: dict[str, float]) -> str:
    """The rows as aligned columns; COST/OPT is the mean cost over the mean lower bound."""
    head = ["POLICY"] + [f"W{w}" for w in windows] + ["MEAN USD", "COST/OPT", "MET", "MOVES", "OD H", "PUBLISHED"]
    opt = sum(bounds) / len(bounds)
    out = [head]
    for r in rows + [Row("optimum (lower bound)", list(bounds), [True] * len(bounds))]:
        mean = sum(r.costs) / len(r.costs)
        out.append([r.name] + [f"{c:.2f}" + ("" if m else " MISSED") for c, m in zip(r.costs, r.met)]
                   + [f"{mean:.2f}", f"{mean / opt:.3f}", f"{sum(r.met)}/{len(r.met)}", str(r.moves), f"{r.od_h:.1f}",
                      f"{published[r.name]:.2f}" if r.name in published else "-"])
    return render(out)


class _OneLine(_Parser):
    def error(self, message: str) -> None:  # one line naming the flag, exit 2
        print(f"bench.replay.skynomad_v100: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    p = _OneLine(prog="python -m bench.replay.skynomad_v100", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the v100-9zone folder")
    p.add_argument("--windows", default=",".join(map(str, WINDOWS)))
    p.add_argument("--cost-model", choices=("ours", "skynomad"), default="ours",
                   help="ours: the daemon's policies in bench.replay.sim (default); skynomad: the artifact's "
                   "charging (bench.replay.tickmodel) with its UP(S), the optimal schedule and the home-zone "
                   "policy (bench.replay.homezone)")
    p.add_argument("--no-migration", action="store_true", help="the job stays in us-east-1 (--cost-model ours)")
    p.add_argument("--lookahead", action="store_true", help="--cost-model skynomad: add the look-ahead policy's "
                   "row (bench.replay.lookahead; about 25 s per window)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.lookahead and args.cost_model != "skynomad":
        print("bench.replay.skynomad_v100: --lookahead: runs in --cost-model skynomad only", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        print(f"bench.replay.skynomad_v100: --trace: {exc}", file=sys.stderr)
        return 2
    missing = [z for z in ZONES if z not in trace.zones]
    tiles = len(trace.zones[ZONES[0]].times) // WINDOW_TICKS if not missing else 0
    try:
        windows = [int(x) for x in args.windows.split(",")]
        bad = [w for w in windows if not 0 <= w < tiles]
        if missing or bad:
            raise ValueError(f"zones {missing} not in the trace" if missing else
                             f"window(s) {bad} outside 0..{tiles - 1} of this trace")
    except ValueError as exc:
        print(f"bench.replay.skynomad_v100: --windows: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    bounds: list[float] = []
    dump: dict[str, dict] = {}
    if args.cost_model == "skynomad":
        rows = [Row(ON_DEMAND), Row("up_s"), Row("optimal"), Row("home_zone")] + (
            [Row("lookahead")] if args.lookahead else [])
        for w in windows:
            rs, bound = run_window_skynomad(trace, w, lookahead=args.lookahead)
            bounds.append(bound)
            for row, r in zip(rows, rs):
                row.add(r.cost_usd, r.done, r.migrations, r.od_ticks * TICK_S / 3600)
            dump[str(w)] = {r.policy: {"cost_usd": round(r.cost_usd, 4), "deadline_met": r.done,
                                       "migrations": r.migrations, "done_tick": r.done_tick} for r in rs}
            dump[str(w)]["optimum_lower_bound_usd"] = round(bound, 4)
        published = {"up_s": PUBLISHED["UP(S) (Uniform Progress, eager failover)"],
                     "optimal": PUBLISHED["Optimal (DP oracle)"]}
        model = "SkyNomad's cost model (bench/replay/tickmodel.py: 195 s ticks billed whole, as its env.py)"
    else:
        rows = [Row(name) for name in POLICIES]
        for w in windows:
            rs = run_window(trace, w, migration=not args.no_migration)
            bound = optimum(tick_market(trace, w), OUR_JOB).cost_usd
            bounds.append(bound)
            for row, r in zip(rows, rs):
                row.add(r.cost_usd, bool(r.deadline_met), r.migrations, r.on_demand_node_hours)
            dump[str(w)] = {r.policy: {k: v for k, v in r.to_dict().items() if k != "timeline"} for r in rs}
            dump[str(w)]["optimum_lower_bound_usd"] = round(bound, 4)
        published = {}
        model = "our cost model (bench/replay/sim.py; the optimum: the DP with its boot, restart, copy and egress)"
    wall = time.perf_counter() - t0
    print(f"SkyNomad V100 setting: zones {', '.join(ZONES)}; job {JOB_H:.2f} h, deadline {DEADLINE_H:.2f} h "
          f"(1.5x); windows {windows}; {model}; {wall:.1f} s")
    print("USD per window (deadline met: yes / MISSED); COST/OPT: mean USD / the optimum's mean lower bound; "
          "data: Can't Be Late / SkyNomad traces, Apache-2.0")
    print(table(rows, bounds, windows, published))
    print("published by the SkyNomad artifact for the same five windows (mean USD; research/data/v100.csv): "
          + "; ".join(f"{k} {v:.2f}" for k, v in PUBLISHED.items()))
    if args.json:
        args.json.write_text(json.dumps(dump, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
