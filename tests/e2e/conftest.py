"""Fixtures for end-to-end runs of ``spotvisord demo`` (real torchrun, real agents)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from bench.ports import free_port

ROOT = Path(__file__).resolve().parents[2]

# A small model so a run is dominated by the resizes, not the training.
SMALL_MODEL = ["--seq-len", "64", "--n-layer", "2", "--n-embd", "128", "--n-head", "4"]


def paced(full_world: int, pace_s: float = 0.5, hold_last: int = 0) -> dict[str, Any]:
    """Job fields that run the small model under ``e2e.paced_trainer``: slowed while the world
    is smaller than ``full_world``, so a run cannot end before its replacements have joined;
    with ``hold_last``, its last steps wait for the whole world (``--hold-last``), so a
    cell's target can end a few steps after its last grow."""
    return {"module": "e2e.paced_trainer",
            "args": [*SMALL_MODEL, "--full-world", str(full_world), "--pace-s", str(pace_s),
                     "--hold-last", str(hold_last)]}


def _run_demo_config(raw: dict[str, Any], tmp_path: Path, timeout_s: float, *,
                     env: dict[str, str] | None = None,
                     during: Callable[[subprocess.Popen, Path], None] | None = None) -> dict[str, Any]:
    """Run ``spotvisord demo`` on ``raw`` (a parsed config) with a free rendezvous port and
    state under ``tmp_path``; the summary dict, with the daemon's stdout under ``_stdout``
    and its stderr under ``_stderr``. ``env``: added to the daemon's environment.
    ``during(proc, socket)``: called once the daemon runs (it may watch it through its
    control socket until ``proc`` exits)."""
    raw["rendezvous"]["port"] = free_port()
    for domain in raw.get("domains", []):  # each placement domain's own rendezvous store
        if domain.get("rendezvous"):
            domain["rendezvous"]["port"] = free_port()
    raw["daemon"]["state_dir"] = str(tmp_path / "state")
    raw["daemon"]["socket"] = str(tmp_path / "d.sock")
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    out = tmp_path / "summary.json"
    tests = str(ROOT / "tests")  # e2e.paced_trainer, for the nodes' workers
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}
    out_path, err_path = tmp_path / "demo.stdout", tmp_path / "demo.stderr"
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f, subprocess.Popen(  # files: never a full pipe
        [sys.executable, "-m", "daemon.interfaces.cli", "demo", "--config", str(cfg), "--summary-json", str(out),
         "--timeout-s", str(timeout_s)],
        cwd=ROOT, stdout=out_f, stderr=err_f, env=env,
    ) as proc:
        try:
            if during is not None:
                during(proc, tmp_path / "d.sock")
            proc.wait(timeout=timeout_s + 60)
        finally:
            if proc.poll() is None:
                proc.kill()
    stdout, stderr = out_path.read_text(), err_path.read_text()
    assert proc.returncode == 0, stdout[-5000:] + stderr[-3000:]
    summary = json.loads(out.read_text())
    summary["_stdout"], summary["_stderr"] = stdout, stderr
    return summary


#: trainer-log lines worth reading when a run's check fails (warnings of ours, errors, tracebacks)
_NOTEWORTHY = (" WARNING ", " ERROR ", "Traceback", "Error:", "Timed out")


def run_evidence(tmp_path: Path, *, lines: int = 40) -> str:
    """What a failed check of a demo run under ``tmp_path`` should print (CI keeps no run
    directory; ``tests/conftest.py`` adds it to every such failure's report): each node's
    trainer-log lines that warn or fail (the last ``lines`` of them in all, the collective
    and where it failed among them), and every rank's ``started`` status lines (attempt,
    world sizes, step, resize figures)."""
    out = []
    for log in sorted((tmp_path / "state").glob("demo-*/nodes/*/trainer.log")):
        hits = [ln[:400] for ln in log.read_text(errors="replace").splitlines()
                if any(m in ln for m in _NOTEWORTHY) and "FutureWarning" not in ln]
        out += [f"{log.parent.name}: {ln}" for ln in hits]
    out = out[-lines:]
    for path in sorted((tmp_path / "state").glob("demo-*/nodes/*/status.jsonl")):
        for raw in path.read_text().splitlines():
            if '"started"' in raw:
                out.append(f"{path.parent.name}: {raw[:400]}")
    return "\n".join(out)


@pytest.fixture
def plain_script_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that is not the reference trainer (a user's plain script, one that crashes):
    its nodes' zygotes preload torch only, as a user's would without ``job.preload``.
    tests/conftest.py has every other job's zygotes preload ``trainer.run`` (with GPT-2 from
    transformers, 3.4 CPU-s a node boot), which such a script never imports."""
    monkeypatch.delenv("SPOTVISOR_ZYGOTE_PRELOAD", raising=False)


@pytest.fixture
def run_config_demo(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """``run_config_demo("configs/X.yaml", timeout_s=...)`` → the summary of ``spotvisord demo``
    on that shipped config as written (job, providers, chaos); ``job``: job fields to
    change (e.g. a smaller model's ``args``, where the test is about the flow, not the model)."""

    def run(config: str, *, timeout_s: float = 240, job: dict[str, Any] | None = None) -> dict[str, Any]:
        raw = yaml.safe_load((ROOT / config).read_text())
        raw["job"].update(job or {})
        return _run_demo_config(raw, tmp_path, timeout_s)

    return run


@pytest.fixture
def run_demo(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """``run_demo(chaos=[...], **job)`` → the summary dict of a demo run from configs/local.yaml.
    ``config``: other sections' fields, merged in; ``daemon_env`` (the daemon's ``env``) and
    ``during``: as :func:`_run_demo_config`."""

    def run(*, chaos: list[dict[str, Any]], dialects: list[str] | None = None, timeout_s: float = 420,
            offers: list[dict[str, Any]] | None = None, pool: dict[str, Any] | None = None,
            config: dict[str, Any] | None = None, daemon_env: dict[str, str] | None = None,
            during: Callable[[subprocess.Popen, Path], None] | None = None, **job: Any) -> dict[str, Any]:
        raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
        raw["job"].update({"checkpoint_interval_steps": 10, "args": SMALL_MODEL, **job})
        raw["job"] = {k: v for k, v in raw["job"].items() if v is not None}  # None: the field left out
        if dialects:
            raw["providers"]["local"]["metadata_dialects"] = dialects
        if offers is not None:
            raw["offers"] = offers
        raw["pool"].update(pool or {})
        raw["chaos"] = chaos
        for section, fields in (config or {}).items():  # e.g. {"notify": [...], "daemon": {...}}
            raw[section] = {**raw.get(section, {}), **fields} if isinstance(fields, dict) else fields
        return _run_demo_config(raw, tmp_path, timeout_s, env=daemon_env, during=during)

    return run
