"""``python -m bench.replay.deadline_markets [--markets 300] [--seed 1]``

The deadline property of ``tests/test_replay.py`` on many seeded random markets, with
figures: one zone whose spot capacity jumps between 0 and 4 nodes every 1-90 minutes,
a job of 0.5-4 h on 1-4 nodes, a deadline 1.05-2.5 x its length. For every market where
buying on-demand from the start meets the deadline, it replays ``deadline_aware`` and
spot alone (``spotvisor``) and prints: deadlines missed by ``deadline_aware`` (the
property says 0), its mean cost relative to on-demand, and how often spot alone met
the deadline.
"""

from __future__ import annotations

import argparse
import random
import sys

from bench.replay.sim import JobModel, Market, Replay
from bench.replay.traces import parse_events
from daemon.control.policies import get_policy


def random_market(rng: random.Random, horizon_h: float):
    """One zone's add/remove events: capacity 0-4, changing every 1-90 minutes, outlasting ``horizon_h``."""
    events, alive, t, k = [], [], 0, 0
    for _ in range(rng.randint(1, 30)):
        count = rng.randint(0, 4)
        while len(alive) < count:
            events.append(f"{t},add,a{k}")
            alive.append(f"a{k}")
            k += 1
        while len(alive) > count:
            events.append(f"{t},remove,{alive.pop()}")
        t += rng.randint(1, 90) * 60_000
    events.append(f"{max(t, int(horizon_h * 3_600_000))},add,a{k}")
    return parse_events(events, zone="z", source="random")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replay.deadline_markets")
    p.add_argument("--markets", type=int, default=300)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    checked = missed = spot_met = 0
    ratios = []
    for _ in range(args.markets):
        job_h, ratio, target = rng.uniform(0.5, 4.0), rng.uniform(1.05, 2.5), rng.randint(1, 4)
        trace = random_market(rng, job_h * ratio + 1)
        job = JobModel(target_steps=max(1, round(job_h * 3600)), step_s=1.0, ref_gpus=target, checkpoint_bytes=4e9)
        deadline = job_h * ratio * 3600
        run = lambda name, market=Market(): Replay(trace, get_policy(name), job=job, target_nodes=target,  # noqa: E731
                                                  deadline_s=deadline, market=market).run()
        od = run("spotvisor", Market(on_demand=True))
        if not od.deadline_met:
            continue
        checked += 1
        da, spot = run("deadline_aware"), run("spotvisor")
        missed += not da.deadline_met
        spot_met += bool(spot.deadline_met)
        ratios.append(da.cost_usd / od.cost_usd)
    print(f"{args.markets} markets (seed {args.seed}), {checked} where on-demand meets the deadline: "
          f"deadline_aware missed {missed}, cost {sum(ratios) / max(1, len(ratios)):.0%} of on-demand on average; "
          f"spot alone met {spot_met / max(1, checked):.0%}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
