"""Recovery policies: how the pool reacts to a preemption. Registered by name.

A policy is one class: its name, whether its nodes act on interruption notices, a
one-line description, and two pure decisions over the pool's state
(:class:`~daemon.control.actions.PoolState`), each returning actions:

- :meth:`RecoveryPolicy.admit`: which ready nodes join the job, and when;
- :meth:`RecoveryPolicy.after_loss`: what to do when nodes that were in the job
  have ended (the cloud took them, or their heartbeat was lost);
- :meth:`RecoveryPolicy.migrate`: whether the whole job moves to another placement
  domain, and where (:func:`daemon.control.migration.decide`);
- :meth:`RecoveryPolicy.markets`: which markets (spot, on-demand) the pool may buy from
  now; :class:`DeadlineAware` spends to a deadline (:mod:`daemon.control.deadline`).

The daemon runs the default, :class:`Spotvisor`; the benchmark (``bench/compare.py``)
runs every registered policy on the same daemon, agents, trainer and trace, so only
the reaction differs. A new policy is a new class with :func:`register` on it::

    @register
    class MyPolicy(Spotvisor):
        name = "my_policy"
        description = "..."

        def after_loss(self, s, lost, *, now):
            ...

Policies whose nodes do not act on notices (``acts_on_notices = False``) run nothing
that reads the metadata endpoint: whoever injects a preemption trace does not publish
their notices and only takes the node ``lead_s`` later, as the cloud does.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar, Iterable, Mapping, Sequence

from daemon.control.actions import Action, Admit, PoolState, RestartJob, Terminate
from daemon.control.admission import Rules, admit, largest_valid
from daemon.control.availability import Availability
from daemon.control.lifecycle import ADMITTED, JobState, NodeState, leaving
from daemon.control.deadline import ON_DEMAND_ONLY, SPOT_ONLY, Progress
from daemon.control.deadline import back_to_spot
from daemon.control.deadline import markets as deadline_markets
from daemon.control import homezone
from daemon.control.homezone import HomeDecision
from daemon.control.migration import DomainView, Move, Plan
from daemon.control.migration import decide as decide_move
from daemon.control.offers import History
from daemon.control.reactions import on_loss_without_notice

__all__ = [
    "RecoveryPolicy",
    "Spotvisor",
    "RestartOnPreemption",
    "ElasticOnly",
    "NoticeNoRejoin",
    "DeadlineAware",
    "HomeZone",
    "DEFAULT_POLICY",
    "register",
    "get_policy",
    "deadline_policy",
    "policy_names",
    "lost_from_job",
]

DEFAULT_POLICY = "spotvisor"
# deadline_aware: a domain's spot this much cheaper per GPU-hour than the on-demand nodes
# filling in for it moves the job there (spot is 10-30 % of on-demand: any spot domain is)
ON_DEMAND_BRIDGE_SAVING = 0.5

_REGISTRY: dict[str, type["RecoveryPolicy"]] = {}


class RecoveryPolicy:
    """The base of every policy; subclasses set the three class attributes."""

    name: ClassVar[str]
    acts_on_notices: ClassVar[bool] = True
    description: ClassVar[str] = ""
    #: its decisions read the availability record: the daemon then asks the providers for
    #: every domain's spot stock with the prices (``Provider.spot_stock``)
    reads_availability: ClassVar[bool] = False

    def admit(self, s: PoolState, rules: Rules, *, now: float) -> list[Action]:
        """Actions that move ready nodes into the job (:func:`daemon.control.admission.admit`)."""
        return admit(s, rules, now=now)

    def after_loss(self, s: PoolState, lost: Sequence[str], *, now: float) -> list[Action]:
        """Actions once the nodes ``lost`` (ids), which were in the job, have ended. None by default:
        the planner replaces the capacity, and torchrun's survivors go on."""
        return []

    def markets(self, progress: Progress | None, *, now: float,
                previous: frozenset[str] | None = None) -> frozenset[str] | None:
        """The markets (``spot``, ``on_demand``) the pool may buy from now, given those it
        was allowed until now (``previous``); None: every offer of the config, ranked as
        usual (on-demand only as the fallback it is configured to be)."""
        return None

    def market_actions(self, s: PoolState, allowed: frozenset[str] | None, *, now: float) -> list[Action]:
        """Actions once :meth:`markets` has said which markets are allowed (``None``: no
        restriction): none by default."""
        return []

    def migrate(self, s: PoolState, domains: Sequence[DomainView], current: str, history: History, *,
                now: float, plan: Plan, starved_since: float | None, checkpoint_bytes: int | None,
                last_move_ended_at: float | None, gpus: int,
                failed_moves: Mapping[str, float] | None = None, progress: Progress | None = None,
                availability: Availability | None = None) -> Move | None:
        """Whether to move the whole job from domain ``current`` to another, and where; None:
        stay. By default :func:`daemon.control.migration.decide` (starved past the patience,
        or cheaper by ``plan.min_saving_fraction``; the cheapest usable domain after its
        recent losses and the copy's egress; not where a move failed within the cooldown).
        ``progress``: where the job stands against its deadline (None: no deadline);
        ``availability``: what the daemon has seen of each domain's capacity."""
        return decide_move(s, domains, current, history, now=now, plan=plan, starved_since=starved_since,
                           checkpoint_bytes=checkpoint_bytes, last_move_ended_at=last_move_ended_at, gpus=gpus,
                           failed_moves=failed_moves)

    def placement(self, s: PoolState, domains: Sequence[DomainView], current: str, history: History, *,
                  now: float, plan: Plan, starved_since: float | None, checkpoint_bytes: int | None, gpus: int,
                  progress: Progress | None, availability: Availability, last_move_ended_at: float | None = None,
                  failed_moves: Mapping[str, float] | None = None) -> HomeDecision | None:
        """Why the job is where it is, for ``spotctl status`` and the feed (None: this
        policy says nothing beyond its moves); the arguments are :meth:`migrate`'s."""
        return None


def register(cls: type[RecoveryPolicy]) -> type[RecoveryPolicy]:
    """Class decorator: register ``cls`` under ``cls.name``.

    Raises:
        ValueError: another class is registered under that name.
    """
    known = _REGISTRY.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"policy {cls.name!r} is already registered by {known.__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def get_policy(name: str) -> RecoveryPolicy:
    """A new instance of the policy registered as ``name``.

    Raises:
        ValueError: no policy has that name (the message lists the known ones).
    """
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}") from None


def deadline_policy(requested: str, *, target_nodes: int, grow: str) -> tuple[str, str]:
    """The policy that spends to ``job.deadline`` and why, in words (``check-config``'s
    line): ``requested`` (``job.deadline_policy``)
    unless it is ``auto``, which takes ``home_zone`` for a pool of more than one node
    (``target_nodes``) that grows in process (``grow``: ``job.grow``), ``deadline_aware``
    otherwise. What the replays measured (bench/README.md, "A pool's levers"): growing in
    process, home_zone cost no more than deadline_aware in each of Parcae's four windows
    and every Bamboo window, less in most, and missed no deadline; where each grow restarts
    the pool it cost more in Parcae's HH window (2.21 against 1.66 × the bound), and for
    one node it did at a deadline 1.2 × the work (the V100 trace's 22 windows: 1.52
    against 1.44). Raises ValueError for an unknown name."""
    if requested != "auto":
        get_policy(requested)  # ValueError: unknown
        return requested, "job.deadline_policy"
    if grow == "in_process" and target_nodes > 1:
        return "home_zone", f"job.deadline_policy auto: {target_nodes} nodes that grow in process"
    return "deadline_aware", "job.deadline_policy auto: " + (
        "one node" if target_nodes == 1 else "each grow restarts the pool (job.grow)")


def policy_names() -> list[str]:
    """Registered names, the default first."""
    return sorted(_REGISTRY, key=lambda n: (n != DEFAULT_POLICY, n))


def lost_from_job(in_job: Iterable[str], states: Mapping[str, NodeState]) -> list[str]:
    """Of the nodes that were in the job, those that have ended since (sorted).

    A node missing from ``states`` counts as ended.
    """
    return sorted(n for n in set(in_job) if states.get(n, NodeState.LOST).is_terminal())


@register
class Spotvisor(RecoveryPolicy):
    """Notice-driven collective commit, elastic shrink, and a grow in-process or by a
    rejoin commit (``job.grow``). The default.

    Example (target 3): n1 n2 n3 train at world size 3. n2's agent reads its notice; every
    rank commits at the next step boundary (step S); n2 leaves; n1 n3 go on at world size
    2 from S in their running processes. The replacement n4, launched at the notice
    (a draining node does not count as capacity), registers. With ``job.grow:
    in_process`` it is admitted at once and its workers join n1 n3 at their next step
    boundary, with the state from n1. With ``restart``, n1 n3 are asked for a rejoin
    commit, hold at it, and n4 is admitted: world size 3 from that step. No step is lost.
    """

    name = DEFAULT_POLICY
    description = "notice-driven collective commit, elastic shrink, a grow in-process or by a rejoin commit"

    def after_loss(self, s: PoolState, lost: Sequence[str], *, now: float) -> list[Action]:
        """A node lost without notice: its peers in the running attempt are woken to re-form
        without it now (:func:`daemon.control.reactions.on_loss_without_notice`)."""
        return on_loss_without_notice(s, lost)


@register
class RestartOnPreemption(RecoveryPolicy):
    """On any node loss: terminate every node, relaunch the whole pool, resume from the
    last periodic commit (SkyPilot managed jobs' recovery; a hand-made restart script).

    Example (target 3, commits every 10 steps): n1 n2 n3 train at world size 3. n2's
    notice comes at step 47; nobody reads it, training goes on, step 50 is committed.
    At the notice's deadline (step 57) the cloud takes n2. The next reconcile pass sees
    its instance gone: n1 and n3 are terminated too, the job is pending again, and the
    planner launches n4 n5 n6 at once (same offers, same launch delay). Once all three
    registered they start together and resume from step 50: steps 51-57 are lost.
    """

    name = "restart_on_preemption"
    acts_on_notices = False
    description = "periodic commits; on any node loss stop all, relaunch all, resume from the last one"

    def after_loss(self, s: PoolState, lost: Sequence[str], *, now: float) -> list[Action]:
        if s.job is not JobState.RUNNING or not lost:
            return []
        ended = tuple(sorted(lost))
        victims = sorted((n for n in s.nodes if not n.state.is_terminal()), key=lambda n: n.ordinal)
        # a launch still in flight lands on a terminated node and is released
        return [*(Terminate(n.id, "restart_all", context=(("after_loss_of", list(ended)),)) for n in victims),
                RestartJob(ended, "restart_on_preemption")]


@register
class ElasticOnly(RecoveryPolicy):
    """torchrun elastic with periodic commits, no notice handling; a lost node is replaced.

    Example (target 3, commits every 10 steps): n2's notice at step 47 is not read; at
    its deadline (step 57) n2 dies. n1 and n3's next all-reduce fails, torchrun
    re-rendezvouses them at world size 2 and they resume from step 50 (51-57 lost).
    The daemon sees n2's instance gone, launches n4; once n4 registers it is admitted
    at once: its torchrun joins, torchrun restarts n1 and n3 at world size 3 from the
    newest commit, and what they trained at world size 2 since their last periodic
    commit is lost too (no rejoin commit).
    """

    name = "elastic_only"
    acts_on_notices = False
    description = "periodic commits; torchrun elastic shrinks on loss; replacement joins at once"

    def admit(self, s: PoolState, rules: Rules, *, now: float) -> list[Action]:
        if s.job is not JobState.RUNNING or s.paused:
            return super().admit(s, rules, now=now)  # the first start: all target nodes together
        ready = s.in_state(NodeState.READY)
        world = sum(n.gpus for n in s.nodes if n.state in ADMITTED)
        return [Admit(n.id, "elastic_join") for n in largest_valid(ready, world, rules.valid_world_sizes)]


@register
class NoticeNoRejoin(ElasticOnly):
    """The default's notice handling without its rejoin commit: a replacement joins as
    soon as it is up and no noticed node is still in the job. It isolates what the
    rejoin commit is worth (``python -m bench.compare --system spotvisor --system
    notice_no_rejoin``), as ``elastic_only`` isolates what acting on notices is worth.

    Example (target 3, commits every 10 steps): n2's notice at step 47 is read; every
    rank commits at step 48, n2 leaves, n1 n3 go on at world size 2 in their processes
    (nothing lost). n4 registers at step 57 and is admitted at once: torchrun restarts
    n1 n3 with n4 at world size 3 from the newest commit, step 50, so steps 51-57 are
    lost; the default asks n1 n3 for a commit at step 58 first and loses none.
    """

    name = "notice_no_rejoin"
    acts_on_notices = True
    description = "notice-driven commit and shrink; a replacement joins at once, without a rejoin commit"

    def admit(self, s: PoolState, rules: Rules, *, now: float) -> list[Action]:
        if any(leaving(n) for n in s.nodes):  # torchrun's next round would count the leaving node
            return []
        return super().admit(s, rules, now=now)


@register
class DeadlineAware(Spotvisor):
    """The default's recovery, spending to ``job.deadline``: spot while the slack allows,
    on-demand where spot has no capacity when the job falls behind the uniform line, and
    on-demand only once the rest of the job barely fits (:func:`daemon.control.deadline.markets`,
    Uniform Progress from Can't Be Late, NSDI'24). Without a deadline it is the default.

    Example (target 4, 100 h of work, deadline 150 h): at hour 60 the job has 35 h done,
    behind the 40 h of the uniform line: replacements may be on-demand when spot has no
    capacity. At hour 120 with 70 h left it buys on-demand only.
    """

    name = "deadline_aware"
    description = "the default's recovery; spot while the deadline's slack allows, on-demand when it does not"

    def markets(self, progress: Progress | None, *, now: float,
                previous: frozenset[str] | None = None) -> frozenset[str] | None:
        return None if progress is None else deadline_markets(progress, now, previous=previous)

    def market_actions(self, s: PoolState, allowed: frozenset[str] | None, *, now: float) -> list[Action]:
        return [] if allowed is None else back_to_spot(s, allowed)

    def migrate(self, s: PoolState, domains: Sequence[DomainView], current: str, history: History, *,
                now: float, plan: Plan, starved_since: float | None, checkpoint_bytes: int | None,
                last_move_ended_at: float | None, gpus: int,
                failed_moves: Mapping[str, float] | None = None, progress: Progress | None = None,
                availability: Availability | None = None) -> Move | None:
        """The default's moves, and one more: when the job's domain has no usable spot
        offer while spot and on-demand are allowed (the job is behind its line: on-demand
        would fill in here), the job moves at once to a domain whose spot is at least
        :data:`ON_DEMAND_BRIDGE_SAVING` cheaper than that on-demand (``spot_elsewhere``,
        built from spot only): spot anywhere before on-demand, as Uniform Progress with
        failover across regions does (UP(S) in SkyNomad's comparison, arXiv 2601.06520).
        Once only on-demand is allowed, no domain offers spot and nothing moves."""
        kw = dict(now=now, starved_since=starved_since, checkpoint_bytes=checkpoint_bytes,
                  last_move_ended_at=last_move_ended_at, gpus=gpus, failed_moves=failed_moves)
        move = super().migrate(s, domains, current, history, plan=plan, **kw)  # type: ignore[arg-type]
        if move is not None:
            return move
        here = next((d for d in domains if d.name == current), None)
        if here is None or any(not o.on_demand for o in here.usable(history, now)):
            return None  # spot can be had here (or on-demand only is allowed: no spot offer at all)
        move = super().migrate(s, domains, current, history,  # type: ignore[arg-type]
                               plan=replace(plan, min_saving_fraction=ON_DEMAND_BRIDGE_SAVING), **kw)
        # built from spot only: if the target has none either, the move fails at once
        # (migration.target_out) and on-demand fills in where the job is
        return None if move is None else replace(move, reason="spot_elsewhere", markets=SPOT_ONLY)


@register
class HomeZone(DeadlineAware):
    """Spending to ``job.deadline`` with a home: the job stays in its domain and spends the
    slack on that domain's outages, moving only when an outage outlasts the slack
    (:mod:`daemon.control.homezone`, from what the daemon has seen of each domain:
    :mod:`daemon.control.availability`). Spot only until the rest of the job barely fits,
    then on-demand only (the safety net of :func:`daemon.control.deadline.markets`): no
    on-demand fill-in while the slack lasts, which is what a wait spends. Without a
    deadline it is the default.

    Example (one node, 30 h of work, 50 h to the deadline): the home's spot runs out; by
    its record its outages last 3 h and its rate is 0.8: waiting finishes in 40.5 h, and
    50 h ≥ 1.2 × 40.5 h: the job waits, buys nothing, and ``spotctl status`` says why.
    An hour later the outage has lasted longer than any before it: the estimate outgrows
    the slack and the job moves to the cheapest domain with spot that fits.
    """

    name = "home_zone"
    description = "spot in the job's home domain; waits out its outages on the deadline's slack, moves when it cannot"
    margin: ClassVar[float] = homezone.MARGIN
    reads_availability = True
    #: the restarts the safety net keeps in hand: 5 where each spot node lost and replaced
    #: restarts the pool (deadline_aware's 3 missed 4 of Bamboo's deadlines: a pool that
    #: does not fill in with on-demand meets the net with more spot nodes to lose); 3 where
    #: it costs a pause (``Progress.grows_in_process``; bench/README.md, "A pool's levers")
    safety_restarts: ClassVar[float] = 5.0
    in_process_restarts: ClassVar[float] = 3.0

    def markets(self, progress: Progress | None, *, now: float,
                previous: frozenset[str] | None = None) -> frozenset[str] | None:
        if progress is None:
            return None
        margin = self.in_process_restarts if progress.grows_in_process else self.safety_restarts
        net = deadline_markets(progress, now, previous=previous, margin=margin)
        return ON_DEMAND_ONLY if net == ON_DEMAND_ONLY else SPOT_ONLY

    def placement(self, s: PoolState, domains: Sequence[DomainView], current: str, history: History, *,
                  now: float, plan: Plan, starved_since: float | None, checkpoint_bytes: int | None, gpus: int,
                  progress: Progress | None, availability: Availability, last_move_ended_at: float | None = None,
                  failed_moves: Mapping[str, float] | None = None) -> HomeDecision | None:
        """:func:`daemon.control.homezone.decide`, never moving within the cooldown of the
        last move, nor to a domain a move to which failed within it (None: no deadline)."""
        if progress is None or s.job.is_terminal() or s.paused or len(domains) < 2:
            return None
        if starved_since is not None and last_move_ended_at is not None and now - last_move_ended_at < plan.cooldown_s:
            return HomeDecision("wait", "a move ended within the cooldown", current)
        avoid = frozenset(d for d, t in (failed_moves or {}).items() if now - t < plan.cooldown_s)
        return homezone.decide(progress, domains, current, history, availability, now=now,
                               starved=starved_since is not None, checkpoint_bytes=checkpoint_bytes, gpus=gpus,
                               avoid=avoid, margin=self.margin)

    def migrate(self, s: PoolState, domains: Sequence[DomainView], current: str, history: History, *,
                now: float, plan: Plan, starved_since: float | None, checkpoint_bytes: int | None,
                last_move_ended_at: float | None, gpus: int,
                failed_moves: Mapping[str, float] | None = None, progress: Progress | None = None,
                availability: Availability | None = None) -> Move | None:
        """Without a deadline, the default's moves. With one, a move only when
        :meth:`placement` says so, built from spot only (``home_out``); never for price alone."""
        if progress is None:
            return super().migrate(s, domains, current, history, now=now, plan=plan, starved_since=starved_since,
                                   checkpoint_bytes=checkpoint_bytes, last_move_ended_at=last_move_ended_at,
                                   gpus=gpus, failed_moves=failed_moves)
        d = self.placement(s, domains, current, history, now=now, plan=plan, starved_since=starved_since,
                           checkpoint_bytes=checkpoint_bytes, gpus=gpus, progress=progress,
                           availability=availability or Availability(), last_move_ended_at=last_move_ended_at,
                           failed_moves=failed_moves)
        if d is None or d.action != "move" or d.target is None:
            return None
        return Move(current, d.target, "home_out", d.figures(), markets=SPOT_ONLY)
