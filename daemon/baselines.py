"""Recovery policies the benchmark compares spotvisor with (``bench/compare.py``).

Same daemon, same node agents, same ``torchrun --nnodes=MIN:MAX`` job, same trainer
with the same periodic commits every K steps; only the reaction to a preemption
differs. Registered by name (:func:`register_policy`), ``spotvisor`` the default:

- ``spotvisor``: :class:`~daemon.supervisor.Supervisor` as is. The node agent reads
  the notice, every rank commits at the next step boundary, the node leaves, the
  survivors shrink; the replacement, launched at the notice, is admitted after a
  rejoin commit.
- ``restart_on_preemption`` (:class:`RestartOnPreemption`): what SkyPilot managed
  jobs and hand-made scripts do. Notices are not acted on; when the cloud takes a
  node, everything stops, the whole pool is relaunched and the job resumes from its
  last periodic commit.
- ``elastic_only`` (:class:`ElasticOnly`): torchrun elastic alone, plus something
  that replaces lost capacity (an autoscaling group). Notices are not acted on; the
  survivors re-rendezvous when the node dies and resume from the last periodic
  commit; the replacement joins as soon as it is up, without a rejoin commit.

The baselines' nodes run nothing that reads the metadata endpoint, so whoever
injects a preemption trace does not publish their notices
(:attr:`Policy.acts_on_notices` is False) and only takes the node ``lead_s`` later,
as the cloud does. Nothing here is reachable from a config file: the daemon's own
behaviour is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import structlog

from daemon.model import EventKind, JobState, NodeState
from daemon.control.pool import Launch, MarkLost, Terminate
from daemon.supervisor import Supervisor, _largest_valid

__all__ = [
    "Policy",
    "DEFAULT_POLICY",
    "register_policy",
    "get_policy",
    "policy_names",
    "lost_from_job",
    "RestartOnPreemption",
    "ElasticOnly",
]

log = structlog.get_logger("spotvisor.baselines")

DEFAULT_POLICY = "spotvisor"


@dataclass(frozen=True, slots=True)
class Policy:
    """A way to react to preemptions.

    ``acts_on_notices``: the nodes watch the metadata endpoint and act on a notice;
    False means a notice is never seen on the node (the trace only takes the node at
    its deadline). ``description``: one line for a report.
    """

    name: str
    supervisor_cls: type[Supervisor]
    acts_on_notices: bool
    description: str


_POLICIES: dict[str, Policy] = {}


def register_policy(name: str, *, acts_on_notices: bool,
                    description: str) -> Callable[[type[Supervisor]], type[Supervisor]]:
    """Class decorator: register a :class:`Supervisor` (sub)class as a policy. Clashing names are errors."""

    def deco(cls: type[Supervisor]) -> type[Supervisor]:
        known = _POLICIES.get(name)
        if known is not None and known.supervisor_cls is not cls:
            raise ValueError(f"policy {name!r} is already registered by {known.supervisor_cls!r}")
        _POLICIES[name] = Policy(name, cls, acts_on_notices, description)
        return cls

    return deco


def get_policy(name: str) -> Policy:
    """The registered policy ``name``. Raises ValueError for an unknown name."""
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}") from None


def policy_names() -> list[str]:
    """Registered names, the default first."""
    return sorted(_POLICIES, key=lambda n: (n != DEFAULT_POLICY, n))


register_policy(DEFAULT_POLICY, acts_on_notices=True,
                description="notice-driven collective commit, elastic shrink, rejoin commit on grow")(Supervisor)


def lost_from_job(in_job: Iterable[str], states: Mapping[str, NodeState]) -> list[str]:
    """Of the nodes that were in the job, those that have ended since (sorted). Pure.

    A node missing from ``states`` counts as ended.
    """
    return sorted(n for n in set(in_job) if states.get(n, NodeState.LOST).is_terminal())


@register_policy("restart_on_preemption", acts_on_notices=False,
                 description="periodic commits; on any node loss stop all, relaunch all, resume from the last one")
class RestartOnPreemption(Supervisor):
    """On any node loss: terminate every node, relaunch the whole pool, resume from the
    last periodic commit (SkyPilot managed jobs' recovery; a hand-made restart script).

    Example (target 3, commits every 10 steps): n1 n2 n3 train at world size 3. n2's
    notice comes at step 47; nobody reads it, training goes on, step 50 is committed.
    At the notice's deadline (step 57) the cloud takes n2. The next reconcile pass sees
    its instance gone: n1 and n3 are terminated too, the job is pending again, and the
    planner launches n4 n5 n6 at once (same offers, same launch delay). Once all three
    registered they start together and resume from step 50: steps 51-57 are lost.
    """

    def _in_job(self) -> set[str]:
        return {n.id for n in self.nodes.values() if n.state is NodeState.RUNNING}

    async def _observe_instances(self) -> None:
        in_job = self._in_job()
        await super()._observe_instances()
        await self._restart_if_lost(in_job)

    async def _apply(self, action: Launch | Terminate | MarkLost) -> None:
        in_job = self._in_job()
        await super()._apply(action)
        if isinstance(action, MarkLost):  # heartbeat lost: a node loss too
            await self._restart_if_lost(in_job)

    async def _restart_if_lost(self, in_job: set[str]) -> None:
        if self.job.state is not JobState.RUNNING:
            return
        lost = lost_from_job(in_job, {n.id: n.state for n in self.nodes.values()})
        if not lost:
            return
        victims = sorted((n for n in self.nodes.values() if not n.state.is_terminal()), key=lambda n: n.ordinal)
        log.info("restart_all", pool=self.pool, lost=lost, terminating=[n.id for n in victims])
        for n in victims:
            if n.instance_id is not None:
                await self.provider_for(n.provider).terminate(n.instance_id)
            # a launch still in flight lands on a terminated node and is released (_launch_call)
            self._set_state(n, NodeState.TERMINATED, "restart_on_preemption")
            self.record(EventKind.NODE_TERMINATED, n.id, reason="restart_all", after_loss_of=lost)
        # the first nodes up start the job together, from the newest committed checkpoint
        self.job.to(JobState.PENDING)
        self._first_ready_at = None
        self._rejoin = None
        self.wake()


@register_policy("elastic_only", acts_on_notices=False,
                 description="periodic commits; torchrun elastic shrinks on loss; replacement joins at once")
class ElasticOnly(Supervisor):
    """torchrun elastic with periodic commits, no notice handling; a lost node is replaced.

    Example (target 3, commits every 10 steps): n2's notice at step 47 is not read; at
    its deadline (step 57) n2 dies. n1 and n3's next all-reduce fails, torchrun
    re-rendezvouses them at world size 2 and they resume from step 50 (51-57 lost).
    The daemon sees n2's instance gone, launches n4; once n4 registers it is admitted
    at once: its torchrun joins, torchrun restarts n1 and n3 at world size 3 from the
    newest commit, and what they trained at world size 2 since their last periodic
    commit is lost too (no rejoin commit).
    """

    def _admit(self, now: float) -> None:
        if self.job.state is not JobState.RUNNING or self.paused:
            super()._admit(now)  # the first start: all target nodes together, as spotvisor
            return
        ready = sorted((n for n in self.nodes.values() if n.state is NodeState.READY), key=lambda n: n.ordinal)
        if not ready:
            return
        world = sum(n.gpus for n in self.nodes.values() if n.state is NodeState.RUNNING)
        for n in _largest_valid(ready, world, set(self.valid_world_sizes())):
            self._start_node(n, "elastic_join")
