"""The chaos cells' EC2 stand-in (``tests/chaos/test_daemon_kill.Ec2Sim``) ends every node
agent it stopped before its own exit returns.

An agent ends with a shutdown that stops its torchrun and its prewarmed launcher
(``NodeAgent.run``: ``finally: await asyncio.shield(self._shutdown())``). The sim stops an
agent when its instance is terminated, from its watch loop. When the sim's exit cancelled
that loop while it waited for an agent to end, the wait passed the cancel on to the agent
a second time: the agent's task ended with its shutdown still running, unowned, and the
test's event loop closed over it, leaving its launcher and zygote behind (stop 50 saw one
outlive ``test_ha_trials``'s migration cell by two minutes).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from chaos.test_daemon_kill import Ec2Sim


class _Imds:
    async def aclose(self) -> None:
        pass


class _Sim(Ec2Sim):
    """Instances from a dict, and an agent whose shutdown takes ``shutdown_s``."""

    def __init__(self, tmp_path: Path, shutdown_s: float) -> None:
        super().__init__("http://127.0.0.1:9", "pool", tmp_path, None)  # never called: instances() is the dict's
        self.state = {"i-1": "running"}
        self.shutdown_s = shutdown_s
        self.booted, self.shutting, self.ended = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def instances(self, states: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        return [{"InstanceId": i, "State": {"Name": s}} for i, s in self.state.items() if not states or s in states]

    async def _boot(self, iid: str) -> None:
        async def shutdown() -> None:
            self.shutting.set()
            await asyncio.sleep(self.shutdown_s)  # SIGTERM to torchrun, then its exit
            self.ended.set()

        async def agent() -> None:  # NodeAgent.run's shape
            try:
                await asyncio.Event().wait()
            finally:
                await asyncio.shield(shutdown())

        self.agents[iid] = (asyncio.create_task(agent(), name=f"agent:{iid}"), _Imds(), "node-1")  # type: ignore[arg-type]
        self._booting.discard(iid)
        self.booted.set()


async def test_the_sims_exit_waits_for_an_agent_it_was_stopping(tmp_path: Path) -> None:
    sim = _Sim(tmp_path, shutdown_s=0.5)
    async with sim:
        await asyncio.wait_for(sim.booted.wait(), 10)  # the watch loop booted the instance's agent
        sim.state["i-1"] = "terminated"  # the harness terminates the instance ...
        await asyncio.wait_for(sim.shutting.wait(), 10)  # ... the watch loop is stopping its agent ...
    # ... and the sim exits meanwhile: its exit returns only once the agent's shutdown is done
    assert sim.ended.is_set()
    assert not sim.agents and not sim._ending
