"""When a chaos event fires (daemon/providers/chaos.py ``ready_to_fire``), for a trainer that
reports its world size and for a ``job.command`` script that reports nothing: a fresh-clone
user trial's scheduled notice never fired on its own script, silently."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from daemon.config import ChaosEvent, Config
from daemon.control.lifecycle import JobState
from daemon.model import NodeState
from daemon.providers.chaos import ready_to_fire, silent_trainer


def _sup(*, command: bool, running: int, world_size: int | None = None, step: int | None = None,
         resumed_at: float | None = None, others: dict[str, NodeState] | None = None) -> Any:
    job: dict[str, Any] = {"command": ["train.py"]} if command else {}
    config = Config.model_validate({"job": job, "pool": {"min_nodes": 1, "target_nodes": 3, "max_nodes": 3}})
    nodes = {f"n{i}": SimpleNamespace(state=NodeState.RUNNING, gpus=1) for i in range(running)}
    nodes.update({k: SimpleNamespace(state=v, gpus=1) for k, v in (others or {}).items()})
    view = SimpleNamespace(started_at=0.0, state=JobState.RUNNING, step=step, world_size=world_size,
                           resumed_at=resumed_at)
    return SimpleNamespace(job=view, nodes=nodes, config=config)


NOTICE = ChaosEvent(action="notice", node=2, at_s=20)


def test_a_reporting_trainer_is_hit_only_at_the_pools_full_world_size() -> None:
    assert not ready_to_fire(NOTICE, _sup(command=False, running=3, world_size=2, step=5), 30.0)  # 3rd joining
    assert ready_to_fire(NOTICE, _sup(command=False, running=3, world_size=3, step=5), 30.0)
    assert not ready_to_fire(NOTICE, _sup(command=False, running=3, world_size=3, step=5), 10.0)  # before at_s


def test_a_script_that_reports_nothing_is_hit_once_the_pool_is_full() -> None:
    sup = _sup(command=True, running=3)
    assert silent_trainer(sup)
    assert ready_to_fire(NOTICE, sup, 30.0)
    assert not ready_to_fire(NOTICE, _sup(command=True, running=2), 30.0)  # the pool short of its target
    joining = _sup(command=True, running=3, others={"n9": NodeState.ADMITTING})
    assert not ready_to_fire(NOTICE, joining, 30.0)


@pytest.mark.parametrize("gone", [True, False], ids=["previous-node-gone", "previous-node-still-there"])
def test_a_scripts_next_event_waits_for_the_previous_node_to_go(gone: bool) -> None:
    """No resume is ever reported by such a script: the previous event's node gone and the
    pool full again are what absorbed it."""
    sup = _sup(command=True, running=3, others={"old": NodeState.TERMINATED if gone else NodeState.RUNNING})
    assert ready_to_fire(NOTICE, sup, 30.0, previous=(25.0, "old")) is gone
    reporting = _sup(command=False, running=3, world_size=3, step=9, resumed_at=20.0,
                     others={"old": NodeState.TERMINATED})
    assert not ready_to_fire(NOTICE, reporting, 30.0, previous=(25.0, "old"))  # resumed before the fault


def test_an_at_step_event_waits_for_steps_a_silent_script_never_reports() -> None:
    ev = ChaosEvent(action="notice", node=2, at_step=20)
    assert not ready_to_fire(ev, _sup(command=True, running=3), 1e6)
    assert ready_to_fire(ev, _sup(command=True, running=3, world_size=3, step=20), 30.0)  # the HF callback reports
