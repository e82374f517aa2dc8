"""``python -m bench.replay --trace PATH [--policy NAME ...] [--json OUT] [--png OUT]``

Replays a public spot trace (a file, or a folder of per-zone files: the format is
recognised from the content, :mod:`bench.replay.traces`) through the daemon's own
decisions (:mod:`bench.replay.sim`), once per policy, and prints one row per policy:
committed steps, steps per hour, lost steps, goodput, USD, USD per step, ``COST/OPT``,
node-hours, restarts, in-process resizes. ``COST/OPT`` is the policy's cost over the least
any pool could pay for the same work (its committed steps) by the same time (the
deadline when it met one, else the hours replayed): the linear relaxation of
:func:`bench.replay.optimum.pool_bound`, spot first, no restarts; a lower bound, so
above 1. ``on_demand`` is the default policy buying on-demand nodes
only (the reference a spot policy must beat on cost); every other name is a registered
recovery policy (:mod:`daemon.control.policies`).

Examples::

    python -m bench.replay --trace ../shared/traces/bamboo/p3-trace.csv
    python -m bench.replay --trace ../shared/traces/parcae/gpt-6.7b/trace_hh_55_65.txt --json hh.json
    python -m bench.replay --trace ../shared/traces/skynomad/v100-9zone \\
        --zones us-east-1c,us-east-2b,us-west-2a --target-nodes 1 --ref-gpus 1

Exit status 2 with one line for a bad argument or an unreadable trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from bench.replay.optimum import pool_bound
from bench.replay.sim import JobModel, Market, Replay, Result, region_of
from bench.replay.traces import TraceError, load_trace
from daemon.control.migration import Plan
from daemon.control.policies import DEFAULT_POLICY, get_policy, policy_names

ON_DEMAND = "on_demand"
DEFAULT_POLICIES = (ON_DEMAND, "restart_on_preemption", "elastic_only", DEFAULT_POLICY, "deadline_aware", "home_zone")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        print(f"bench.replay: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="a trace file or a folder of <zone>_*.csv files")
    p.add_argument("--policy", action="append", help=f"repeatable; default: {', '.join(DEFAULT_POLICIES)}")
    p.add_argument("--zones", help="comma-separated zones of a multi-zone trace (default: all)")
    p.add_argument("--target-nodes", type=int, help="the pool's target (default: the trace's cap)")
    p.add_argument("--hours", type=float, help="replay only the first HOURS of the trace")
    p.add_argument("--ref-gpus", type=int, default=None, help="GPUs at which a step takes --step-s (default: target)")
    p.add_argument("--step-s", type=float, default=JobModel.step_s, help="seconds per step at --ref-gpus")
    p.add_argument("--checkpoint-gb", type=float, default=JobModel.checkpoint_bytes / 1e9)
    p.add_argument("--checkpoint-every", type=int, default=JobModel.checkpoint_every_steps, help="steps")
    p.add_argument("--boot-s", type=float, default=JobModel.boot_s)
    p.add_argument("--restart-s", type=float, default=JobModel.restart_s)
    p.add_argument("--on-demand-usd-h", type=float, default=Market.on_demand_usd_h)
    p.add_argument("--spot-usd-h", type=float, default=Market.spot_usd_h, help="when the trace has no prices")
    p.add_argument("--job-hours", type=float, help="the job's length on on-demand nodes at the target size "
                   "(default: longer than the trace: it trains throughout)")
    p.add_argument("--deadline-x", type=float, default=1.5,
                   help="the deadline as a multiple of --job-hours (deadline_aware; default 1.5)")
    p.add_argument("--domains", choices=("region", "zone", "one"), default="region",
                   help="placement domains of a multi-zone trace: one per region (default: the job moves "
                   "between regions as a whole), one per zone, or one for all (the job may span every zone)")
    p.add_argument("--no-migration", action="store_true", help="never move the job to another domain")
    p.add_argument("--egress-usd-per-gb", type=float, default=0.02,
                   help="what copying the checkpoint out of a domain costs (AWS inter-region: $0.02/GB)")
    p.add_argument("--copy-gb-s", type=float, default=0.5, help="the checkpoint copy's throughput between domains")
    p.add_argument("--grow", choices=("restart", "in_process"), default="restart",
                   help="how a running job takes new nodes (job.grow): a rejoin commit and a restart (default), "
                   "or in-process, the state sent from a survivor (the daemon's policies only: the baselines "
                   "restart as torchrun does)")
    p.add_argument("--peer-gb-s", type=float, default=JobModel.peer_bytes_s / 1e9,
                   help="node to node, an in-process grow's state to its joiners")
    p.add_argument("--json", type=Path, help="write the figures here, keyed by policy")
    p.add_argument("--png", type=Path, help="draw world size, spend and progress over time (needs matplotlib)")
    return p


def format_table(results: Sequence[Result]) -> str:
    head = ["POLICY", "STEPS", "STEPS/H", "LOST", "GOODPUT", "USD", "USD/STEP", "COST/OPT", "NODE-H", "OD NODE-H", "RESTARTS",
            "RESIZES", "MOVES", "DONE AT H", "DEADLINE"]
    rows = [head]
    for r in results:
        rows.append([r.policy, f"{r.steps:,}", f"{r.steps_per_hour:,.0f}", f"{r.lost_steps:,}",
                     "-" if r.goodput is None else f"{r.goodput:.3f}", f"{r.cost_usd:,.2f}",
                     "-" if r.usd_per_step is None else f"{r.usd_per_step:.5f}",
                     f"{r.cost_usd / r.optimum_usd:.3f}" if r.optimum_usd else "-", f"{r.node_hours:,.1f}",
                     f"{r.on_demand_node_hours:,.1f}", str(r.restarts), str(r.resizes),
                     f"{r.migrations}" + (f" ({r.migrations_failed} failed)" if r.migrations_failed else ""),
                     "-" if r.completed_at_h is None else f"{r.completed_at_h:.2f}",
                     {None: "-", True: "met", False: "MISSED"}[r.deadline_met]])
    return render(rows)


def render(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as aligned columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in rows)


def run(args: argparse.Namespace) -> list[Result]:
    trace = load_trace(args.trace)
    zones = args.zones.split(",") if args.zones else None
    for z in zones or []:
        if z not in trace.zones:
            raise TraceError(f"--zones: {z!r} is not a zone of {args.trace} ({', '.join(sorted(trace.zones))})")
    target = args.target_nodes or trace.max_nodes or 1
    ref = args.ref_gpus or target
    steps = 10**12 if args.job_hours is None else max(1, round(args.job_hours * 3600 / args.step_s))
    job = JobModel(target_steps=steps, step_s=args.step_s, ref_gpus=ref,
                   checkpoint_bytes=args.checkpoint_gb * 1e9, checkpoint_every_steps=args.checkpoint_every,
                   boot_s=args.boot_s, restart_s=args.restart_s, peer_bytes_s=args.peer_gb_s * 1e9)
    deadline = None if args.job_hours is None else args.job_hours * args.deadline_x * 3600
    domains = domains_for(zones or sorted(trace.zones), args.domains)
    out = []
    for name in args.policy or DEFAULT_POLICIES:
        market = Market(on_demand_usd_h=args.on_demand_usd_h, spot_usd_h=args.spot_usd_h, on_demand=name == ON_DEMAND)
        policy = get_policy(DEFAULT_POLICY if name == ON_DEMAND else name)
        r = Replay(trace, policy, job=job, market=market, target_nodes=target, zones=zones,
                   deadline_s=deadline, domains=domains, migration=None if args.no_migration else Plan(),
                   egress_usd_per_gb=args.egress_usd_per_gb, copy_bytes_s=args.copy_gb_s * 1e9,
                   grow_in_process=args.grow == "in_process").run(
            until_s=None if args.hours is None else args.hours * 3600)
        r.policy = name
        horizon = deadline if r.deadline_met else r.hours * 3600
        r.optimum_usd = pool_bound(trace, zones or sorted(trace.zones), target=target,
                                   node_s=r.steps * job.step_s * job.ref_gpus / market.gpus_per_node,
                                   deadline_s=horizon, on_demand_usd_h=market.on_demand_usd_h,
                                   spot_usd_h=market.spot_usd_h)
        out.append(r)
    return out


def domains_for(zones: Sequence[str], how: str) -> dict[str, str] | None:
    """Each zone's placement domain: its region (``region``), itself (``zone``), or one
    domain for all (``one``: None)."""
    if how == "one":
        return None
    return {z: (region_of(z) if how == "region" else z) for z in zones}


def draw(results: Sequence[Result], path: Path, title: str) -> str | None:
    """World size, spend and progress over time, one line per policy; None, or why not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install '.[bench]')"
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for r in results:
        hours = [p[0] for p in r.timeline]
        for ax, idx in zip(axes, (1, 2, 3)):
            ax.plot(hours, [p[idx] for p in r.timeline], label=r.policy, drawstyle="steps-post")
    for ax, label in zip(axes, ("world size (GPUs)", "spend (USD)", "steps (a restart falls back)")):
        ax.set_ylabel(label)
    axes[-1].set_xlabel("hours")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in args.policy or ():
        if name != ON_DEMAND and name not in policy_names():
            print(f"bench.replay: --policy {name!r}: known: {ON_DEMAND}, {', '.join(policy_names())}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    try:
        results = run(args)
    except TraceError as exc:
        print(f"bench.replay: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    print(f"trace {args.trace}: {results[0].hours:.2f} h replayed per policy in {wall:.1f} s "
          f"(source and licence: shared/traces/README.md)")
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps({r.policy: r.to_dict() for r in results}, indent=1) + "\n")
    if args.png:
        why = draw(results, args.png, f"{args.trace}")
        if why:
            print(why, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
