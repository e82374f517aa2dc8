"""``job.command``: a notice reaches the user's own script as a SIGTERM with its deadline.

The plain notice's format (:func:`trainer.contract.write_plain_notice`), its delivery by
the agent's :class:`~daemon.gpunode.trainer_process.TrainerProcess` to a real process
(SIGTERM, the file readable with ``json.load``; SIGKILL to it and its children at the
deadline), the /proc reading behind that kill, and the daemon's pure decisions for such
a job: a replacement admitted at once, the job complete when every torchrun exited 0,
its silence (no step reported) never a stall.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from daemon.control import actions as a
from daemon.control.admission import Rules, admit
from daemon.control.lifecycle import JobState, NodeState, TrainerState
from daemon.control.reactions import on_notice, script_completed
from daemon.control.stall import Progress, StallRules, check, observe
from daemon.gpunode.proctree import descendants, parent_of
from daemon.gpunode.trainer_process import TrainerProcess
from trainer.contract import NOTICE_ENV, write_plain_notice
from trainers import TRAINERS

R, X, N = TrainerState.RUNNING, TrainerState.EXITED, TrainerState.NOT_STARTED


# -- the file -------------------------------------------------------------------------------------------

def test_the_plain_notice_is_one_json_object_with_the_deadline_and_seconds_left(tmp_path: Path) -> None:
    path = tmp_path / "notice.json"
    write_plain_notice(path, notice_id="n2:abc", kind="interruption", seen_at=1000.0, deadline=1120.0)
    with open(path) as f:
        got = json.load(f)
    assert got == {"id": "n2:abc", "kind": "interruption", "time": 1000.0, "deadline": 1120.0, "seconds_left": 120.0}
    write_plain_notice(path, notice_id="d1", kind="drain", seen_at=1001.0, deadline=None)  # replaces it whole
    assert json.loads(path.read_text())["seconds_left"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notice.json"]  # no tmp file left beside it


# -- delivery to a real process ---------------------------------------------------------------------------

def _runner(tmp_path: Path, mode: str, *args: str, signal_on_notice: bool = True) -> tuple[TrainerProcess, Path]:
    """The agent's trainer process running ``tests/trainers/plain_script.py`` in ``mode``
    (saver: saves the notice it reads on SIGTERM to ``args[0]``; stubborn: ignores SIGTERM,
    as does its child); and the FIFO it says it is ready on."""
    fifo = tmp_path / "ready.fifo"
    os.mkfifo(fifo)
    runner = TrainerProcess(workdir=tmp_path, node_id="n2", on_change=lambda: None)
    runner.job = {"argv": [str(TRAINERS / "plain_script.py"), mode, str(fifo), *args], "env": {},
                  **({"notice_signal": True} if signal_on_notice else {})}
    return runner, fifo


async def _ready(fifo: Path) -> str:
    def read() -> str:
        with open(fifo) as f:  # blocks until the script opens it: its handler is installed by then
            return f.readline().strip()
    async with asyncio.timeout(60):
        return await asyncio.to_thread(read)


async def test_the_script_gets_sigterm_and_reads_its_deadline(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    runner, fifo = _runner(tmp_path, "saver", str(out))
    assert runner.job_env()[NOTICE_ENV] == str(tmp_path / "notice.json")
    await runner.start()
    assert await _ready(fifo) == "ready"
    seen_at = time.time()
    assert runner.notice("n2:abc", kind="interruption", seen_at=seen_at, deadline=seen_at + 60) is True
    async with asyncio.timeout(30):
        assert await runner.proc.wait() == 0  # its own handler ran, and it exited as it chose
    got = json.loads(out.read_text())
    assert got["signal"] == signal.SIGTERM
    assert got["notice"]["deadline"] == seen_at + 60 and got["notice"]["seconds_left"] == 60.0
    assert got["at"] < got["notice"]["deadline"]
    assert not runner.notice("n2:abc", kind="interruption", seen_at=seen_at, deadline=seen_at + 60)  # once


async def test_what_outlives_its_deadline_is_killed_with_its_children(tmp_path: Path) -> None:
    runner, fifo = _runner(tmp_path, "stubborn")
    await runner.start()
    child = int(await _ready(fifo))
    assert descendants(runner.proc.pid) == [child]
    child_fd = os.pidfd_open(child)  # readable once the child has exited, whoever reaps it
    try:
        t0 = time.time()
        assert runner.notice("drain-1", kind="interruption", seen_at=t0, deadline=t0 + 1.0)
        async with asyncio.timeout(30):
            assert await runner.proc.wait() == -signal.SIGKILL
        assert time.time() - t0 >= 0.9  # not before the deadline
        # SIGKILL is delivered asynchronously: the child is dead once its pidfd says so, and
        # it ignores SIGTERM, so only the deadline's SIGKILL can end it.
        async with asyncio.timeout(10):
            await _exited(child_fd)
    finally:
        os.close(child_fd)


async def _exited(pidfd: int) -> None:
    """Wait until the process behind ``pidfd`` has exited (the fd polls readable then)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)


async def test_a_module_trainer_gets_no_sigterm_on_a_notice(tmp_path: Path) -> None:
    runner, fifo = _runner(tmp_path, "saver", str(tmp_path / "out.json"), signal_on_notice=False)
    assert NOTICE_ENV not in runner.job_env()
    await runner.start()
    await _ready(fifo)
    assert runner.notice("n2:abc", kind="interruption", seen_at=time.time(), deadline=time.time() + 60) is False
    assert runner.proc.returncode is None and not (tmp_path / "notice.json").exists()
    await runner.stop()


@pytest.mark.parametrize(("stat", "ppid"), [
    ("4242 (python) S 17 4242 17 0 -1", 17),
    ("4242 (a) b (c)) R 1 4242 1 0", 1),  # a command name with spaces and parentheses
    ("garbage", None),
])
def test_the_parent_pid_is_read_after_the_last_parenthesis(stat: str, ppid: int | None) -> None:
    assert parent_of(stat) == ppid


# -- the daemon's decisions -------------------------------------------------------------------------------

def _pool(*trainers: TrainerState, job: JobState = JobState.RUNNING,
          states: tuple[NodeState, ...] = ()) -> a.PoolState:
    nodes = tuple(a.NodeView(id=f"n{i}", state=states[i - 1] if states else NodeState.RUNNING, gpus=1,
                             created_at=0.0, trainer=t, ordinal=i) for i, t in enumerate(trainers, 1))
    return a.PoolState(nodes=nodes, job=job, target_nodes=3, desired_nodes=3)


@pytest.mark.parametrize(("s", "codes", "done"), [
    (_pool(X, X, X), {"n1": 0, "n2": 0, "n3": 0}, True),
    (_pool(X, X, R), {"n1": 0, "n2": 0}, False),  # one still trains
    (_pool(X, X, X), {"n1": 0, "n2": 0, "n3": 1}, False),  # one failed: a stall's to restart, not an end
    (_pool(X, X, R, states=(NodeState.RUNNING, NodeState.RUNNING, NodeState.DRAINING)),
     {"n1": 0, "n2": 0}, False),  # a noticed node is still in the job
    (_pool(X, X, X, states=(NodeState.RUNNING, NodeState.RUNNING, NodeState.LOST)),
     {"n1": 0, "n2": 0}, True),  # a lost node is no part of it
    (_pool(X, X, X, job=JobState.PAUSED), {"n1": 0, "n2": 0, "n3": 0}, False),
    (_pool(N, N), {}, False),
])
def test_a_script_is_complete_when_every_torchrun_in_the_job_exited_0(s: a.PoolState, codes: dict,
                                                                      done: bool) -> None:
    assert script_completed(s, codes) is done


def test_a_replacement_is_admitted_at_once_with_no_commit_asked() -> None:
    s = _pool(R, R, N, states=(NodeState.RUNNING, NodeState.RUNNING, NodeState.READY))
    rules = Rules(min_nodes=1, valid_world_sizes=frozenset({1, 2, 3}), rejoin_timeout_s=90.0)
    assert not any(isinstance(x, a.Admit) for x in admit(s, rules, now=0.0))  # a module job asks a commit first
    assert admit(s, Rules(1, frozenset({1, 2, 3}), 90.0, rejoin_commit=False), now=0.0) == [a.Admit("n3", "restart")]


def test_a_notice_on_a_script_watches_no_flush_but_still_leaves() -> None:
    node = _pool(R).nodes[0]
    acts = on_notice(node, notice_id="n1:x", deadline=120.0, lead_s=120.0, now=0.0, commits=False)
    assert a.Leave("n1", "interruption notice") in acts and not any(isinstance(x, a.WatchFlush) for x in acts)


def test_a_script_that_reports_no_step_is_never_a_no_step_stall() -> None:
    rules = StallRules(first_step_s=900.0)
    s = _pool(R, R, R)
    p = observe(Progress(since=0.0), s, step=None, now=0.0)
    assert check(p, s, now=10_000.0, rules=rules, exit_codes={}).reason == "no_step"
    assert check(p, s, now=10_000.0, rules=rules, exit_codes={}, steps_expected=False) is None
