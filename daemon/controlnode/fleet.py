"""The pool's provider arm: every provider call the daemon makes, and what it learns from them.

:class:`Fleet` carries out the planner's capacity actions (:class:`Launch`,
:class:`Terminate`, :class:`MarkLost`; a launch's call runs in its own task:
:class:`~daemon.controlnode.launch_calls.LaunchCalls`), lists the pool's instances each
pass (:meth:`Fleet.observe`), and tells its :class:`~daemon.controlnode.offer_book.OfferBook`
what the outcomes say about offers: capacity backoff, offer families sitting out a
quota or auth error, zones that just preempted a node, spot prices. Nothing else in
the daemon calls a provider.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import secrets
import time
from typing import Any, Mapping

import structlog

from daemon.control import launch_replay as replay
from daemon.control.actions import Launch, MarkLost, Terminate
from daemon.control.lifecycle import LIVE
from daemon.control.listing import absent_means_gone
from daemon.control.offers import History, Offer
from daemon.controlnode.check_gate import CheckGate
from daemon.controlnode.cloud_check import CheckResult
from daemon.controlnode.cloud_probe import run_checks
from daemon.controlnode.core import Core
from daemon.controlnode.launch_calls import LaunchCalls, agent_urls, ca_digest
from daemon.controlnode.offer_book import AVOID_ZONE_S, OfferBook
from daemon.gpunode.metadata.registry import DOCUMENTED_LEAD_S
from daemon.model import EventKind, Node, NodeState
from daemon.providers.agent_wheel import AgentWheels
from daemon.providers.base import Instance, Provider, ProviderError

__all__ = ["Fleet", "AVOID_ZONE_S"]

log = structlog.get_logger("spotvisor.daemon")

PRICE_REFRESH_S = 300.0


class Fleet:
    """Provider calls for one pool. ``providers``: by name (offers name theirs);
    ``provider``, if given, serves any name not among them."""

    def __init__(self, core: Core, *, providers: Mapping[str, Provider] | None, provider: Provider | None,
                 rng: random.Random) -> None:
        if provider is None and not providers:
            raise ValueError("Supervisor needs a provider (or providers by name)")
        self.core = core
        self.providers: dict[str, Provider] = dict(providers or {})
        self._default = provider
        self.book = OfferBook(core.config, rng=rng)  # prices and backoffs, by offer index
        self.unusable: frozenset[int] = frozenset()  # offers whose GPUs cannot hold the job: never bought
        self._released_unowned: set[str] = set()  # instance ids settle_unowned terminated
        self._listed: set[str] = set()  # live nodes' instance ids a listing has shown (observe)
        self._listed_at = float("-inf")  # time.monotonic() of the last whole listing (observe)
        # spot_stock's word per spot offer, (unix s, in stock), asked with the prices when the
        # recovery policy reads the availability record (the migrator sets probe_stock)
        self.stock: dict[int, tuple[float, bool]] = {}
        self.probe_stock = False
        self._no_stock: set[str] = set()  # providers whose spot_stock said None: they cannot tell
        d = core.config.daemon
        # the agent's wheel for nodes that install it at boot; a URL lives a bit over the
        # slowest offer's launch timeout (a node fetches it while it boots)
        slowest = max([core.config.launch_timeout_s(o.key) for o in core.config.offers] or [d.launch_timeout_s])
        self.agent_wheels = AgentWheels(configured=d.agent_wheel, work_dir=d.state_path() / "agent-wheel",
                                        open_store=self._checkpoint_store, expires_s=int(slowest) + 600)
        # the cloud check (spotvisord check's), at start and on a backoff while it fails: the gate on buying
        self.checks = CheckGate(core, run=lambda: run_checks(core.config, self.provider_for))
        self.calls = LaunchCalls(core, book=self.book, provider_for=self.provider_for, agent_wheels=self.agent_wheels)

    @property
    def launching(self) -> set[str]:
        """Node ids whose ``provider.launch`` call is in flight (:class:`LaunchCalls`)."""
        return self.calls.launching

    # -- providers ----------------------------------------------------------------------------
    @property
    def provider(self) -> Provider:
        """The provider of the local pool (chaos hooks), else the default one."""
        return self.providers.get("local") or self._default or next(iter(self.providers.values()))

    def provider_for(self, name: str) -> Provider:
        """Raises ProviderError: no provider ``name`` is configured."""
        p = self.providers.get(name) or self._default
        if p is None:
            raise ProviderError(f"no provider {name!r} is configured (add providers.{name})")
        return p

    def all_providers(self) -> list[Provider]:
        every = [*self.providers.values(), *([self._default] if self._default else [])]
        return list({id(p): p for p in every}.values())  # each once: the default may be one of them

    async def preflight(self, checked: list[CheckResult] | None = None) -> None:
        """The pre-flight at start (pure: GPU memory per offer, estimated flush per notice
        window): offers that cannot hold the job are never bought; its findings are events.
        Then the cloud check (:mod:`.check_gate`): its first run is awaited (``checked``: a
        run the caller made just before, an HA standby's), a failed one is retried in a
        task of its own."""
        from daemon.controlnode import preflight

        pre = preflight.at_start(self.core.config)
        self.unusable = pre.unusable
        if pre.note:
            log.info("preflight_skipped", pool=self.core.pool, note=pre.note)
        for gap in preflight.control_node_gaps(lambda name: importlib.util.find_spec(name) is not None):
            log.warning("control_node_gap", pool=self.core.pool, note=gap)
        for kind, data in pre.events:
            self.core.record(EventKind(kind), None, **data)
        await self.checks.check_once(checked)
        self.core.spawn(self.checks.retry_loop(), "cloud-check")

    # -- offers ---------------------------------------------------------------------------------
    def offer(self, i: int) -> Offer:
        """Offer ``i`` of the config, with its current spot price (USD/hour, None: unknown)."""
        return self.book.offer(i)

    def usable_offers(self) -> list[Offer]:
        return [self.offer(i) for i in range(len(self.core.config.offers)) if i not in self.unusable]

    def history(self, now: float) -> History:
        """What recent outcomes say about offers; an offer a failed cloud check concerns is out."""
        return self.book.history(now, held=self.checks.blocked())

    def avoid_zone_of(self, node: Node) -> None:
        """A notice in ``node``'s zone: replacements prefer another for :data:`AVOID_ZONE_S`."""
        self.book.avoid_zone_of(node, self.core.clock())

    def notice_published_at(self, node: Node, provider: str | None, deadline: float | None) -> float | None:
        """When ``node``'s notice appeared: from the provider when it knows (the local
        fakes), else the deadline minus the cloud's documented lead."""
        known = getattr(self.provider_for(node.provider), "notice_published_at", None)
        if known is not None and node.instance_id is not None:
            at = known(node.instance_id)
            if at is not None:
                return at
        lead = DOCUMENTED_LEAD_S.get(provider or "")
        return None if deadline is None or lead is None else deadline - lead

    async def refresh_prices(self) -> None:
        """Every offer's spot price; and, with :attr:`probe_stock`, every spot offer's stock."""
        for i, o in enumerate(self.core.config.offers):
            try:
                self.book.prices[i] = await self.provider_for(o.provider).spot_price(self.offer(i))
            except ProviderError as exc:
                log.warning("spot_price_failed", offer=self.offer(i).key, error=str(exc))
        if self.probe_stock:
            await self.refresh_stock()

    async def refresh_stock(self) -> None:
        """Ask each spot offer's provider whether its capacity is in stock now
        (:meth:`Provider.spot_stock`; a provider that cannot tell is not asked again):
        what the availability record knows of domains the pool does not launch in."""
        for i, o in enumerate(self.core.config.offers):
            if o.market != "spot" or i in self.unusable or o.provider in self._no_stock:
                continue
            try:
                ok = await self.provider_for(o.provider).spot_stock(self.offer(i))
            except ProviderError as exc:
                log.warning("spot_stock_failed", offer=self.offer(i).key, error=str(exc)[:200])
                continue
            if ok is None:
                self._no_stock.add(o.provider)
            else:
                self.stock[i] = (self.core.clock(), ok)

    async def price_loop(self) -> None:
        while True:
            await asyncio.sleep(PRICE_REFRESH_S)  # a refresh period, not synchronisation
            await self.refresh_prices()

    # -- observe ----------------------------------------------------------------------------------
    async def observe(self, max_age_s: float = 0.0) -> None:
        """List the pool's instances; a live node whose instance is gone ended (terminated
        after a notice, lost without one); not within ``max_age_s`` of the last listing (the
        loop's period: EC2 meters DescribeInstances per account; woken passes listed 3.6/s).

        Only a node whose instance was known before the listing was asked for can be
        found gone: a launch that lands while the listing is in flight (a concurrent
        task) is not in it, and is no loss. Nor is a new instance a lagging listing has
        not shown yet (:func:`daemon.control.listing.absent_means_gone`)."""
        core = self.core
        known = {n.id: n.instance_id for n in core.nodes.values() if n.state in LIVE and n.instance_id is not None}
        alive: dict[int, set[str]] = {}
        found: list[tuple[Provider, Instance]] = []
        if (started := time.monotonic()) - self._listed_at < max_age_s:
            return
        for p in self.all_providers():
            instances = await p.describe(core.pool)
            alive[id(p)] = {i.id for i in instances}
            found += [(p, i) for i in instances]
        self._listed_at = started
        now = core.clock()
        live_ids = {n.instance_id for n in core.nodes.values() if n.state in LIVE}
        self._listed = (self._listed & live_ids) | {i.id for _, i in found}  # bounded by the pool's live nodes
        await self.settle_unowned(found)
        for node in list(core.nodes.values()):
            if node.state not in LIVE or node.instance_id is None or known.get(node.id) != node.instance_id:
                continue
            provider = self.provider_for(node.provider)
            if node.instance_id in alive.get(id(provider), set()):
                continue
            seen = node.instance_id in self._listed or node.last_heartbeat is not None  # listed, or its agent spoke
            if not absent_means_gone(listed_before=seen, requested_at=node.created_at, now=now,
                                     lag_s=getattr(provider, "listing_lag_s", 0.0)):
                continue  # a new instance not listed yet: the listing lags (the boot timeout still holds)
            if node.state is NodeState.DRAINING:
                core.set_state(node, NodeState.TERMINATED, "instance gone after notice")
                core.record(EventKind.NODE_TERMINATED, node.id, reason="spot_reclaimed")
            else:
                core.set_state(node, NodeState.LOST, "instance gone without notice")
                core.record(EventKind.NODE_LOST, node.id, reason="instance_gone", last_step=node.step)

    async def settle_unowned(self, found: list[tuple[Provider, Instance]]) -> None:
        """What a daemon killed at any instant leaves behind (docs/architecture.md, Contracts: Store), settled from
        the pool's instances as the providers list them (their node tag names the node).

        - A node still ``requested`` with no launch call in flight in this process: the
          previous daemon died inside ``provider.launch``. Its instance found → adopted
          (``launching``, ``node_launched`` with ``adopted``). Not found → its launch is
          sent again under its own client token, byte for byte from what the call was
          recorded with (``node_launched`` with ``replayed``): EC2 and ECS answer the
          instance a first call that landed created, or create it now
          (:mod:`daemon.control.launch_replay`); a call it never made is made now, on any
          provider. Where a replay cannot be (a provider without tokens, a changed config,
          the agent wheel's URL about to expire) → ``failed``
          (``node_launch_failed``, ``error: interrupted``) and the planner launches
          another node, so the pool neither duplicates the node nor waits for it forever.
        - An instance whose node is over (terminated, lost, failed) with no launch in
          flight: a launch that landed after its node was given up, or a terminate the
          dead daemon never sent. Terminated once (retried next pass if that fails), so
          nothing is leaked.

        Example: daemon A records ``node_launch_requested`` for n1 and is SIGKILLed while
        RunInstances is on the wire. Daemon B starts: if EC2 lists n1's instance, B adopts
        it; if not, B sends n1's RunInstances again, and whichever of the two requests EC2
        runs first creates n1's one instance. On the local provider (no tokens) n1 fails
        and B launches n2; if n1's instance shows up later anyway, B terminates it.
        """
        core = self.core
        by_node = {i.node_id: (p, i) for p, i in found if i.node_id}
        for node in list(core.nodes.values()):
            if node.state is not NodeState.REQUESTED or node.id in self.launching:
                continue
            hit = by_node.get(node.id)
            if hit is not None:
                node.instance_id = hit[1].id
                core.set_state(node, NodeState.LAUNCHING, "adopted after a daemon restart")
                core.record(EventKind.NODE_LAUNCHED, node.id, instance_id=node.instance_id, offer=node.offer_key,
                            price_usd_h=node.price_usd_h, adopted=True)
            elif (index := self._replayable(node)) is not None:
                node.detail = "launch sent again after a daemon restart"
                core.store.put_node(node)
                log.info("launch_replayed", node_id=node.id, offer=node.offer_key,
                         sent=bool((node.launch_call or {}).get("sent")))
                self.calls.start(node, index)
            else:
                core.set_state(node, NodeState.FAILED, "launch interrupted by a daemon restart")
                core.record(EventKind.NODE_LAUNCH_FAILED, node.id, error="interrupted", offer=node.offer_key,
                            message="the daemon stopped during the launch call; no instance of this node exists")
        for p, inst in found:
            node = core.nodes.get(inst.node_id)
            if node is None or not node.state.is_terminal() or node.id in self.launching:
                continue
            if inst.id in self._released_unowned:
                continue
            try:
                await p.terminate(inst.id)
            except ProviderError as exc:
                log.warning("unowned_instance_terminate_failed", node_id=node.id, instance_id=inst.id, error=str(exc))
                continue
            self._released_unowned.add(inst.id)
            if node.instance_id is None:  # it cost something after all (Node.hours_held)
                node.instance_id = inst.id
                node.ended_at = core.clock()
                core.store.put_node(node)
            core.record(EventKind.NODE_TERMINATED, node.id, reason="unowned_instance", instance_id=inst.id)

    def _replayable(self, node: Node) -> int | None:
        """The offer index to send ``node``'s interrupted launch again on, under its own client
        token (:mod:`daemon.control.launch_replay`); None: it cannot be (logged, with why)."""
        core = self.core
        index = next((i for i in range(len(core.config.offers)) if self.book.offer(i).key == node.offer_key), None)
        try:
            idempotent = self.provider_for(node.provider).idempotent_launch
        except ProviderError:
            idempotent = False
        refusal = replay.replay_refusal(node.launch_call, core.clock(), idempotent=idempotent,
                                        offer_known=index is not None, daemon_url=agent_urls(core),
                                        ca_sha256=ca_digest(core.agent_ca_pem))
        if refusal is not None:
            log.info("launch_not_replayed", node_id=node.id, reason=refusal)
            return None
        return index

    # -- act ----------------------------------------------------------------------------------------
    async def apply(self, action: Launch | Terminate | MarkLost) -> None:
        """Carry out one capacity action. Raises ProviderError: the call failed (retried next pass)."""
        core = self.core
        if isinstance(action, Launch):
            self.launch(action.offer_index, action.reason)
        elif isinstance(action, MarkLost):
            node = core.nodes[action.node_id]
            core.set_state(node, NodeState.LOST, action.reason)
            core.record(EventKind.NODE_LOST, node.id, reason=action.reason, last_step=node.step)
            if node.instance_id:
                await self.provider_for(node.provider).terminate(node.instance_id)
        elif isinstance(action, Terminate):
            node = core.nodes[action.node_id]
            # why a drained node left (its notice, an operator's drain, its torchrun dead while
            # the job went on): its detail, which the terminal state's replaces
            left = {"left": node.detail} if node.state is NodeState.DRAINING and node.detail else {}
            if node.instance_id:
                await self.provider_for(node.provider).terminate(node.instance_id)
            core.set_state(node, action.final_state, action.reason)
            core.record(EventKind.NODE_TERMINATED, node.id, reason=action.reason, **left, **dict(action.context))

    def launch(self, offer_index: int, reason: str) -> Node:
        """Record a new node of offer ``offer_index`` and start its launch call (an owned task)."""
        core = self.core
        ordinal = max((n.ordinal for n in core.nodes.values()), default=0) + 1
        offer = core.config.offers[offer_index]
        node = Node(
            id=f"{core.pool}-{ordinal}", ordinal=ordinal, provider=offer.provider, market=offer.market,
            region=offer.region, zone=offer.zone, instance_type=offer.instance_type, gpus=offer.gpus_per_node,
            price_usd_h=self.book.prices.get(offer_index) or 0.0, token=secrets.token_urlsafe(24),
            created_at=core.clock(), launch_call=dict(replay.NOT_SENT),
        )
        core.add_node(node)
        core.record(EventKind.NODE_LAUNCH_REQUESTED, node.id, offer=node.offer_key, reason=reason)
        self.calls.start(node, offer_index)
        return node

    def _checkpoint_store(self, domain: str) -> tuple[str, Any]:
        """The checkpoint store of ``domain``: ``(uri, store)`` (no I/O)."""
        from trainer.checkpoint import open_store

        d, uri = self.core.config.domain(domain), self.core.config.checkpoint_uri(domain)
        return uri, open_store(uri, s3_endpoint_url=d.s3_endpoint_url, oss_endpoint=d.oss_endpoint)
