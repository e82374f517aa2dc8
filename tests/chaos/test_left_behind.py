"""Chaos cell: one node's torchrun exits non-zero and the job goes on without it.

In an in-process job (``job.grow: in_process``) the others shrink and go on, while the
node's instance stays up and its agent heartbeats: it counts as capacity, so the pool
would never replace it, and the job would train short for good. The stall rules cannot
see it (steps keep coming). :func:`daemon.control.stall.left_behind` makes the node
leave once the exit grace has passed and the others went on without it (a step after
the exit, or an attempt started without it); the planner releases it and launches a
replacement.

In-process (:class:`~chaos.conftest.Sim`): the real Supervisor on a ManualClock; the
test plays the agents and the trainer.
"""

from __future__ import annotations

import pytest

from chaos.conftest import Matrix, Sim
from daemon.model import Node, NodeState

pytestmark = pytest.mark.chaos

IN_PROCESS = {"grow": "in_process"}


async def _two_node_job(sim: Sim) -> tuple[Node, Node, str]:
    n1, n2 = await sim.two_running()
    attempt = sim.start([n1, n2], step=0)
    sim.beat(n1, step=20)
    sim.beat(n2, step=20)
    return n1, n2, attempt


def _torchrun_exits(sim: Sim, node: Node, code: int) -> None:
    sim.sup.intake.on_reports(node, [{"kind": "trainer_exited", "exit_code": code}])
    sim.beat(node, trainer="exited")


async def _passes(sim: Sim, n1: Node, *, seconds: float, step: int | None) -> None:
    """Reconcile passes over ``seconds`` of the clock, one each 2 s; node 1 (rank 0)
    heartbeats ``step`` at each, its last one if None."""
    for _ in range(int(seconds // 2)):
        sim.clock.advance(2)
        if step is not None:
            step += 1
        sim.beat(n1, step=step if step is not None else sim.sup.job.step)
        await sim.sup.reconcile_once()


async def test_a_node_whose_torchrun_exited_while_the_job_trains_on_is_replaced(make_sim, matrix: Matrix) -> None:
    async with make_sim(job=IN_PROCESS) as sim:
        n1, n2, _ = await _two_node_job(sim)
        await sim.sup.reconcile_once()
        _torchrun_exits(sim, n2, 1)
        await _passes(sim, n1, seconds=8, step=20)  # inside the exit grace (10 s)
        assert n2.state is NodeState.RUNNING
        await _passes(sim, n1, seconds=4, step=24)
        assert n2.state is NodeState.DRAINING and "goes on without it" in n2.detail, n2.detail
        n3 = await sim.launched(3)  # its replacement, which will join in-process
        await sim.until(lambda: n2.state is NodeState.TERMINATED, what="node 2 released")
        [gone] = [e for e in sim.events("node_terminated") if e.node == n2.id]  # the operator's record of why
        assert gone.data["reason"] == "drained" and "goes on without it" in gone.data["left"], gone.data
        assert n1.state is NodeState.RUNNING and not sim.events("job_stalled")
        matrix.row("a node's torchrun exits, the job trains on", job_completed=None, lost_checkpoints=0,
                   leaked_instances=len([i for i in sim.provider.live() if i.id == n2.instance_id]),
                   lost_events=sim.lost_events())
        assert n3.state is NodeState.LAUNCHING


@pytest.mark.parametrize("case", ["no_step_since", "grow_restart"])
async def test_without_a_step_since_or_for_torchrun_joiners_the_node_stays(make_sim, case: str) -> None:
    """No step after the exit: the job may be failing as a whole, which is the stall
    rules' to judge. ``job.grow: restart``: the exit closed the rendezvous a
    replacement's torchrun would join, so a replacement could only fail in turn."""
    async with make_sim(**({} if case == "grow_restart" else {"job": IN_PROCESS})) as sim:
        n1, n2, _ = await _two_node_job(sim)
        await sim.sup.reconcile_once()
        _torchrun_exits(sim, n2, 1)
        await _passes(sim, n1, seconds=60, step=None if case == "no_step_since" else 20)
        assert n2.state is NodeState.RUNNING
        assert len(sim.provider.launched) == 2


async def test_a_first_round_formed_without_a_dead_node_is_led_once_that_node_leaves(make_sim) -> None:
    """Seen in an HA trial: node 2's torchrun agent died in the first rendezvous round and
    node 1 formed it alone. Node 1's claim to rank 0 of that attempt (world size 1) waits
    for another node's word, and node 2 will never give it: no step is recorded, so no
    step can be the evidence. The attempt node 1 started without node 2 is: node 2
    leaves, node 1's claim then stands alone, and its steps count."""
    async with make_sim(job=IN_PROCESS) as sim:
        n1, n2 = await sim.two_running()
        sim.beat(n1, step=0)
        sim._status(n1, "started", 0, attempt="alone", world_size=1, resumed_from=None, rank=0)
        await sim.sup.reconcile_once()
        assert not sim.events("job_resumed") and sim.sup.job.attempt != "alone"  # waits for a second word
        _torchrun_exits(sim, n2, 1)
        await _passes(sim, n1, seconds=12, step=0)
        assert n2.state is NodeState.DRAINING, n2.detail
        await sim.until(lambda: sim.sup.job.attempt == "alone", what="node 1's claim taken")
        sim.beat(n1, step=5)
        assert sim.sup.job.step == 5
