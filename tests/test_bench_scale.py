"""bench/scale.py, small: 20 simulated nodes, a 2-node notice storm, a few seconds each phase.

It checks that the bench runs end to end (daemon, fleet and webhook sink in three
processes) and that its figures are there and consistent, not what they are: the
numbers belong to the 1,000-node run (bench/README.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.scale import Options, _config
from daemon.config import Config

REPO = Path(__file__).resolve().parents[1]


def test_config_admits_full_and_post_storm_world_sizes(tmp_path: Path) -> None:
    o = Options(nodes=1000, gpus_per_node=8, storm_frac=0.1)
    config = Config.model_validate(_config(o, tmp_path, "/tmp/x.sock", "http://127.0.0.1:1/hook"))
    valid = set(config.job.valid_world_sizes(8000))
    assert {8000, 7200} <= valid
    assert config.agent.heartbeat_interval_s == o.heartbeat_interval_s == 1.0


def test_scale_smoke(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--nodes", "20", "--steady-s", "2", "--settle-s", "0.5",
         "--boot-s", "0.3", "--rdzv-s", "0.5", "--flush-s", "0.3", "--step-s", "0.5", "--probe-every-s", "0.5",
         "--json", str(out), "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "daemon CPU, steady (% of one core)" in proc.stdout
    doc = json.loads(out.read_text())
    storm = doc["storm"]
    assert storm["notices"] == 2
    assert storm["replacements_planned"] == 2 and storm["replacements_issued"] == 2
    assert 0 <= storm["all_replacements_planned_s"] <= storm["all_replacements_issued_s"]
    assert storm["back_at_full_size_s"] is not None
    steady = doc["steady"]
    assert steady["heartbeats_per_s"] > 0 and steady["daemon_rss_mb"]["max"] > 0
    assert doc["webhook_latency"]["steady"]["n"] >= 1  # the probe's pool_scaled events
    assert doc["webhook"]["events"] > 0 and doc["webhook"]["bad_signatures"] == 0
    assert doc["fleet"]["hb_failed"] == 0 and doc["fleet"]["reports_failed"] == 0
    assert doc["daemon_log"]["errors"] == 0


WATCHED = """
import asyncio, sys, time

async def main():
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    sys.stdin.readline()  # the test's watch has started
    await asyncio.sleep(0.4)  # idle in the selector: no stall
    t = time.process_time()
    while time.process_time() - t < 0.3:  # a callback that computes for 0.3 s
        pass
    await asyncio.sleep(0.4)
    time.sleep(0.3)  # a blocking call on the loop
    await asyncio.sleep(0.4)
    # idle in the selector until the test has stopped watching: the interpreter's
    # exit (~50 ms of CPU) is not one of the stalls under test
    done = loop.create_future()
    loop.add_reader(sys.stdin.fileno(), done.set_result, None)
    print("done", flush=True)
    await done

asyncio.run(main())
"""


def test_loopwatch_sees_a_busy_and_a_blocked_loop_from_outside() -> None:
    """The scale bench's stall figures: an idle loop has none; 0.3 s of computing is a
    stall spent on a CPU; 0.3 s in a blocking call is one spent neither on a CPU nor
    waiting for one (when /proc/PID/syscall is readable; else it looks asleep)."""
    from bench.loopwatch import LoopWatch

    child = subprocess.Popen([sys.executable, "-c", WATCHED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        watch = LoopWatch(child.pid, every_s=0.01)
        watch.start()
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        stalls = watch.stop()
        child.communicate("", timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0
    # On a loaded machine a stall lasts longer than its 0.3 s (the computing callback
    # waits for a CPU: runq_s), and the idle waits may show small wake-up delays: the
    # test asserts what each stall was spent on, not its length.
    big = [st for st in stalls if st["lag_s"] >= 0.2]
    assert 1 <= len(big) <= 2, stalls
    busy = big[0]
    assert busy["cpu_s"] >= 0.2 and busy["cpu_s"] + busy["runq_s"] >= 0.6 * busy["lag_s"], stalls
    if len(big) == 2:  # the blocking call: neither computing nor waiting for a CPU while it blocks
        blocked = big[1]
        assert blocked["cpu_s"] < 0.1 and blocked["cpu_s"] + blocked["runq_s"] < blocked["lag_s"] - 0.2, stalls
        assert blocked["t"] - busy["t"] >= 0.5  # the idle 0.4 s between them is not a stall
