"""The job's progress (daemon/control/progress.py, progress_view.py): rates over a window,
the expected finish and the deadline slack as pure functions (property tests), the
heartbeat's ``progress`` bounded at the edge, the agent's side (one heartbeat carries the
newest step and the summed tokens however many steps came), and a daemon that shows the
same figures in ``/metrics`` and ``spotctl status``."""

from __future__ import annotations

import math

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.control.progress import ProgressWindow, Sample, deadline_slack, expected_finish, rates
from daemon.control.reports import Limits, ReportError, parse_progress
from daemon.gpunode.agent import StepProgress
from daemon.interfaces.ctl_render import render_status
from test_ctl import running_node
from test_metrics import agent_post, samples, scrape_socket, status_line

times = st.floats(0, 1e9, allow_nan=False)
rates_s = st.floats(1e-4, 1e4, allow_nan=False)


@given(t0=times, rate=rates_s, tokens_per_step=st.integers(1, 10**6), n=st.integers(2, 50),
       dt=st.floats(0.5, 40), step0=st.integers(0, 10**6))
def test_a_steady_run_is_measured_at_its_own_rate(t0, rate, tokens_per_step, n, dt, step0) -> None:
    """Heartbeats every ``dt`` s of a job at ``rate`` steps/s: the window's rate is that rate
    (to the step the heartbeats round to), tokens/s is steps/s x tokens per step."""
    w = ProgressWindow(window_s=1e9)
    for i in range(n):
        step = step0 + int(rate * dt * i)
        w.add("n1", Sample(t=t0 + dt * i, step=step, tokens=step * tokens_per_step))
    r = w.rates(t0 + dt * (n - 1))
    span = (t0 + dt * (n - 1)) - t0  # as the floats have it
    assert r.steps_per_s == pytest.approx(int(rate * dt * (n - 1)) / span, rel=1e-9)
    assert r.tokens_per_s == pytest.approx(r.steps_per_s * tokens_per_step, rel=1e-9)


@given(st.lists(st.tuples(st.floats(0, 1e4), st.integers(0, 10**6), st.none() | st.integers(0, 10**9)),
                max_size=60), st.floats(0, 2e4), st.floats(1, 1e4))
def test_rates_are_never_negative_and_the_window_stays_bounded(raw, now, window_s) -> None:
    w = ProgressWindow(window_s=window_s, max_samples=16)
    for t, step, tokens in raw:
        w.add("n1", Sample(t=t, step=step, tokens=tokens))
        assert len(w.samples) <= 16
        ts = [s.t for s in w.samples]
        assert ts == sorted(ts) and ts[-1] - ts[0] <= window_s  # one series, oldest first, within the window
    r = w.rates(now)
    assert r.steps_per_s is None or (r.steps_per_s >= 0 and math.isfinite(r.steps_per_s))
    assert r.tokens_per_s is None or (r.tokens_per_s >= 0 and math.isfinite(r.tokens_per_s))


def test_a_stall_a_restart_and_a_new_leader_start_the_window_over() -> None:
    w = ProgressWindow(window_s=300)
    for i in range(5):
        w.add("n1", Sample(t=100.0 + i, step=10 * i, tokens=1000 * i))
    assert w.rates(104).steps_per_s == 10
    for i in range(5, 9):  # a stall: heartbeats, no step
        w.add("n1", Sample(t=100.0 + i, step=40, tokens=4000))
    assert w.rates(108).steps_per_s == 5  # 40 steps over 8 s: falling
    w.add("n1", Sample(t=109.0, step=30, tokens=5000))  # resumed from an older commit: steps redone
    assert len(w.samples) == 1 and w.rates(109).steps_per_s is None
    w.add("n2", Sample(t=110.0, step=31, tokens=10))  # another node leads now
    assert list(w.samples) == [Sample(t=110.0, step=31, tokens=10)] and w.source == "n2"
    assert w.rates(110 + 301).steps_per_s is None  # every sample older than the window: not known


@given(step=st.integers(0, 10**7), target=st.integers(1, 10**7), rate=rates_s, now=times)
def test_the_expected_finish_is_the_work_left_at_the_rate(step, target, rate, now) -> None:
    finish = expected_finish(step, target, rate, now)
    assert finish is not None and finish >= now
    assert finish == (now if step >= target else pytest.approx(now + (target - step) / rate))


@given(deadline=times, finish=times)
def test_slack_is_the_deadline_less_the_finish(deadline, finish) -> None:
    assert deadline_slack(deadline, finish) == deadline - finish
    assert deadline_slack(None, finish) is None and deadline_slack(deadline, None) is None


def test_no_rate_no_finish() -> None:
    assert expected_finish(5, 10, None, 1.0) is None and expected_finish(5, 10, 0.0, 1.0) is None
    assert expected_finish(None, 10, 1.0, 1.0) is None
    assert rates([Sample(1.0, 1), Sample(1.0, 5)], now=1.0).steps_per_s is None  # no time between them
    with pytest.raises(ValueError, match="window_s"):
        rates([], now=0, window_s=0)


LIMITS = Limits(max_step=1000, max_world_size=8)


@pytest.mark.parametrize("bad, why", [
    ("x", "progress is not an object"), ({"loss": 1.0}, "step is missing"), ({"step": 1001}, "step 1001 is outside"),
    ({"step": 1, "tokens": -1}, "tokens -1 is outside"), ({"step": 1, "tokens": True}, "tokens is not an integer"),
    ({"step": 1, "loss": float("nan")}, "loss nan is outside"), ({"step": 1, "loss": 10**400}, "loss is outside"),
    ({"step": 1, "loss": "low"}, "loss is not a number"),
])
def test_a_bad_progress_is_refused_naming_the_field(bad, why) -> None:
    with pytest.raises(ReportError, match=why):
        parse_progress(bad, LIMITS)


def test_the_agent_sends_the_newest_step_and_every_steps_tokens() -> None:
    """10 steps between two heartbeats: one body, the newest step's loss, all 10 steps' tokens."""
    p = StepProgress()
    assert p.body() is None
    for s in range(1, 11):
        p.on_line({"event": "step", "step": s, "loss": 5.0 - s / 10, "tokens": 512})
    p.on_line({"event": "checkpoint_committed", "step": 10})
    assert p.body() == {"step": 10, "loss": 4.0, "tokens": 5120}
    p.on_line({"event": "step", "step": 11, "loss": float("nan"), "tokens": 2**41})  # a diverged loss, a bad count
    assert p.body() == {"step": 11, "loss": None, "tokens": 5120}
    p.on_line({"event": "started", "step": 8})  # a restart: no newest step until its first; the total goes on
    assert p.body() is None
    p.on_line({"event": "step", "step": 9, "loss": 3.0})  # a trainer that counts no tokens
    assert p.body() == {"step": 9, "loss": 3.0, "tokens": 5120}
    assert parse_progress(p.body(), LIMITS) is not None


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def test_the_daemon_shows_rates_finish_and_loss_in_metrics_and_status(spot_daemon, monkeypatch) -> None:
    """The leading node's heartbeats at 2 steps/s, 1,024 tokens a step: /metrics and
    ``spotctl status`` say 2 steps/s, 2,048 tokens/s, the loss and the finish at that rate;
    another node's progress and a bad one change nothing."""
    h = spot_daemon
    await running_node(h)
    node = h.sup.nodes["test-1"]
    await agent_post(h, node, "/v1/agent/events", {"events": [status_line("started", "a1", 0)]})
    clock = _Clock(h.sup.clock())
    monkeypatch.setattr(h.sup, "clock", clock)
    t0 = clock.t
    for i, step in enumerate((100, 120, 140)):  # a heartbeat every 10 s
        clock.t = t0 + 10 * i
        await agent_post(h, node, "/v1/agent/heartbeat", {
            "step": step, "progress": {"step": step, "loss": 2.5 - i / 10, "tokens": 1024 * step}})
    dropped = h.sup.reports_dropped["progress"]
    await agent_post(h, node, "/v1/agent/heartbeat", {"progress": {"step": 140, "tokens": -5}})
    assert h.sup.reports_dropped["progress"] == dropped + 1

    m = samples((await scrape_socket(h.socket_path))[1])
    target = h.config.job.target_steps
    assert m[("spotvisor_job_steps_per_second", ())] == pytest.approx(2.0)
    assert m[("spotvisor_job_tokens_per_second", ())] == pytest.approx(2048.0)
    assert m[("spotvisor_job_loss", ())] == pytest.approx(2.3)
    assert m[("spotvisor_job_expected_finish_timestamp_seconds", ())] == pytest.approx(clock.t + (target - 140) / 2)
    assert ("spotvisor_job_deadline_slack_seconds", ()) not in m  # no job.deadline: no slack series
    assert m[("spotvisor_pool_nodes", (("domain", "local-local"), ("market", "spot")))] == 1

    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=h.socket_path)) as s:
        async with s.get("http://spotvisord/v1/status") as r:  # what `spotctl status --json` prints
            status = await r.json()
    p = status["job"]["progress"]
    assert p["steps_per_s"] == pytest.approx(2.0) and p["tokens_per_s"] == pytest.approx(2048.0)
    assert p["loss"] == pytest.approx(2.3) and p["goodput"] == 1.0
    text = render_status(status, now=clock.t)
    assert "progress  2 steps/s  2,048 tokens/s  loss 2.3" in text and "expected finish" in text
