"""The nodes admitted together at the job's start wait for each other's torchrun before
the first round (``rendezvous.start_wait_s``): the admission says how many they are, the
agent hands that to torchrun (``$SPOTVISOR_START_COHORT``, read by trainer.rendezvous).
The round itself is tested in tests/test_rendezvous_handler.py, the daemon's reply in
tests/test_agent_api.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.control import actions as a
from daemon.control.admission import Rules, admit
from daemon.control.lifecycle import JobState, NodeState, TrainerState
from daemon.gpunode.agent import start_cohort
from daemon.gpunode.trainer_process import TrainerProcess
from trainer.contract import START_COHORT_ENV


def _ready(n: int) -> a.PoolState:
    nodes = tuple(a.NodeView(id=f"n{i}", state=NodeState.READY, gpus=1, created_at=0.0,
                             trainer=TrainerState.NOT_STARTED, ordinal=i) for i in range(1, n + 1))
    return a.PoolState(nodes=nodes, job=JobState.PENDING, target_nodes=n, desired_nodes=n)


def test_the_nodes_admitted_at_the_start_know_how_many_they_are() -> None:
    acts = admit(_ready(3), Rules(1, frozenset({1, 2, 3}), 90.0), now=0.0)
    assert [(x.node_id, x.reason, x.cohort) for x in acts if isinstance(x, a.Admit)] == [
        ("n1", "job_start", 3), ("n2", "job_start", 3), ("n3", "job_start", 3)]
    # a world size the batch cannot take is left out: the cohort is the nodes admitted
    acts = admit(_ready(3), Rules(1, frozenset({1, 2}), 90.0), now=0.0)
    assert [x.cohort for x in acts if isinstance(x, a.Admit)] == [2, 2]


# ids without "@": xdist's loadgroup reads what follows one in a test's id as its group
@pytest.mark.parametrize(("raw", "expected"), [
    ({"nodes": 3, "until": 1767225600.5}, (3, 1767225600.5)),
    ({"nodes": 2, "until": 1767225600}, (2, 1767225600.0)),
    (None, None), ("3@1", None), ({"nodes": 1, "until": 1767225600}, None), ({"nodes": True, "until": 1.0}, None),
    ({"nodes": "3", "until": 1767225600}, None), ({"nodes": 3, "until": "soon"}, None),
    ({"nodes": 3, "until": float("inf")}, None), ({"nodes": 3, "until": False}, None),
], ids=["float", "int", "none", "string", "one_node", "bool_nodes", "str_nodes", "str_until", "inf", "bool_until"])
def test_the_agent_reads_the_cohort_or_nothing(raw: object, expected: object) -> None:
    assert start_cohort(raw) == expected


async def _environ(tp: TrainerProcess, **kwargs: object) -> dict[str, str]:
    tp.job = {"argv": ["-c", "import sys; sys.stdin.read()"], "env": {},
              "join": {"argv": ["-c", "import sys; sys.stdin.read()"], "env": {}}}
    await tp.start(**kwargs)  # type: ignore[arg-type]
    assert tp.proc is not None
    try:
        with open(f"/proc/{tp.proc.pid}/environ", "rb") as f:
            return dict(x.decode().split("=", 1) for x in f.read().split(b"\0") if b"=" in x)
    finally:
        tp.proc.kill()
        await tp.proc.wait()


async def test_torchrun_gets_the_cohort_and_a_joiner_does_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_COHORT_ENV, "9@1")  # the agent's own: never passed on
    tp = TrainerProcess(workdir=tmp_path, node_id="n1", on_change=lambda: None)
    assert (await _environ(tp, cohort=(3, 1767225600.5)))[START_COHORT_ENV] == "3@1767225600.500"
    assert START_COHORT_ENV not in await _environ(tp)
    assert START_COHORT_ENV not in await _environ(tp, join=True, cohort=(3, 1767225600.5))  # joins a running group
