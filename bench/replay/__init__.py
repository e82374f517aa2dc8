"""Replays of public spot-market traces through the daemon's own decisions (issue 16).

:mod:`bench.replay.traces` reads the traces of ``shared/traces`` (Bamboo, Parcae,
Oobleck, SkyNomad / Can't Be Late) into one shape: capacity and price per zone over time.
:mod:`bench.replay.sim` replays the daemon's policies on them (our cost model);
:mod:`bench.replay.tickmodel` charges one instance as SkyNomad's simulator does (issue 31);
:mod:`bench.replay.optimum` is the offline optimum and a pool's lower bound;
:mod:`bench.replay.lookahead` a policy that re-plans with it over sampled futures.
"""
