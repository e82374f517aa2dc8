"""The deadline property over every window of real spot traces (bench/replay/windows.py).

Bamboo's p3 and g4dn traces (MIT, copied into tests/data/traces/bamboo) run in CI; the
45-day 9-zone V100 data runs when ``../shared/traces`` is beside the checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.replay.traces import load_trace
from bench.replay.windows import SETTINGS, check, summary

DATA = Path(__file__).parent / "data" / "traces"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.mark.parametrize("path, ratio", [("bamboo/p3-trace.csv", 1.2), ("bamboo/p3-trace.csv", 1.5),
                                         ("bamboo/g4dn-trace.csv", 1.5)])
def test_deadline_aware_meets_every_deadline_on_demand_meets_on_every_window(path: str, ratio: float) -> None:
    setting = next(s for s in SETTINGS if s.path == path)
    rows = check(load_trace(DATA / path), setting, ratio)
    sm = summary(rows)
    assert sm["windows"] >= 8 and sm["on_demand_met"] == sm["windows"]
    assert sm["deadline_aware_missed"] == 0, sm["missed_at_h"]
    assert sm["home_zone_missed"] == 0, sm["home_zone_missed_at_h"]
    assert sm["deadline_aware_cost_vs_on_demand"] < 0.9  # and it saves money doing so
    assert sm["home_zone_cost_vs_on_demand"] < 0.9
    # each window's cost is above the lower bound on any pool's cost there
    assert all(r.optimum <= min(r.deadline_aware[0], r.on_demand[0]) for r in rows)
    assert all(r.optimum <= r.spot[0] for r in rows if r.spot[1])


@pytest.mark.slow
@pytest.mark.skipif(not SHARED.exists(), reason="the shared traces are not beside this checkout")
def test_every_window_of_the_45_day_v100_trace() -> None:
    setting = next(s for s in SETTINGS if s.path.startswith("skynomad"))
    sm = summary(check(load_trace(SHARED / setting.path), setting, 1.5))
    assert sm["windows"] == 18 and sm["deadline_aware_missed"] == 0 and sm["home_zone_missed"] == 0, sm


_OTHERS = [s.path for s in SETTINGS if not s.path.startswith(("skynomad", "bamboo/p3", "bamboo/g4dn"))]


@pytest.mark.slow
@pytest.mark.skipif(not SHARED.exists(), reason="the shared traces are not beside this checkout")
@pytest.mark.parametrize("path", _OTHERS)
def test_every_window_of_every_other_shared_trace(path: str) -> None:
    """GCP's A100 and V100 groups, Parcae's copy of the p3 trace and its four windows,
    Oobleck's synthetic and rescaled traces: both deadline policies meet every deadline
    on-demand meets, and no window is cheaper than its bound."""
    setting = next(s for s in SETTINGS if s.path == path)
    rows = check(load_trace(SHARED / path), setting, 1.5)
    sm = summary(rows)
    assert sm["windows"] >= 2 and sm["on_demand_met"] == sm["windows"], sm
    assert sm["deadline_aware_missed"] == 0 and sm["home_zone_missed"] == 0, sm
    assert all(r.optimum <= min(r.deadline_aware[0], r.home_zone[0], r.on_demand[0]) + 1e-9 for r in rows)
