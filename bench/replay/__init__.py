"""Replays of public spot-market traces through the daemon's own decisions (issue 16).

:mod:`bench.replay.traces` reads the traces of ``shared/traces`` (Bamboo, Parcae,
Oobleck, SkyNomad / Can't Be Late) into one shape: capacity and price per zone over time.
"""
