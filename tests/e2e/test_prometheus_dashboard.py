"""A real Prometheus (Debian's ``prometheus`` package) scrapes a daemon's ``/metrics`` during
a short local run, and every query of the Grafana dashboard (configs/grafana/spotvisor.json,
its variables substituted as Grafana would) returns data over the run: what a person
importing the dashboard will see is there. The helpers are bench/dashboard_png.py's, which
draws the same queries to docs/img/dashboard.png."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.dashboard_png import (INSTALL, dashboard_queries, demo_config, free_port, prometheus_binary, proc_wait,
                                 record, run_config, start_prometheus)
from e2e.conftest import SMALL_MODEL


def test_the_dashboard_json_is_importable() -> None:
    """Grafana's import needs a title, panels with targets and a datasource variable."""
    dash = json.loads(Path("configs/grafana/spotvisor.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])
    titles = {p["title"] for p in dash["panels"]}
    assert {"Pool by domain and market", "World size", "Events", "Spend (USD)", "Goodput", "Step rate (steps/s)",
            "Tokens/s", "Loss", "Expected finish", "Deadline slack"} <= titles
    assert not [q.expr for q in dashboard_queries() if "$" in q.expr]  # every variable substituted


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path: Path) -> None:
    if prometheus_binary() is None:
        pytest.fail(f"the prometheus binary is missing: {INSTALL} (or: make test-deps)")
    port = free_port()
    prom, url = start_prometheus(f"127.0.0.1:{port}", tmp_path / "prom", scrape_interval_s=1.0)
    try:
        raw = demo_config(port, tmp_path, target_steps=90)
        raw["job"].update({"args": SMALL_MODEL, "checkpoint_interval_steps": 10})
        raw["chaos"] = [{"action": "notice", "node": 2, "at_step": 30, "lead_s": 30, "wait_full_pool": False}]
        start = time.time()
        done = run_config(raw, tmp_path, timeout_s=300)
        end = time.time()
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        rec = record(dashboard_queries(), url, start, end)
    finally:
        prom.terminate()
        proc_wait(prom, 10)
    empty = [f"{q.panel}: {q.expr}" for q, series in rec.series.items()
             if not any(s["values"] for s in series)]
    assert not empty, f"queries without data: {empty}"

    def peak(expr_part: str) -> float:
        (q,) = [q for q in rec.series if expr_part in q.expr]
        return max(float(v[1]) for s in rec.series[q] for v in s["values"])

    assert peak("spotvisor_job_steps_per_second") > 0
    assert peak("spotvisor_job_tokens_per_second") > 0
    assert 30 < peak("spotvisor_job_step{") <= 90  # past the notice (the last scrape may precede the end)
    assert peak("spotvisor_job_deadline_slack_seconds") > 0  # 90 steps are well inside 2 h
    events = {s["metric"].get("kind") for q, ss in rec.series.items() if "spotvisor_events_total" in q.expr
              for s in ss}
    assert "interruption_notice" in events, events
