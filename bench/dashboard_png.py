"""The Grafana dashboard (configs/grafana/spotvisor.json) rendered to a PNG from a real run.

Runs ``spotvisord demo`` on configs/local.yaml (its chaos schedule: two notices and a kill)
with ``daemon.metrics_port`` set and a ``job.deadline`` (so the slack has a value), a
real Prometheus (Debian's ``prometheus`` package: ``apt-get install -y prometheus``)
scraping it every second on 127.0.0.1, then asks Prometheus's range API
(``/api/v1/query_range``, https://prometheus.io/docs/prometheus/latest/querying/api/)
for every query of every panel of the dashboard, as Grafana would, and draws the
panels with matplotlib in the dashboard's grid::

    .venv/bin/python -m bench.dashboard_png --out docs/img/dashboard.png

The helpers (:func:`dashboard_queries`, :func:`start_prometheus`, :func:`query_range`,
:func:`run_config`) are what ``tests/e2e/test_prometheus_dashboard.py`` uses too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from bench.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "configs" / "grafana" / "spotvisor.json"
INSTALL = "apt-get install -y prometheus"
#: what the dashboard's variables and Grafana's own become outside Grafana
VARIABLES = {"$instance": ".*", "${instance}": ".*", "$__rate_interval": "15s", "${datasource}": "prometheus"}


@dataclass(frozen=True)
class Query:
    panel: str
    unit: str
    expr: str  # variables substituted
    legend: str
    grid: tuple[int, int, int, int]  # x, y, w, h (Grafana's 24-column grid)


def dashboard_queries(path: Path = DASHBOARD, variables: dict[str, str] = VARIABLES) -> list[Query]:
    """Every target of every panel of the dashboard JSON, its variables substituted."""
    dash = json.loads(path.read_text())
    out = []
    for p in dash["panels"]:
        g = p["gridPos"]
        for t in p.get("targets", []):
            expr = t["expr"]
            for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace(name, value)
            out.append(Query(p["title"], p.get("fieldConfig", {}).get("defaults", {}).get("unit", "none"), expr,
                             t.get("legendFormat", ""), (g["x"], g["y"], g["w"], g["h"])))
    return out


def prometheus_binary() -> str | None:
    return shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None)


def start_prometheus(target: str, workdir: Path, *, scrape_interval_s: float = 1.0) -> tuple[subprocess.Popen, str]:
    """A Prometheus on 127.0.0.1 (a free port) scraping ``target`` (host:port) every
    ``scrape_interval_s``; returns the process and its URL once it answers ``/-/ready``.

    Raises:
        FileNotFoundError: no ``prometheus`` binary (the message says how to install it).
        RuntimeError: it did not become ready in 60 s (its log's tail).
    """
    binary = prometheus_binary()
    if binary is None:
        raise FileNotFoundError(f"no prometheus binary: {INSTALL}")
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{scrape_interval_s:g}s", "scrape_timeout": f"{scrape_interval_s:g}s"},
        "scrape_configs": [{"job_name": "spotvisord", "static_configs": [{"targets": [target]}]}],
    }))
    port = free_port()
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        proc_wait(proc, 0.2)
    proc.kill()
    raise RuntimeError("prometheus did not start: " + (workdir / "prometheus.log").read_text()[-2000:])


def proc_wait(proc: subprocess.Popen, seconds: float) -> None:
    """Wait up to ``seconds`` for ``proc`` (a pause that ends early if it exits)."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


def query_range(url: str, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict[str, Any]]:
    """``/api/v1/query_range``'s ``result``: one ``{"metric": labels, "values": [[t, "v"], ...]}`` per series.

    Raises:
        RuntimeError: Prometheus answered an error (the query does not parse, ...).
    """
    q = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{q}", timeout=30) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


def demo_config(metrics_port: int, tmp: Path, *, target_steps: int | None = None) -> dict[str, Any]:
    """configs/local.yaml with ``/metrics`` on 127.0.0.1:``metrics_port``, a spot price, an
    on-demand offer beside the spot one and a 2 h ``job.deadline`` (what the slack needs),
    its state under ``tmp`` and a free rendezvous port."""
    raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    spot = {**raw["offers"][0], "on_demand_price_usd_h": 3.0}
    raw["offers"] = [spot, {**spot, "market": "on_demand", "on_demand_price_usd_h": None}]
    raw["pool"]["on_demand_fallback"] = True
    raw["providers"]["local"]["spot_price_usd_h"] = 0.9
    raw["job"].update({"deadline": 2.0, "step_s": 0.5})
    if target_steps is not None:
        raw["job"]["target_steps"] = target_steps
    raw["daemon"].update({"metrics_port": metrics_port, "state_dir": str(tmp / "state"), "socket": str(tmp / "d.sock")})
    raw["rendezvous"]["port"] = free_port()
    return raw


def run_config(raw: dict[str, Any], tmp: Path, *, timeout_s: float = 600,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``spotvisord demo`` on ``raw`` until it ends (its output in files under ``tmp``)."""
    cfg = tmp / "demo.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    with open(tmp / "demo.stdout", "w") as out, open(tmp / "demo.stderr", "w") as err:
        proc = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "demo", "--config", str(cfg),
                               "--summary-json", str(tmp / "summary.json"), "--timeout-s", str(timeout_s)],
                              cwd=ROOT, stdout=out, stderr=err, env={**os.environ, **(env or {})},
                              timeout=timeout_s + 60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, (tmp / "demo.stdout").read_text(),
                                       (tmp / "demo.stderr").read_text())


@dataclass
class Recorded:
    """A run's window and each query's series: what the PNG draws."""

    start: float
    end: float
    series: dict[Query, list[dict[str, Any]]]


def record(queries: list[Query], url: str, start: float, end: float, step_s: float = 1.0) -> Recorded:
    return Recorded(start, end, {q: query_range(url, q.expr, start, end, step_s) for q in queries})


def _legend(q: Query, labels: dict[str, str]) -> str:
    out = q.legend or q.expr
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def render(rec: Recorded, out: Path, title: str = "spotvisor: the job") -> None:
    """The panels in the dashboard's grid, one matplotlib axis each (x: minutes into the run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[str, list[Query]] = {}
    for q in rec.series:
        panels.setdefault(q.panel, []).append(q)
    rows = max(q.grid[1] + q.grid[3] for q in rec.series) // 7
    fig, axes = plt.subplots(rows, 3, figsize=(16, 3.1 * rows), squeeze=False)
    for name, qs in panels.items():
        x, y, _, _ = qs[0].grid
        ax = axes[y // 7][x // 8]
        unit = qs[0].unit
        for q in qs:
            for s in rec.series[q]:
                t = [(float(v[0]) - rec.start) / 60 for v in s["values"]]
                v = [float(v[1]) for v in s["values"]]
                if unit == "dateTimeAsIso":  # ms since the epoch: hours after the run's start
                    v = [(val / 1000 - rec.start) / 3600 for val in v]
                step = "post" if "increase(" in q.expr else None
                if step:
                    ax.bar(t, v, width=0.25 / 60 * 15, label=_legend(q, s["metric"]), alpha=0.7)
                else:
                    ax.plot(t, v, label=_legend(q, s["metric"]), linewidth=1.4)
        ylabel = {"dateTimeAsIso": "hours after start", "s": "seconds", "percentunit": "ratio",
                  "currencyUSD": "USD"}.get(unit, "")
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in axes[-1]:
        ax.set_xlabel("minutes into the run", fontsize=8)
    fig.suptitle(f"{title}  ({time.strftime('%Y-%m-%d %H:%M', time.localtime(rec.start))}, "
                 f"{(rec.end - rec.start) / 60:.1f} min, Prometheus range queries of configs/grafana/spotvisor.json)",
                 fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    p.add_argument("--target-steps", type=int, default=None, help="default: configs/local.yaml's")
    args = p.parse_args(argv)
    if prometheus_binary() is None:
        print(f"dashboard_png: no prometheus binary ({INSTALL})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="sv-dash-", dir="/tmp") as d:
        tmp = Path(d)
        port = free_port()
        prom, url = start_prometheus(f"127.0.0.1:{port}", tmp / "prom")
        try:
            start = time.time()
            done = run_config(demo_config(port, tmp, target_steps=args.target_steps), tmp)
            end = time.time()
            if done.returncode != 0:
                print(done.stdout[-3000:] + done.stderr[-2000:], file=sys.stderr)
                return 1
            rec = record(dashboard_queries(), url, start, end)
        finally:
            prom.terminate()
            proc_wait(prom, 10)
    empty = [q.expr for q, s in rec.series.items() if not s]
    render(rec, Path(args.out))
    print(f"dashboard_png: {args.out} ({(end - start) / 60:.1f} min run; queries without data: {empty or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
