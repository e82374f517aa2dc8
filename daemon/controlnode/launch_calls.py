"""One node's launch, as a task of its own: the provider call and what its outcome means.

:meth:`Fleet.launch <daemon.controlnode.fleet.Fleet.launch>` records the node
(``requested``) and starts its call here (:meth:`LaunchCalls.start`). The outcome moves
the node (``launching``, with ``node_launched``; ``failed``, with ``node_launch_failed``
saying why) and is told to the :class:`~daemon.controlnode.offer_book.OfferBook`: a
capacity refusal backs the offer off, a quota or auth error takes its family out
(``offer_family_backoff``), a success clears both. An instance that lands for a node
released meanwhile is terminated at once. :attr:`LaunchCalls.launching` holds the nodes
whose call is in flight (a restarted daemon's orphans are told from them).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Callable

import structlog

from daemon.control import launch_replay as replay
from daemon.control.offers import Offer
from daemon.controlnode.core import Core
from daemon.controlnode.offer_book import OfferBook
from daemon.model import EventKind, Node, NodeState
from daemon.providers.agent_wheel import AgentWheelError, AgentWheels
from daemon.providers.base import (NODE_TAG, POOL_TAG, AgentWheelRef, AuthError, CapacityError, NodeSpec, Provider,
                                   ProviderError, QuotaError)

__all__ = ["LaunchCalls", "agent_urls", "ca_digest"]

log = structlog.get_logger("spotvisor.daemon")


def agent_urls(core: Core) -> str:
    """What a node is given as ``--daemon-url``: this daemon's agent URL, then the other
    control nodes' of ``ha.agent_urls`` (comma-separated), so its agent follows the leader."""
    assert core.agent_url is not None
    ha = core.config.ha
    others = [u for u in (ha.agent_urls if ha else []) if u.rstrip("/") != core.agent_url.rstrip("/")]
    return ",".join([core.agent_url, *others])


def ca_digest(pem: str | None) -> str | None:
    """The agents' CA certificate's SHA-256 (hex), as a launch records it; None: plain HTTP."""
    return None if pem is None else hashlib.sha256(pem.encode()).hexdigest()


class LaunchCalls:
    """The launch calls in flight for one pool. Constructor does no I/O.

    ``provider_for``: :meth:`Fleet.provider_for`; ``agent_wheels``: the agent's wheel for
    nodes that install it at boot."""

    def __init__(self, core: Core, *, book: OfferBook, provider_for: Callable[[str], Provider],
                 agent_wheels: AgentWheels) -> None:
        self.core, self.book = core, book
        self._provider_for, self._agent_wheels = provider_for, agent_wheels
        self.launching: set[str] = set()  # node ids whose provider.launch call is in flight

    def start(self, node: Node, offer_index: int) -> None:
        """Start ``node``'s launch call on offer ``offer_index`` (an owned task); the loop
        is woken when it lands."""
        core = self.core
        self.launching.add(node.id)
        task = core.spawn(self._call(node, offer_index), f"launch:{node.id}")

        def landed(_: asyncio.Task[Any], node_id: str = node.id) -> None:
            self.launching.discard(node_id)
            core.wake()

        task.add_done_callback(landed)

    async def _call(self, node: Node, offer_index: int) -> None:
        """The launch task: the provider call and what its outcome means. Whatever it
        raises (a provider's bug, an error of this daemon's own), the node ends ``failed``
        with a ``node_launch_failed`` event (``error``: the exception's type) and the offer
        backs off as for a provider error, so no node stays ``requested`` with no call in
        flight. A cancel (the daemon stopping) is not a failure: the next daemon adopts
        or fails the node (``error: interrupted``)."""
        try:
            await self._launch_and_record(node, offer_index)
        except Exception as exc:  # noqa: BLE001 - the node must not be left requested forever
            log.error("launch_call_crashed", node_id=node.id, error=repr(exc), exc_info=exc)
            core = self.core
            self.book.failed(offer_index, core.clock(), keep_longer=True)
            self._launch_failed(node, f"{type(exc).__name__}: {exc}")
            core.record(EventKind.NODE_LAUNCH_FAILED, node.id, error=type(exc).__name__, message=str(exc)[:512],
                        offer=node.offer_key)
        finally:
            self.core.wake()

    async def _agent_wheel(self, node: Node, offer_index: int) -> AgentWheelRef | None | bool:
        """The wheel a node of this offer installs; None: its image has the agent; False: the
        wheel cannot be had, and the launch has failed (fail closed: no node is bought that
        could not start its agent), with a ``node_launch_failed`` saying why."""
        offer, core = self.book.offer(offer_index), self.core
        if not self._provider_for(offer.provider).installs_agent or core.config.daemon.agent_install == "image":
            return None
        try:
            return await self._agent_wheels.ref(core.config.domain_of_offer(offer_index))
        except AgentWheelError as exc:
            self.book.failed(offer_index, core.clock())
            self._launch_failed(node, str(exc))
            log.error("agent_wheel_unavailable", offer=offer.key, reason=str(exc))
            core.record(EventKind.NODE_LAUNCH_FAILED, node.id, error="agent_wheel", message=str(exc), offer=offer.key)
            return False

    async def _spec(self, node: Node, offer_index: int) -> NodeSpec | None:
        """The node's launch parameters (:mod:`daemon.control.launch_replay`). A call an
        earlier daemon sent (``launch_call``: a replay) is rebuilt from what it recorded,
        byte for byte; a first call's are recorded before it is sent (SQLite: on disk at
        once; HA: the fenced provider's launch syncs the store to etcd before it calls the
        cloud). None: the agent's wheel cannot be had, and the launch has failed."""
        core = self.core
        call = node.launch_call or {}
        if call.get("sent"):
            wheel, daemon_url = call.get("wheel"), call["daemon_url"]
        else:
            got = await self._agent_wheel(node, offer_index)
            if got is False:
                return None
            wheel = None if got is None else {"url": got.url, "sha256": got.sha256, "version": got.version}
            daemon_url = agent_urls(core)
            node.launch_call = replay.sent(daemon_url, ca_digest(core.agent_ca_pem), wheel, None if got is None
                                           else core.clock() + self._agent_wheels.expires_s)
            core.store.put_node(node)  # HA: the fenced provider syncs it to etcd before the call
        return NodeSpec(node_id=node.id, pool=core.pool, token=node.token, daemon_url=daemon_url,
                        tags={POOL_TAG: core.pool, NODE_TAG: node.id},
                        ca_cert_pem=core.agent_ca_pem,  # None: plain HTTP
                        agent_wheel=None if wheel is None else AgentWheelRef(**wheel))

    async def _launch_and_record(self, node: Node, offer_index: int) -> None:
        core = self.core
        if core.agent_url is None:
            raise RuntimeError("the launch ran before the daemon knew its agent URL (Supervisor.start)")
        replayed = bool((node.launch_call or {}).get("sent"))
        spec = await self._spec(node, offer_index)
        if spec is None:
            return
        offer = self.book.offer(offer_index)
        try:
            inst = await self._provider_for(offer.provider).launch(offer, spec)
        except CapacityError as exc:
            wait, n = self.book.capacity_refused(offer_index, core.clock())
            self._launch_failed(node, str(exc))
            core.record(EventKind.NODE_LAUNCH_FAILED, node.id, error="capacity", message=str(exc), offer=offer.key,
                        backoff_s=round(wait, 1), failures=n)
        except (QuotaError, AuthError) as exc:
            # an account limit (or a refused permission): its offer family sits out a backoff (daemon.control.quota)
            self._launch_failed(node, str(exc))
            family = self._family_out(offer, exc)
            core.record(EventKind.NODE_LAUNCH_FAILED, node.id, error=type(exc).__name__, message=str(exc),
                        offer=offer.key, family=family)
        except ProviderError as exc:
            self.book.failed(offer_index, core.clock())
            self._launch_failed(node, str(exc))
            core.record(EventKind.NODE_LAUNCH_FAILED, node.id, error=type(exc).__name__, message=str(exc),
                        offer=offer.key)
        else:
            self.book.launched(offer_index)
            node.instance_id = inst.id
            if node.state.is_terminal():
                # released while its launch was in flight (job completed, scale-in): the
                # instance exists only now; give it back at once rather than leak it
                await self._provider_for(offer.provider).terminate(inst.id)
                node.ended_at = core.clock()
                core.store.put_node(node)
                core.record(EventKind.NODE_TERMINATED, node.id, reason="released_while_launching",
                            instance_id=inst.id)
            else:
                core.set_state(node, NodeState.LAUNCHING)
                core.record(EventKind.NODE_LAUNCHED, node.id, instance_id=inst.id, offer=offer.key,
                            price_usd_h=node.price_usd_h, **({"replayed": True} if replayed else {}))

    def _family_out(self, offer: Offer, exc: ProviderError) -> str:
        """``offer``'s family (its provider's offers, for an auth error) sits out its backoff
        (:meth:`OfferBook.family_out`): an ``offer_family_backoff`` event says until when.
        Returns the family."""
        core, now = self.core, self.core.clock()
        family, out = self.book.family_out(offer, auth=isinstance(exc, AuthError), now=now)
        if out is None:  # already sitting out (this launch was in flight): said once already
            return family
        log.error("offer_family_backoff", family=family, error=type(exc).__name__, message=str(exc),
                  retry_in_s=out.until - now)
        core.record(EventKind.OFFER_FAMILY_BACKOFF, None, family=family, error=type(exc).__name__,
                    message=str(exc)[:512], failures=out.failures, retry_in_s=round(out.until - now, 1),
                    retry_at=round(out.until, 3))
        return family

    def _launch_failed(self, node: Node, detail: str) -> None:
        """The launch call failed: the node is ``failed`` (unless it was released meanwhile)."""
        if not node.state.is_terminal():
            self.core.set_state(node, NodeState.FAILED, detail)
